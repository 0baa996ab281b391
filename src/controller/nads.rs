//! Keeping pools in step with networks.
//!
//! Every range of every valid whereabouts NAD has its IPPool, created empty, labelled with what it
//! is (network, range) and annotated with the networks that use it, so `kubectl get ippools` and the metrics show a network before its first
//! pod. A pool whose networks are all gone is deleted while it is empty (with a resourceVersion
//! precondition, so a plugin writing to it at that moment wins) and kept and reported otherwise.
//! A NAD that fails validation gets a Warning Event with the validator's message.

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::sync::Arc;

use k8s_openapi::api::core::v1::ObjectReference;
use kube::ResourceExt;
use kube::api::{Api, ObjectMeta, Patch, PatchParams, PostParams};
use serde_json::json;

use super::Context;
use crate::crd::{IPPool, IPPoolSpec, NetworkAttachmentDefinition};
use crate::ipam::naming::pool_labels;
use crate::nad_check::{check_spec_config, message};

/// Which networks (`<ns>/<nad>`) use a pool; written by the operator.
pub const NETWORKS_ANNOTATION: &str = "whereabouts.cni.cncf.io/networks";

#[derive(Debug, Default, PartialEq, Eq)]
pub struct Desired {
    /// By pool name.
    pub pools: BTreeMap<String, DesiredPool>,
    /// NADs whose whereabouts config is invalid: (NAD, resourceVersion, message).
    pub invalid: Vec<(String, String, String)>,
}

/// A pool some NADs call for.
#[derive(Debug, Default, PartialEq, Eq)]
pub struct DesiredPool {
    pub range: String,
    /// The networks (`<ns>/<nad>`) using it.
    pub networks: BTreeSet<String>,
    /// What the pool is (`ipam::naming::pool_labels`): written on pools that lack them, so that
    /// an upstream pool, once a NAD names it, is known by its labels rather than its name.
    pub labels: BTreeMap<String, String>,
}

/// The pools the NADs call for, and the NADs that are invalid. Pure.
pub fn desired(nads: &[Arc<NetworkAttachmentDefinition>]) -> Desired {
    let mut d = Desired::default();
    for nad in nads {
        let network = format!("{}/{}", nad.namespace().unwrap_or_default(), nad.name_any());
        let check = check_spec_config(&nad.spec.config);
        if !check.is_valid() {
            let message = check
                .errors
                .iter()
                .map(message)
                .collect::<Vec<_>>()
                .join("; ");
            d.invalid.push((
                network.clone(),
                nad.resource_version().unwrap_or_default(),
                message,
            ));
        }
        // A sliced range allocates from its slices' pools, which the nodes create.
        for range in check.ranges.iter().filter(|r| r.slices.is_none()) {
            let cidr = range.range.cidr();
            let entry = d
                .pools
                .entry(range.pool_name())
                .or_insert_with(|| DesiredPool {
                    range: cidr.to_string(),
                    networks: BTreeSet::new(),
                    labels: pool_labels(range.network_name.as_deref(), cidr, None),
                });
            entry.networks.insert(network.clone());
        }
    }
    d
}

fn networks_value(networks: &BTreeSet<String>) -> String {
    networks.iter().cloned().collect::<Vec<_>>().join(",")
}

/// Applies `desired` to the pool namespace. Returns the number of writes.
pub async fn reconcile(
    ctx: &Context,
    reported: &mut HashMap<String, String>,
) -> Result<usize, kube::Error> {
    let d = desired(&ctx.caches.nads.state());
    for (nad, rv, message) in &d.invalid {
        if reported.get(nad) != Some(rv) {
            tracing::warn!(nad, "{message}");
            ctx.event(&nad_reference(nad), true, "InvalidConfig", message)
                .await;
            reported.insert(nad.clone(), rv.clone());
        }
    }
    if ctx.opts.dry_run {
        return Ok(0);
    }
    let api: Api<IPPool> = Api::namespaced(ctx.client.clone(), &ctx.opts.pool_namespace);
    let cached: HashMap<String, Arc<IPPool>> = ctx
        .caches
        .pools
        .state()
        .into_iter()
        .map(|p| (p.name_any(), p))
        .collect();
    let mut writes = 0;
    for (name, want) in &d.pools {
        let value = networks_value(&want.networks);
        match cached.get(name) {
            None => writes += create(&api, name, want, &value).await?,
            Some(p)
                if p.annotations().get(NETWORKS_ANNOTATION) != Some(&value)
                    || want
                        .labels
                        .iter()
                        .any(|(k, v)| p.labels().get(k) != Some(v)) =>
            {
                let patch = json!({"metadata": {
                    "annotations": {NETWORKS_ANNOTATION: value},
                    "labels": want.labels,
                }});
                api.patch(name, &PatchParams::default(), &Patch::Merge(&patch))
                    .await?;
                writes += 1;
            }
            Some(_) => {}
        }
    }
    for (name, pool) in cached.iter().filter(|(n, p)| {
        !d.pools.contains_key(*n) && p.annotations().contains_key(NETWORKS_ANNOTATION)
    }) {
        writes += retire(&api, name, pool).await?;
    }
    Ok(writes)
}

