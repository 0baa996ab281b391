//! The agent's allocator: one queue per pool, drained by one worker that runs everything queued
//! as two groups, the releases ([`release_group`](crate::alloc::group::release_group)) and then
//! the allocations ([`allocate_group_from`](crate::alloc::group::allocate_group_from)). While a
//! group is being written, the next requests queue up, so the group size follows the arrival
//! rate with no added delay: a request alone is served at once, a burst of hundreds in a handful
//! of pool writes. One worker per pool also means the agent never races itself for a pool.

use std::collections::HashMap;
use std::net::IpAddr;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio::sync::{mpsc, oneshot};

use super::attachments::Marker;
use crate::alloc::{AllocError, Allocate, Allocated, Job, Owner, Target};
use crate::metrics::agent::AgentMetrics;
use crate::store::{Datastore, StoreError};

mod depth;
mod worker;

pub use depth::QueueDepth;
use worker::worker;

/// The most ADDs one group takes; the rest wait for the next group.
const MAX_GROUP: usize = 500;
/// Requests one pool's queue holds (admitted, not yet taken into a group): one full group. All
/// that is queued then fits in the very next group, so a queued request waits for at most the
/// group being written and its own. The bench writes 200 ADDs in about 0.8 s
/// (docs/benchmarks.md), so two groups of 500 take seconds against the 110 s an ADD has
/// (`cni::ADD_DEADLINE`); a longer queue would only hold requests that the plugin, handed them
/// back, can start at once.
pub const MAX_POOL_QUEUE: usize = MAX_GROUP;
/// Requests all pools' queues hold together: half of the connections the agent serves at once
/// (`server::MAX_IN_FLIGHT`, 2048), so that a pile-up in the queues is handed back as such while
/// the other half (requests in the groups being written, requests still being read) go on. All
/// pools share the agent's one API connection: at the bench's pace 1024 requests take about 4 s.
pub const MAX_QUEUED: usize = 1024;
/// How long the pool version a worker wrote is trusted as the starting point of its next group.
const KNOWN_FOR: Duration = Duration::from_secs(2);
/// A pool's worker stops after this long without work (a node has few pools, but they change).
const IDLE: Duration = Duration::from_secs(300);

type Reply = oneshot::Sender<Result<Allocated, AllocError>>;
type Released = oneshot::Sender<Result<Vec<IpAddr>, StoreError>>;

/// What a pool's worker is asked to do.
enum Work {
    Allocate(Job, Reply),
    Release(Job, Released),
}

impl Work {
    fn pool(&self) -> &str {
        match self {
            Work::Allocate(job, _) | Work::Release(job, _) => &job.target.pool,
        }
    }

    /// Whether the requester stopped waiting (its deadline passed and it rolled back).
    fn abandoned(&self) -> bool {
        match self {
            Work::Allocate(_, reply) => reply.is_closed(),
            Work::Release(_, reply) => reply.is_closed(),
        }
    }
}

/// Work in a pool's queue, with the place it holds there and what marks its container once the
/// worker takes it into a group (see [`super::attachments`]).
struct Queued {
    work: Work,
    _slot: Slot,
    marker: Option<Marker>,
}

/// The bounds of the queues ([`MAX_POOL_QUEUE`], [`MAX_QUEUED`]; tests use small ones).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Limits {
    pub per_pool: usize,
    pub total: usize,
}

impl Default for Limits {
    fn default() -> Self {
        Limits {
            per_pool: MAX_POOL_QUEUE,
            total: MAX_QUEUED,
        }
    }
}

/// Why a request was not admitted: the plugin runs it itself.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum QueueFull {
    #[error(
        "the node agent's queue for pool {pool} is full ({limit} requests waiting, the per-pool bound)"
    )]
    Pool { pool: String, limit: usize },
    #[error(
        "the node agent's queues are full ({limit} requests waiting across pools, the total bound)"
    )]
    Total { limit: usize },
}

impl QueueFull {
    /// The `reason` label of `whereabouts_agent_handbacks_total`.
    pub fn reason(&self) -> &'static str {
        match self {
            QueueFull::Pool { .. } => "pool_queue_full",
            QueueFull::Total { .. } => "total_queue_full",
        }
    }
}

/// One request's place in one pool's queue, held from admission until the pool's worker takes
/// the request into a group (or the request ends without sending it): dropping it frees it.
struct Slot {
    pool: Arc<AtomicUsize>,
    total: Arc<AtomicUsize>,
}

impl Drop for Slot {
    fn drop(&mut self) {
        self.pool.fetch_sub(1, Ordering::SeqCst);
        self.total.fetch_sub(1, Ordering::SeqCst);
    }
}

