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

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::sync::Arc;

use ipnet::IpNet;
use kube::api::{Api, DeleteParams, ObjectMeta, PostParams, Preconditions};
use kube::{Resource, ResourceExt};

use super::Context;
use crate::config::NodeSlice;
use crate::crd::{
    NetworkAttachmentDefinition, NodeSliceAllocation, NodeSlicePool, NodeSlicePoolSpec,
    NodeSlicePoolStatus,
};
use crate::ipam::AddrRange;
use crate::ipam::naming::slice_pool_name;
use crate::ipam::slices::{parse_slice_size, slice_range, slices};
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

/// What one NodeSlicePool should say, and what to tell people about it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Plan {
    pub spec: NodeSlicePoolSpec,
    pub allocations: Vec<NodeSliceAllocation>,
    /// Nodes left without a slice: every slice is taken.
    pub starved: Vec<String>,
    /// Why the stored layout was kept although the NADs ask for another.
    pub kept: Option<String>,
}

impl Plan {
    pub fn assigned(&self) -> usize {
        self.allocations
            .iter()
            .filter(|a| !a.node_name.is_empty())
            .count()
    }
}

/// The assignment of `net`'s slices to `nodes`, from the stored NodeSlicePool (if any) and the
/// pools that hold entries (`live`: pool names). Pure.
pub fn plan(
    net: &SliceNetwork,
    current: Option<&NodeSlicePool>,
    nodes: &BTreeSet<String>,
    live: &BTreeSet<String>,
) -> Plan {
    let wanted = NodeSlicePoolSpec {
        range: net.range.cidr().trunc().to_string(),
        slice_size: net.size.text.clone(),
    };
    let stored = current.map(|c| (c.spec.clone(), assignments(c)));
    let (spec, whole, mut assign, kept) = match stored {
        Some((spec, assign)) if spec == wanted => {
            (spec, net.range.clone(), onto_layout(net, &assign), None)
        }
        Some((spec, assign)) => match old_layout(net, &spec, &assign, live) {
            Some((whole, full)) => {
                let why = format!(
                    "the NADs ask for range {} in {} slices, but slices of the stored layout (range {} in {} slices) still hold addresses: it is kept, and still given to new nodes, until they are drained",
                    wanted.range, wanted.slice_size, spec.range, spec.slice_size
                );
                (spec, whole, full, Some(why))
            }
            None => (wanted.clone(), net.range.clone(), fresh(net), None),
        },
        None => (wanted.clone(), net.range.clone(), fresh(net), None),
    };
    keep_live_slices(net, &mut assign, live);
    release_departed(net, &mut assign, nodes, live);
    let starved = assign_new(&whole, &mut assign, nodes);
    Plan {
        spec,
        allocations: assign
            .into_iter()
            .map(|(slice, node_name)| NodeSliceAllocation {
                node_name,
                slice_range: slice.to_string(),
            })
            .collect(),
        starved,
        kept,
    }
}

/// (slice, node) in the stored order; entries that do not parse are dropped (rewritten).
fn assignments(pool: &NodeSlicePool) -> Vec<(IpNet, String)> {
    pool.status
        .iter()
        .flat_map(|s| &s.allocations)
        .filter_map(|a| Some((a.slice_range.parse().ok()?, a.node_name.clone())))
        .collect()
}

/// Every slice of `net`, free.
fn fresh(net: &SliceNetwork) -> Vec<(IpNet, String)> {
    slices(net.range.cidr(), net.size.prefix)
        .map(|s| (s, String::new()))
        .collect()
}

/// Every slice of `net` with its stored node: a slice missing from a hand-edited object comes
/// back free, an entry that is not one of the slices goes.
fn onto_layout(net: &SliceNetwork, stored: &[(IpNet, String)]) -> Vec<(IpNet, String)> {
    let by_slice: HashMap<IpNet, &String> = stored.iter().map(|(s, n)| (*s, n)).collect();
    let mut layout = fresh(net);
    for (slice, node) in &mut layout {
        if let Some(stored) = by_slice.get(slice) {
            node.clone_from(stored);
        }
    }
    layout
}

