//! The pure planning of one NodeSlicePool: which node holds which slice.

use std::collections::{BTreeMap, BTreeSet, HashMap};

use ipnet::IpNet;

use super::SliceNetwork;
pub use super::live::LivePools;
use crate::crd::{NodeSliceAllocation, NodeSlicePool, NodeSlicePoolSpec};
use crate::ipam::AddrRange;
use crate::ipam::naming::slice_pool_name;
use crate::ipam::slices::{parse_slice_size, slice_range, slices};

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
    live: &LivePools,
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
    live: &LivePools,
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

/// For each slice whose pool holds entries for some node: that node (see [`LivePools::owner`]).
fn live_owners(
    net: &SliceNetwork,
    layout: impl Iterator<Item = IpNet>,
    live: &LivePools,
) -> BTreeMap<IpNet, String> {
    layout
        .filter_map(|slice| Some((slice, live.owner(net.network_name.as_deref(), slice)?)))
        .collect()
}

/// A slice whose pool holds entries belongs to that pool's node, whatever the stored object says
/// (it was deleted or edited by hand): giving it to another node would hand out its addresses
/// again from another pool.
fn keep_live_slices(net: &SliceNetwork, assign: &mut [(IpNet, String)], live: &LivePools) {
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
    live: &LivePools,
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
