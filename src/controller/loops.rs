//! The operator's periodic loops: the pool audit, NADs to pools, node slices, and addresses whose
//! holders are gone.

use std::sync::Arc;
use std::time::Duration;

use tokio::sync::Notify;

use super::{Context, audit, claim_records, holders, nads, slices, status};

pub(super) async fn audit_loop(ctx: Arc<Context>) {
    let mut auditor = audit::Auditor::new();
    // A short first period so that the second observation of a stale entry found at start-up comes
    // as soon as the grace period allows.
    let mut ticker = tokio::time::interval(
        ctx.opts
            .audit_interval
            .min(ctx.opts.stale_grace.max(Duration::from_secs(1))),
    );
    let mut since_full = Duration::MAX;
    loop {
        ticker.tick().await;
        since_full = since_full.saturating_add(ticker.period());
        let suspects_pending = auditor.has_suspects();
        if since_full < ctx.opts.audit_interval && !suspects_pending {
            continue;
        }
        since_full = Duration::ZERO;
        if !ctx.is_leader() {
            continue;
        }
        let started = std::time::Instant::now();
        match auditor.run_once(&ctx).await {
            Ok(report) => {
                ctx.metrics
                    .set_audit(&report.stale, report.orphans, report.held_twice);
                if report.released > 0 || report.released_orphans > 0 {
                    tracing::info!(?report, "audit released stale addresses");
                }
                ctx.metrics
                    .observe_reconcile("audit", true, started.elapsed());
            }
            Err(e) => {
                tracing::warn!(error = %e, "audit failed");
                ctx.metrics.record_release_error("audit");
                ctx.metrics
                    .observe_reconcile("audit", false, started.elapsed());
            }
        }
    }
}

pub(super) async fn nad_loop(ctx: Arc<Context>, changed: Arc<Notify>, slices: Arc<Notify>) {
    let mut reported = std::collections::HashMap::new();
    loop {
        if ctx.is_leader() {
            let started = std::time::Instant::now();
            let result = nads::reconcile(&ctx, &mut reported).await;
            if let Err(e) = &result {
                tracing::warn!(error = %e, "NAD reconcile failed");
            }
            ctx.metrics
                .observe_reconcile("nad", result.is_ok(), started.elapsed());
        }
        slices.notify_one();
        // NAD changes wake us; pools changing under us (or leadership changing) are caught by the
        // periodic pass.
        let _ = tokio::time::timeout(Duration::from_secs(30), changed.notified()).await;
        tokio::time::sleep(Duration::from_millis(200)).await; // coalesce bursts of NAD events
    }
}

/// Node slices, in a loop of their own: a cluster where nodes cannot be listed (RBAC of an older
/// install) still gets its NADs' pools. Drained slices are noticed by the periodic pass.
pub(super) async fn slice_loop(ctx: Arc<Context>, changed: Arc<Notify>) {
    // Never planned from a partial list of nodes: that would free slices in use.
    let _ = tokio::join!(
        ctx.caches.nodes.wait_until_ready(),
        ctx.caches.slice_pools.wait_until_ready()
    );
    let mut reported = std::collections::HashMap::new();
    loop {
        if ctx.is_leader() {
            let started = std::time::Instant::now();
            let result = slices::reconcile(&ctx, &mut reported).await;
            if let Err(e) = &result {
                tracing::warn!(error = %e, "node slice reconcile failed");
            }
            ctx.metrics
                .observe_reconcile("slices", result.is_ok(), started.elapsed());
        }
        let _ = tokio::time::timeout(Duration::from_secs(15), changed.notified()).await;
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

/// How often held addresses are checked against their holders when nothing wakes the check.
const HOLDER_PERIOD: Duration = Duration::from_secs(60);

/// Addresses held by StatefulSets and IPAMClaims, freed when their holder goes; woken by
/// StatefulSet and IPAMClaim changes and pod deletions. Never decided from partial lists (that
/// would free kept addresses): a kind whose cache has not listed yet is left for a later pass,
/// without holding up the other.
/// Fresh IPAMClaim records are checked against their pods here too (`claim_records`): claim
/// changes wake this loop.
pub(super) async fn holder_loop(ctx: Arc<Context>, changed: Arc<Notify>) {
    let mut checked = std::collections::HashSet::new();
    loop {
        if ctx.is_leader() {
            let started = std::time::Instant::now();
            let result = holders::reconcile(&ctx).await;
            if let Err(e) = &result {
                tracing::warn!(error = %e, "held address reconcile failed");
            }
            ctx.metrics
                .observe_reconcile("holders", result.is_ok(), started.elapsed());
            if let Err(e) = claim_records::check(&ctx, &mut checked).await {
                tracing::warn!(error = %e, "IPAMClaim record check failed");
            }
        }
        let _ = tokio::time::timeout(HOLDER_PERIOD, changed.notified()).await;
        // Coalesces a burst (a StatefulSet scaled down by many replicas).
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
}

/// IPPool status (`kubectl get ippools` columns), from the pool cache: changed pools are written
/// at most once per `status::MIN_INTERVAL` each.
pub(super) async fn status_loop(ctx: Arc<Context>) {
    let mut written = status::Written::default();
    let mut ticker = tokio::time::interval(Duration::from_secs(2));
    loop {
        ticker.tick().await;
        if !ctx.is_leader() {
            continue;
        }
        let started = std::time::Instant::now();
        let result = status::reconcile(&ctx, &mut written).await;
        if let Err(e) = &result {
            tracing::warn!(error = %e, "pool status update failed");
        }
        ctx.metrics
            .observe_reconcile("pool_status", result.is_ok(), started.elapsed());
    }
}