/// The stored layout, if any of its slices' pools still holds entries: its whole range (for which
/// of its slices can give an address) and its assignments.
fn old_layout(
    net: &SliceNetwork,
    spec: &NodeSlicePoolSpec,
    assign: &[(IpNet, String)],
    live: &BTreeSet<String>,
) -> Option<(AddrRange, Vec<(IpNet, String)>)> {
    let any_live = assign.iter().any(|(slice, node)| {
        !node.is_empty()
            && live.contains(&slice_pool_name(net.network_name.as_deref(), node, *slice))
    }) || !live_owners(net, assign.iter().map(|(s, _)| *s), live).is_empty();
    if !any_live {
        return None;
    }
    let cidr: IpNet = spec.range.parse().ok()?;
    parse_slice_size(&spec.slice_size)?;
    let whole = AddrRange::new(cidr, None, None, &[]).ok()?;
    Some((whole, assign.to_vec()))
}

/// For each slice whose pool holds entries for some node: that node (the first by name).
fn live_owners(
    net: &SliceNetwork,
    layout: impl Iterator<Item = IpNet>,
    live: &BTreeSet<String>,
) -> BTreeMap<IpNet, String> {
    let prefix = match net.network_name.as_deref() {
        Some(n) if !n.is_empty() => format!("{n}-"),
        _ => String::new(),
    };
    let mut owners = BTreeMap::new();
    for slice in layout {
        let suffix = format!("-{}", slice.trunc().to_string().replace([':', '/'], "-"));
        let node = live.iter().find_map(|pool| {
            let node = pool.strip_prefix(&prefix)?.strip_suffix(&suffix)?;
            (!node.is_empty()).then(|| node.to_owned())
        });
        if let Some(node) = node {
            owners.insert(slice, node);
        }
    }
    owners
}

/// A slice whose pool holds entries belongs to that pool's node, whatever the stored object says
/// (it was deleted or edited by hand): giving it to another node would hand out its addresses
/// again from another pool.
fn keep_live_slices(net: &SliceNetwork, assign: &mut [(IpNet, String)], live: &BTreeSet<String>) {
    let owners = live_owners(net, assign.iter().map(|(s, _)| *s), live);
    for (slice, node) in assign.iter_mut() {
        let Some(owner) = owners.get(slice) else {
            continue;
        };
        let own_live = !node.is_empty()
            && live.contains(&slice_pool_name(net.network_name.as_deref(), node, *slice));
        if !own_live && node != owner {
            *node = owner.clone();
        }
    }
}

/// Frees the slices of nodes that are gone, once their pools are empty.
fn release_departed(
    net: &SliceNetwork,
    assign: &mut [(IpNet, String)],
    nodes: &BTreeSet<String>,
    live: &BTreeSet<String>,
) {
    for (slice, node) in assign.iter_mut() {
        if node.is_empty() || nodes.contains(node.as_str()) {
            continue;
        }
        if !live.contains(&slice_pool_name(net.network_name.as_deref(), node, *slice)) {
            node.clear();
        }
    }
}

/// Gives every node without a slice the first free slice that has an address to give. Returns
/// the nodes left without one.
fn assign_new(
    whole: &AddrRange,
    assign: &mut [(IpNet, String)],
    nodes: &BTreeSet<String>,
) -> Vec<String> {
    let holding: BTreeSet<String> = assign.iter().map(|(_, n)| n.clone()).collect();
    let mut starved = Vec::new();
    let mut free = assign
        .iter_mut()
        .filter(|(s, n)| n.is_empty() && slice_range(whole, *s).is_ok());
    for node in nodes.iter().filter(|n| !holding.contains(*n)) {
        match free.next() {
            Some((_, slot)) => *slot = node.clone(),
            None => starved.push(node.clone()),
        }
    }
    starved
}

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
    let live: BTreeSet<String> = ctx
        .caches
        .pools
        .state()
        .iter()
        .filter(|p| !p.spec.allocations.is_empty())
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
            writes += write(&api, &net.name, current, &plan).await?;
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

