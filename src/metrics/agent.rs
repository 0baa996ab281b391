//! The node agent's metrics. Its own registry: the agent is another process, and its `/metrics`
//! must not carry the operator's families (a `whereabouts_leader 0` from every node).

use std::time::Duration;

use prometheus::core::Collector;
use prometheus::{
    HistogramOpts, HistogramVec, IntCounter, IntCounterVec, IntGaugeVec, Opts, Registry,
};

use super::{build_info, names, register, register_collector, render};

/// The gauge of requests waiting in each pool's queue, computed at scrape time from the queues
/// themselves (see `agent::batch`), so it can never drift from them.
pub const QUEUE_DEPTH: &str = "whereabouts_agent_queue_depth";
pub const QUEUE_DEPTH_HELP: &str =
    "Requests admitted to a pool's queue of the node agent and not yet in a group, by pool.";

pub struct AgentMetrics {
    pub registry: Registry,
    pub requests: IntCounterVec,
    pub request_duration: HistogramVec,
    pub handbacks: IntCounterVec,
    pub held_back: IntCounter,
    pub group_size: HistogramVec,
    pub build_info: IntGaugeVec,
}

impl Default for AgentMetrics {
    fn default() -> Self {
        AgentMetrics::new()
    }
}

impl AgentMetrics {
    /// A fresh registry holding every agent family, `whereabouts_build_info` set.
    pub fn new() -> Self {
        let r = Registry::new();
        AgentMetrics {
            requests: register(&r, IntCounterVec::new(Opts::new("whereabouts_agent_requests_total", "Requests the node agent answered, by command (add, del, check, gc, status, version, unknown) and result (ok, error, handback)."), &["command", "result"]).unwrap()),
            request_duration: register(&r, HistogramVec::new(HistogramOpts::new("whereabouts_agent_request_duration_seconds", "Time from reading a request to answering it, hand-backs included.").buckets(vec![0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0]), &["command"]).unwrap()),
            handbacks: register(&r, IntCounterVec::new(Opts::new("whereabouts_agent_handbacks_total", "Requests the node agent handed back to the plugin to run itself, by reason."), &["reason"]).unwrap()),
            held_back: register(&r, IntCounter::new("whereabouts_agent_held_back_total", "Requests answered 'try again later' (CNI code 11) instead of being handed back, because earlier work of their container was still in the node agent.").unwrap()),
            // A group is at most 500 (MAX_GROUP in agent::batch).
            group_size: register(&r, HistogramVec::new(HistogramOpts::new("whereabouts_agent_group_size", "Requests per group the node agent wrote to a pool, by kind (add, del).").buckets(vec![1.0, 2.0, 5.0, 10.0, 20.0, 50.0, 100.0, 200.0, 500.0]), &["kind"]).unwrap()),
            build_info: build_info(&r),
            registry: r,
        }
    }

    /// Names of the agent's metrics (the queue depth gauge included).
    pub fn names(&self) -> Vec<String> {
        let mut names = names(&[
            &self.requests,
            &self.request_duration,
            &self.handbacks,
            &self.group_size,
            &self.held_back,
        ]);
        names.push(QUEUE_DEPTH.to_owned());
        names
    }

    /// One request answered: `result` is `ok`, `error` or `handback`.
    pub fn record_request(&self, command: &str, result: &str, took: Duration) {
        self.requests.with_label_values(&[command, result]).inc();
        self.request_duration
            .with_label_values(&[command])
            .observe(took.as_secs_f64());
    }

    /// Makes the series of `reason` exist at 0, so that `rate()` sees its first hand-back.
    pub fn declare_handback(&self, reason: &str) {
        self.handbacks.with_label_values(&[reason]);
    }

    pub fn record_handback(&self, reason: &str) {
        self.handbacks.with_label_values(&[reason]).inc();
    }

    /// One group written: `kind` is `add` or `del`.
    pub fn observe_group(&self, kind: &str, size: usize) {
        self.group_size
            .with_label_values(&[kind])
            .observe(size as f64);
    }

    /// Adds a scrape-time collector (the queue depths); a second registration is ignored.
    pub fn register_collector(&self, c: Box<dyn Collector>) {
        register_collector(&self.registry, c);
    }

    /// The Prometheus text exposition of the agent's metrics.
    pub fn render(&self) -> String {
        render(&self.registry)
    }
}
