//! Every Prometheus metric of whereabouts: the operator's, registered in one registry, and the
//! node agent's ([`agent`]), in a registry of its own.
//!
//! Labels are pools, networks, controllers, commands and reasons only: never one series per
//! address or pod. Nothing here is touched on the CNI plugin's allocation path.

use std::sync::LazyLock;
use std::time::Duration;

use prometheus::{
    Encoder, HistogramOpts, HistogramVec, IntCounterVec, IntGauge, IntGaugeVec, Opts, Registry,
    TextEncoder,
};

pub struct Metrics {
    pub registry: Registry,
    pub releases: IntCounterVec,
    pub release_errors: IntCounterVec,
    pub reconciles: IntCounterVec,
    pub reconcile_duration: HistogramVec,
    pub stale: IntGaugeVec,
    pub orphans: IntGauge,
    pub leader: IntGauge,
    pub build_info: IntGaugeVec,
    pub webhook_requests: IntCounterVec,
    pub webhook_duration: prometheus::Histogram,
}

fn register<T: prometheus::core::Collector + Clone + 'static>(registry: &Registry, metric: T) -> T {
    registry
        .register(Box::new(metric.clone()))
        .expect("metric names are unique");
    metric
}

static METRICS: LazyLock<Metrics> = LazyLock::new(|| {
    let r = Registry::new();
    let m = Metrics {
        releases: register(&r, IntCounterVec::new(Opts::new("whereabouts_releases_total", "Addresses released by the operator, by reason (pod_deleted, audit, orphan)."), &["reason"]).unwrap()),
        release_errors: register(&r, IntCounterVec::new(Opts::new("whereabouts_release_errors_total", "Failed release attempts, by reason."), &["reason"]).unwrap()),
        reconciles: register(&r, IntCounterVec::new(Opts::new("whereabouts_reconcile_total", "Reconcile passes, by controller and result."), &["controller", "result"]).unwrap()),
        reconcile_duration: register(&r, HistogramVec::new(HistogramOpts::new("whereabouts_reconcile_duration_seconds", "Duration of reconcile passes."), &["controller"]).unwrap()),
        stale: register(&r, IntGaugeVec::new(Opts::new("whereabouts_stale_reservations", "Pool entries whose pod no longer exists, as last audited."), &["pool"]).unwrap()),
        orphans: register(&r, IntGauge::new("whereabouts_orphan_reservations", "Reservations without a pool entry plus pool entries without their reservation, as last audited.").unwrap()),
        leader: register(&r, IntGauge::new("whereabouts_leader", "1 when this replica is the leader.").unwrap()),
        build_info: register(&r, IntGaugeVec::new(Opts::new("whereabouts_build_info", "Build information."), &["version"]).unwrap()),
        webhook_requests: register(&r, IntCounterVec::new(Opts::new("whereabouts_webhook_requests_total", "Admission reviews, by operation and result (allowed, denied, error, overloaded)."), &["operation", "result"]).unwrap()),
        webhook_duration: register(
            &r,
            prometheus::Histogram::with_opts(HistogramOpts::new("whereabouts_webhook_duration_seconds", "Time to answer an admission review.").buckets(vec![0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.5, 1.0])).unwrap(),
        ),
        registry: r,
    };
    m.build_info
        .with_label_values(&[env!("CARGO_PKG_VERSION")])
        .set(1);
    m
});

pub fn metrics() -> &'static Metrics {
    &METRICS
}

pub fn record_releases(reason: &str, n: usize) {
    if n > 0 {
        METRICS
            .releases
            .with_label_values(&[reason])
            .inc_by(n as u64);
    }
}

pub fn record_release_error(reason: &str) {
    METRICS.release_errors.with_label_values(&[reason]).inc();
}