/// A request admitted to the queues of all its pools at once, before it runs: a full queue
/// hands the whole request back instead of stopping it between two ranges.
pub struct Ticket {
    slots: Mutex<Vec<(String, Slot)>>,
}

impl Ticket {
    fn take(&self, pool: &str) -> Option<Slot> {
        let mut slots = self.slots.lock().unwrap_or_else(|e| e.into_inner());
        let i = slots.iter().position(|(p, _)| p == pool)?;
        Some(slots.swap_remove(i).1)
    }
}

/// A pool's queue: its worker's channel (none until the first request is sent) and how many
/// requests hold a place in it.
#[derive(Default)]
struct PoolQueue {
    tx: Option<mpsc::UnboundedSender<Queued>>,
    waiting: Arc<AtomicUsize>,
}

type Queues = Arc<Mutex<HashMap<String, PoolQueue>>>;

pub struct Batcher<S> {
    store: Arc<S>,
    limits: Limits,
    /// The channels are unbounded: what they hold is bounded by admission ([`Batcher::admit`]),
    /// which counts places, plus at most one rollback release per admitted request.
    queues: Queues,
    total: Arc<AtomicUsize>,
    metrics: Arc<AgentMetrics>,
}

impl<S: Datastore + 'static> Batcher<S> {
    /// A batcher whose workers count their groups in `metrics`.
    pub fn new(store: Arc<S>, metrics: Arc<AgentMetrics>) -> Self {
        Self::with_limits(store, Limits::default(), metrics)
    }

    pub fn with_limits(store: Arc<S>, limits: Limits, metrics: Arc<AgentMetrics>) -> Self {
        Batcher {
            store,
            limits,
            queues: Arc::default(),
            total: Arc::default(),
            metrics,
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<String, PoolQueue>> {
        self.queues.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Admits a request that goes through `pools` (one per range, in order), or says which bound
    /// is full. All or nothing; places are only taken under the lock, so no bound is overshot.
    pub fn admit<'p>(&self, pools: impl IntoIterator<Item = &'p str>) -> Result<Ticket, QueueFull> {
        let pools: Vec<&str> = pools.into_iter().collect();
        let mut queues = self.lock();
        for pool in &pools {
            // A pool named by two ranges needs two places.
            let need = pools.iter().filter(|p| *p == pool).count();
            let waiting = queues
                .get(*pool)
                .map_or(0, |q| q.waiting.load(Ordering::SeqCst));
            if waiting + need > self.limits.per_pool {
                return Err(QueueFull::Pool {
                    pool: (*pool).to_owned(),
                    limit: self.limits.per_pool,
                });
            }
        }
        if self.total.load(Ordering::SeqCst) + pools.len() > self.limits.total {
            return Err(QueueFull::Total {
                limit: self.limits.total,
            });
        }
        let slots = pools
            .iter()
            .map(|pool| ((*pool).to_owned(), self.slot(&mut queues, pool)))
            .collect();
        Ok(Ticket {
            slots: Mutex::new(slots),
        })
    }

    /// The allocator of an admitted request: its work uses the places of `ticket`, and the
    /// worker marks its container with `marker` while the work runs.
    pub fn admitted(&self, ticket: Ticket, marker: Marker) -> Admitted<'_, S> {
        Admitted {
            batcher: self,
            ticket,
            marker,
        }
    }

    /// Takes a place in `pool`'s queue, whatever the bounds (the caller checked them, or it is a
    /// rollback of an admitted request).
    fn slot(&self, queues: &mut HashMap<String, PoolQueue>, pool: &str) -> Slot {
        let queue = queues.entry(pool.to_owned()).or_default();
        queue.waiting.fetch_add(1, Ordering::SeqCst);
        self.total.fetch_add(1, Ordering::SeqCst);
        Slot {
            pool: queue.waiting.clone(),
            total: self.total.clone(),
        }
    }

    /// Requests holding a place in `pool`'s queue.
    pub fn waiting(&self, pool: &str) -> usize {
        self.lock()
            .get(pool)
            .map_or(0, |q| q.waiting.load(Ordering::SeqCst))
    }

    /// Requests holding a place in any queue.
    pub fn waiting_total(&self) -> usize {
        self.total.load(Ordering::SeqCst)
    }

    /// The scrape-time gauge of every pool's queue depth.
    pub fn depth_collector(&self) -> QueueDepth {
        QueueDepth::new(self.queues.clone())
    }

    /// The channel of `pool`, starting its worker when there is none (or it has stopped).
    fn queue(&self, pool: &str) -> mpsc::UnboundedSender<Queued> {
        let mut queues = self.lock();
        let queue = queues.entry(pool.to_owned()).or_default();
        if let Some(tx) = queue.tx.as_ref().filter(|tx| !tx.is_closed()) {
            return tx.clone();
        }
        let (tx, rx) = mpsc::unbounded_channel();
        let (store, metrics) = (self.store.clone(), self.metrics.clone());
        tokio::spawn(worker(store, metrics, pool.to_owned(), rx));
        queue.tx = Some(tx.clone());
        tx
    }

    /// Hands `work` to its pool's worker.
    fn send(&self, mut queued: Queued) -> Result<(), String> {
        // A worker that has just stopped for idleness refuses the work: start a new one.
        for _ in 0..2 {
            match self.queue(queued.work.pool()).send(queued) {
                Ok(()) => return Ok(()),
                Err(mpsc::error::SendError(back)) => queued = back,
            }
        }
        Err("could not queue the request".into())
    }

    async fn submit(
        &self,
        job: Job,
        slot: Slot,
        marker: Option<Marker>,
    ) -> Result<Allocated, AllocError> {
        let (reply, result) = oneshot::channel();
        self.send(Queued {
            work: Work::Allocate(job, reply),
            _slot: slot,
            marker,
        })
        .map_err(AllocError::Agent)?;
        result
            .await
            .unwrap_or_else(|_| Err(AllocError::Agent("the pool's worker stopped".into())))
    }

    async fn submit_release(
        &self,
        job: Job,
        slot: Slot,
        marker: Option<Marker>,
    ) -> Result<Vec<IpAddr>, StoreError> {
        let (reply, result) = oneshot::channel();
        let pool = job.target.pool.clone();
        self.send(Queued {
            work: Work::Release(job, reply),
            _slot: slot,
            marker,
        })
        .map_err(|m| release_failed(&pool, m))?;
        result
            .await
            .unwrap_or_else(|_| Err(release_failed(&pool, "the pool's worker stopped".into())))
    }

    /// A place for a request that was not admitted as a whole: its own, when there is room.
    fn admit_one(&self, pool: &str) -> Result<Slot, QueueFull> {
        let ticket = self.admit([pool])?;
        Ok(ticket.take(pool).expect("admitted to its pool"))
    }
}

