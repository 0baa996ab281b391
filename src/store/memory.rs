//! An in-memory [`Store`] with the same conditional semantics as the Kubernetes one, for fast tests
//! of the CNI handlers (including concurrency) without a cluster.

use std::collections::{BTreeMap, HashMap};
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};

use tokio::sync::watch;

use super::{
    Pool, PoolChanges, PoolClaim, PoolWrite, Reservation, Result, Store, StoreError, Turn,
    TurnAttempt, Write,
};
use crate::crd::{IPAllocation, OverlappingRangeIPReservationSpec};

pub struct MemoryStore {
    state: Arc<Mutex<State>>,
    next: AtomicU64,
    /// Bumped on every pool write, to wake watchers.
    writes: watch::Sender<u64>,
    /// When set, every call fails with this message (to test error paths).
    pub fail: Mutex<Option<String>>,
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
}

impl Default for MemoryStore {
    fn default() -> Self {
        MemoryStore {
            state: Arc::default(),
            next: AtomicU64::new(0),
            writes: watch::Sender::new(0),
            fail: Mutex::default(),
            calls: Mutex::default(),
            interleave: Default::default(),
            held: watch::Sender::new(false),
            waiting: AtomicUsize::new(0),
        }
    }
}

#[derive(Default, Clone)]
struct State {
    pools: BTreeMap<String, (String, BTreeMap<u128, IPAllocation>, u64)>,
    reservations: BTreeMap<String, Reservation>,
    /// The pool and address each reservation was claimed for.
    claims: BTreeMap<String, (String, std::net::IpAddr)>,
    pods: HashMap<String, String>,
    /// Writer turns by pool: the turn's uid.
    turns: BTreeMap<String, String>,
    /// Reservations whose release was announced, with the bucket of the announcement.
    releasing: BTreeMap<String, i64>,
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
                code: 500,
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

/// Watches a pool of a [`MemoryStore`].
pub struct MemoryChanges {
    state: Arc<Mutex<State>>,
    writes: watch::Receiver<u64>,
    pool: String,
    seen: String,
}

impl PoolChanges for MemoryChanges {
    fn ended(&self) -> bool {
        !self.state.lock().unwrap().pools.contains_key(&self.pool)
    }

    async fn next(&mut self, wait: std::time::Duration) -> Result<Option<Pool>> {
        let deadline = tokio::time::Instant::now() + wait;
        loop {
            self.writes.borrow_and_update();
            let current = self.state.lock().unwrap().pool(&self.pool);
            match current {
                None => return Ok(None),
                Some(p) if p.resource_version != self.seen => {
                    self.seen = p.resource_version.clone();
                    return Ok(Some(p));
                }
                Some(_) => {}
            }
            match tokio::time::timeout_at(deadline, self.writes.changed()).await {
                Ok(Ok(())) => continue,
                _ => return Ok(None),
            }
        }
    }
}

fn same_owner(current: &IPAllocation, expected: &IPAllocation) -> bool {
    current.id == expected.id && current.podref == expected.podref
}

impl Store for MemoryStore {
    async fn get_pool(&self, name: &str) -> Result<Option<Pool>> {
        self.pause().await;
        self.check("get", name)?;
        self.counted("get_pool");
        Ok(self.state.lock().unwrap().pool(name))
    }

    async fn get_pool_cached(&self, name: &str) -> Result<Option<Pool>> {
        self.get_pool(name).await
    }

    async fn create_pool(&self, name: &str, range: &str) -> Result<Write> {
        self.check("create", name)?;
        let mut s = self.state.lock().unwrap();
        if s.pools.contains_key(name) {
            return Ok(Write::Conflict);
        }
        s.pools
            .insert(name.into(), (range.into(), BTreeMap::new(), 1));
        drop(s);
        self.writes.send_modify(|n| *n += 1);
        Ok(Write::Done)
    }

    async fn add_allocations(
        &self,
        pool: &str,
        entries: &[(u128, IPAllocation)],
        resource_version: &str,
    ) -> Result<PoolWrite> {
        self.write_at(pool, resource_version, |allocations| {
            for (offset, entry) in entries {
                allocations.insert(*offset, entry.clone());
            }
        })
        .await
    }

