//! Addresses that stay, in the CNI handlers over the in-memory store: requested addresses
//! (`runtimeConfig.ips`, `args.cni.ips`), sticky StatefulSet addresses and IPAMClaims. Nothing
//! requested, sticky or claimed is ever handed to another pod.

use std::collections::HashMap;

use serde_json::{Value, json};
use whereabouts::cni::protocol::{CniError, Code, Command};
use whereabouts::cni::{FlatSource, Invocation, Request};
use whereabouts::crd::claim;
use whereabouts::crd::{IPAMClaim, IPAMClaimSpec};
use whereabouts::store::memory::MemoryStore;
use whereabouts::store::{Datastore, PodFacts};

mod cni_support;
use cni_support::{addresses, handle};

/// One invocation: `extra` is merged into the network config's top level.
fn request(
    command: Command,
    ipam: &Value,
    extra: Value,
    pod: &str,
    container: &str,
) -> Result<Request, CniError> {
    let mut conf = json!({"cniVersion": "1.0.0", "name": "net", "type": "macvlan", "ipam": ipam});
    for (k, v) in extra.as_object().unwrap() {
        conf[k] = v.clone();
    }
    let vars: HashMap<&str, String> = HashMap::from([
        // Pods named launcher-<x> run on node-<x> (a VM's pods move between nodes).
        (
            "NODENAME",
            format!("node-{}", pod.trim_start_matches("launcher-")),
        ),
        ("CNI_CONTAINERID", container.to_owned()),
        ("CNI_IFNAME", "net1".to_owned()),
        (
            "CNI_ARGS",
            format!(
                "IgnoreUnknown=1;K8S_POD_NAMESPACE=ns;K8S_POD_NAME={pod};K8S_POD_UID=u-{container}"
            ),
        ),
    ]);
    let env = move |k: &str| vars.get(k).cloned();
    Invocation::read(&env, &conf.to_string(), FlatSource::Paths(vec![])).load(command)
}

async fn add_with(
    store: &MemoryStore,
    ipam: &Value,
    extra: Value,
    pod: &str,
    c: &str,
) -> Result<Vec<String>, CniError> {
    let req = request(Command::Add, ipam, extra, pod, c)?;
    Ok(addresses(&handle(store, &req).await?.unwrap()))
}

async fn add(
    store: &MemoryStore,
    ipam: &Value,
    pod: &str,
    c: &str,
) -> Result<Vec<String>, CniError> {
    add_with(store, ipam, json!({}), pod, c).await
}

async fn del(store: &MemoryStore, ipam: &Value, pod: &str, c: &str) {
    let req = request(Command::Del, ipam, json!({}), pod, c).unwrap();
    whereabouts::cni::handle(store, &req).await.unwrap();
}

fn ips(list: &[&str]) -> Value {
    json!({"runtimeConfig": {"ips": list}})
}

fn small() -> Value {
    json!({"type": "whereabouts", "range": "10.0.0.0/29"})
}

#[tokio::test]
async fn a_requested_address_is_given_and_never_handed_out_again() {
    let store = MemoryStore::new();
    let ipam = small();
    assert_eq!(
        add_with(&store, &ipam, ips(&["10.0.0.3/29"]), "fixed", "c-fixed")
            .await
            .unwrap(),
        ["10.0.0.3/29"]
    );
    // Dynamic ADDs take the lowest free addresses around it, and never it.
    let mut dynamic = Vec::new();
    for i in 0..5 {
        dynamic.extend(
            add(&store, &ipam, &format!("p{i}"), &format!("c{i}"))
                .await
                .unwrap(),
        );
    }
    assert_eq!(
        dynamic,
        [
            "10.0.0.1/29",
            "10.0.0.2/29",
            "10.0.0.4/29",
            "10.0.0.5/29",
            "10.0.0.6/29"
        ]
    );
    let e = add(&store, &ipam, "p6", "c6").await.unwrap_err();
    assert_eq!(e.code, Code::Exhausted);
    // A second pod asking for it is told who holds it; nothing is taken.
    let e = add_with(&store, &ipam, ips(&["10.0.0.3"]), "other", "c-other")
        .await
        .unwrap_err();
    assert_eq!(e.code, Code::AddressUnavailable);
    assert_eq!(
        e.msg,
        "requested address 10.0.0.3 is held by pod ns/fixed interface net1 (pool 10.0.0.0-29)"
    );
    // The same ADD again is idempotent; DEL releases it like any address.
    assert_eq!(
        add_with(&store, &ipam, ips(&["10.0.0.3"]), "fixed", "c-fixed")
            .await
            .unwrap(),
        ["10.0.0.3/29"]
    );
    del(&store, &ipam, "fixed", "c-fixed").await;
    assert_eq!(
        add_with(&store, &ipam, ips(&["10.0.0.3"]), "other", "c-other")
            .await
            .unwrap(),
        ["10.0.0.3/29"]
    );
}

