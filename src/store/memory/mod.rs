//! An in-memory [`Datastore`](super::Datastore) with the same conditional semantics as the
//! Kubernetes one, for fast tests of the CNI handlers (including concurrency) without a cluster.

use std::collections::{BTreeMap, HashMap};
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};

use tokio::sync::watch;

use super::{Pool, PoolWrite, Reservation, Result, StoreError, Write};
use crate::crd::IPAllocation;

mod store;

pub use store::MemoryChanges;

pub struct MemoryStore {
    state: Arc<Mutex<State>>,
    next: AtomicU64,
    /// Bumped on every pool write, to wake watchers.
    writes: watch::Sender<u64>,
    /// When set, every call fails with this message (to test error paths).
    pub fail: Mutex<Option<String>>,
    /// The HTTP status of those failures (0: 500).
    pub fail_code: std::sync::atomic::AtomicU16,
    /// Counters of calls by kind, for tests that check how much work was done.
    pub calls: Mutex<BTreeMap<&'static str, u64>>,
    /// When set, every call yields to the scheduler first, so that concurrent tasks interleave
    /// between requests the way concurrent processes do against an API server.
    interleave: std::sync::atomic::AtomicBool,
    /// While true, every call that pauses waits at its start: a test holds a group's write to
    /// fill the queues behind it.
    held: watch::Sender<bool>,
    /// Calls waiting at the hold.
    waiting: AtomicUsize,
    /// When set, the reads the Kubernetes store serves from the API server's watch cache
    /// (`get_pool_cached`, `claims_of`, `releases_of`) answer from a state a few calls old, as a
    /// lagging cache does: `history` holds the states the last calls started from.
    lagging: std::sync::atomic::AtomicBool,
    history: Mutex<std::collections::VecDeque<State>>,
    /// How long a reservation delete takes, in milliseconds: the round trip that separates a
    /// release's removal of an entry from the deletion of its reservation on a real API server.
    delete_latency: AtomicU64,
    /// When set, the cached reads answer from this state: a watch cache stuck behind.
    frozen: Mutex<Option<State>>,
}

/// How many calls back a lagging cached read may answer from.
const LAG: usize = 4;

impl Default for MemoryStore {
    fn default() -> Self {
        MemoryStore {
            state: Arc::default(),
            next: AtomicU64::new(0),
            writes: watch::Sender::new(0),
            fail: Mutex::default(),
            fail_code: Default::default(),
            calls: Mutex::default(),
            interleave: Default::default(),
            held: watch::Sender::new(false),
            waiting: AtomicUsize::new(0),
            lagging: Default::default(),
            history: Mutex::default(),
            delete_latency: AtomicU64::new(0),
            frozen: Mutex::default(),
        }
    }
}

#[derive(Default, Clone)]
struct State {
    pools: BTreeMap<String, (String, BTreeMap<u128, IPAllocation>, u64)>,
    /// The labels each pool was created with.
    pool_labels: BTreeMap<String, BTreeMap<String, String>>,
    reservations: BTreeMap<String, Reservation>,
    /// The pool and address each reservation was claimed for.
    claims: BTreeMap<String, (String, std::net::IpAddr)>,
    pods: HashMap<String, String>,
    /// Writer turns by pool: the turn's uid.
    turns: BTreeMap<String, String>,
    /// Reservations whose release was announced, with the bucket of the announcement.
    releasing: BTreeMap<String, i64>,
    /// NodeSlicePools by name, their resourceVersion in their metadata.
    slices: BTreeMap<String, crate::crd::NodeSlicePool>,
    /// What ADDs read of pods, by `<namespace>/<name>`.
    pod_facts: HashMap<String, super::PodFacts>,
    /// IPAMClaims by `<namespace>/<name>`, their resourceVersion in their metadata.
    ipam_claims: BTreeMap<String, crate::crd::IPAMClaim>,
}

impl State {
    fn pool(&self, name: &str) -> Option<Pool> {
        self.pools.get(name).map(|(range, allocations, rv)| Pool {
            name: name.into(),
            range: range.clone(),
            allocations: allocations.clone(),
            resource_version: rv.to_string(),
        })
    }
}

impl MemoryStore {
    pub fn new() -> Self {
        Self::default()
    }