    async fn remove_allocations(
        &self,
        pool: &str,
        offsets: &[u128],
        resource_version: &str,
    ) -> Result<PoolWrite> {
        self.write_at(pool, resource_version, |allocations| {
            for offset in offsets {
                allocations.remove(offset);
            }
        })
        .await
    }

    type Changes = MemoryChanges;

    async fn watch_pool(&self, pool: &str, resource_version: &str) -> Result<MemoryChanges> {
        self.check("watch", pool)?;
        self.counted("watch");
        Ok(MemoryChanges {
            state: self.state.clone(),
            writes: self.writes.subscribe(),
            pool: pool.into(),
            seen: resource_version.into(),
        })
    }

    async fn take_turn(&self, pool: &str, _holder: &str) -> TurnAttempt {
        self.pause().await;
        if self.check("create", pool).is_err() {
            return TurnAttempt::Unavailable;
        }
        self.counted("take_turn");
        let mut s = self.state.lock().unwrap();
        if s.turns.contains_key(pool) {
            return TurnAttempt::Busy;
        }
        let uid = format!("turn-{}", self.next.fetch_add(1, Ordering::Relaxed));
        s.turns.insert(pool.into(), uid.clone());
        TurnAttempt::Taken(Turn {
            pool: pool.into(),
            uid,
        })
    }

    async fn end_turn(&self, turn: &Turn) {
        let mut s = self.state.lock().unwrap();
        if s.turns.get(&turn.pool) == Some(&turn.uid) {
            s.turns.remove(&turn.pool);
        }
    }

    async fn turn_holder(&self, pool: &str) -> Option<(String, String)> {
        let s = self.state.lock().unwrap();
        s.turns.get(pool).map(|uid| (uid.clone(), uid.clone()))
    }

    async fn break_turn(&self, pool: &str, uid: &str, _rv: &str) {
        self.counted("break_turn");
        let mut s = self.state.lock().unwrap();
        if s.turns.get(pool).map(String::as_str) == Some(uid) {
            s.turns.remove(pool);
        }
    }

    async fn replace_allocation(
        &self,
        pool: &str,
        offset: u128,
        expected: &IPAllocation,
        entry: &IPAllocation,
    ) -> Result<Write> {
        self.with_pool("patch", pool, |allocations, _| {
            match allocations.get_mut(&offset) {
                Some(current) if same_owner(current, expected) => {
                    *current = entry.clone();
                    Write::Done
                }
                _ => Write::Conflict,
            }
        })
    }

    async fn remove_allocation(
        &self,
        pool: &str,
        offset: u128,
        expected: &IPAllocation,
    ) -> Result<Write> {
        self.with_pool("patch", pool, |allocations, _| {
            match allocations.get(&offset) {
                Some(current) if same_owner(current, expected) => {
                    allocations.remove(&offset);
                    Write::Done
                }
                _ => Write::Conflict,
            }
        })
    }

    async fn create_reservation(
        &self,
        name: &str,
        spec: &OverlappingRangeIPReservationSpec,
        pool: &str,
        ip: std::net::IpAddr,
    ) -> Result<(Write, String)> {
        self.pause().await;
        self.check("create", name)?;
        let mut s = self.state.lock().unwrap();
        if s.reservations.contains_key(name) {
            return Ok((Write::Conflict, String::new()));
        }
        let uid = format!("uid-{}", self.next.fetch_add(1, Ordering::Relaxed));
        let now = super::now_secs();
        s.reservations.insert(
            name.into(),
            Reservation {
                name: name.into(),
                uid: uid.clone(),
                spec: spec.clone(),
                created: Some(now),
                resource_version: self.next.fetch_add(1, Ordering::Relaxed).to_string(),
            },
        );
        s.claims.insert(name.into(), (pool.into(), ip));
        Ok((Write::Done, uid))
    }

