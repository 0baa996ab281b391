//! Pools as the operator sees them in its cache, and the pure planning over them.
//!
//! A pool says which network it is of, so the offset of every entry maps back to an address and to
//! the reservation that guards it, without reading any NAD: cleanup works the same for a NAD that
//! was edited or deleted since the pod started. Pools ours creates carry labels naming their
//! network, range and node ([`crate::ipam::naming::pool_labels`]), and the labels decide. Only an
//! unlabelled pool (upstream's) is read by its name (`[<network_name>-]<normalised cidr>`, or a
//! node slice's `[<network_name>-]<node>-<slice>` as the NodeSlicePools describe them); the
//! operator labels such a pool once it knows it from a NAD or a NodeSlicePool.

use std::collections::{BTreeMap, BTreeSet};
use std::net::IpAddr;
use std::sync::Arc;

use kube::ResourceExt;

use crate::alloc::Target;
use crate::crd::{IPAllocation, IPPool, NodeSlicePool};
use crate::ipam::AddrRange;
use crate::ipam::naming::{labelled_network, pool_name, reservation_name};
use crate::ipam::slices::{is_slice_of, parse_slice_size};
use crate::ownership::{PodIdentity, belongs_to};

/// A parsed pool from the cache.
#[derive(Debug, Clone)]
pub struct PoolView {
    pub name: String,
    pub range: AddrRange,
    pub network_name: Option<String>,
    /// Where the network was read from: the labels decide; a name is a guess.
    pub known_by: KnownBy,
    pub entries: BTreeMap<u128, IPAllocation>,
}

/// How the operator knows a pool's network.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum KnownBy {
    /// Its labels, which compose its name (ours, or labelled by the operator).
    Labels,
    /// Its name, as a NodeSlicePool describes its slices.
    SliceIndex,
    /// Its name alone: a node slice pool that no NodeSlicePool describes reads as a pool of
    /// network `<network>-<node>`.
    Name,
}

impl PoolView {
    /// `None` for a pool whose range does not parse or whose name does not fit its range (not
    /// ours to touch).
    pub fn from_pool(pool: &IPPool) -> Option<PoolView> {
        Self::from_pool_in(pool, &SliceIndex::default())
    }

    /// As [`from_pool`](Self::from_pool), knowing the slice pools of `slices`, whose names
    /// (`[<network>-]<node>-<slice>`) carry a node name between the network and the range.
    pub fn from_pool_in(pool: &IPPool, slices: &SliceIndex) -> Option<PoolView> {
        let name = pool.metadata.name.clone()?;
        let cidr: ipnet::IpNet = pool.spec.range.parse().ok()?;
        let range = AddrRange::new(cidr, None, None, &[]).ok()?;
        let labels = pool.metadata.labels.clone().unwrap_or_default();
        let (network_name, known_by) = match labelled_network(&name, &labels, cidr) {
            Some(network) => (network, KnownBy::Labels),
            None => match slices.network_of(&name, cidr) {
                Some(network) => (network, KnownBy::SliceIndex),
                None => (network_of(&name, cidr)?, KnownBy::Name),
            },
        };
        let entries = pool
            .spec
            .allocations
            .iter()
            .filter_map(|(k, e)| Some((k.parse().ok()?, e.clone())))
            .collect();
        Some(PoolView {
            name,
            range,
            network_name,
            known_by,
            entries,
        })
    }

    pub fn ip(&self, offset: u128) -> Option<IpAddr> {
        self.range.addr_at(offset)
    }

    pub fn reservation_of(&self, offset: u128) -> Option<String> {
        self.ip(offset)
            .map(|ip| reservation_name(self.network_name.as_deref(), ip))
    }

    /// The engine's target of this pool. Reservations are always looked for: a network without
    /// overlap protection simply has none.
    pub fn target(&self) -> Target {
        Target {
            pool: self.name.clone(),
            range: self.range.clone(),
            network: self.network_name.clone(),
            overlapping: true,
            node: None,
        }
    }
}

/// The sliced ranges, from the NodeSlicePools: which pools are node slices, and of which network.
#[derive(Debug, Default)]
pub struct SliceIndex {
    /// (range, slice prefix length, NodeSlicePool name, nodes holding a slice).
    ranges: Vec<(ipnet::IpNet, u8, String, BTreeSet<String>)>,
}