pub fn observe_reconcile(controller: &str, ok: bool, took: Duration) {
    METRICS
        .reconciles
        .with_label_values(&[controller, if ok { "success" } else { "error" }])
        .inc();
    METRICS
        .reconcile_duration
        .with_label_values(&[controller])
        .observe(took.as_secs_f64());
}

pub fn set_leader(leading: bool) {
    METRICS.leader.set(i64::from(leading));
}

/// Replaces the stale gauges with the latest audit's figures (pools no longer stale drop to 0).
pub fn set_audit(report: &crate::controller::audit::Report) {
    METRICS.stale.reset();
    for (pool, n) in &report.stale {
        METRICS.stale.with_label_values(&[pool]).set(*n as i64);
    }
    METRICS.orphans.set(report.orphans as i64);
}

/// Adds a scrape-time collector (the pool and network usage over the operator's caches). A second
/// registration of the same metric names is ignored.
pub fn register_collector(c: Box<dyn prometheus::core::Collector>) {
    if let Err(e) = METRICS.registry.register(c) {
        tracing::debug!(error = %e, "collector already registered");
    }
}

/// The name of every metric the operator or the node agent can export (series appear once they
/// have a value).
pub fn defined_names() -> Vec<String> {
    use prometheus::core::Collector;
    let m = &*METRICS;
    let collectors: Vec<&dyn Collector> = vec![
        &m.releases,
        &m.release_errors,
        &m.reconciles,
        &m.reconcile_duration,
        &m.stale,
        &m.orphans,
        &m.leader,
        &m.build_info,
        &m.webhook_requests,
        &m.webhook_duration,
    ];
    let mut names: Vec<String> = collectors
        .iter()
        .flat_map(|c| c.desc().into_iter().map(|d| d.fq_name.clone()))
        .collect();
    names.extend(crate::controller::usage::family_names());
    names.extend(agent::defined_names());
    names
}

/// One admission review answered.
pub fn record_webhook(operation: &str, result: &str, took: Duration) {
    METRICS
        .webhook_requests
        .with_label_values(&[operation, result])
        .inc();
    METRICS.webhook_duration.observe(took.as_secs_f64());
}

/// The Prometheus text exposition of every metric.
pub fn render() -> String {
    let mut out = Vec::new();
    TextEncoder::new()
        .encode(&METRICS.registry.gather(), &mut out)
        .expect("text encoding");
    String::from_utf8(out).expect("prometheus text is UTF-8")
}

pub mod agent {
    //! The node agent's metrics. Its own registry: the agent is another process, and its
    //! `/metrics` must not carry the operator's families (a `whereabouts_leader 0` from every
    //! node).

    use super::*;
    use prometheus::core::Collector;

    /// The gauge of requests waiting in each pool's queue, computed at scrape time from the
    /// queues themselves (see `agent::batch`), so it can never drift from them.
    pub const QUEUE_DEPTH: &str = "whereabouts_agent_queue_depth";
    pub const QUEUE_DEPTH_HELP: &str =
        "Requests admitted to a pool's queue of the node agent and not yet in a group, by pool.";

    pub struct AgentMetrics {
        pub registry: Registry,
        pub requests: IntCounterVec,
        pub request_duration: HistogramVec,
        pub handbacks: IntCounterVec,
        pub group_size: HistogramVec,
        pub build_info: IntGaugeVec,
    }