    /// Stores a NodeSlicePool as an operator (or a person) would: a new resourceVersion each time.
    pub fn put_node_slice_pool(&self, mut pool: crate::crd::NodeSlicePool) {
        let name = pool.metadata.name.clone().unwrap_or_default();
        pool.metadata.resource_version =
            Some(format!("s{}", self.next.fetch_add(1, Ordering::Relaxed)));
        self.state.lock().unwrap().slices.insert(name, pool);
    }

    /// The labels pool `name` was created with.
    pub fn pool_labels(&self, name: &str) -> Option<BTreeMap<String, String>> {
        self.state.lock().unwrap().pool_labels.get(name).cloned()
    }

    /// The NodeSlicePool named `name`, as stored.
    pub fn node_slice_pool(&self, name: &str) -> Option<crate::crd::NodeSlicePool> {
        self.state.lock().unwrap().slices.get(name).cloned()
    }

    /// Stores what an ADD reads of pod `podref` (and makes the pod live with its UID).
    pub fn put_pod_facts(&self, podref: &str, facts: super::PodFacts) {
        let mut s = self.state.lock().unwrap();
        s.pods.insert(podref.into(), facts.uid.clone());
        s.pod_facts.insert(podref.into(), facts);
    }

    /// Stores an IPAMClaim as a person would: a new resourceVersion each time.
    pub fn put_ipam_claim(&self, mut claim: crate::crd::IPAMClaim) {
        let key = format!(
            "{}/{}",
            claim.metadata.namespace.clone().unwrap_or_default(),
            claim.metadata.name.clone().unwrap_or_default()
        );
        claim.metadata.resource_version =
            Some(format!("c{}", self.next.fetch_add(1, Ordering::Relaxed)));
        self.state.lock().unwrap().ipam_claims.insert(key, claim);
    }

    /// Deletes the IPAMClaim `<namespace>/<name>`.
    pub fn delete_ipam_claim(&self, key: &str) {
        self.state.lock().unwrap().ipam_claims.remove(key);
    }

    /// The IPAMClaim `<namespace>/<name>`, as stored.
    pub fn ipam_claim(&self, key: &str) -> Option<crate::crd::IPAMClaim> {
        self.state.lock().unwrap().ipam_claims.get(key).cloned()
    }

    pub fn set_pod(&self, podref: &str, uid: &str) {
        self.state
            .lock()
            .unwrap()
            .pods
            .insert(podref.into(), uid.into());
    }

    pub fn reservation_names(&self) -> Vec<String> {
        self.state
            .lock()
            .unwrap()
            .reservations
            .keys()
            .cloned()
            .collect()
    }

    /// Makes every reservation look `secs` older, as if time had passed.
    pub fn age_reservations(&self, secs: i64) {
        for r in self.state.lock().unwrap().reservations.values_mut() {
            r.created = r.created.map(|c| c - secs);
            r.claimed = r.created.map(crate::store::claim_bucket);
        }
    }

    /// Writes an entry directly, as another writer (an upstream plugin) would.
    pub fn put_entry(&self, pool: &str, range: &str, offset: u128, entry: IPAllocation) {
        let mut s = self.state.lock().unwrap();
        let p = s
            .pools
            .entry(pool.into())
            .or_insert_with(|| (range.into(), BTreeMap::new(), 1));
        p.1.insert(offset, entry);
        p.2 += 1;
        drop(s);
        self.writes.send_modify(|n| *n += 1);
    }

    /// Leaves a writer turn on `pool` that nobody will give back, as a killed writer would.
    pub fn abandon_turn(&self, pool: &str) {
        self.state
            .lock()
            .unwrap()
            .turns
            .insert(pool.into(), "abandoned".into());
    }

    /// Whether `pool`'s writer turn is held.
    pub fn turn_held(&self, pool: &str) -> bool {
        self.state.lock().unwrap().turns.contains_key(pool)
    }

    /// How many calls of `kind` were made (`"patch"`, `"take_turn"`, ...).
    pub fn count(&self, kind: &str) -> u64 {
        self.calls.lock().unwrap().get(kind).copied().unwrap_or(0)
    }

    /// Makes every call yield first (see the field).
    pub fn interleaved(self) -> Self {
        self.interleave.store(true, Ordering::Relaxed);
        self
    }

    /// Makes the cached reads lag (see the field): the cluster's behaviour, where a LIST or GET
    /// served from the watch cache may miss the last writes.
    pub fn lagging(self) -> Self {
        self.lagging.store(true, Ordering::Relaxed);
        self
    }