/// Creates the NodeSlicePool, or replaces it at the version read when the plan differs. A lost
/// race (409) is left for the next pass.
async fn write(
    api: &Api<NodeSlicePool>,
    name: &str,
    current: Option<&NodeSlicePool>,
    plan: &Plan,
) -> Result<usize, kube::Error> {
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
                    labels: Some([(MANAGED_LABEL.to_owned(), MANAGER.to_owned())].into()),
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
    live: &BTreeSet<String>,
) -> Result<usize, kube::Error> {
    let ours = pool.labels().get(MANAGED_LABEL).map(String::as_str) == Some(MANAGER);
    let name = pool.name_any();
    let in_use = pool.status.iter().flat_map(|s| &s.allocations).any(|a| {
        !a.node_name.is_empty()
            && live.iter().any(|p| {
                p.contains(&format!(
                    "{}-{}",
                    a.node_name,
                    a.slice_range.replace([':', '/'], "-")
                ))
            })
    });
    if !ours || in_use {
        return Ok(0);
    }
    let params = DeleteParams {
        preconditions: Some(Preconditions {
            resource_version: pool.meta().resource_version.clone(),
            uid: None,
        }),
        ..Default::default()
    };
    match api.delete(&name, &params).await {
        Ok(_) => {
            tracing::info!(nodeslicepool = name, "deleted a NodeSlicePool no NAD uses");
            Ok(1)
        }
        Err(kube::Error::Api(s)) if s.code == 409 || s.code == 404 => Ok(0),
        Err(e) => Err(e),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn net(range: &str, size: &str, excludes: &[&str]) -> SliceNetwork {
        let excludes: Vec<IpNet> = excludes.iter().map(|e| e.parse().unwrap()).collect();
        SliceNetwork {
            name: "blue".into(),
            range: AddrRange::new(range.parse().unwrap(), None, None, &excludes).unwrap(),
            size: NodeSlice {
                prefix: parse_slice_size(size).unwrap(),
                text: size.into(),
            },
            network_name: Some("blue".into()),
            nads: BTreeSet::from(["ns/blue".to_owned()]),
        }
    }

    fn stored(range: &str, size: &str, slices: &[(&str, &str)]) -> NodeSlicePool {
        let mut p = NodeSlicePool::new(
            "blue",
            NodeSlicePoolSpec {
                range: range.into(),
                slice_size: size.into(),
            },
        );
        p.status = Some(NodeSlicePoolStatus {
            allocations: slices
                .iter()
                .map(|(s, n)| NodeSliceAllocation {
                    node_name: (*n).into(),
                    slice_range: (*s).into(),
                })
                .collect(),
        });
        p
    }

    fn set(items: &[&str]) -> BTreeSet<String> {
        items.iter().map(|s| (*s).to_owned()).collect()
    }

    fn owners(plan: &Plan) -> Vec<&str> {
        plan.allocations
            .iter()
            .map(|a| a.node_name.as_str())
            .collect()
    }

    #[test]
    fn a_new_network_gives_nodes_slices_in_order() {
        let p = plan(
            &net("10.0.0.0/24", "/26", &[]),
            None,
            &set(&["c", "a", "b"]),
            &set(&[]),
        );
        assert_eq!(owners(&p), ["a", "b", "c", ""]);
        assert_eq!(p.allocations[3].slice_range, "10.0.0.192/26");
        assert_eq!(p.spec.range, "10.0.0.0/24");
        assert_eq!(p.spec.slice_size, "/26");
        assert!(p.starved.is_empty() && p.kept.is_none());
    }

    #[test]
    fn assignments_are_kept_and_departed_nodes_released_once_drained() {
        let n = net("10.0.0.0/24", "/26", &[]);
        let cur = stored(
            "10.0.0.0/24",
            "/26",
            &[
                ("10.0.0.0/26", "b"),
                ("10.0.0.64/26", "gone"),
                ("10.0.0.128/26", "left"),
                ("10.0.0.192/26", ""),
            ],
        );
        // "gone" still has addresses in its pool: kept; "left" is drained: its slice goes to "a".
        let live = set(&["blue-gone-10.0.0.64-26"]);
        let p = plan(&n, Some(&cur), &set(&["a", "b"]), &live);
        assert_eq!(owners(&p), ["b", "gone", "a", ""]);
        let p = plan(&n, Some(&cur), &set(&["a", "b"]), &set(&[]));
        assert_eq!(owners(&p), ["b", "a", "", ""]);
    }

    #[test]
    fn more_nodes_than_slices_are_reported() {
        let p = plan(
            &net("10.0.0.0/25", "/26", &[]),
            None,
            &set(&["a", "b", "c"]),
            &set(&[]),
        );
        assert_eq!(owners(&p), ["a", "b"]);
        assert_eq!(p.starved, ["c"]);
    }

    #[test]
    fn a_slice_without_a_usable_address_is_not_given() {
        let n = net("10.0.0.0/24", "/26", &["10.0.0.64/26"]);
        let p = plan(&n, None, &set(&["a", "b"]), &set(&[]));
        assert_eq!(owners(&p), ["a", "", "b", ""]);
    }

    #[test]
    fn live_pools_rebuild_a_deleted_object_and_undo_a_hand_edit() {
        let n = net("10.0.0.0/24", "/26", &[]);
        let live = set(&["blue-b-10.0.0.64-26", "other-x-10.0.0.0-26"]);
        let p = plan(&n, None, &set(&["a", "b"]), &live);
        assert_eq!(
            owners(&p),
            ["a", "b", "", ""],
            "b keeps the slice its pool lives in"
        );
        let edited = stored(
            "10.0.0.0/24",
            "/26",
            &[("10.0.0.0/26", "a"), ("10.0.0.64/26", "c")],
        );
        let p = plan(&n, Some(&edited), &set(&["a", "b", "c"]), &live);
        assert_eq!(owners(&p), ["a", "b", "c", ""]);
    }

    #[test]
    fn a_new_layout_waits_for_the_old_one_to_drain() {
        let n = net("10.0.0.0/24", "/25", &[]);
        let cur = stored(
            "10.0.0.0/24",
            "/26",
            &[
                ("10.0.0.0/26", "a"),
                ("10.0.0.64/26", ""),
                ("10.0.0.128/26", ""),
                ("10.0.0.192/26", ""),
            ],
        );
        let p = plan(
            &n,
            Some(&cur),
            &set(&["a", "b"]),
            &set(&["blue-a-10.0.0.0-26"]),
        );
        assert_eq!(p.spec.slice_size, "/26");
        assert_eq!(
            owners(&p),
            ["a", "b", "", ""],
            "new nodes still get old slices"
        );
        assert!(p.kept.as_ref().unwrap().contains("still hold addresses"));
        let p = plan(&n, Some(&cur), &set(&["a", "b"]), &set(&[]));
        assert_eq!(p.spec.slice_size, "/25");
        assert_eq!(owners(&p), ["a", "b"]);
        assert!(p.kept.is_none());
    }

    #[test]
    fn nads_of_one_network_must_agree() {
        let nad = |name: &str, range: &str| {
            let mut n = NetworkAttachmentDefinition::new(
                name,
                crate::crd::NetworkAttachmentDefinitionSpec {
                    config: format!(
                        r#"{{"cniVersion":"1.0.0","name":"x","type":"macvlan","ipam":{{"type":"whereabouts","range":"{range}","network_name":"blue","node_slice_size":"/26"}}}}"#
                    ),
                },
            );
            n.metadata.namespace = Some("ns".into());
            Arc::new(n)
        };
        let (nets, conflicts) = slice_networks(&[
            nad("b", "10.0.1.0/24"),
            nad("a", "10.0.0.0/24"),
            nad("c", "10.0.0.0/24"),
        ]);
        assert_eq!(nets["blue"].nads, set(&["ns/a", "ns/c"]));
        assert_eq!(conflicts.len(), 1);
        assert_eq!(conflicts[0].0, "ns/b");
        assert!(
            conflicts[0]
                .1
                .contains("already sliced as range 10.0.0.0/24"),
            "{}",
            conflicts[0].1
        );
    }
}
