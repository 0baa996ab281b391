//! The other NADs, for the cross-NAD overlap warning.
//!
//! The operator watches NADs once (all namespaces) into a kube-runtime reflector store; a request
//! reads an index of their ranges, never the API. The index is rebuilt only when the watch has
//! changed the store since it was built (the source's generation), and then each NAD's config is
//! parsed again only if its resourceVersion moved. So a request costs O(log n + k) (the overlap
//! query), and a NAD change one rebuild, O(n log n), for the requests after it.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use kube::ResourceExt;
use kube::runtime::reflector::Store;

use crate::crd::NetworkAttachmentDefinition;
use crate::nad_check::{NadRange, RangeIndex, check_spec_config};

/// A snapshot of the NADs the cluster holds.
pub trait NadSource: Send + Sync {
    fn snapshot(&self) -> Vec<Arc<NetworkAttachmentDefinition>>;

    /// A number that changes whenever the snapshot may have (`None`: unknown, so every request
    /// rebuilds the index).
    fn generation(&self) -> Option<u64> {
        None
    }
}

/// The operator's NAD cache: the reflector store and a counter its watch loop bumps after each
/// event has been applied to the store.
pub struct WatchedNads {
    pub store: Store<NetworkAttachmentDefinition>,
    pub generation: Arc<AtomicU64>,
}

impl NadSource for WatchedNads {
    fn snapshot(&self) -> Vec<Arc<NetworkAttachmentDefinition>> {
        self.store.state()
    }

    fn generation(&self) -> Option<u64> {
        Some(self.generation.load(Ordering::SeqCst))
    }
}

/// A fixed set, for tests and for running without a cluster.
impl NadSource for Vec<Arc<NetworkAttachmentDefinition>> {
    fn snapshot(&self) -> Vec<Arc<NetworkAttachmentDefinition>> {
        self.clone()
    }

    fn generation(&self) -> Option<u64> {
        Some(0)
    }
}

type Parsed = (String, Arc<Vec<NadRange>>);

#[derive(Default)]
struct Built {
    /// The source's generation when `index` was built (`None`: never built).
    generation: Option<u64>,
    /// `namespace/name` -> (resourceVersion, ranges of its valid whereabouts blocks).
    parsed: HashMap<String, Parsed>,
    index: Arc<RangeIndex>,
}

pub struct NadIndex {
    source: Arc<dyn NadSource>,
    built: Mutex<Built>,
}

impl NadIndex {
    pub fn new(source: Arc<dyn NadSource>) -> Self {
        NadIndex {
            source,
            built: Mutex::new(Built::default()),
        }
    }

    /// The empty index: no other NADs are known.
    pub fn empty() -> Self {
        NadIndex::new(Arc::new(Vec::new()))
    }

    /// The ranges of every NAD the cluster holds, indexed. The caller leaves its own NAD out of
    /// the query (`overlap_warnings` takes its key).
    pub fn index(&self) -> Arc<RangeIndex> {
        // Read before the snapshot: a change after this read bumps the generation again.
        let generation = self.source.generation();
        let mut built = self.built.lock().unwrap_or_else(|p| p.into_inner());
        if generation.is_some() && built.generation == generation {
            return built.index.clone();
        }
        let mut parsed = HashMap::with_capacity(built.parsed.len());
        for nad in self.source.snapshot() {
            let key = format!("{}/{}", nad.namespace().unwrap_or_default(), nad.name_any());
            let rv = nad.resource_version().unwrap_or_default();
            let ranges = match built.parsed.remove(&key) {
                Some((old_rv, ranges)) if old_rv == rv && !rv.is_empty() => ranges,
                _ => Arc::new(check_spec_config(&nad.spec.config).ranges),
            };
            parsed.insert(key, (rv, ranges));
        }
        let index = Arc::new(RangeIndex::build(
            parsed.iter().map(|(k, (_, r))| (k.as_str(), r.as_slice())),
        ));
        *built = Built {
            generation,
            parsed,
            index: index.clone(),
        };
        index
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::crd::NetworkAttachmentDefinitionSpec;
    use crate::nad_check::overlap_warnings;

    /// A source whose NADs and generation the test sets.
    #[derive(Default)]
    struct Changing {
        nads: Mutex<Vec<Arc<NetworkAttachmentDefinition>>>,
        generation: AtomicU64,
    }

    impl NadSource for Changing {
        fn snapshot(&self) -> Vec<Arc<NetworkAttachmentDefinition>> {
            self.nads.lock().unwrap().clone()
        }
        fn generation(&self) -> Option<u64> {
            Some(self.generation.load(Ordering::SeqCst))
        }
    }

    fn nad(ns: &str, range: &str) -> Arc<NetworkAttachmentDefinition> {
        let config = serde_json::json!({"cniVersion": "1.0.0", "type": "macvlan",
            "ipam": {"type": "whereabouts", "range": range}});
        let mut n = NetworkAttachmentDefinition::new(
            "net",
            NetworkAttachmentDefinitionSpec {
                config: config.to_string(),
            },
        );
        n.metadata.namespace = Some(ns.to_owned());
        n.metadata.resource_version = Some("1".to_owned());
        Arc::new(n)
    }

    /// How many other NADs' ranges 10.0.0.0/24 overlaps, for `ns-x/net`, per the index.
    fn overlapping(index: &NadIndex) -> usize {
        let mine = check_spec_config(&nad("ns-x", "10.0.0.0/24").spec.config).ranges;
        overlap_warnings(&mine, "ns-x/net", &index.index()).len()
    }

    #[test]
    fn the_index_is_rebuilt_when_the_generation_moves_and_only_then() {
        let source = Arc::new(Changing::default());
        let index = NadIndex::new(source.clone());
        assert_eq!(overlapping(&index), 0);
        source.nads.lock().unwrap().push(nad("ns-a", "10.0.0.0/24"));
        // Same generation: the index built before is answered (no snapshot is read).
        assert_eq!(overlapping(&index), 0);
        source.generation.fetch_add(1, Ordering::SeqCst);
        assert_eq!(overlapping(&index), 1);
        // The NAD's own stored version never counts.
        source.nads.lock().unwrap().push(nad("ns-x", "10.0.0.0/24"));
        source.generation.fetch_add(1, Ordering::SeqCst);
        assert_eq!(overlapping(&index), 1);
        source.nads.lock().unwrap().clear();
        source.generation.fetch_add(1, Ordering::SeqCst);
        assert_eq!(overlapping(&index), 0);
    }
}