impl SliceIndex {
    pub fn new(pools: &[Arc<NodeSlicePool>]) -> SliceIndex {
        let ranges = pools
            .iter()
            .filter_map(|p| {
                let nodes = p.status.iter().flat_map(|s| &s.allocations);
                Some((
                    p.spec.range.parse().ok()?,
                    parse_slice_size(&p.spec.slice_size)?,
                    p.name_any(),
                    nodes.map(|a| a.node_name.clone()).collect(),
                ))
            })
            .collect();
        SliceIndex { ranges }
    }

    /// The network of a slice pool (`Some(None)`: the unnamed network), `None` when `pool` is not
    /// a slice pool. A NodeSlicePool is named after its network's `network_name`, or the
    /// config's `name` when there is none, in which case its pools carry no network prefix: a
    /// pool `<nodeslicepool>-<node>-<slice>` is the named network's unless `<nodeslicepool>-<node>`
    /// is itself a node holding that slice.
    pub fn network_of(&self, pool: &str, cidr: ipnet::IpNet) -> Option<Option<String>> {
        let suffix = format!("-{}", pool_name(None, cidr));
        let rest = pool.strip_suffix(&suffix)?;
        self.ranges
            .iter()
            .filter(|(range, prefix, _, _)| {
                *prefix == cidr.prefix_len() && is_slice_of(*range, cidr)
            })
            .find_map(|(_, _, name, nodes)| {
                let named = rest
                    .strip_prefix(&format!("{name}-"))
                    .filter(|n| !n.is_empty());
                match named {
                    Some(_) if !nodes.contains(rest) => Some(Some(name.clone())),
                    _ if !rest.is_empty() => Some(None),
                    _ => None,
                }
            })
    }
}

/// The network name encoded in a pool name: `Some(None)` for the unnamed network, `None` when the
/// name does not end with the range's normalised form.
pub fn network_of(pool: &str, cidr: ipnet::IpNet) -> Option<Option<String>> {
    let bare = pool_name(None, cidr);
    if pool == bare {
        return Some(None);
    }
    pool.strip_suffix(&format!("-{bare}"))
        .filter(|n| !n.is_empty())
        .map(|n| Some(n.to_owned()))
}