#[tokio::test]
async fn requests_per_range_and_their_errors() {
    let store = MemoryStore::new();
    let ipam = json!({"type": "whereabouts", "ipRanges": [
        {"range": "10.0.0.0/24", "exclude": ["10.0.0.200/29"]}, {"range": "fd00::/64"}
    ]});
    // args.cni.ips too; the IPv6 range without a request stays dynamic.
    let extra = json!({"args": {"cni": {"ips": ["10.0.0.50"]}}});
    assert_eq!(
        add_with(&store, &ipam, extra, "a", "ca").await.unwrap(),
        ["10.0.0.50/24", "fd00::1/64"]
    );
    let both = ips(&["10.0.0.60/24", "fd00::60/64"]);
    assert_eq!(
        add_with(&store, &ipam, both, "b", "cb").await.unwrap(),
        ["10.0.0.60/24", "fd00::60/64"]
    );
    for (request, words) in [
        (
            "10.1.0.5",
            "is outside every range of this network (10.0.0.0/24, fd00::/64)",
        ),
        (
            "10.0.0.201",
            "is excluded from range 10.0.0.0/24 (exclude 10.0.0.200/29)",
        ),
        (
            "10.0.0.255",
            "is outside the usable window 10.0.0.1 to 10.0.0.254 of range 10.0.0.0/24",
        ),
    ] {
        let e = add_with(&store, &ipam, ips(&[request]), "c", "cc")
            .await
            .unwrap_err();
        assert_eq!(e.code, Code::AddressUnavailable, "{}", e.msg);
        assert_eq!(
            e.msg,
            format!("runtimeConfig.ips[0]: requested address {request} {words}")
        );
    }
    // The IPv4 request is free, the IPv6 one is held: all or nothing.
    let e = add_with(&store, &ipam, ips(&["10.0.0.70", "fd00::60"]), "c", "cc")
        .await
        .unwrap_err();
    assert!(
        e.msg
            .contains("requested address fd00::60 is held by pod ns/b"),
        "{}",
        e.msg
    );
    let pool = store.get_pool("10.0.0.0-24").await.unwrap().unwrap();
    assert!(
        pool.allocations.values().all(|e| e.podref != "ns/c"),
        "the IPv4 address was rolled back"
    );
    let e = add_with(
        &store,
        &ipam,
        json!({"runtimeConfig": {"ips": "10.0.0.5"}}),
        "c",
        "cc",
    )
    .await
    .unwrap_err();
    assert_eq!(e.code, Code::InvalidConfig);
}

#[tokio::test]
async fn with_requested_addresses_cni_args_ip_is_ignored() {
    let store = MemoryStore::new();
    let ipam = small();
    let conf = json!({"cniVersion": "1.0.0", "name": "net", "type": "macvlan", "ipam": ipam, "runtimeConfig": {"ips": ["10.0.0.4"]}});
    let vars: HashMap<&str, String> = HashMap::from([
        ("CNI_CONTAINERID", "c1".to_owned()),
        ("CNI_IFNAME", "net1".to_owned()),
        (
            "CNI_ARGS",
            "K8S_POD_NAMESPACE=ns;K8S_POD_NAME=p;IP=192.168.9.9/24".to_owned(),
        ),
    ]);
    let env = move |k: &str| vars.get(k).cloned();
    let req = Invocation::read(&env, &conf.to_string(), FlatSource::Paths(vec![]))
        .load(Command::Add)
        .unwrap();
    let reply = handle(&store, &req).await.unwrap().unwrap();
    assert_eq!(addresses(&reply), ["10.0.0.4/29"]);
}

