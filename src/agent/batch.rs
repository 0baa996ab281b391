//! The agent's allocator: one queue per pool, drained by one worker that runs everything queued
//! as a group ([`allocate_group`]). While a group is being claimed and written, the next ADDs
//! queue up, so the group size follows the arrival rate with no added delay: an ADD alone is
//! served at once, a burst of hundreds is served in a handful of pool writes.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio::sync::{mpsc, oneshot};

use crate::cni::Allocate;
use crate::cni::allocate::{AllocError, Allocated, Scope};
use crate::cni::group::{Job, allocate_group_from};
use crate::cni::protocol::Attachment;
use crate::config::RangeConfig;
use crate::store::{Pool, Store};

/// The most ADDs one group takes; the rest wait for the next group.
const MAX_GROUP: usize = 500;
/// How long the pool version a worker wrote is trusted as the starting point of its next group.
const KNOWN_FOR: Duration = Duration::from_secs(2);
/// A pool's worker stops after this long without work (a node has few pools, but they change).
const IDLE: Duration = Duration::from_secs(300);

type Reply = oneshot::Sender<Result<Allocated, AllocError>>;

pub struct Batcher<S> {
    store: Arc<S>,
    queues: Mutex<HashMap<String, mpsc::UnboundedSender<(Job, Reply)>>>,
}

impl<S: Store + 'static> Batcher<S> {
    pub fn new(store: Arc<S>) -> Self {
        Batcher {
            store,
            queues: Mutex::new(HashMap::new()),
        }
    }

    /// The queue of `pool`, starting its worker when there is none (or it has stopped).
    fn queue(&self, pool: &str) -> mpsc::UnboundedSender<(Job, Reply)> {
        let mut queues = self.queues.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(tx) = queues.get(pool).filter(|tx| !tx.is_closed()) {
            return tx.clone();
        }
        let (tx, rx) = mpsc::unbounded_channel();
        tokio::spawn(worker(self.store.clone(), pool.to_owned(), rx));
        queues.insert(pool.to_owned(), tx.clone());
        tx
    }

    /// Queues a job and waits for its result.
    async fn submit(&self, job: Job) -> Result<Allocated, AllocError> {
        let (reply, result) = oneshot::channel();
        let mut item = (job, reply);
        // A worker that has just stopped for idleness refuses the job: start a new one.
        for _ in 0..2 {
            match self.queue(&item.0.range.pool_name).send(item) {
                Ok(()) => {
                    return result.await.unwrap_or_else(|_| {
                        Err(AllocError::Agent("the pool's worker stopped".into()))
                    });
                }
                Err(mpsc::error::SendError(back)) => item = back,
            }
        }
        Err(AllocError::Agent("could not queue the allocation".into()))
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
}

async fn worker<S: Store>(
    store: Arc<S>,
    pool: String,
    mut rx: mpsc::UnboundedReceiver<(Job, Reply)>,
) {
    let mut known: Option<(tokio::time::Instant, Pool)> = None;
    loop {
        let first = match tokio::time::timeout(IDLE, rx.recv()).await {
            Ok(Some(first)) => first,
            Ok(None) => return,
            Err(_) => {
                // Refuse new jobs (their senders start a new worker), finish those already queued.
                rx.close();
                match rx.recv().await {
                    Some(first) => first,
                    None => return,
                }
            }
        };
        let mut group = vec![first];
        while group.len() < MAX_GROUP {
            match rx.try_recv() {
                Ok(next) => group.push(next),
                Err(_) => break,
            }
        }
        // An ADD that ran out of time meanwhile has rolled back: it must take nothing.
        group.retain(|(_, reply)| !reply.is_closed());
        if group.is_empty() {
            continue;
        }
        let started = tokio::time::Instant::now();
        let (jobs, replies): (Vec<Job>, Vec<Reply>) = group.into_iter().unzip();
        let size = jobs.len();
        // The version this worker wrote last is the pool's current one unless another node
        // wrote since: start from it while it is fresh, saving a read (and, when the read would
        // come from the API server's lagging cache, a lost write).
        let start = known
            .take()
            .filter(|(at, _)| at.elapsed() < KNOWN_FOR)
            .map(|(_, p)| p);
        let (results, last) = allocate_group_from(&*store, jobs, start).await;
        known = last.map(|pool| (tokio::time::Instant::now(), pool));
        tracing::debug!(%pool, size, ms = started.elapsed().as_millis() as u64, "group allocated");
        for (reply, result) in replies.into_iter().zip(results) {
            let _ = reply.send(result);
        }
    }
}