/// Every entry that belongs to `pod`, pool by pool (pools without any are left out).
pub fn entries_of_pod<'a>(
    pools: &'a [PoolView],
    pod: &PodIdentity,
) -> Vec<(&'a PoolView, Vec<(u128, IPAllocation)>)> {
    pools
        .iter()
        .filter_map(|p| {
            let mine: Vec<_> = p
                .entries
                .iter()
                .filter(|(o, e)| p.ip(**o).is_some_and(|ip| belongs_to(e, ip, pod)))
                .map(|(o, e)| (*o, e.clone()))
                .collect();
            (!mine.is_empty()).then_some((p, mine))
        })
        .collect()
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use crate::crd::IPPoolSpec;

    pub fn pool(name: &str, range: &str, entries: &[(u128, &str, &str)]) -> IPPool {
        let allocations = entries
            .iter()
            .map(|(o, podref, uid)| {
                (
                    o.to_string(),
                    IPAllocation {
                        id: format!("c-{o}"),
                        podref: (*podref).into(),
                        poduid: (*uid).into(),
                        ..Default::default()
                    },
                )
            })
            .collect();
        let mut p = IPPool::new(
            name,
            IPPoolSpec {
                range: range.into(),
                allocations,
            },
        );
        p.metadata.namespace = Some("kube-system".into());
        p
    }

    #[test]
    fn network_names_from_pool_names() {
        let cidr = "10.0.0.0/24".parse().unwrap();
        assert_eq!(network_of("10.0.0.0-24", cidr), Some(None));
        assert_eq!(
            network_of("blue-10.0.0.0-24", cidr),
            Some(Some("blue".into()))
        );
        assert_eq!(network_of("10.0.1.0-24", cidr), None);
        let v6 = "fd00::/64".parse().unwrap();
        assert_eq!(
            network_of("red-net-fd00---64", v6),
            Some(Some("red-net".into()))
        );
    }

    #[test]
    fn finds_the_entries_of_a_pod_across_pools() {
        let pools: Vec<PoolView> = [
            pool(
                "10.0.0.0-24",
                "10.0.0.0/24",
                &[(5, "ns/a", "ua"), (6, "ns/a", "older"), (7, "ns/b", "ub")],
            ),
            pool("blue-fd00---64", "fd00::/64", &[(5, "ns/a", "ua")]),
            pool("bogus", "10.9.0.0/24", &[(5, "ns/a", "ua")]),
        ]
        .iter()
        .filter_map(PoolView::from_pool)
        .collect();
        assert_eq!(
            pools.len(),
            2,
            "a pool whose name does not match its range is ignored"
        );
        let pod = PodIdentity {
            podref: "ns/a".into(),
            uid: "ua".into(),
            addresses: vec![],
        };
        let found = entries_of_pod(&pools, &pod);
        assert_eq!(found.len(), 2);
        assert_eq!(found[0].1.iter().map(|(o, _)| *o).collect::<Vec<_>>(), [5]);
        assert_eq!(found[1].0.reservation_of(5).unwrap(), "blue-fd00--5");
    }

    #[test]
    fn slice_pools_belong_to_their_network() {
        let nsp = |name: &str, nodes: &[&str]| {
            let mut p = NodeSlicePool::new(
                name,
                crate::crd::NodeSlicePoolSpec {
                    range: "10.0.0.0/16".into(),
                    slice_size: "/24".into(),
                },
            );
            p.status = Some(crate::crd::NodeSlicePoolStatus {
                allocations: nodes
                    .iter()
                    .map(|n| crate::crd::NodeSliceAllocation {
                        node_name: (*n).into(),
                        slice_range: "10.0.4.0/24".into(),
                    })
                    .collect(),
            });
            Arc::new(p)
        };
        let cidr = "10.0.4.0/24".parse().unwrap();
        let index = SliceIndex::new(&[nsp("blue", &["node-1"])]);
        assert_eq!(
            index.network_of("blue-node-1-10.0.4.0-24", cidr),
            Some(Some("blue".into()))
        );
        assert_eq!(
            index.network_of("blue-10.0.4.0-24", cidr),
            Some(None),
            "node 'blue', unnamed"
        );
        assert_eq!(index.network_of("blue-node-1-10.0.5.0-24", cidr), None);
        // The unnamed network: the NodeSlicePool is named after the config, its pools are not.
        let index = SliceIndex::new(&[nsp("mynet", &["worker"])]);
        assert_eq!(index.network_of("worker-10.0.4.0-24", cidr), Some(None));
        let p = pool(
            "blue-node-1-10.0.4.0-24",
            "10.0.4.0/24",
            &[(5, "ns/a", "ua")],
        );
        let index = SliceIndex::new(&[nsp("blue", &["node-1"])]);
        let view = PoolView::from_pool_in(&p, &index).unwrap();
        assert_eq!(view.reservation_of(5).unwrap(), "blue-10.0.4.5");
        let plain = PoolView::from_pool(&p).unwrap();
        assert_eq!(
            plain.network_name.as_deref(),
            Some("blue-node-1"),
            "without the index"
        );
    }

    #[test]
    fn a_labelled_pool_is_known_by_its_labels_not_its_name() {
        use crate::ipam::naming::pool_labels;
        let cidr = "10.0.4.0/24".parse().unwrap();
        let mut p = pool(
            "blue-node-1-10.0.4.0-24",
            "10.0.4.0/24",
            &[(5, "ns/a", "ua")],
        );
        p.metadata.labels = Some(pool_labels(Some("blue"), cidr, Some("node-1")));
        // No NodeSlicePool describes it (deleted by hand, or not cached yet): its labels still do.
        let view = PoolView::from_pool(&p).unwrap();
        assert_eq!(view.network_name.as_deref(), Some("blue"));
        assert_eq!(view.known_by, KnownBy::Labels);
        assert_eq!(view.reservation_of(5).unwrap(), "blue-10.0.4.5");
        // Labels that do not compose the name were not written for this pool: read by name.
        p.metadata.labels = Some(pool_labels(Some("red"), cidr, Some("node-1")));
        let view = PoolView::from_pool(&p).unwrap();
        assert_eq!(view.known_by, KnownBy::Name);
        assert_eq!(view.network_name.as_deref(), Some("blue-node-1"));
        // The audit guesses other networks' reservations for a pool known by name alone.
        let guessed = crate::controller::audit::expected_reservations(&[view]);
        assert!(guessed.contains("blue-10.0.4.5") && guessed.contains("10.0.4.5"));
        p.metadata.labels = Some(pool_labels(Some("blue"), cidr, Some("node-1")));
        let known = PoolView::from_pool(&p).unwrap();
        let expected = crate::controller::audit::expected_reservations(&[known]);
        assert_eq!(expected.into_iter().collect::<Vec<_>>(), ["blue-10.0.4.5"]);
    }
}
