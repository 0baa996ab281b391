use super::*;
use crate::controller::pools::tests::pool;
use crate::crd::{NetworkAttachmentDefinitionSpec, size::POOL_OBJECT_BUDGET};

fn reservation(name: &str, podref: &str, age: u64) -> ListedReservation {
    ListedReservation {
        name: name.into(),
        uid: format!("uid-{name}"),
        resource_version: "7".into(),
        spec: OverlappingRangeIPReservationSpec {
            podref: podref.into(),
            containerid: "c".into(),
            ..Default::default()
        },
        age: Some(age),
    }
}

fn kinds(found: &[Finding]) -> Vec<String> {
    found.iter().map(|f| format!("{f}")).collect()
}

#[test]
fn each_kind_is_found_with_its_evidence() {
    // ns/live lives; ns/gone does not. Pools 10.0.0.0-24 and 10.0.0.0-25 overlap.
    let mut a = pool(
        "10.0.0.0-24",
        "10.0.0.0/24",
        &[
            (1, "ns/live", "u1"),
            (2, "ns/gone", "u2"),
            (5, "ns/live", "u1"),
            (7, "ns/live", "u1"),
        ],
    );
    a.spec.allocations.insert(
        "300".into(),
        IPAllocation {
            id: "x".into(),
            podref: "ns/gone".into(),
            ..Default::default()
        },
    );
    let b = pool("10.0.0.0-25", "10.0.0.0/25", &[(5, "ns/other", "u3")]);
    let mut pods = LivePods::default();
    pods.uids.insert("ns/live".into(), "u1".into());
    pods.uids.insert("ns/other".into(), "u3".into());
    let nad = NetworkAttachmentDefinition::new(
        "bad",
        NetworkAttachmentDefinitionSpec {
            config: r#"{"cniVersion":"1.0.0","name":"n","type":"macvlan","ipam":{"type":"whereabouts","range":"10.0.0.0/33"}}"#.into(),
        },
    );
    let snap = Snapshot {
        pools: vec![a, b],
        reservations: vec![
            reservation("10.0.0.1", "ns/live", 7200),
            reservation("10.0.0.7", "ns/thief", 7200),
            reservation("10.0.0.2", "ns/gone", 90),
            reservation("10.0.0.9", "ns/killed", 600),
            reservation("10.0.0.10", "ns/racing", 2),
        ],
        pods,
        nads: vec![nad],
        min_age: 60,
        ..Default::default()
    };
    let found = audit(&snap);
    let text = kinds(&found);
    let has = |prefix: &str| text.iter().filter(|t| t.starts_with(prefix)).count();
    assert_eq!(
        has(
            "stale-entry: pool 10.0.0.0-24 10.0.0.2 (offset 2) of pod ns/gone container c-2, 1m old: pod ns/gone no longer exists"
        ),
        1,
        "{text:#?}"
    );
    assert_eq!(
        has("orphan-reservation: overlappingrangeipreservation 10.0.0.9 (pod ns/killed"),
        1,
        "{text:#?}"
    );
    assert_eq!(
        has(
            "orphan-reservation: overlappingrangeipreservation 10.0.0.10 (pod ns/racing, container c, 2s old) has no pool entry; recent"
        ),
        1,
        "{text:#?}"
    );
    assert_eq!(
        has("missing-reservation: pool 10.0.0.0-24 10.0.0.5"),
        1,
        "{text:#?}"
    );
    assert_eq!(
        has("missing-reservation: pool 10.0.0.0-25 10.0.0.5"),
        1,
        "{text:#?}"
    );
    assert_eq!(
        has("duplicate-address: 10.0.0.5 is held by more than one pod: pool 10.0.0.0-24"),
        1,
        "{text:#?}"
    );
    // An entry whose reservation names another pod: held by two pods as well.
    assert_eq!(
        text.iter()
            .filter(|t| t.starts_with(
                "duplicate-address: 10.0.0.7 is held by more than one pod: pool 10.0.0.0-24"
            ) && t.ends_with("; its reservation names pod ns/thief"))
            .count(),
        1,
        "{text:#?}"
    );
    assert_eq!(
        has(r#"outside-range: pool 10.0.0.0-24 entry "300" (pod ns/gone)"#),
        1,
        "{text:#?}"
    );
    assert_eq!(
        has("invalid-nad: /bad: spec.config: ipam.range"),
        1,
        "{text:#?}"
    );
    assert_eq!(found.len(), 9, "{text:#?}");
    let repairable: Vec<&str> = found
        .iter()
        .filter(|f| f.repairable())
        .map(Finding::kind)
        .collect();
    assert_eq!(
        repairable,
        [
            "stale-entry",
            "orphan-reservation",
            "missing-reservation",
            "missing-reservation"
        ]
    );
    // The report round-trips: repair reads what audit wrote.
    let json = serde_json::to_string(&found).unwrap();
    let back: Vec<Finding> = serde_json::from_str(&json).unwrap();
    assert_eq!(back, found);
}

#[test]
fn held_entries_and_live_pods_are_not_findings() {
    let mut p = pool(
        "10.1.0.0-24",
        "10.1.0.0/24",
        &[(1, "ns/web-0", "old"), (2, "ns/live", "u")],
    );
    p.spec.allocations.get_mut("1").unwrap().statefulset = "web".into();
    let mut pods = LivePods::default();
    pods.uids.insert("ns/live".into(), "u".into());
    let snap = Snapshot {
        pools: vec![p],
        reservations: vec![
            reservation("10.1.0.1", "ns/web-0", 100),
            reservation("10.1.0.2", "ns/live", 100),
        ],
        pods,
        min_age: 60,
        ..Default::default()
    };
    assert!(audit(&snap).is_empty(), "{:#?}", audit(&snap));
}

#[test]
fn a_pool_near_the_object_limit_is_reported() {
    let mut p = pool("10.2.0.0-16", "10.2.0.0/16", &[]);
    let filler = |i: u32| IPAllocation {
        id: format!("{i:064}"),
        podref: format!("ns/p-{i:040}"),
        poduid: "u".repeat(36),
        ..Default::default()
    };
    let mut i = 1;
    while crate::crd::size::pool_bytes(
        &p.spec.range,
        p.spec
            .allocations
            .iter()
            .map(|(k, e)| (k.parse::<u128>().unwrap(), e))
            .collect::<Vec<_>>()
            .iter()
            .map(|(o, e)| (o, *e)),
    ) < POOL_OBJECT_BUDGET * 85 / 100
    {
        for _ in 0..200 {
            p.spec.allocations.insert(i.to_string(), filler(i));
            i += 1;
        }
    }
    let found = nearly_full(&p).expect("nearly full");
    assert!(
        format!("{found}").starts_with("pool-nearly-full: pool 10.2.0.0-16 holds"),
        "{found}"
    );
}

#[test]
fn networks_without_reservations_and_superseded_entries_are_reported_as_they_are() {
    let p = pool(
        "10.3.0.0-24",
        "10.3.0.0/24",
        &[(1, "ns/live", "u"), (2, "ns/live", "u")],
    );
    let mut pods = LivePods::default();
    pods.uids.insert("ns/live".into(), "u".into());
    // The pod's network-status lists .1 on net1: the entry at .2 is an earlier sandbox's.
    pods.interfaces.insert(
        "ns/live".into(),
        [("net1".to_owned(), vec!["10.3.0.1".parse().unwrap()])].into(),
    );
    let nad = NetworkAttachmentDefinition::new(
        "plain",
        NetworkAttachmentDefinitionSpec {
            config: r#"{"cniVersion":"1.0.0","name":"n","type":"macvlan","ipam":{"type":"whereabouts","range":"10.3.0.0/24","enable_overlapping_ranges":false}}"#.into(),
        },
    );
    let mut entry_pool = p.clone();
    for e in entry_pool.spec.allocations.values_mut() {
        e.ifname = "net1".into();
    }
    let snap = Snapshot {
        pools: vec![entry_pool],
        pods,
        nads: vec![nad],
        min_age: 60,
        ..Default::default()
    };
    let found = audit(&snap);
    assert_eq!(
        found.len(),
        1,
        "no missing-reservation for a network without them: {found:#?}"
    );
    assert!(matches!(
        &found[0],
        Finding::StaleEntry {
            superseded: true,
            ..
        }
    ));
    assert!(
        !found[0].repairable(),
        "its pod exists: the operator's audit frees it, not repair"
    );
}
