//! Node slices: the operator assigns each node a slice of every sliced range (the NodeSlicePool
//! of upstream's "fast IPAM", same objects and names), from the NAD and Node caches.
//!
//! Better than upstream's controller (#497, #518, #558, #666):
//! - Deterministic: slices in ascending order, nodes in name order; existing assignments kept.
//! - A departed node's slice is released only once its pool is empty (pod cleanup and the audit
//!   drain it first), so an address in use is never handed to another node.
//! - A slice whose pool holds entries stays with the node of that pool: a NodeSlicePool deleted
//!   by hand is rebuilt from the live pools, and a hand edit that moves a live slice is undone.
//! - Changing the range or the size never orphans a live allocation: the old layout is kept (and
//!   still given to new nodes) until its slices are drained, with a Warning Event saying so.
//! - More nodes than slices is a Warning Event and a metric, not silence.
//!
//! Nodes take further slices themselves when theirs are full (`cni::slices`); the operator keeps
//! those assignments like any other.

use std::collections::{BTreeMap, BTreeSet, HashMap, HashSet};
use std::sync::Arc;

use kube::ResourceExt;
use kube::api::{Api, ObjectMeta, Patch, PatchParams, PostParams};

use super::Context;
use crate::config::NodeSlice;
use crate::crd::{IPPool, NetworkAttachmentDefinition, NodeSlicePool, NodeSlicePoolStatus};
use crate::ipam::AddrRange;
use crate::ipam::naming::{NETWORK_LABEL, pool_labels, slice_pool_name};
use crate::nad_check::check_spec_config;

/// Marks the NodeSlicePools this operator created (it deletes only those once unused).
pub const MANAGED_LABEL: &str = "app.kubernetes.io/managed-by";
pub const MANAGER: &str = "whereabouts-operator";

/// One sliced range of one network, as the NADs that use it describe it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SliceNetwork {
    /// The NodeSlicePool's name.
    pub name: String,
    /// The whole range, with its window and excludes.
    pub range: AddrRange,
    pub size: NodeSlice,
    /// The `network_name` prefixing its slice pools.
    pub network_name: Option<String>,
    /// The NADs (`<ns>/<name>`) that use it.
    pub nads: BTreeSet<String>,
}

/// The sliced ranges the NADs call for, and the NADs that disagree with an earlier NAD of the same
/// network about its range or size: (NAD, message).
pub fn slice_networks(
    nads: &[Arc<NetworkAttachmentDefinition>],
) -> (BTreeMap<String, SliceNetwork>, Vec<(String, String)>) {
    let mut networks: BTreeMap<String, SliceNetwork> = BTreeMap::new();
    let mut conflicts = Vec::new();
    let mut sorted: Vec<_> = nads.iter().collect();
    sorted.sort_by_key(|n| (n.namespace(), n.name_any()));
    for nad in sorted {
        let id = format!("{}/{}", nad.namespace().unwrap_or_default(), nad.name_any());
        for range in check_spec_config(&nad.spec.config).ranges {
            let Some((name, size)) = range.slices else {
                continue;
            };
            match networks.get_mut(&name) {
                None => {
                    let net = SliceNetwork {
                        name: name.clone(),
                        range: range.range,
                        size,
                        network_name: range.network_name,
                        nads: BTreeSet::from([id.clone()]),
                    };
                    networks.insert(name, net);
                }
                Some(net) if net.range.cidr() == range.range.cidr() && net.size == size => {
                    net.nads.insert(id.clone());
                }
                Some(net) => conflicts.push((
                    id.clone(),
                    format!(
                        "nodeslicepool {name} is already sliced as range {} in {} slices by {}; this NAD asks for range {} in {} slices: NADs of one network must agree (ignored)",
                        net.range.cidr(),
                        net.size.text,
                        net.nads.iter().next().map(String::as_str).unwrap_or_default(),
                        range.range.cidr(),
                        size.text
                    ),
                )),
            }
        }
    }
    (networks, conflicts)
}