fn sticky() -> Value {
    json!({"type": "whereabouts", "range": "10.0.1.0/29", "sticky_statefulset": true})
}

fn statefulset_pod(store: &MemoryStore, pod: &str, uid: &str) {
    store.put_pod_facts(
        &format!("ns/{pod}"),
        PodFacts {
            uid: uid.into(),
            networks: None,
            statefulset: Some("web".into()),
        },
    );
}

#[tokio::test]
async fn a_statefulset_pod_keeps_its_address_across_delete_and_recreate() {
    let store = MemoryStore::new();
    let ipam = sticky();
    add(&store, &ipam, "filler", "c-filler").await.unwrap_err(); // no such pod in the API server
    statefulset_pod(&store, "web-0", "u-c-old");
    assert_eq!(
        add(&store, &ipam, "web-0", "c-old").await.unwrap(),
        ["10.0.1.1/29"]
    );
    let pool = store.get_pool("10.0.1.0-29").await.unwrap().unwrap();
    assert_eq!(
        pool.allocations[&1].statefulset, "web",
        "the entry says it is sticky"
    );
    // The pod is deleted: DEL keeps the address, and dynamic ADDs do not get it.
    del(&store, &ipam, "web-0", "c-old").await;
    store.put_pod_facts(
        "ns/p1",
        PodFacts {
            uid: "u-c1".into(),
            ..Default::default()
        },
    );
    assert_eq!(
        add(&store, &ipam, "p1", "c1").await.unwrap(),
        ["10.0.1.2/29"]
    );
    // The replacement (a new UID and container) gets it back.
    statefulset_pod(&store, "web-0", "u-c-new");
    assert_eq!(
        add(&store, &ipam, "web-0", "c-new").await.unwrap(),
        ["10.0.1.1/29"]
    );
    let pool = store.get_pool("10.0.1.0-29").await.unwrap().unwrap();
    assert_eq!(pool.allocations[&1].id, "c-new");
    assert_eq!(pool.allocations[&1].poduid, "u-c-new");
    // A pod that is not a StatefulSet's is not sticky: its DEL frees.
    del(&store, &ipam, "p1", "c1").await;
    assert!(
        !store
            .get_pool("10.0.1.0-29")
            .await
            .unwrap()
            .unwrap()
            .allocations
            .contains_key(&2)
    );
}

fn claim(name: &str) -> IPAMClaim {
    let mut c = IPAMClaim::new(
        name,
        IPAMClaimSpec {
            network: "net".into(),
            interface: "net1".into(),
        },
    );
    c.metadata.namespace = Some("ns".into());
    c
}

fn vm_pod(store: &MemoryStore, pod: &str, claim: &str) {
    let networks = json!([{"name": "net", "ipam-claim-reference": claim}]).to_string();
    store.put_pod_facts(
        &format!("ns/{pod}"),
        PodFacts {
            uid: format!("u-c-{pod}"),
            networks: Some(networks),
            statefulset: None,
        },
    );
}

fn persistent() -> Value {
    json!({"type": "whereabouts", "ipRanges": [{"range": "10.0.2.0/29"}, {"range": "fd00:2::/125"}]})
}

fn claim_ips(store: &MemoryStore, key: &str) -> Vec<String> {
    store
        .ipam_claim(key)
        .unwrap()
        .status
        .unwrap_or_default()
        .ips
}

