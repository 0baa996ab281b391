//! Every Prometheus metric of whereabouts, as values: the operator's [`Metrics`] and the node
//! agent's [`agent::AgentMetrics`], each holding a registry of its own. The command that starts a
//! process (`cli::run`, `cli::agent`) creates its one value and hands it to the parts that count;
//! nothing here is global, so tests count into values of their own.
//!
//! Labels are pools, networks, controllers, commands and reasons only: never one series per
//! address or pod. Nothing here is touched on the CNI plugin's allocation path.

pub mod agent;

use std::collections::HashMap;
use std::time::Duration;

use prometheus::core::Collector;
use prometheus::{
    Encoder, HistogramOpts, HistogramVec, IntCounterVec, IntGauge, IntGaugeVec, Opts, Registry,
    TextEncoder,
};

/// The operator's metrics (controllers and webhook) and the registry `/metrics` renders.
pub struct Metrics {
    pub registry: Registry,
    pub releases: IntCounterVec,
    pub release_errors: IntCounterVec,
    pub reconciles: IntCounterVec,
    pub reconcile_duration: HistogramVec,
    pub stale: IntGaugeVec,
    pub orphans: IntGauge,
    pub held_twice: IntGauge,
    pub claims_restored: prometheus::IntCounter,
    pub claim_records_unverified: prometheus::IntCounter,
    pub releases_waiting: IntGaugeVec,
    pub node_slices: IntGaugeVec,
    pub nodes_without_slice: IntGaugeVec,
    pub leader: IntGauge,
    pub build_info: IntGaugeVec,
    pub webhook_requests: IntCounterVec,
    pub webhook_duration: prometheus::Histogram,
    pub crd_fields_missing: IntGaugeVec,
    pub upstream_components: IntGaugeVec,
}

fn register<T: Collector + Clone + 'static>(registry: &Registry, metric: T) -> T {
    registry
        .register(Box::new(metric.clone()))
        .expect("metric names are unique");
    metric
}

/// `whereabouts_build_info{version}` at 1, in both registries.
fn build_info(registry: &Registry) -> IntGaugeVec {
    let info = register(
        registry,
        IntGaugeVec::new(
            Opts::new("whereabouts_build_info", "Build information."),
            &["version"],
        )
        .unwrap(),
    );
    info.with_label_values(&[env!("CARGO_PKG_VERSION")]).set(1);
    info
}

fn names(collectors: &[&dyn Collector]) -> Vec<String> {
    collectors
        .iter()
        .flat_map(|c| c.desc().into_iter().map(|d| d.fq_name.clone()))
        .collect()
}

fn render(registry: &Registry) -> String {
    let mut out = Vec::new();
    TextEncoder::new()
        .encode(&registry.gather(), &mut out)
        .expect("text encoding");
    String::from_utf8(out).expect("prometheus text is UTF-8")
}

/// Adds a scrape-time collector; a second registration of the same metric names is ignored.
fn register_collector(registry: &Registry, c: Box<dyn Collector>) {
    if let Err(e) = registry.register(c) {
        tracing::debug!(error = %e, "collector already registered");
    }
}

impl Default for Metrics {
    fn default() -> Self {
        Metrics::new()
    }
}

