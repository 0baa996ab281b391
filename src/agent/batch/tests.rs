use prometheus::core::Collector;

use super::*;
use crate::metrics::agent::QUEUE_DEPTH;
use crate::store::memory::MemoryStore;

fn depths(batcher: &Batcher<MemoryStore>) -> Vec<(String, i64)> {
    let families = batcher.depth_collector().collect();
    assert_eq!(families[0].name(), QUEUE_DEPTH);
    let mut depths: Vec<(String, i64)> = families[0]
        .get_metric()
        .iter()
        .map(|m| {
            let pool = m.get_label()[0].value().to_owned();
            (pool, m.get_gauge().get_value() as i64)
        })
        .collect();
    depths.sort();
    depths
}

/// The gauge reads the places held, and a dropped ticket gives its places back.
#[test]
fn the_depth_gauge_follows_admissions() {
    let batcher = Batcher::with_limits(
        Arc::new(MemoryStore::new()),
        Limits {
            per_pool: 2,
            total: 3,
        },
        Arc::new(AgentMetrics::new()),
    );
    let first = batcher.admit(["a", "b"]).unwrap();
    let second = batcher.admit(["a"]).unwrap();
    assert_eq!(depths(&batcher), [("a".into(), 2), ("b".into(), 1)]);
    assert_eq!(
        batcher.admit(["a"]).err(),
        Some(QueueFull::Pool {
            pool: "a".into(),
            limit: 2
        })
    );
    assert_eq!(
        batcher.admit(["c"]).err(),
        Some(QueueFull::Total { limit: 3 })
    );
    drop(first);
    assert_eq!(depths(&batcher), [("a".into(), 1), ("b".into(), 0)]);
    // One pool named by two ranges needs two places.
    assert!(batcher.admit(["a", "a"]).is_err());
    drop(second);
    let twice = batcher.admit(["a", "a"]).unwrap();
    assert_eq!(batcher.waiting("a"), 2);
    drop(twice);
    assert_eq!(batcher.waiting_total(), 0);
}