#[tokio::test]
async fn an_ipamclaim_keeps_its_addresses_across_pods() {
    let store = MemoryStore::new();
    let ipam = persistent();
    let on = json!({"allowPersistentIPs": true});
    store.put_ipam_claim(claim("vm1.net"));
    vm_pod(&store, "launcher-a", "vm1.net");
    let first = add_with(&store, &ipam, on.clone(), "launcher-a", "c-launcher-a")
        .await
        .unwrap();
    assert_eq!(first, ["10.0.2.1/29", "fd00:2::1/125"]);
    let recorded = store.ipam_claim("ns/vm1.net").unwrap().status.unwrap();
    assert_eq!(recorded.ips, first);
    assert_eq!(recorded.owner_pod.as_ref().unwrap().name, "launcher-a");
    let c = &recorded.conditions[0];
    assert_eq!(
        (c.type_.as_str(), c.status.as_str(), c.reason.as_str()),
        ("IPsAllocated", "True", "SuccessfulAllocation")
    );
    // The record names the node that wrote it (the claims policy holds a node's credentials to
    // their own node's name there).
    assert_eq!(claim::recorder(&recorded), Some("node-a"));
    // A live migration: the target pod refers to the same claim while the source runs.
    vm_pod(&store, "launcher-b", "vm1.net");
    assert_eq!(
        add_with(&store, &ipam, on.clone(), "launcher-b", "c-launcher-b")
            .await
            .unwrap(),
        first
    );
    let moved = store.ipam_claim("ns/vm1.net").unwrap().status.unwrap();
    assert_eq!(moved.owner_pod.as_ref().unwrap().name, "launcher-b");
    assert_eq!(
        claim::recorder(&moved),
        Some("node-b"),
        "the target's node wrote it"
    );
    assert_eq!(moved.conditions.len(), 2, "{:?}", moved.conditions);
    // Both pods go: DEL keeps the addresses; the next pod of the VM gets them back.
    del(&store, &ipam, "launcher-a", "c-launcher-a").await;
    del(&store, &ipam, "launcher-b", "c-launcher-b").await;
    store.put_pod_facts(
        "ns/other",
        PodFacts {
            uid: "u-c-other".into(),
            ..Default::default()
        },
    );
    assert_eq!(
        add(&store, &ipam, "other", "c-other").await.unwrap(),
        ["10.0.2.2/29", "fd00:2::2/125"]
    );
    vm_pod(&store, "launcher-c", "vm1.net");
    assert_eq!(
        add_with(&store, &ipam, on.clone(), "launcher-c", "c-launcher-c")
            .await
            .unwrap(),
        first
    );
    // Without allowPersistentIPs the claim reference is not read.
    vm_pod(&store, "launcher-d", "vm1.net");
    assert_eq!(
        add(&store, &ipam, "launcher-d", "c-launcher-d")
            .await
            .unwrap(),
        ["10.0.2.3/29", "fd00:2::3/125"]
    );
}

#[tokio::test]
async fn a_claim_reports_why_it_got_no_address() {
    let store = MemoryStore::new();
    let ipam = json!({"type": "whereabouts", "range": "10.0.3.0/30", "allowPersistentIPs": true});
    for i in 0..2 {
        store.put_pod_facts(
            &format!("ns/p{i}"),
            PodFacts {
                uid: format!("u-c{i}"),
                ..Default::default()
            },
        );
        add(&store, &ipam, &format!("p{i}"), &format!("c{i}"))
            .await
            .unwrap();
    }
    store.put_ipam_claim(claim("vm2.net"));
    vm_pod(&store, "launcher", "vm2.net");
    let e = add(&store, &ipam, "launcher", "c-launcher")
        .await
        .unwrap_err();
    assert_eq!(e.code, Code::Exhausted);
    let status = store.ipam_claim("ns/vm2.net").unwrap().status.unwrap();
    assert!(status.ips.is_empty());
    assert_eq!(status.conditions[0].reason, "SubnetExhausted");
    assert_eq!(status.conditions[0].status, "False");
    // A claim whose recorded address another pod holds is a conflict, named.
    let mut taken = claim("vm3.net");
    taken.status = Some(whereabouts::crd::IPAMClaimStatus {
        ips: vec!["10.0.3.1/30".into()],
        ..Default::default()
    });
    store.put_ipam_claim(taken);
    vm_pod(&store, "launcher3", "vm3.net");
    let e = add(&store, &ipam, "launcher3", "c-launcher3")
        .await
        .unwrap_err();
    assert_eq!(e.code, Code::AddressUnavailable);
    assert!(
        e.msg
            .starts_with("requested address 10.0.3.1 is held by pod ns/p0"),
        "{}",
        e.msg
    );
    assert_eq!(
        claim_ips(&store, "ns/vm3.net"),
        ["10.0.3.1/30"],
        "the claim's addresses are not rewritten"
    );
    assert_eq!(
        store
            .ipam_claim("ns/vm3.net")
            .unwrap()
            .status
            .unwrap()
            .conditions[0]
            .reason,
        "IPAddressConflict"
    );
    // A reference to a claim that does not exist is an error to retry.
    vm_pod(&store, "launcher4", "missing.net");
    let e = add(&store, &ipam, "launcher4", "c-launcher4")
        .await
        .unwrap_err();
    assert_eq!(e.code, Code::TryAgainLater);
    assert!(e.msg.contains("IPAMClaim ns/missing.net"), "{}", e.msg);
}