    async fn claims_of(&self, pool: &str) -> Result<Vec<PoolClaim>> {
        self.pause().await;
        self.check("list", pool)?;
        self.counted("claims_of");
        let s = self.state.lock().unwrap();
        Ok(s.claims
            .iter()
            .filter(|(_, (p, _))| p == pool)
            .filter_map(|(name, (_, ip))| {
                let r = s.reservations.get(name)?;
                // Only recent claims, as the Kubernetes store's claim-time label selects them.
                let recent = super::recent_buckets(super::now_secs());
                if !recent.contains(&super::claim_bucket(r.created?))
                    || s.releasing.contains_key(name)
                {
                    return None;
                }
                Some(PoolClaim {
                    ip: *ip,
                    uid: r.uid.clone(),
                    spec: r.spec.clone(),
                })
            })
            .collect())
    }

    async fn releases_of(&self, pool: &str) -> Result<Vec<PoolClaim>> {
        self.pause().await;
        self.check("list", pool)?;
        self.counted("releases_of");
        let s = self.state.lock().unwrap();
        let recent = super::recent_buckets(super::now_secs());
        Ok(s.releasing
            .iter()
            .filter(|(_, bucket)| recent.contains(bucket))
            .filter_map(|(name, _)| {
                let (p, ip) = s.claims.get(name)?;
                let r = s.reservations.get(name)?;
                (p == pool).then(|| PoolClaim {
                    ip: *ip,
                    uid: r.uid.clone(),
                    spec: r.spec.clone(),
                })
            })
            .collect())
    }

    async fn mark_releasing(&self, name: &str, uid: &str) -> Result<(Write, String)> {
        self.pause().await;
        self.check("patch", name)?;
        self.counted("mark_releasing");
        let rv = self.next.fetch_add(1, Ordering::Relaxed).to_string();
        let mut s = self.state.lock().unwrap();
        match s.reservations.get_mut(name) {
            None => Ok((Write::Missing, String::new())),
            Some(r) if r.uid != uid => Ok((Write::Conflict, String::new())),
            Some(r) => {
                r.resource_version = rv.clone();
                let bucket = super::claim_bucket(super::now_secs());
                s.releasing.insert(name.into(), bucket);
                Ok((Write::Done, rv))
            }
        }
    }

    async fn take_over_reservation(
        &self,
        name: &str,
        uid: &str,
        resource_version: &str,
        spec: &OverlappingRangeIPReservationSpec,
    ) -> Result<Write> {
        self.pause().await;
        self.check("patch", name)?;
        self.counted("take_over_reservation");
        let rv = self.next.fetch_add(1, Ordering::Relaxed).to_string();
        let mut s = self.state.lock().unwrap();
        match s.reservations.get_mut(name) {
            None => Ok(Write::Missing),
            Some(r) if r.uid != uid || r.resource_version != resource_version => {
                Ok(Write::Conflict)
            }
            Some(r) => {
                r.spec = spec.clone();
                r.resource_version = rv;
                s.releasing.remove(name);
                Ok(Write::Done)
            }
        }
    }

    async fn get_reservation(&self, name: &str) -> Result<Option<Reservation>> {
        self.pause().await;
        self.check("get", name)?;
        Ok(self.state.lock().unwrap().reservations.get(name).cloned())
    }

    async fn delete_reservation(
        &self,
        name: &str,
        uid: &str,
        resource_version: Option<&str>,
    ) -> Result<Write> {
        self.check("delete", name)?;
        let mut s = self.state.lock().unwrap();
        match s.reservations.get(name) {
            None => Ok(Write::Missing),
            Some(r) if r.uid != uid => Ok(Write::Conflict),
            Some(r) if resource_version.is_some_and(|v| v != r.resource_version) => {
                Ok(Write::Conflict)
            }
            Some(_) => {
                s.reservations.remove(name);
                s.claims.remove(name);
                s.releasing.remove(name);
                Ok(Write::Done)
            }
        }
    }

    async fn pod_uids(&self) -> Result<HashMap<String, String>> {
        self.check("list", "pods")?;
        Ok(self.state.lock().unwrap().pods.clone())
    }
}