impl Metrics {
    /// A fresh registry holding every operator family, `whereabouts_build_info` set.
    pub fn new() -> Self {
        let r = Registry::new();
        Metrics {
            releases: register(&r, IntCounterVec::new(Opts::new("whereabouts_releases_total", "Addresses released by the operator, by reason (pod_deleted, audit, orphan)."), &["reason"]).unwrap()),
            release_errors: register(&r, IntCounterVec::new(Opts::new("whereabouts_release_errors_total", "Failed release attempts, by reason."), &["reason"]).unwrap()),
            reconciles: register(&r, IntCounterVec::new(Opts::new("whereabouts_reconcile_total", "Reconcile passes, by controller and result."), &["controller", "result"]).unwrap()),
            reconcile_duration: register(&r, HistogramVec::new(HistogramOpts::new("whereabouts_reconcile_duration_seconds", "Duration of reconcile passes."), &["controller"]).unwrap()),
            stale: register(&r, IntGaugeVec::new(Opts::new("whereabouts_stale_reservations", "Pool entries whose pod no longer exists, as last audited."), &["pool"]).unwrap()),
            node_slices: register(&r, IntGaugeVec::new(Opts::new("whereabouts_node_slices", "Node slices of each sliced range, by NodeSlicePool and state (assigned, free); their sum is the slice count."), &["nodeslicepool", "state"]).unwrap()),
            nodes_without_slice: register(&r, IntGaugeVec::new(Opts::new("whereabouts_nodes_without_slice", "Nodes the operator could not give a slice of this NodeSlicePool (every slice is taken): their pods on this network fail."), &["nodeslicepool"]).unwrap()),
            releases_waiting: register(&r, IntGaugeVec::new(Opts::new("whereabouts_releases_waiting", "Deleted pods holding addresses whose release waits for their node's kubelet to DEL them, by reason (kubelet_grace: a Ready node, within --deleted-pod-grace; node_not_ready: until the node is Ready again or deleted)."), &["reason"]).unwrap()),
            orphans: register(&r, IntGauge::new("whereabouts_orphan_reservations", "Reservations without a pool entry plus pool entries without their reservation, as last audited.").unwrap()),
            held_twice: register(&r, IntGauge::new("whereabouts_addresses_held_twice", "Addresses that two pods have held for the grace period, as last audited: entries of different pods in pools of overlapping ranges, or an entry whose claim names another pod. The operator's log names each address and its holders.").unwrap()),
            claims_restored: register(&r, prometheus::IntCounter::new("whereabouts_claims_restored_total", "Reservations the audit re-created for pool entries that had lost theirs (deleted by upstream's DEL, or by hand), so that no overlapping range hands the address out again.").unwrap()),
            claim_records_unverified: register(&r, prometheus::IntCounter::new("whereabouts_claim_records_unverified_total", "IPAMClaim records (addresses, owner pod, the node that wrote them) that their owner pod did not bear out while fresh: the pod did not exist, ran on another node, or did not refer to the claim. Each has a ClaimRecordUnverified Event on the claim.").unwrap()),
            leader: register(&r, IntGauge::new("whereabouts_leader", "1 when this replica is the leader.").unwrap()),
            build_info: build_info(&r),
            webhook_requests: register(&r, IntCounterVec::new(Opts::new("whereabouts_webhook_requests_total", "Admission reviews, by operation and result (allowed, denied, error, overloaded)."), &["operation", "result"]).unwrap()),
            webhook_duration: register(
                &r,
                prometheus::Histogram::with_opts(HistogramOpts::new("whereabouts_webhook_duration_seconds", "Time to answer an admission review.").buckets(vec![0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.5, 1.0])).unwrap(),
            ),
            crd_fields_missing: register(&r, IntGaugeVec::new(Opts::new("whereabouts_crd_fields_missing", "Fields of ours the installed CRD lacks (and so the API server prunes), as last checked: 0 when it keeps them all. Fix: kubectl apply -f crds/."), &["crd"]).unwrap()),
            upstream_components: register(&r, IntGaugeVec::new(Opts::new("whereabouts_upstream_components", "1 while this component of upstream whereabouts exists next to ours (each known one is exported, at 0 when absent): remove it."), &["kind", "namespace", "name"]).unwrap()),
            registry: r,
        }
    }

    pub fn record_releases(&self, reason: &str, n: usize) {
        if n > 0 {
            self.releases.with_label_values(&[reason]).inc_by(n as u64);
        }
    }

    pub fn record_release_error(&self, reason: &str) {
        self.release_errors.with_label_values(&[reason]).inc();
    }

    pub fn observe_reconcile(&self, controller: &str, ok: bool, took: Duration) {
        self.reconciles
            .with_label_values(&[controller, if ok { "success" } else { "error" }])
            .inc();
        self.reconcile_duration
            .with_label_values(&[controller])
            .observe(took.as_secs_f64());
    }

    /// The waiting releases, by reason.
    pub fn set_waiting(&self, counts: &[(&str, usize)]) {
        for (reason, n) in counts {
            self.releases_waiting
                .with_label_values(&[reason])
                .set(*n as i64);
        }
    }

    pub fn set_leader(&self, leading: bool) {
        self.leader.set(i64::from(leading));
    }

    /// Replaces the stale gauges with the latest audit's figures: stale entries per pool (pools
    /// no longer stale drop to 0), the orphan count and the addresses held twice.
    pub fn set_audit(&self, stale: &HashMap<String, usize>, orphans: usize, held_twice: usize) {
        self.held_twice.set(held_twice as i64);
        self.stale.reset();
        for (pool, n) in stale {
            self.stale.with_label_values(&[pool]).set(*n as i64);
        }
        self.orphans.set(orphans as i64);
    }

