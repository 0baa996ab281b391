//! The other NADs, for the cross-NAD overlap warning.
//!
//! The operator watches NADs once (all namespaces) into a kube-runtime reflector store; a request
//! reads the store, never the API. Parsing a NAD's config is cached per resourceVersion, so a
//! request costs one pass over the ranges, not one parse per NAD.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use kube::ResourceExt;
use kube::runtime::reflector::Store;

use crate::crd::NetworkAttachmentDefinition;
use crate::validate::{NadRange, check_spec_config};

/// A snapshot of the NADs the cluster holds.
pub trait NadSource: Send + Sync {
    fn snapshot(&self) -> Vec<Arc<NetworkAttachmentDefinition>>;
}

impl NadSource for Store<NetworkAttachmentDefinition> {
    fn snapshot(&self) -> Vec<Arc<NetworkAttachmentDefinition>> {
        self.state()
    }
}

/// A fixed set, for tests and for running without a cluster.
impl NadSource for Vec<Arc<NetworkAttachmentDefinition>> {
    fn snapshot(&self) -> Vec<Arc<NetworkAttachmentDefinition>> {
        self.clone()
    }
}

type Parsed = (String, Arc<Vec<NadRange>>);

pub struct NadIndex {
    source: Arc<dyn NadSource>,
    /// `namespace/name` -> (resourceVersion, ranges of its valid whereabouts blocks).
    cache: Mutex<HashMap<String, Parsed>>,
}

impl NadIndex {
    pub fn new(source: Arc<dyn NadSource>) -> Self {
        NadIndex {
            source,
            cache: Mutex::new(HashMap::new()),
        }
    }

    /// The empty index: no other NADs are known.
    pub fn empty() -> Self {
        NadIndex::new(Arc::new(Vec::new()))
    }

    /// Every NAD but `me` (`namespace/name`) that has whereabouts ranges.
    pub fn others(&self, me: &str) -> Vec<(String, Arc<Vec<NadRange>>)> {
        let snapshot = self.source.snapshot();
        let mut cache = self.cache.lock().unwrap_or_else(|p| p.into_inner());
        let mut fresh = HashMap::with_capacity(snapshot.len());
        let mut out = Vec::new();
        for nad in snapshot {
            let key = format!("{}/{}", nad.namespace().unwrap_or_default(), nad.name_any());
            let rv = nad.resource_version().unwrap_or_default();
            let ranges = match cache.remove(&key) {
                Some((old_rv, ranges)) if old_rv == rv && !rv.is_empty() => ranges,
                _ => Arc::new(check_spec_config(&nad.spec.config).ranges),
            };
            if key != me && !ranges.is_empty() {
                out.push((key.clone(), ranges.clone()));
            }
            fresh.insert(key, (rv, ranges));
        }
        *cache = fresh;
        out
    }
}
