use super::*;
use std::collections::BTreeSet;

use crate::crd::IPPool;

#[test]
fn suspects_are_due_only_after_the_grace_period() {
    let mut s = Suspects::default();
    let t0 = Instant::now();
    let grace = Duration::from_secs(60);
    assert!(s.observe(t0, ["a", "b"], grace).is_empty());
    assert!(
        s.observe(t0 + Duration::from_secs(30), ["a", "b"], grace)
            .is_empty()
    );
    // b stopped being stale (its pod showed up in the cache): forgotten.
    assert!(
        s.observe(t0 + Duration::from_secs(45), ["a"], grace)
            .is_empty()
    );
    assert_eq!(
        s.observe(t0 + Duration::from_secs(61), ["a", "b"], grace),
        vec!["a"]
    );
    // b starts over.
    assert_eq!(
        s.observe(t0 + Duration::from_secs(122), ["b"], grace),
        vec!["b"]
    );
}

/// A pool of three entries: .5 of the live pod `ns/a`, .6 of a gone pod, and .7 of an earlier
/// sandbox of `ns/a` on net1.
fn blue_pool() -> IPPool {
    use crate::crd::{IPAllocation, IPPoolSpec};
    let mut p = IPPool::new(
        "blue-10.0.0.0-24",
        IPPoolSpec {
            range: "10.0.0.0/24".into(),
            allocations: Default::default(),
        },
    );
    p.spec.allocations.insert(
        "5".into(),
        IPAllocation {
            id: "c5".into(),
            podref: "ns/a".into(),
            poduid: "ua".into(),
            ..Default::default()
        },
    );
    p.spec.allocations.insert(
        "6".into(),
        IPAllocation {
            id: "c6".into(),
            podref: "ns/gone".into(),
            ..Default::default()
        },
    );
    p.spec.allocations.insert(
        "7".into(),
        IPAllocation {
            id: "c7-earlier-sandbox".into(),
            podref: "ns/a".into(),
            poduid: "ua".into(),
            ifname: "net1".into(),
            ..Default::default()
        },
    );
    p
}

#[test]
fn stale_entries_and_expected_reservations() {
    let pools = vec![PoolView::from_pool(&blue_pool()).unwrap()];
    let mut live = LivePods {
        uids: HashMap::from([("ns/a".to_owned(), "ua".to_owned())]),
        ..Default::default()
    };
    let key = |o: u128, id: &str| ("blue-10.0.0.0-24".to_owned(), o, id.to_owned());
    assert_eq!(stale_entries(&pools, &live), vec![key(6, "c6")]);
    // Once Multus lists .5 on net1, the earlier sandbox's .7 on net1 is left over.
    live.interfaces.insert(
        "ns/a".into(),
        HashMap::from([("net1".to_owned(), vec!["10.0.0.5".parse().unwrap()])]),
    );
    assert_eq!(
        stale_entries(&pools, &live),
        vec![key(6, "c6"), key(7, "c7-earlier-sandbox")]
    );
    assert_eq!(
        expected_reservations(&pools),
        BTreeSet::from([
            "blue-10.0.0.5".to_owned(),
            "blue-10.0.0.6".to_owned(),
            "blue-10.0.0.7".to_owned(),
            // Spared in case "blue" is a node and the pool a slice of the unnamed network.
            "10.0.0.5".to_owned(),
            "10.0.0.6".to_owned(),
            "10.0.0.7".to_owned()
        ])
    );
}