    /// Makes every reservation delete take `ms` milliseconds before it acts (see the field).
    pub fn slow_deletes(self, ms: u64) -> Self {
        self.delete_latency.store(ms, Ordering::Relaxed);
        self
    }

    /// Waits as long as a reservation delete takes.
    async fn delete_round_trip(&self) {
        let ms = self.delete_latency.load(Ordering::Relaxed);
        if ms > 0 {
            tokio::time::sleep(std::time::Duration::from_millis(ms)).await;
        }
    }

    /// Makes the cached reads answer from the state of this moment, until [`Self::thaw_cache`].
    pub fn freeze_cache(&self) {
        *self.frozen.lock().unwrap() = Some(self.state.lock().unwrap().clone());
    }

    /// Lets the cached reads catch up again.
    pub fn thaw_cache(&self) {
        *self.frozen.lock().unwrap() = None;
    }

    /// The state a cached read answers from: the frozen one if any, else the current one, or,
    /// lagging, one of the last few.
    fn cached(&self) -> State {
        if let Some(frozen) = self.frozen.lock().unwrap().clone() {
            return frozen;
        }
        let history = self.history.lock().unwrap();
        match fastrand::usize(..=history.len()) {
            i if i < history.len() => history[i].clone(),
            _ => self.state.lock().unwrap().clone(),
        }
    }

    /// Holds (`true`) or lets go of (`false`) every call that pauses (reads and writes).
    pub fn hold(&self, on: bool) {
        self.held.send_replace(on);
    }

    /// How many calls are waiting at the hold.
    pub fn waiting(&self) -> usize {
        self.waiting.load(Ordering::SeqCst)
    }

    async fn pause(&self) {
        if *self.held.borrow() {
            let mut held = self.held.subscribe();
            self.waiting.fetch_add(1, Ordering::SeqCst);
            let _ = held.wait_for(|on| !*on).await;
            self.waiting.fetch_sub(1, Ordering::SeqCst);
        }
        if self.lagging.load(Ordering::Relaxed) {
            let now = self.state.lock().unwrap().clone();
            let mut history = self.history.lock().unwrap();
            if history.len() == LAG {
                history.pop_front();
            }
            history.push_back(now);
        }
        if self.interleave.load(Ordering::Relaxed) {
            tokio::task::yield_now().await;
        }
    }

    fn counted(&self, kind: &'static str) {
        *self.calls.lock().unwrap().entry(kind).or_default() += 1;
    }

    fn check(&self, op: &'static str, object: &str) -> Result<()> {
        match self.fail.lock().unwrap().clone() {
            Some(message) => Err(StoreError::Api {
                op,
                object: object.into(),
                code: match self.fail_code.load(Ordering::Relaxed) {
                    0 => 500,
                    code => code,
                },
                message,
            }),
            None => Ok(()),
        }
    }

    fn with_pool(
        &self,
        op: &'static str,
        pool: &str,
        f: impl FnOnce(&mut BTreeMap<u128, IPAllocation>, u64) -> Write,
    ) -> Result<Write> {
        self.check(op, pool)?;
        let mut s = self.state.lock().unwrap();
        let Some((_, allocations, rv)) = s.pools.get_mut(pool) else {
            return Ok(Write::Missing);
        };
        let outcome = f(allocations, *rv);
        if outcome == Write::Done {
            *rv += 1;
            drop(s);
            self.writes.send_modify(|n| *n += 1);
        }
        Ok(outcome)
    }
}

impl MemoryStore {
    /// Changes the pool's entries if it is still at `resource_version`, as a merge patch carrying
    /// the resourceVersion does.
    async fn write_at(
        &self,
        pool: &str,
        resource_version: &str,
        change: impl FnOnce(&mut BTreeMap<u128, IPAllocation>),
    ) -> Result<PoolWrite> {
        self.pause().await;
        self.counted("patch");
        let outcome = self.with_pool("patch", pool, |allocations, rv| {
            if rv.to_string() != resource_version {
                return Write::Conflict;
            }
            change(allocations);
            Write::Done
        })?;
        Ok(match outcome {
            Write::Done => match self.state.lock().unwrap().pool(pool) {
                Some(p) => PoolWrite::Done(p),
                None => PoolWrite::Missing,
            },
            Write::Conflict => PoolWrite::Conflict,
            Write::Missing => PoolWrite::Missing,
        })
    }
}
