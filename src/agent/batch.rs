//! The agent's allocator: one queue per pool, drained by one worker that runs everything queued
//! as two groups, the releases ([`release_group`]) and then the allocations
//! ([`allocate_group_from`]). While a group is being written, the next requests queue up, so the
//! group size follows the arrival rate with no added delay: a request alone is served at once, a
//! burst of hundreds in a handful of pool writes. One worker per pool also means the agent never
//! races itself for a pool.

use std::collections::HashMap;
use std::net::IpAddr;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio::sync::{mpsc, oneshot};

use crate::cni::Allocate;
use crate::cni::allocate::{AllocError, Allocated, Scope};
use crate::cni::group::{Job, allocate_group_from, release_group};
use crate::cni::protocol::Attachment;
use crate::config::RangeConfig;
use crate::store::{Pool, Store, StoreError};

/// The most ADDs one group takes; the rest wait for the next group.
const MAX_GROUP: usize = 500;
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
            Work::Allocate(job, _) | Work::Release(job, _) => &job.range.pool_name,
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

pub struct Batcher<S> {
    store: Arc<S>,
    queues: Mutex<HashMap<String, mpsc::UnboundedSender<Work>>>,
}

impl<S: Store + 'static> Batcher<S> {
    pub fn new(store: Arc<S>) -> Self {
        Batcher {
            store,
            queues: Mutex::new(HashMap::new()),
        }
    }

    /// The queue of `pool`, starting its worker when there is none (or it has stopped).
    fn queue(&self, pool: &str) -> mpsc::UnboundedSender<Work> {
        let mut queues = self.queues.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(tx) = queues.get(pool).filter(|tx| !tx.is_closed()) {
            return tx.clone();
        }
        let (tx, rx) = mpsc::unbounded_channel();
        tokio::spawn(worker(self.store.clone(), pool.to_owned(), rx));
        queues.insert(pool.to_owned(), tx.clone());
        tx
    }

    /// Hands `work` to its pool's worker.
    fn send(&self, mut work: Work) -> Result<(), String> {
        // A worker that has just stopped for idleness refuses the work: start a new one.
        for _ in 0..2 {
            match self.queue(work.pool()).send(work) {
                Ok(()) => return Ok(()),
                Err(mpsc::error::SendError(back)) => work = back,
            }
        }
        Err("could not queue the request".into())
    }

    async fn submit(&self, job: Job) -> Result<Allocated, AllocError> {
        let (reply, result) = oneshot::channel();
        self.send(Work::Allocate(job, reply))
            .map_err(AllocError::Agent)?;
        result
            .await
            .unwrap_or_else(|_| Err(AllocError::Agent("the pool's worker stopped".into())))
    }

    async fn submit_release(&self, job: Job) -> Result<Vec<IpAddr>, StoreError> {
        let stopped = |message: String| StoreError::Transport {
            op: "release",
            object: format!("ippool {}", job.range.pool_name),
            source: Arc::new(std::io::Error::other(message)),
        };
        let (reply, result) = oneshot::channel();
        self.send(Work::Release(job.clone(), reply))
            .map_err(stopped)?;
        result
            .await
            .unwrap_or_else(|_| Err(stopped("the pool's worker stopped".into())))
    }
}

impl<S: Store + 'static> Allocate<S> for Batcher<S> {
    fn allocate(
        &self,
        _store: &S,
        range: &RangeConfig,
        scope: Scope<'_>,
        who: &Attachment,
    ) -> impl Future<Output = Result<Allocated, AllocError>> + Send {
        self.submit(Job::new(range, scope, who))
    }

    fn release(
        &self,
        _store: &S,
        range: &RangeConfig,
        scope: Scope<'_>,
        who: &Attachment,
    ) -> impl Future<Output = Result<Vec<IpAddr>, StoreError>> + Send {
        self.submit_release(Job::new(range, scope, who))
    }
}

async fn worker<S: Store>(store: Arc<S>, pool: String, mut rx: mpsc::UnboundedReceiver<Work>) {
    let mut known: Option<(tokio::time::Instant, Pool)> = None;
    // Work held back from the last batch to keep its order (see `conflicts`).
    let mut carried: Option<Work> = None;
    loop {
        let first = match carried.take() {
            Some(work) => work,
            None => match tokio::time::timeout(IDLE, rx.recv()).await {
                Ok(Some(first)) => first,
                Ok(None) => return,
                Err(_) => {
                    // Refuse new work (its senders start a new worker), finish what is queued.
                    rx.close();
                    match rx.recv().await {
                        Some(first) => first,
                        None => return,
                    }
                }
            },
        };
        let mut queued = vec![first];
        while queued.len() < MAX_GROUP {
            match rx.try_recv() {
                // A batch runs its releases before its allocations: a DEL that arrived after an
                // ADD of the same interface waits for the next batch, or it would release
                // nothing and the ADD would then record an address for a gone container.
                Ok(next) if conflicts(&queued, &next) => {
                    carried = Some(next);
                    break;
                }
                Ok(next) => queued.push(next),
                Err(_) => break,
            }
        }
        // A request that ran out of time meanwhile has rolled back: it must take nothing.
        queued.retain(|w| !w.abandoned());
        let (mut adds, mut dels) = (Vec::new(), Vec::new());
        for work in queued {
            match work {
                Work::Allocate(job, reply) => adds.push((job, reply)),
                Work::Release(job, reply) => dels.push((job, reply)),
            }
        }
        let started = tokio::time::Instant::now();
        if !dels.is_empty() {
            // Releases first: the addresses they free are there for the allocations.
            let (jobs, replies): (Vec<Job>, Vec<Released>) = dels.into_iter().unzip();
            let results = release_group(&*store, &jobs).await;
            tracing::debug!(%pool, size = jobs.len(), ms = started.elapsed().as_millis() as u64, "group released");
            for (reply, result) in replies.into_iter().zip(results) {
                let _ = reply.send(result);
            }
            known = None;
        }
        if !adds.is_empty() {
            let (jobs, replies): (Vec<Job>, Vec<Reply>) = adds.into_iter().unzip();
            let size = jobs.len();
            // The version this worker wrote last is the pool's current one unless another node
            // wrote since: start from it while it is fresh, saving a read (and, when the read
            // would come from the API server's lagging cache, a lost write).
            let start = known
                .take()
                .filter(|(at, _)| at.elapsed() < KNOWN_FOR)
                .map(|(_, p)| p);
            let (results, last) = allocate_group_from(&*store, jobs.clone(), start).await;
            known = last.map(|pool| (tokio::time::Instant::now(), pool));
            tracing::debug!(%pool, size, ms = started.elapsed().as_millis() as u64, "group allocated");
            let mut orphans = Vec::new();
            for ((reply, result), job) in replies.into_iter().zip(results).zip(jobs) {
                // The ADD ran out of time while its group ran, and has rolled back what it found:
                // the address recorded after that is released here, not left to the audit.
                if let Err(Ok(_)) = reply.send(result) {
                    orphans.push(job);
                }
            }
            if !orphans.is_empty() {
                tracing::warn!(%pool, count = orphans.len(), "releasing addresses of ADDs that gave up waiting");
                release_group(&*store, &orphans).await;
                known = None;
            }
        }
    }
}

/// Whether `next` releases an interface that an allocation already in `queued` is for.
fn conflicts(queued: &[Work], next: &Work) -> bool {
    let Work::Release(del, _) = next else {
        return false;
    };
    queued.iter().any(|w| match w {
        Work::Allocate(add, _) => {
            add.who.container_id == del.who.container_id && add.who.ifname == del.who.ifname
        }
        Work::Release(..) => false,
    })
}