    /// The slices of every sliced range as last planned: (NodeSlicePool, slices, assigned,
    /// nodes without a slice). Ranges no NAD slices any more disappear.
    pub fn set_node_slices(&self, networks: &[(String, usize, usize, usize)]) {
        self.node_slices.reset();
        self.nodes_without_slice.reset();
        for (name, total, assigned, starved) in networks {
            let set = |state: &str, n: usize| {
                self.node_slices
                    .with_label_values(&[name.as_str(), state])
                    .set(n as i64)
            };
            set("assigned", *assigned);
            set("free", total - assigned);
            self.nodes_without_slice
                .with_label_values(&[name])
                .set(*starved as i64);
        }
    }

    /// The fields of ours that the installed CRD `crd` lacks.
    pub fn set_crd_fields_missing(&self, crd: &str, missing: usize) {
        self.crd_fields_missing
            .with_label_values(&[crd])
            .set(missing as i64);
    }

    /// Whether one of upstream's components (`daemonset`, `kube-system`, `whereabouts`) runs.
    pub fn set_upstream_component(&self, kind: &str, namespace: &str, name: &str, running: bool) {
        self.upstream_components
            .with_label_values(&[kind, namespace, name])
            .set(i64::from(running));
    }

    /// Adds a scrape-time collector (the pool and network usage over the operator's caches). A
    /// second registration of the same metric names is ignored.
    pub fn register_collector(&self, c: Box<dyn Collector>) {
        register_collector(&self.registry, c);
    }

    /// One admission review answered. The operation is the request's own text: one the API
    /// server does not send counts as `other`, so that junk requests cannot add series.
    pub fn record_webhook(&self, operation: &str, result: &str, took: Duration) {
        let operation = match operation {
            "CREATE" | "UPDATE" | "DELETE" | "CONNECT" | "unknown" => operation,
            _ => "other",
        };
        self.webhook_requests
            .with_label_values(&[operation, result])
            .inc();
        self.webhook_duration.observe(took.as_secs_f64());
    }

    /// The name of every family defined here (series appear once they have a value); the
    /// collectors registered later name their own.
    pub fn names(&self) -> Vec<String> {
        names(&[
            &self.releases,
            &self.releases_waiting,
            &self.release_errors,
            &self.reconciles,
            &self.reconcile_duration,
            &self.stale,
            &self.orphans,
            &self.held_twice,
            &self.claims_restored,
            &self.claim_records_unverified,
            &self.node_slices,
            &self.nodes_without_slice,
            &self.leader,
            &self.build_info,
            &self.webhook_requests,
            &self.webhook_duration,
            &self.crd_fields_missing,
            &self.upstream_components,
        ])
    }

    /// The Prometheus text exposition of every metric in the registry.
    pub fn render(&self) -> String {
        render(&self.registry)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn renders_every_family() {
        let metrics = Metrics::new();
        metrics.record_releases("audit", 2);
        metrics.set_leader(true);
        let text = metrics.render();
        assert!(
            text.contains("whereabouts_releases_total{reason=\"audit\"}"),
            "{text}"
        );
        assert!(text.contains("whereabouts_leader 1"));
        assert!(text.contains("whereabouts_build_info{version="));
    }

    /// A request can name any operation; the label takes only the API server's four.
    #[test]
    fn webhook_operations_are_a_fixed_set() {
        let metrics = Metrics::new();
        metrics.record_webhook("CREATE", "allowed", Duration::ZERO);
        for junk in ["create", "X".repeat(200).as_str(), "PATCH"] {
            metrics.record_webhook(junk, "error", Duration::ZERO);
        }
        let text = metrics.render();
        assert!(
            text.contains(r#"operation="CREATE",result="allowed"} 1"#),
            "{text}"
        );
        assert!(
            text.contains(r#"operation="other",result="error"} 3"#),
            "{text}"
        );
        assert!(!text.contains("XXXX") && !text.contains("PATCH"), "{text}");
    }

    #[test]
    fn the_agent_registry_holds_only_agent_families() {
        let agent = agent::AgentMetrics::new();
        agent.record_handback("busy");
        agent.observe_group("add", 3);
        let text = agent.render();
        assert!(
            text.contains("whereabouts_agent_handbacks_total{reason=\"busy\"}"),
            "{text}"
        );
        assert!(text.contains("whereabouts_agent_group_size_bucket{kind=\"add\",le=\"5\"}"));
        assert!(text.contains("whereabouts_build_info{version="));
        assert!(!text.contains("whereabouts_leader"), "{text}");
        assert!(agent.names().contains(&agent::QUEUE_DEPTH.to_owned()));
    }
}