mod live;
mod plan;
#[cfg(test)]
mod tests;

pub use live::LivePools;
pub use plan::{Plan, plan};

/// Brings every NodeSlicePool in step with its plan; returns the number of writes. Warnings (NADs
/// that disagree, nodes without a slice, a layout kept) are published once per change of text.
pub async fn reconcile(
    ctx: &Context,
    reported: &mut HashMap<String, String>,
) -> Result<usize, kube::Error> {
    let (networks, conflicts) = slice_networks(&ctx.caches.nads.state());
    for (nad, message) in conflicts {
        warn_once(ctx, reported, &nad, "NodeSlicePoolConflict", &message).await;
    }
    let nodes: BTreeSet<String> = ctx
        .caches
        .nodes
        .state()
        .iter()
        .map(|n| n.name_any())
        .collect();
    let pools = ctx.caches.pools.state();
    let live = LivePools::of(pools.iter().map(AsRef::as_ref));
    // Upstream's pools, by name: the ones a NodeSlicePool may tell us how to label.
    let unlabelled: HashSet<String> = pools
        .iter()
        .filter(|p| !p.labels().contains_key(NETWORK_LABEL))
        .map(|p| p.name_any())
        .collect();
    let stored: HashMap<String, Arc<NodeSlicePool>> = ctx
        .caches
        .slice_pools
        .state()
        .into_iter()
        .map(|p| (p.name_any(), p))
        .collect();
    let api: Api<NodeSlicePool> = Api::namespaced(ctx.client.clone(), &ctx.opts.pool_namespace);
    let mut writes = 0;
    let mut gauges = Vec::new();
    for net in networks.values() {
        let current = stored.get(&net.name).map(AsRef::as_ref);
        let plan = plan(net, current, &nodes, &live);
        gauges.push((
            net.name.clone(),
            plan.allocations.len(),
            plan.assigned(),
            plan.starved.len(),
        ));
        tell(ctx, reported, net, &plan).await;
        if !ctx.opts.dry_run {
            writes += write(&api, net, current, &plan).await?;
            writes += label_slice_pools(ctx, net, &plan, &unlabelled).await?;
        }
    }
    ctx.metrics.set_node_slices(&gauges);
    if !ctx.opts.dry_run {
        for pool in stored
            .values()
            .filter(|p| !networks.contains_key(&p.name_any()))
        {
            writes += retire(&api, pool, &live).await?;
        }
    }
    Ok(writes)
}

/// Labels the unlabelled pools (upstream's) of the slices `plan` assigns: the NodeSlicePool now
/// says whose slice of which network each is, so from here on its labels say it (see
/// `ipam::naming::pool_labels`), and nobody parses its name.
async fn label_slice_pools(
    ctx: &Context,
    net: &SliceNetwork,
    plan: &Plan,
    unlabelled: &HashSet<String>,
) -> Result<usize, kube::Error> {
    let api: Api<IPPool> = Api::namespaced(ctx.client.clone(), &ctx.opts.pool_namespace);
    let mut writes = 0;
    for a in plan.allocations.iter().filter(|a| !a.node_name.is_empty()) {
        let Ok(slice) = a.slice_range.parse::<ipnet::IpNet>() else {
            continue;
        };
        let network = net.network_name.as_deref();
        let name = slice_pool_name(network, &a.node_name, slice);
        let labels = pool_labels(network, slice, Some(&a.node_name));
        if !unlabelled.contains(&name) || labels.is_empty() {
            continue;
        }
        let patch = serde_json::json!({"metadata": {"labels": labels}});
        match api
            .patch(&name, &PatchParams::default(), &Patch::Merge(&patch))
            .await
        {
            Ok(_) => writes += 1,
            Err(kube::Error::Api(s)) if s.code == 404 => {}
            Err(e) => return Err(e),
        }
    }
    Ok(writes)
}