/// One step of the property below: a pod requesting an offset of the /27, or a dynamic ADD.
#[derive(Debug, Clone)]
enum Op {
    Request(u8),
    Dynamic,
    /// DEL of the n-th pod added so far (if any).
    Del(usize),
}

fn op() -> impl proptest::strategy::Strategy<Value = Op> {
    use proptest::prelude::*;
    prop_oneof![
        (1u8..31).prop_map(Op::Request),
        Just(Op::Dynamic),
        (0usize..40).prop_map(Op::Del),
    ]
}

proptest::proptest! {
    #![proptest_config(proptest::prelude::ProptestConfig::with_cases(64))]

    /// Against a model of who holds what: a requested address is never given to a dynamic ADD,
    /// a dynamic ADD still gets the lowest address nobody holds, a request for a held address is
    /// refused and takes nothing.
    #[test]
    fn requested_and_dynamic_addresses_never_meet(
        ops in proptest::collection::vec(op(), 1..40),
        overlapping in proptest::bool::ANY,
    ) {
        let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
        rt.block_on(async {
            let store = MemoryStore::new();
            let ipam = json!({"type": "whereabouts", "range": "10.0.4.0/27", "enable_overlapping_ranges": overlapping});
            // Model: offset -> pod, and the pods added in order.
            let mut held: std::collections::BTreeMap<u8, String> = Default::default();
            let mut pods: Vec<(String, Option<u8>)> = Vec::new();
            for (i, op) in ops.into_iter().enumerate() {
                let pod = format!("p{i}");
                match op {
                    Op::Request(o) => {
                        let got = add_with(&store, &ipam, ips(&[&format!("10.0.4.{o}")]), &pod, &pod).await;
                        if let Some(holder) = held.get(&o) {
                            let e = got.unwrap_err();
                            assert_eq!(e.code, Code::AddressUnavailable);
                            assert!(e.msg.contains(&format!("held by pod ns/{holder}")), "{}", e.msg);
                        } else {
                            assert_eq!(got.unwrap(), [format!("10.0.4.{o}/27")]);
                            held.insert(o, pod.clone());
                            pods.push((pod, Some(o)));
                        }
                    }
                    Op::Dynamic => {
                        let lowest = (1u8..31).find(|o| !held.contains_key(o));
                        let got = add(&store, &ipam, &pod, &pod).await;
                        match lowest {
                            Some(o) => {
                                assert_eq!(got.unwrap(), [format!("10.0.4.{o}/27")]);
                                held.insert(o, pod.clone());
                                pods.push((pod, Some(o)));
                            }
                            None => assert_eq!(got.unwrap_err().code, Code::Exhausted),
                        }
                    }
                    Op::Del(n) => {
                        if let Some((pod, Some(o))) = pods.get(n).cloned() {
                            del(&store, &ipam, &pod, &pod).await;
                            held.remove(&o);
                            pods[n].1 = None;
                        }
                    }
                }
            }
            let pool = store.get_pool("10.0.4.0-27").await.unwrap().unwrap_or_default();
            let stored: std::collections::BTreeMap<u8, String> = pool
                .allocations
                .iter()
                .map(|(o, e)| (*o as u8, e.podref.trim_start_matches("ns/").to_owned()))
                .collect();
            assert_eq!(stored, held);
            if overlapping {
                assert_eq!(store.reservation_names().len(), held.len(), "one reservation per address");
            }
        });
    }
}

