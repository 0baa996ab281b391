//! The slice planner's rules, and how NADs of one network are read.

use std::collections::BTreeSet;
use std::sync::Arc;

use ipnet::IpNet;

use super::*;
use crate::crd::{NodeSliceAllocation, NodeSlicePoolSpec, NodeSlicePoolStatus};
use crate::ipam::AddrRange;
use crate::ipam::slices::parse_slice_size;

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

fn live_pools(names: &[&str]) -> LivePools {
    LivePools::named(names.iter().copied())
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
        &live_pools(&[]),
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
    let live = live_pools(&["blue-gone-10.0.0.64-26"]);
    let p = plan(&n, Some(&cur), &set(&["a", "b"]), &live);
    assert_eq!(owners(&p), ["b", "gone", "a", ""]);
    let p = plan(&n, Some(&cur), &set(&["a", "b"]), &live_pools(&[]));
    assert_eq!(owners(&p), ["b", "a", "", ""]);
}

#[test]
fn more_nodes_than_slices_are_reported() {
    let p = plan(
        &net("10.0.0.0/25", "/26", &[]),
        None,
        &set(&["a", "b", "c"]),
        &live_pools(&[]),
    );
    assert_eq!(owners(&p), ["a", "b"]);
    assert_eq!(p.starved, ["c"]);
}

#[test]
fn a_slice_without_a_usable_address_is_not_given() {
    let n = net("10.0.0.0/24", "/26", &["10.0.0.64/26"]);
    let p = plan(&n, None, &set(&["a", "b"]), &live_pools(&[]));
    assert_eq!(owners(&p), ["a", "", "b", ""]);
}

#[test]
fn live_pools_rebuild_a_deleted_object_and_undo_a_hand_edit() {
    let n = net("10.0.0.0/24", "/26", &[]);
    let live = live_pools(&["blue-b-10.0.0.64-26", "other-x-10.0.0.0-26"]);
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
        &live_pools(&["blue-a-10.0.0.0-26"]),
    );
    assert_eq!(p.spec.slice_size, "/26");
    assert_eq!(
        owners(&p),
        ["a", "b", "", ""],
        "new nodes still get old slices"
    );
    assert!(p.kept.as_ref().unwrap().contains("still hold addresses"));
    let p = plan(&n, Some(&cur), &set(&["a", "b"]), &live_pools(&[]));
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

/// A labelled pool says whose slice of which network it is; its name alone would mislead: for
/// the unnamed network `blue-b-<slice>` reads as node `blue-b`'s, while its labels say it is node
/// `b`'s slice of network `blue`, another network.
#[test]
fn labels_not_names_decide_whose_live_slice_a_pool_is() {
    use crate::crd::{IPAllocation, IPPool, IPPoolSpec};
    use crate::ipam::naming::pool_labels;
    let slice: IpNet = "10.0.0.64/26".parse().unwrap();
    let mut pool = IPPool::new(
        "blue-b-10.0.0.64-26",
        IPPoolSpec {
            range: slice.to_string(),
            allocations: [("1".to_owned(), IPAllocation::default())].into(),
        },
    );
    let unnamed = SliceNetwork {
        network_name: None,
        ..net("10.0.0.0/24", "/26", &[])
    };
    let by_name = LivePools::of([&pool]);
    let p = plan(&unnamed, None, &set(&["a", "b"]), &by_name);
    assert_eq!(
        owners(&p),
        ["a", "blue-b", "b", ""],
        "upstream's pool: read by its name"
    );
    pool.metadata.labels = Some(pool_labels(Some("blue"), slice, Some("b")));
    let labelled = LivePools::of([&pool]);
    let p = plan(&unnamed, None, &set(&["a", "b"]), &labelled);
    assert_eq!(owners(&p), ["a", "b", "", ""], "another network's slice");
    let p = plan(
        &net("10.0.0.0/24", "/26", &[]),
        None,
        &set(&["a", "c"]),
        &labelled,
    );
    assert_eq!(
        owners(&p),
        ["a", "b", "c", ""],
        "network blue: b keeps its live slice"
    );
    assert!(labelled.slice_in_use("b", slice) && !labelled.slice_in_use("a", slice));
}
