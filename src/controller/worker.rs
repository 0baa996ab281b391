//! The cleanup worker: releases due pods' addresses in batches, waits for a deleted pod's node
//! where its kubelet may still run the DEL, and retries what failed. Only the leader releases; a
//! replica that stands by keeps the jobs for when it leads.

use std::collections::VecDeque;
use std::sync::Arc;
use std::time::Duration;

use tokio::sync::mpsc;

use super::cleanup::{self, Trigger};
use super::{Context, deferral, pools};
use crate::ownership::PodIdentity;
use crate::retry::POD_RELEASE;

/// A pod whose addresses are due, and how often its release was tried.
pub(super) struct Job {
    pub pod: PodIdentity,
    pub trigger: Trigger,
    pub attempt: u32,
    /// The node the pod was bound to, if any (a deleted pod's release may wait for it).
    pub node: Option<String>,
    /// Since when its release has been waiting for the node's kubelet.
    pub since: std::time::Instant,
}

/// The most pods released in one batch. Jobs that arrive while a batch is being released wait
/// for the next one, so a burst of deletions is released in a few batches, each pool written once
/// per batch; concurrent writes of one pool were measured to be far slower than serial ones,
/// because the API server re-runs every write that loses (docs/benchmarks.md, "Operator").
const BATCH: usize = 1000;

/// The most jobs a replica that does not lead keeps for when it leads (see [`hold`]); beyond it
/// the oldest go, left to the audit. A job is a pod's identity: about 200 bytes.
const STANDBY_JOBS: usize = 100_000;

/// How long a standby keeps a job. The leader renews its Lease every few seconds and loses it
/// 15 s after it stops; what it received well before that it has run (or is retrying itself).
/// So only the last moments matter, and a standby that waits for days neither grows with every
/// pod deleted in the cluster nor replays all of them when it leads.
const STANDBY_WINDOW: Duration = Duration::from_secs(120);

/// Releases due pods' addresses, batch by batch. Errors and empty results that may be cache lag
/// are retried with exponential backoff a bounded number of times; the audit catches anything
/// left. A replica that does not lead keeps the jobs and runs them once it leads.
pub(super) async fn cleanup_worker(
    ctx: Arc<Context>,
    mut rx: mpsc::UnboundedReceiver<Job>,
    tx: mpsc::UnboundedSender<Job>,
) {
    let mut leading = ctx.leader.clone();
    let mut standby = VecDeque::new();
    loop {
        let first = tokio::select! {
            job = rx.recv() => match job {
                Some(job) => job,
                None => return,
            },
            Ok(()) = leading.changed(), if !standby.is_empty() => {
                if *leading.borrow_and_update() {
                    prune(&mut standby);
                    tracing::info!(pods = standby.len(), "leading: releasing the pods deleted while this replica stood by");
                    for job in standby.drain(..) {
                        let _ = tx.send(job);
                    }
                }
                continue;
            }
        };
        let mut batch = vec![first];
        while batch.len() < BATCH {
            match rx.try_recv() {
                Ok(job) => batch.push(job),
                Err(_) => break,
            }
        }
        if !ctx.is_leader() {
            hold(&ctx, &mut standby, batch);
            continue;
        }
        release_batch(&ctx, batch, &tx).await;
    }
}

/// A replica that does not lead keeps what its watches made due, so that pods deleted around a
/// failover (a rolling update of the operator, a leader killed) are released as soon as it leads,
/// not at its next full audit, minutes later. A job the old leader already ran finds nothing:
/// releases are matched by pod UID and written conditionally. Nothing waits for a node meanwhile.
fn hold(ctx: &Context, standby: &mut VecDeque<Job>, batch: Vec<Job>) {
    for job in batch {
        ctx.waiting
            .set(&job.pod.podref, &job.pod.uid, deferral::Wait::No, false);
        standby.push_back(job);
    }
    prune(standby);
}

/// Drops the jobs older than [`STANDBY_WINDOW`] (by their `since`: when their pod event came, or
/// when a NotReady node's wait began) and the oldest beyond [`STANDBY_JOBS`]; jobs are kept in
/// the order they came.
fn prune(standby: &mut VecDeque<Job>) {
    while standby.len() > STANDBY_JOBS
        || standby
            .front()
            .is_some_and(|j| j.since.elapsed() > STANDBY_WINDOW)
    {
        standby.pop_front();
    }
}