/// Requested and dynamic ADDs at once, interleaved request by request: every ADD gets a distinct
/// address, every request its own, and the pool and reservations agree.
#[tokio::test]
async fn concurrent_requested_and_dynamic_adds_never_share_an_address() {
    let store = std::sync::Arc::new(MemoryStore::new().interleaved());
    let ipam = json!({"type": "whereabouts", "range": "10.0.5.0/26"});
    let mut tasks = Vec::new();
    for i in 0..40u32 {
        let (store, ipam) = (store.clone(), ipam.clone());
        tasks.push(tokio::spawn(async move {
            let pod = format!("p{i}");
            // Every fourth pod asks for .(i+1): the lowest addresses, which dynamic ADDs want too.
            let wanted = (i % 4 == 0).then(|| format!("10.0.5.{}", i / 4 + 1));
            let extra = wanted.as_deref().map_or(json!({}), |w| ips(&[w]));
            let got = add_with(&store, &ipam, extra, &pod, &pod).await;
            (wanted, got)
        }));
    }
    let (mut seen, mut refused) = (std::collections::BTreeMap::new(), Vec::new());
    for (i, t) in tasks.into_iter().enumerate() {
        let (wanted, got) = t.await.unwrap();
        match (wanted, got) {
            (_, Ok(got)) => assert!(
                seen.insert(got[0].clone(), i).is_none(),
                "{} handed out twice",
                got[0]
            ),
            // A dynamic ADD may take a requested address before its request comes: the request is
            // refused, naming who holds it, and takes nothing.
            (Some(w), Err(e)) if e.code == Code::AddressUnavailable => refused.push((w, e.msg)),
            (w, Err(e)) => panic!("{w:?}: {}", e.msg),
        }
    }
    let pool = store.get_pool("10.0.5.0-26").await.unwrap().unwrap();
    assert_eq!(pool.allocations.len(), seen.len());
    assert_eq!(store.reservation_names().len(), seen.len());
    for (w, msg) in refused {
        let holder = seen[&format!("{w}/26")];
        assert!(msg.contains(&format!("held by pod ns/p{holder} ")), "{msg}");
    }
}

#[tokio::test]
async fn the_plugin_refuses_addresses_that_stay_in_node_slices() {
    let store = MemoryStore::new();
    let ipam = json!({"type": "whereabouts", "range": "10.0.0.0/16", "node_slice_size": "/24", "sticky_statefulset": true});
    let e = add(&store, &ipam, "web-0", "c0").await.unwrap_err();
    assert_eq!(e.code, Code::InvalidConfig);
    assert!(e.msg.starts_with("invalid whereabouts config: ipam.sticky_statefulset cannot be combined with node_slice_size"), "{}", e.msg);
}

#[tokio::test]
async fn a_claims_stray_entry_is_let_go_and_its_recorded_addresses_taken() {
    let store = MemoryStore::new();
    let ipam = json!({"type": "whereabouts", "range": "10.0.6.0/28", "allowPersistentIPs": true});
    // An ADD that lost the race to record the claim's first address left an entry at .1; the
    // claim records .2, written with another prefix length.
    let stray = whereabouts::crd::IPAllocation {
        id: "c-loser".into(),
        podref: "ns/launcher-x".into(),
        ifname: "net1".into(),
        ipamclaimref: "ns/vm5.net".into(),
        ..Default::default()
    };
    store.put_entry("10.0.6.0-28", "10.0.6.0/28", 1, stray);
    let mut c = claim("vm5.net");
    c.status = Some(whereabouts::crd::IPAMClaimStatus {
        ips: vec!["10.0.6.2/24".into()],
        ..Default::default()
    });
    store.put_ipam_claim(c);
    vm_pod(&store, "launcher-y", "vm5.net");
    assert_eq!(
        add(&store, &ipam, "launcher-y", "c-launcher-y")
            .await
            .unwrap(),
        ["10.0.6.2/28"]
    );
    let pool = store.get_pool("10.0.6.0-28").await.unwrap().unwrap();
    assert_eq!(
        pool.allocations.keys().copied().collect::<Vec<_>>(),
        [2],
        "the stray is gone"
    );
    // The status is rewritten in the result's form; the address stays the same.
    assert_eq!(claim_ips(&store, "ns/vm5.net"), ["10.0.6.2/28"]);
}