async fn tell(
    ctx: &Context,
    reported: &mut HashMap<String, String>,
    net: &SliceNetwork,
    plan: &Plan,
) {
    for nad in &net.nads {
        if !plan.starved.is_empty() {
            let message = format!(
                "nodeslicepool {}: every one of its {} slices is taken, so {} node(s) have none and their pods on this network fail: {}; use a larger range or a smaller node_slice_size",
                net.name,
                plan.allocations.len(),
                plan.starved.len(),
                plan.starved.join(", ")
            );
            warn_once(ctx, reported, nad, "NodeSlicesExhausted", &message).await;
        }
        if let Some(why) = &plan.kept {
            let message = format!("nodeslicepool {}: {why}", net.name);
            warn_once(ctx, reported, nad, "NodeSliceLayoutKept", &message).await;
        }
    }
}

async fn warn_once(
    ctx: &Context,
    reported: &mut HashMap<String, String>,
    nad: &str,
    reason: &str,
    message: &str,
) {
    let key = format!("{reason}:{nad}");
    if reported.get(&key).map(String::as_str) == Some(message) {
        return;
    }
    tracing::warn!(nad, reason, "{message}");
    ctx.event(&super::nads::nad_reference(nad), true, reason, message)
        .await;
    reported.insert(key, message.to_owned());
}

/// What a NodeSlicePool this operator creates says of itself: that it manages it, and the
/// network and range it slices (as a pool's labels do; see `ipam::naming::pool_labels`).
fn labels_of(net: &SliceNetwork) -> BTreeMap<String, String> {
    let mut labels = pool_labels(net.network_name.as_deref(), net.range.cidr(), None);
    labels.insert(MANAGED_LABEL.to_owned(), MANAGER.to_owned());
    labels
}

/// Creates the NodeSlicePool, or replaces it at the version read when the plan differs. A lost
/// race (409) is left for the next pass.
async fn write(
    api: &Api<NodeSlicePool>,
    net: &SliceNetwork,
    current: Option<&NodeSlicePool>,
    plan: &Plan,
) -> Result<usize, kube::Error> {
    let name = net.name.as_str();
    let status = Some(NodeSlicePoolStatus {
        allocations: plan.allocations.clone(),
    });
    let result = match current {
        Some(c) if c.spec == plan.spec && c.status == status => return Ok(0),
        Some(c) => {
            let mut next = c.clone();
            next.spec = plan.spec.clone();
            next.status = status;
            api.replace(name, &PostParams::default(), &next)
                .await
                .map(|_| ())
        }
        None => {
            let pool = NodeSlicePool {
                metadata: ObjectMeta {
                    name: Some(name.to_owned()),
                    labels: Some(labels_of(net)),
                    ..Default::default()
                },
                spec: plan.spec.clone(),
                status,
            };
            api.create(&PostParams::default(), &pool).await.map(|_| ())
        }
    };
    match result {
        Ok(()) => {
            tracing::info!(
                nodeslicepool = name,
                assigned = plan.assigned(),
                slices = plan.allocations.len(),
                "node slices written"
            );
            Ok(1)
        }
        Err(kube::Error::Api(s)) if s.code == 409 => Ok(0),
        Err(e) => Err(e),
    }
}

/// Deletes a NodeSlicePool this operator created once no NAD slices its range and none of its
/// slices' pools holds an entry (at the version seen).
async fn retire(
    api: &Api<NodeSlicePool>,
    pool: &NodeSlicePool,
    live: &LivePools,
) -> Result<usize, kube::Error> {
    let ours = pool.labels().get(MANAGED_LABEL).map(String::as_str) == Some(MANAGER);
    let in_use = pool.status.iter().flat_map(|s| &s.allocations).any(|a| {
        a.slice_range
            .parse()
            .is_ok_and(|slice| live.slice_in_use(&a.node_name, slice))
    });
    if !ours || in_use || !super::delete_unchanged(api, pool).await? {
        return Ok(0);
    }
    tracing::info!(nodeslicepool = %pool.name_any(), "deleted a NodeSlicePool no NAD uses");
    Ok(1)
}