async fn create(
    api: &Api<IPPool>,
    name: &str,
    want: &DesiredPool,
    networks: &str,
) -> Result<usize, kube::Error> {
    let meta = ObjectMeta {
        name: Some(name.into()),
        annotations: Some([(NETWORKS_ANNOTATION.to_owned(), networks.to_owned())].into()),
        labels: Some(want.labels.clone()),
        ..Default::default()
    };
    let pool = IPPool {
        metadata: meta,
        spec: IPPoolSpec {
            range: want.range.clone(),
            allocations: Default::default(),
        },
        status: None,
    };
    match api.create(&PostParams::default(), &pool).await {
        Ok(_) => {
            tracing::info!(pool = name, networks, "created pool");
            Ok(1)
        }
        Err(kube::Error::Api(s)) if s.code == 409 => Ok(0),
        Err(e) => Err(e),
    }
}

/// Deletes a pool no network uses any more, if it is still empty at the version we saw.
async fn retire(api: &Api<IPPool>, name: &str, pool: &IPPool) -> Result<usize, kube::Error> {
    if !pool.spec.allocations.is_empty() {
        tracing::warn!(
            pool = name,
            entries = pool.spec.allocations.len(),
            "no network uses this pool any more; keeping it while it holds entries"
        );
        return Ok(0);
    }
    if !super::delete_unchanged(api, pool).await? {
        return Ok(0);
    }
    tracing::info!(pool = name, "deleted an unused empty pool");
    Ok(1)
}

pub(super) fn nad_reference(nad: &str) -> ObjectReference {
    let (namespace, name) = nad.split_once('/').unwrap_or_default();
    ObjectReference {
        api_version: Some("k8s.cni.cncf.io/v1".into()),
        kind: Some("NetworkAttachmentDefinition".into()),
        namespace: Some(namespace.into()),
        name: Some(name.into()),
        ..Default::default()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::crd::NetworkAttachmentDefinitionSpec;

    fn nad(ns: &str, name: &str, config: &str) -> Arc<NetworkAttachmentDefinition> {
        let mut n = NetworkAttachmentDefinition::new(
            name,
            NetworkAttachmentDefinitionSpec {
                config: config.into(),
            },
        );
        n.metadata.namespace = Some(ns.into());
        n.metadata.resource_version = Some("7".into());
        Arc::new(n)
    }

    #[test]
    fn pools_of_valid_nads_and_warnings_for_invalid_ones() {
        let nads = vec![
            nad(
                "a",
                "dual",
                r#"{"cniVersion":"1.0.0","type":"macvlan","ipam":{"type":"whereabouts","ipRanges":[{"range":"10.0.0.0/24"},{"range":"fd00::/64"}]}}"#,
            ),
            nad(
                "b",
                "same",
                r#"{"plugins":[{"type":"bridge","ipam":{"type":"whereabouts","range":"10.0.0.0/24"}}]}"#,
            ),
            nad(
                "b",
                "named",
                r#"{"type":"bridge","ipam":{"type":"whereabouts","range":"10.0.0.0/24","network_name":"blue"}}"#,
            ),
            nad(
                "c",
                "bad",
                r#"{"type":"bridge","ipam":{"type":"whereabouts","range":"10.0.0.0/24","range_start":"10.9.9.9"}}"#,
            ),
            nad(
                "c",
                "broken",
                r#"{"type":"bridge","ipam":{"type":"whereabouts""#,
            ),
            nad(
                "d",
                "hostlocal",
                r#"{"type":"bridge","ipam":{"type":"host-local","subnet":"10.0.0.0/24"}}"#,
            ),
        ];
        let d = desired(&nads);
        assert_eq!(
            d.pools.keys().collect::<Vec<_>>(),
            ["10.0.0.0-24", "blue-10.0.0.0-24", "fd00---64"]
        );
        assert_eq!(
            d.pools["10.0.0.0-24"].networks,
            BTreeSet::from(["a/dual".to_owned(), "b/same".to_owned()])
        );
        let blue = &d.pools["blue-10.0.0.0-24"].labels;
        assert_eq!(blue[crate::ipam::naming::NETWORK_LABEL], "blue");
        assert_eq!(
            d.pools["10.0.0.0-24"].labels[crate::ipam::naming::NETWORK_LABEL],
            ""
        );
        assert_eq!(d.invalid.len(), 2);
        assert_eq!(
            d.invalid[0].2,
            r#"spec.config: ipam.range_start "10.9.9.9" is outside range 10.0.0.0/24"#
        );
        assert!(d.invalid[1].2.starts_with("spec.config is not valid JSON"));
    }
}