#[tokio::test]
async fn a_claim_for_another_interface_or_network_is_refused_by_name() {
    let store = MemoryStore::new();
    let ipam = json!({"type": "whereabouts", "range": "10.0.7.0/28", "allowPersistentIPs": true});
    let mut c = claim("vm6.net");
    c.spec.interface = "net2".into();
    store.put_ipam_claim(c);
    vm_pod(&store, "launcher", "vm6.net");
    let e = add(&store, &ipam, "launcher", "c-launcher")
        .await
        .unwrap_err();
    assert_eq!(e.code, Code::InvalidConfig);
    assert_eq!(
        e.msg,
        "IPAMClaim ns/vm6.net is for network \"net\" interface \"net2\", but this ADD is for network \"net\" interface \"net1\""
    );
    assert!(
        store
            .get_pool("10.0.7.0-28")
            .await
            .unwrap()
            .is_none_or(|p| p.allocations.is_empty())
    );
}

#[tokio::test]
async fn a_sticky_pod_whose_request_changed_moves_to_the_new_address() {
    let store = MemoryStore::new();
    let ipam = sticky();
    statefulset_pod(&store, "web-0", "u-c0");
    assert_eq!(
        add_with(&store, &ipam, ips(&["10.0.1.3"]), "web-0", "c0")
            .await
            .unwrap(),
        ["10.0.1.3/29"]
    );
    del(&store, &ipam, "web-0", "c0").await;
    statefulset_pod(&store, "web-0", "u-c1");
    assert_eq!(
        add_with(&store, &ipam, ips(&["10.0.1.5"]), "web-0", "c1")
            .await
            .unwrap(),
        ["10.0.1.5/29"]
    );
    let pool = store.get_pool("10.0.1.0-29").await.unwrap().unwrap();
    assert_eq!(pool.allocations.keys().copied().collect::<Vec<_>>(), [5]);
    assert_eq!(store.reservation_names(), ["10.0.1.5"]);
}

#[tokio::test]
async fn a_bad_ips_value_does_not_stop_del() {
    let store = MemoryStore::new();
    let ipam = small();
    add(&store, &ipam, "p", "c").await.unwrap();
    let bad = json!({"runtimeConfig": {"ips": ["not-an-address"]}});
    let req = request(Command::Del, &ipam, bad, "p", "c").unwrap();
    whereabouts::cni::handle(&store, &req).await.unwrap();
    assert!(
        store
            .get_pool("10.0.0.0-29")
            .await
            .unwrap()
            .unwrap()
            .allocations
            .is_empty()
    );
}

/// Issue 25: an IPAMClaim deleted while its pod object still exists. The entry stays while the
/// pod runs (the operator keeps it: a pod of the claim exists); the DEL of that pod's sandbox,
/// the last to hold it, frees it. It stayed for good ("held"). A DEL with the claim still there
/// keeps it, as before.
#[tokio::test]
async fn the_last_del_after_its_claim_is_deleted_frees_the_address() {
    let store = MemoryStore::new();
    let ipam = persistent();
    let on = json!({"allowPersistentIPs": true});
    store.put_ipam_claim(claim("vm1.net"));
    vm_pod(&store, "launcher-a", "vm1.net");
    add_with(&store, &ipam, on.clone(), "launcher-a", "c-launcher-a")
        .await
        .unwrap();
    let del_on = |pod: &'static str, c: &'static str| {
        let req = request(Command::Del, &ipam, on.clone(), pod, c).unwrap();
        let store = &store;
        async move { whereabouts::cni::handle(store, &req).await.unwrap() }
    };
    let entries = |pool: &'static str| {
        let store = &store;
        async move {
            store
                .get_pool(pool)
                .await
                .unwrap()
                .unwrap()
                .allocations
                .len()
        }
    };
    del_on("launcher-a", "c-launcher-a").await;
    assert_eq!(
        entries("10.0.2.0-29").await,
        1,
        "a live claim keeps its address"
    );
    vm_pod(&store, "launcher-b", "vm1.net");
    add_with(&store, &ipam, on.clone(), "launcher-b", "c-launcher-b")
        .await
        .unwrap();
    store.delete_ipam_claim("ns/vm1.net");
    del_on("launcher-b", "c-launcher-b").await;
    assert_eq!(entries("10.0.2.0-29").await, 0);
    assert_eq!(entries("fd00-2---125").await, 0);
    assert!(
        store.reservation_names().is_empty(),
        "{:?}",
        store.reservation_names()
    );
}
