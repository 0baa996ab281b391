//! The queue-depth gauge, computed from the queues themselves when `/metrics` is scraped.

use std::sync::atomic::Ordering;

use prometheus::core::{Collector, Desc};
use prometheus::proto::MetricFamily;
use prometheus::{IntGaugeVec, Opts};

use super::Queues;
use crate::metrics::agent::{QUEUE_DEPTH, QUEUE_DEPTH_HELP};

/// `whereabouts_agent_queue_depth{pool}`, read from the queues at scrape time.
pub struct QueueDepth {
    queues: Queues,
    template: IntGaugeVec,
}

impl QueueDepth {
    pub(super) fn new(queues: Queues) -> Self {
        QueueDepth {
            queues,
            template: depth_gauge(),
        }
    }
}

fn depth_gauge() -> IntGaugeVec {
    IntGaugeVec::new(Opts::new(QUEUE_DEPTH, QUEUE_DEPTH_HELP), &["pool"]).expect("valid gauge")
}

impl Collector for QueueDepth {
    fn desc(&self) -> Vec<&Desc> {
        self.template.desc()
    }

    fn collect(&self) -> Vec<MetricFamily> {
        let gauge = depth_gauge();
        let queues = self.queues.lock().unwrap_or_else(|e| e.into_inner());
        for (pool, queue) in queues.iter() {
            let waiting = queue.waiting.load(Ordering::SeqCst);
            gauge.with_label_values(&[pool]).set(waiting as i64);
        }
        gauge.collect()
    }
}