async fn release_batch(ctx: &Context, batch: Vec<Job>, tx: &mpsc::UnboundedSender<Job>) {
    let batch = not_waiting(ctx, batch, tx);
    if batch.is_empty() {
        return;
    }
    let started = std::time::Instant::now();
    let pods: Vec<_> = batch.iter().map(|j| (j.pod.clone(), j.trigger)).collect();
    let results = cleanup::release_pods(ctx, &pods).await;
    tracing::debug!(pods = batch.len(), elapsed = ?started.elapsed(), "released a batch");
    for (job, result) in batch.into_iter().zip(results) {
        finish(ctx, job, result, tx, started.elapsed()).await;
    }
}

/// The jobs to release now; the others (deleted pods whose node's kubelet may still DEL them) are
/// put back on the queue for when they are due, and counted as waiting.
fn not_waiting(ctx: &Context, batch: Vec<Job>, tx: &mpsc::UnboundedSender<Job>) -> Vec<Job> {
    let now = std::time::Instant::now();
    let mut due = Vec::with_capacity(batch.len());
    // Read once, and only if some pod waits.
    let mut views = None;
    for mut job in batch {
        let wait = match (&job.trigger, job.node.as_deref()) {
            (Trigger::Deleted, Some(node)) => {
                let health = cleanup::health_of(Some(node), &ctx.caches.nodes);
                if health == cleanup::NodeHealth::NotReady {
                    // The grace counts from when the node is Ready again.
                    job.since = now;
                }
                deferral::wait(health, job.since, ctx.opts.deleted_pod_grace, now)
            }
            _ => deferral::Wait::No,
        };
        if wait == deferral::Wait::No {
            ctx.waiting.set(&job.pod.podref, &job.pod.uid, wait, false);
            due.push(job);
            continue;
        }
        let views = views.get_or_insert_with(|| ctx.pool_views());
        let holds =
            !job.pod.addresses.is_empty() || !pools::entries_of_pod(views, &job.pod).is_empty();
        ctx.waiting.set(&job.pod.podref, &job.pod.uid, wait, holds);
        tracing::debug!(pod = %job.pod.podref, reason = wait.reason(), "release waits for the node's kubelet");
        let (tx, at) = (tx.clone(), wait.recheck_at(now));
        tokio::spawn(async move {
            tokio::time::sleep_until(at.into()).await;
            let _ = tx.send(job);
        });
    }
    ctx.metrics.set_waiting(&ctx.waiting.counts());
    due
}

/// Logs, counts and (if needed) requeues one pod's release.
async fn finish(
    ctx: &Context,
    job: Job,
    result: Result<cleanup::Outcome, crate::store::StoreError>,
    tx: &mpsc::UnboundedSender<Job>,
    elapsed: Duration,
) {
    let retry = match &result {
        Ok(o) => {
            if o.found > 0 {
                tracing::info!(pod = %job.pod.podref, released = ?o.released, trigger = ?job.trigger, "released");
            }
            // The pod's network-status names addresses the pool cache does not show yet.
            o.found == 0 && !job.pod.addresses.is_empty() && job.attempt < 2
        }
        Err(e) => {
            tracing::warn!(pod = %job.pod.podref, error = %e, "release failed; retrying");
            ctx.metrics.record_release_error("pod_deleted");
            ctx.event(
                &cleanup::reference(&job.pod),
                true,
                "ReleaseFailed",
                &e.to_string(),
            )
            .await;
            POD_RELEASE.allows(job.attempt + 1)
        }
    };
    ctx.metrics
        .observe_reconcile("pod_cleanup", result.is_ok(), elapsed);
    if retry {
        let delay = POD_RELEASE.delay(job.attempt);
        let tx = tx.clone();
        tokio::spawn(async move {
            tokio::time::sleep(delay).await;
            let _ = tx.send(Job {
                attempt: job.attempt + 1,
                ..job
            });
        });
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn job(name: &str, age: Duration) -> Job {
        Job {
            pod: PodIdentity {
                podref: format!("ns/{name}"),
                ..Default::default()
            },
            trigger: Trigger::Deleted,
            attempt: 0,
            node: None,
            since: std::time::Instant::now() - age,
        }
    }

    #[test]
    fn a_standby_keeps_only_the_recent_jobs() {
        let mut standby: VecDeque<Job> = [
            job("old", STANDBY_WINDOW + Duration::from_secs(10)),
            job("recent", Duration::from_secs(5)),
            job("new", Duration::ZERO),
        ]
        .into();
        prune(&mut standby);
        let kept: Vec<&str> = standby.iter().map(|j| j.pod.podref.as_str()).collect();
        assert_eq!(kept, ["ns/recent", "ns/new"]);
        let mut full: VecDeque<Job> = (0..STANDBY_JOBS + 3)
            .map(|i| job(&i.to_string(), Duration::ZERO))
            .collect();
        prune(&mut full);
        assert_eq!(full.len(), STANDBY_JOBS);
        assert_eq!(full.front().unwrap().pod.podref, "ns/3");
    }
}
