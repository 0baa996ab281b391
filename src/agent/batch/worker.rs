//! A pool's worker: it takes what is queued for its pool as one group, runs the releases and then
//! the allocations, and keeps the pool version it wrote last for the next group.

use std::sync::Arc;

use tokio::sync::mpsc;

use super::{IDLE, KNOWN_FOR, MAX_GROUP, Queued, Released, Reply, Work};
use crate::agent::attachments::Held;
use crate::alloc::Job;
use crate::alloc::group::{allocate_group_from, release_group};
use crate::metrics::agent::AgentMetrics;
use crate::store::{Datastore, Pool};

/// The releases and allocations of one group, each with the reply it owes, and the marks of
/// their containers, kept until the group is done.
type Group = (Vec<(Job, Reply)>, Vec<(Job, Released)>, Vec<Held>);

/// One pool's worker and what it carries from one group to the next.
struct Worker<S> {
    store: Arc<S>,
    metrics: Arc<AgentMetrics>,
    pool: String,
    rx: mpsc::UnboundedReceiver<Queued>,
    /// The pool version this worker wrote last, and when.
    known: Option<(tokio::time::Instant, Pool)>,
    /// Work held back from the last batch to keep its order (see `conflicts`).
    carried: Option<Queued>,
}

/// Drains `pool`'s queue group by group until the channel closes or the worker idles out.
pub(super) async fn worker<S: Datastore>(
    store: Arc<S>,
    metrics: Arc<AgentMetrics>,
    pool: String,
    rx: mpsc::UnboundedReceiver<Queued>,
) {
    let mut worker = Worker {
        store,
        metrics,
        pool,
        rx,
        known: None,
        carried: None,
    };
    while let Some(queued) = worker.take().await {
        // `_held` lives to the end of the group: until then a retry of one of its containers
        // is not handed back to run beside what the group may still write or release.
        let (adds, dels, _held) = split(queued);
        let started = tokio::time::Instant::now();
        if !dels.is_empty() {
            // Releases first: the addresses they free are there for the allocations.
            worker.release(dels, started).await;
        }
        if !adds.is_empty() {
            worker.allocate(adds, started).await;
        }
    }
}

impl<S: Datastore> Worker<S> {
    /// The next group: the carried-over work or the next to arrive, then whatever else is
    /// queued, up to [`MAX_GROUP`]. `None` when the worker is to stop (its channel closed, or
    /// it idled and has finished what was queued).
    async fn take(&mut self) -> Option<Vec<Queued>> {
        let first = match self.carried.take() {
            Some(work) => work,
            None => self.wait().await?,
        };
        let mut queued = vec![first];
        while queued.len() < MAX_GROUP {
            match self.rx.try_recv() {
                // A batch runs its releases before its allocations: a DEL that arrived after an
                // ADD of the same interface waits for the next batch, or it would release
                // nothing and the ADD would then record an address for a gone container.
                Ok(next) if conflicts(&queued, &next.work) => {
                    self.carried = Some(next);
                    break;
                }
                Ok(next) => queued.push(next),
                Err(_) => break,
            }
        }
        Some(queued)
    }

    /// The next work to arrive, or `None` when there will be none: after [`IDLE`] without
    /// work the channel is closed and only what is already queued is still taken.
    async fn wait(&mut self) -> Option<Queued> {
        match tokio::time::timeout(IDLE, self.rx.recv()).await {
            Ok(Some(first)) => Some(first),
            Ok(None) => None,
            Err(_) => {
                // Refuse new work (its senders start a new worker), finish what is queued.
                self.rx.close();
                self.rx.recv().await
            }
        }
    }

    /// Runs a group's releases and replies to each; the pool version known is then stale.
    async fn release(&mut self, dels: Vec<(Job, Released)>, started: tokio::time::Instant) {
        let pool = &self.pool;
        let (jobs, replies): (Vec<Job>, Vec<Released>) = dels.into_iter().unzip();
        self.metrics.observe_group("del", jobs.len());
        let results = release_group(&*self.store, &jobs).await;
        tracing::debug!(%pool, size = jobs.len(), ms = started.elapsed().as_millis() as u64, "group released");
        for (reply, result) in replies.into_iter().zip(results) {
            let _ = reply.send(result);
        }
        self.known = None;
    }

    /// Runs a group's allocations from the known pool version while it is fresh, replies to
    /// each, and keeps the version written for the next group.
    async fn allocate(&mut self, adds: Vec<(Job, Reply)>, started: tokio::time::Instant) {
        let (jobs, replies): (Vec<Job>, Vec<Reply>) = adds.into_iter().unzip();
        let size = jobs.len();
        self.metrics.observe_group("add", size);
        // The version this worker wrote last is the pool's current one unless another node
        // wrote since: start from it while it is fresh, saving a read (and, when the read
        // would come from the API server's lagging cache, a lost write).
        let start = self
            .known
            .take()
            .filter(|(at, _)| at.elapsed() < KNOWN_FOR)
            .map(|(_, p)| p);
        let (results, last) = allocate_group_from(&*self.store, jobs.clone(), start).await;
        self.known = last.map(|pool| (tokio::time::Instant::now(), pool));
        let pool = &self.pool;
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
            self.release_orphans(&orphans).await;
        }
    }

    /// Releases the addresses recorded for ADDs that gave up waiting.
    async fn release_orphans(&mut self, orphans: &[Job]) {
        let pool = &self.pool;
        tracing::warn!(%pool, count = orphans.len(), "releasing addresses of ADDs that gave up waiting");
        release_group(&*self.store, orphans).await;
        self.known = None;
    }
}

/// A group taken in, split into its allocations and its releases (so that the releases can run
/// first), without the requests that stopped waiting.
fn split(queued: Vec<Queued>) -> Group {
    let (mut adds, mut dels, mut held) = (Vec::new(), Vec::new(), Vec::new());
    // Taken into the group: the places in the queue are free for the next requests.
    for Queued { work, marker, .. } in queued {
        // Marked before the look at the requester: see `agent::attachments`.
        let mark = marker.map(|m| m.hold());
        // A request that ran out of time meanwhile has rolled back: it must take nothing.
        if work.abandoned() {
            continue;
        }
        held.extend(mark);
        match work {
            Work::Allocate(job, reply) => adds.push((job, reply)),
            Work::Release(job, reply) => dels.push((job, reply)),
        }
    }
    (adds, dels, held)
}

/// Whether `next` releases an interface that an allocation already in `queued` is for.
fn conflicts(queued: &[Queued], next: &Work) -> bool {
    let Work::Release(del, _) = next else {
        return false;
    };
    queued.iter().any(|q| match &q.work {
        Work::Allocate(add, _) => {
            add.who.container_id == del.who.container_id && add.who.ifname == del.who.ifname
        }
        Work::Release(..) => false,
    })
}