    static AGENT: LazyLock<AgentMetrics> = LazyLock::new(|| {
        let r = Registry::new();
        let m = AgentMetrics {
            requests: register(&r, IntCounterVec::new(Opts::new("whereabouts_agent_requests_total", "Requests the node agent answered, by command (add, del, check, gc, status, version, unknown) and result (ok, error, handback)."), &["command", "result"]).unwrap()),
            request_duration: register(&r, HistogramVec::new(HistogramOpts::new("whereabouts_agent_request_duration_seconds", "Time from reading a request to answering it, hand-backs included.").buckets(vec![0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0]), &["command"]).unwrap()),
            handbacks: register(&r, IntCounterVec::new(Opts::new("whereabouts_agent_handbacks_total", "Requests the node agent handed back to the plugin to run itself, by reason."), &["reason"]).unwrap()),
            // A group is at most 500 (MAX_GROUP in agent::batch).
            group_size: register(&r, HistogramVec::new(HistogramOpts::new("whereabouts_agent_group_size", "Requests per group the node agent wrote to a pool, by kind (add, del).").buckets(vec![1.0, 2.0, 5.0, 10.0, 20.0, 50.0, 100.0, 200.0, 500.0]), &["kind"]).unwrap()),
            build_info: register(&r, IntGaugeVec::new(Opts::new("whereabouts_build_info", "Build information."), &["version"]).unwrap()),
            registry: r,
        };
        m.build_info
            .with_label_values(&[env!("CARGO_PKG_VERSION")])
            .set(1);
        m
    });

    pub fn metrics() -> &'static AgentMetrics {
        &AGENT
    }

    /// Names of the agent's metrics (the queue depth gauge included).
    pub fn defined_names() -> Vec<String> {
        let m = &*AGENT;
        let collectors: Vec<&dyn Collector> = vec![
            &m.requests,
            &m.request_duration,
            &m.handbacks,
            &m.group_size,
        ];
        let mut names: Vec<String> = collectors
            .iter()
            .flat_map(|c| c.desc().into_iter().map(|d| d.fq_name.clone()))
            .collect();
        names.push(QUEUE_DEPTH.to_owned());
        names
    }

    /// One request answered: `result` is `ok`, `error` or `handback`.
    pub fn record_request(command: &str, result: &str, took: Duration) {
        AGENT.requests.with_label_values(&[command, result]).inc();
        AGENT
            .request_duration
            .with_label_values(&[command])
            .observe(took.as_secs_f64());
    }

    /// Makes the series of `reason` exist at 0, so that `rate()` sees its first hand-back.
    pub fn declare_handback(reason: &str) {
        AGENT.handbacks.with_label_values(&[reason]);
    }

    pub fn record_handback(reason: &str) {
        AGENT.handbacks.with_label_values(&[reason]).inc();
    }

    /// One group written: `kind` is `add` or `del`.
    pub fn observe_group(kind: &str, size: usize) {
        AGENT
            .group_size
            .with_label_values(&[kind])
            .observe(size as f64);
    }

    /// Adds a scrape-time collector (the queue depths); a second registration is ignored.
    pub fn register_collector(c: Box<dyn Collector>) {
        if let Err(e) = AGENT.registry.register(c) {
            tracing::debug!(error = %e, "agent collector already registered");
        }
    }

    /// The Prometheus text exposition of the agent's metrics.
    pub fn render() -> String {
        let mut out = Vec::new();
        TextEncoder::new()
            .encode(&AGENT.registry.gather(), &mut out)
            .expect("text encoding");
        String::from_utf8(out).expect("prometheus text is UTF-8")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn renders_every_family() {
        record_releases("audit", 2);
        set_leader(true);
        let text = render();
        assert!(
            text.contains("whereabouts_releases_total{reason=\"audit\"}"),
            "{text}"
        );
        assert!(text.contains("whereabouts_leader 1"));
        assert!(text.contains("whereabouts_build_info{version="));
    }

    #[test]
    fn the_agent_registry_holds_only_agent_families() {
        agent::record_handback("busy");
        agent::observe_group("add", 3);
        let text = agent::render();
        assert!(
            text.contains("whereabouts_agent_handbacks_total{reason=\"busy\"}"),
            "{text}"
        );
        assert!(text.contains("whereabouts_agent_group_size_bucket{kind=\"add\",le=\"5\"}"));
        assert!(text.contains("whereabouts_build_info{version="));
        assert!(!text.contains("whereabouts_leader"), "{text}");
        assert!(defined_names().contains(&agent::QUEUE_DEPTH.to_owned()));
    }
}