fn release_failed(pool: &str, message: String) -> StoreError {
    StoreError::Transport {
        op: "release",
        object: format!("ippool {pool}"),
        source: Arc::new(std::io::Error::other(message)),
    }
}

/// Each call is admitted on its own: a full queue fails that range (use [`Batcher::admit`] and
/// [`Batcher::admitted`] to hand back whole requests instead).
impl<S: Datastore + 'static> Allocate<S> for Batcher<S> {
    fn allocate(
        &self,
        _store: &S,
        target: &Target,
        who: &Owner,
    ) -> impl Future<Output = Result<Allocated, AllocError>> + Send {
        let job = Job::new(target, who);
        let slot = self.admit_one(&target.pool);
        async move {
            let slot = slot.map_err(|e| AllocError::Agent(e.to_string()))?;
            self.submit(job, slot, None).await
        }
    }

    fn release(
        &self,
        _store: &S,
        target: &Target,
        who: &Owner,
    ) -> impl Future<Output = Result<Vec<IpAddr>, StoreError>> + Send {
        let job = Job::new(target, who);
        let slot = self.admit_one(&target.pool);
        async move {
            let slot = slot.map_err(|e| release_failed(&job.target.pool, e.to_string()))?;
            self.submit_release(job, slot, None).await
        }
    }
}

/// The allocator of one admitted request: each range's work takes the place the request was
/// admitted with. A rollback release after its pool's place was used takes one beyond the bound
/// (at most one per admitted request), since refusing it would leave an address behind.
pub struct Admitted<'a, S> {
    batcher: &'a Batcher<S>,
    ticket: Ticket,
    marker: Marker,
}

impl<S: Datastore + 'static> Admitted<'_, S> {
    fn slot(&self, pool: &str) -> Slot {
        self.ticket.take(pool).unwrap_or_else(|| {
            let mut queues = self.batcher.lock();
            self.batcher.slot(&mut queues, pool)
        })
    }
}

impl<S: Datastore + 'static> Allocate<S> for Admitted<'_, S> {
    fn allocate(
        &self,
        _store: &S,
        target: &Target,
        who: &Owner,
    ) -> impl Future<Output = Result<Allocated, AllocError>> + Send {
        let slot = self.slot(&target.pool);
        let marker = Some(self.marker.clone());
        self.batcher.submit(Job::new(target, who), slot, marker)
    }

    fn release(
        &self,
        _store: &S,
        target: &Target,
        who: &Owner,
    ) -> impl Future<Output = Result<Vec<IpAddr>, StoreError>> + Send {
        let slot = self.slot(&target.pool);
        let marker = Some(self.marker.clone());
        self.batcher
            .submit_release(Job::new(target, who), slot, marker)
    }
}

#[cfg(test)]
mod tests;
