//! Node slices in the CNI handlers, over the in-memory store: each node allocates from its own
//! slices, a full slice takes a free one, nothing is handed out twice.

use std::collections::{BTreeSet, HashMap};
use std::sync::Arc;

use serde_json::{Value, json};
use whereabouts::cni::protocol::{CniError, Code, Command};
use whereabouts::cni::{FlatSource, Invocation, Request};
use whereabouts::crd::{
    NodeSliceAllocation, NodeSlicePool, NodeSlicePoolSpec, NodeSlicePoolStatus,
};
use whereabouts::store::Datastore;
use whereabouts::store::memory::MemoryStore;

mod cni_support;
use cni_support::{addresses, handle};

fn request(
    command: Command,
    ipam: &Value,
    node: &str,
    container: &str,
) -> Result<Request, CniError> {
    let conf = json!({"cniVersion": "1.0.0", "name": "net", "type": "macvlan", "ipam": ipam});
    let vars: HashMap<&str, String> = HashMap::from([
        ("CNI_CONTAINERID", container.to_owned()),
        ("CNI_IFNAME", "net1".to_owned()),
        (
            "CNI_ARGS",
            format!("K8S_POD_NAMESPACE=ns;K8S_POD_NAME=pod-{container};K8S_POD_UID=u-{container}"),
        ),
        ("NODENAME", node.to_owned()),
    ]);
    let env = move |k: &str| vars.get(k).cloned();
    Invocation::read(&env, &conf.to_string(), FlatSource::Paths(vec![])).load(command)
}

async fn add(
    store: &MemoryStore,
    ipam: &Value,
    node: &str,
    c: &str,
) -> Result<Vec<String>, CniError> {
    let req = request(Command::Add, ipam, node, c)?;
    Ok(addresses(&handle(store, &req).await?.unwrap()))
}

async fn del(store: &MemoryStore, ipam: &Value, node: &str, c: &str) -> Result<(), CniError> {
    let req = request(Command::Del, ipam, node, c)?;
    whereabouts::cni::handle(store, &req).await.map(|_| ())
}

/// A NodeSlicePool as the operator (or upstream's controller) writes it.
fn slice_pool(name: &str, range: &str, size: &str, slices: &[(&str, &str)]) -> NodeSlicePool {
    let mut p = NodeSlicePool::new(
        name,
        NodeSlicePoolSpec {
            range: range.into(),
            slice_size: size.into(),
        },
    );
    p.status = Some(NodeSlicePoolStatus {
        allocations: slices
            .iter()
            .map(|(slice, node)| NodeSliceAllocation {
                node_name: (*node).into(),
                slice_range: (*slice).into(),
            })
            .collect(),
    });
    p
}

fn v4() -> Value {
    json!({"type": "whereabouts", "range": "10.0.0.0/24", "node_slice_size": "/26", "network_name": "blue"})
}

fn four_slices(a: &str, b: &str) -> NodeSlicePool {
    slice_pool(
        "blue",
        "10.0.0.0/24",
        "/26",
        &[
            ("10.0.0.0/26", a),
            ("10.0.0.64/26", b),
            ("10.0.0.128/26", ""),
            ("10.0.0.192/26", ""),
        ],
    )
}

#[tokio::test]
async fn each_node_allocates_from_its_slice_with_the_whole_prefix() {
    let store = MemoryStore::new();
    store.put_node_slice_pool(four_slices("node-a", "node-b"));
    assert_eq!(
        add(&store, &v4(), "node-a", "c1").await.unwrap(),
        ["10.0.0.1/24"]
    );
    assert_eq!(
        add(&store, &v4(), "node-b", "c2").await.unwrap(),
        ["10.0.0.65/24"]
    );
    assert_eq!(
        add(&store, &v4(), "node-a", "c3").await.unwrap(),
        ["10.0.0.2/24"]
    );
    // Upstream's pool names and offsets: counted from the slice's network address.
    let a = store
        .get_pool("blue-node-a-10.0.0.0-26")
        .await
        .unwrap()
        .unwrap();
    assert_eq!(a.range, "10.0.0.0/26");
    assert_eq!(a.allocations.keys().copied().collect::<Vec<_>>(), [1, 2]);
    let b = store
        .get_pool("blue-node-b-10.0.0.64-26")
        .await
        .unwrap()
        .unwrap();
    assert_eq!(b.allocations.keys().copied().collect::<Vec<_>>(), [1]);
    assert!(store.get_pool("blue-10.0.0.0-24").await.unwrap().is_none());
    // Each slice pool says what it is: its network, its slice and its node.
    let labels = store.pool_labels("blue-node-b-10.0.0.64-26").unwrap();
    let want = [
        ("whereabouts.cni.cncf.io/network", "blue"),
        ("whereabouts.cni.cncf.io/node", "node-b"),
        ("whereabouts.cni.cncf.io/range", "10.0.0.64-26"),
    ];
    assert_eq!(
        labels,
        want.map(|(k, v)| (k.to_owned(), v.to_owned())).into()
    );
    // The reservations keep their upstream names (the network's, not the slice pool's).
    assert!(
        store
            .get_reservation("blue-10.0.0.65")
            .await
            .unwrap()
            .is_some()
    );
    del(&store, &v4(), "node-b", "c2").await.unwrap();
    let b = store
        .get_pool("blue-node-b-10.0.0.64-26")
        .await
        .unwrap()
        .unwrap();
    assert!(b.allocations.is_empty());
    assert!(
        store
            .get_reservation("blue-10.0.0.65")
            .await
            .unwrap()
            .is_none()
    );
}

#[tokio::test]
async fn dual_stack_slices_every_range_and_honours_excludes() {
    let store = MemoryStore::new();
    let ipam = json!({
        "type": "whereabouts",
        "network_name": "ds",
        "node_slice_size": "/26",
        "ipRanges": [
            {"range": "10.1.0.0/24", "exclude": ["10.1.0.64/30"]},
            {"range": "fd00:1::/120", "node_slice_size": "/122", "range_start": "fd00:1::30"}
        ]
    });
    store.put_node_slice_pool(slice_pool(
        "ds",
        "10.1.0.0/24",
        "/26",
        &[("10.1.0.0/26", "n1"), ("10.1.0.64/26", "n2")],
    ));
    store.put_node_slice_pool(slice_pool(
        "ds-fd00-1---120",
        "fd00:1::/120",
        "/122",
        &[("fd00:1::/122", "n2"), ("fd00:1::40/122", "n1")],
    ));
    assert_eq!(
        add(&store, &ipam, "n1", "a").await.unwrap(),
        ["10.1.0.1/24", "fd00:1::41/120"]
    );
    assert_eq!(
        add(&store, &ipam, "n2", "b").await.unwrap(),
        ["10.1.0.68/24", "fd00:1::30/120"],
        "the exclude holds inside n2's slice"
    );
}

#[tokio::test]
async fn a_full_slice_takes_a_free_one_and_the_last_one_fails_clearly() {
    let store = MemoryStore::new();
    let ipam = json!({"type": "whereabouts", "range": "10.2.0.0/28", "node_slice_size": "30"});
    store.put_node_slice_pool(slice_pool(
        "net",
        "10.2.0.0/28",
        "30",
        &[
            ("10.2.0.0/30", "n1"),
            ("10.2.0.4/30", "n2"),
            ("10.2.0.8/30", ""),
            ("10.2.0.12/30", ""),
        ],
    ));
    // A /30 slice gives two addresses: its first and last are not handed out.
    let mut got = Vec::new();
    for c in 0..6 {
        got.extend(add(&store, &ipam, "n1", &format!("c{c}")).await.unwrap());
    }
    assert_eq!(
        got,
        [
            "10.2.0.1/28",
            "10.2.0.2/28",
            "10.2.0.9/28",
            "10.2.0.10/28",
            "10.2.0.13/28",
            "10.2.0.14/28"
        ]
    );
    let pool = store.node_slice_pool("net").unwrap();
    let owners: Vec<&str> = pool
        .status
        .as_ref()
        .unwrap()
        .allocations
        .iter()
        .map(|a| a.node_name.as_str())
        .collect();
    assert_eq!(owners, ["n1", "n2", "n1", "n1"]);
    let e = add(&store, &ipam, "n1", "c9").await.unwrap_err();
    assert_eq!(e.code, Code::Exhausted);
    assert!(
        e.msg.contains("3 slice(s) of 30 are full") && e.msg.contains("nodeslicepool net"),
        "{}",
        e.msg
    );
    // DEL finds the address in whichever slice holds it.
    del(&store, &ipam, "n1", "c4").await.unwrap();
    del(&store, &ipam, "n1", "c1").await.unwrap();
    assert_eq!(
        add(&store, &ipam, "n1", "c10").await.unwrap(),
        ["10.2.0.2/28"]
    );
    assert_eq!(
        add(&store, &ipam, "n1", "c11").await.unwrap(),
        ["10.2.0.13/28"]
    );
}

#[tokio::test]
async fn nodes_racing_for_free_slices_never_share_one() {
    let store = Arc::new(MemoryStore::new().interleaved());
    let ipam = json!({"type": "whereabouts", "range": "10.3.0.0/24", "node_slice_size": "/28"});
    let allocations: Vec<(String, &str)> = (0..16)
        .map(|i| (format!("10.3.0.{}/28", i * 16), ""))
        .collect();
    let slices: Vec<(&str, &str)> = allocations.iter().map(|(s, n)| (s.as_str(), *n)).collect();
    let mut pool = slice_pool("net", "10.3.0.0/24", "/28", &slices);
    for (i, a) in pool
        .status
        .as_mut()
        .unwrap()
        .allocations
        .iter_mut()
        .take(4)
        .enumerate()
    {
        a.node_name = format!("n{i}");
    }
    store.put_node_slice_pool(pool);
    // 4 nodes x 40 ADDs: 14 addresses a slice, so each node needs three slices.
    let tasks: Vec<_> = (0..160)
        .map(|i| {
            let store = store.clone();
            let ipam = ipam.clone();
            tokio::spawn(async move {
                add(&store, &ipam, &format!("n{}", i % 4), &format!("c{i}")).await
            })
        })
        .collect();
    let mut seen = BTreeSet::new();
    for t in tasks {
        for ip in t.await.unwrap().unwrap() {
            assert!(seen.insert(ip.clone()), "{ip} handed out twice");
        }
    }
    let pool = store.node_slice_pool("net").unwrap();
    for node in ["n0", "n1", "n2", "n3"] {
        let held = pool
            .status
            .as_ref()
            .unwrap()
            .allocations
            .iter()
            .filter(|a| a.node_name == node)
            .count();
        assert_eq!(held, 3, "{node} holds three slices");
    }
}

#[tokio::test(start_paused = true)]
async fn a_node_without_a_slice_waits_then_says_so() {
    let store = MemoryStore::new();
    let e = add(&store, &v4(), "node-a", "c1").await.unwrap_err();
    assert_eq!(e.code, Code::TryAgainLater);
    assert!(
        e.msg.contains("no allocated node slice for node node-a")
            && e.msg.contains("does not exist"),
        "{}",
        e.msg
    );
    store.put_node_slice_pool(four_slices("node-x", "node-y"));
    let e = add(&store, &v4(), "node-a", "c1").await.unwrap_err();
    assert!(e.msg.contains("assigns it no slice yet"), "{}", e.msg);
    // A DEL of such a node has nothing to release and succeeds.
    del(&store, &v4(), "node-a", "c1").await.unwrap();
    // A slice that arrives while the ADD waits is used.
    let store = Arc::new(store);
    let waiting = {
        let store = store.clone();
        tokio::spawn(async move { add(&store, &v4(), "node-a", "c2").await })
    };
    tokio::time::sleep(std::time::Duration::from_secs(3)).await;
    store.put_node_slice_pool(four_slices("node-x", "node-a"));
    assert_eq!(waiting.await.unwrap().unwrap(), ["10.0.0.65/24"]);
}

#[test]
fn the_node_name_must_be_usable_in_object_names() {
    let e = request(Command::Add, &v4(), "Node_A", "c").unwrap_err();
    assert_eq!(e.code, Code::InvalidEnv);
    assert!(e.msg.contains("\"Node_A\" (from NODENAME)"), "{}", e.msg);
    // Not read at all without slices.
    let plain = json!({"type": "whereabouts", "range": "10.0.0.0/24"});
    assert!(
        request(Command::Add, &plain, "Node_A", "c")
            .unwrap()
            .node
            .is_none()
    );
}

#[tokio::test]
async fn check_finds_the_entry_in_whichever_slice_holds_it_and_names_that_pool() {
    let store = MemoryStore::new();
    let ipam = json!({"type": "whereabouts", "range": "10.2.0.0/28", "node_slice_size": "30"});
    store.put_node_slice_pool(slice_pool(
        "net",
        "10.2.0.0/28",
        "30",
        &[
            ("10.2.0.0/30", "n1"),
            ("10.2.0.4/30", ""),
            ("10.2.0.8/30", ""),
        ],
    ));
    for c in ["c0", "c1", "c2"] {
        add(&store, &ipam, "n1", c).await.unwrap();
    }
    let check = |prev: &str, c: &str| {
        let mut req = request(Command::Check, &ipam, "n1", c).unwrap();
        req.conf.value["prevResult"] = json!({"ips": [{"address": prev}]});
        req
    };
    // c2 got the second slice's first address.
    whereabouts::cni::handle(&store, &check("10.2.0.5/28", "c2"))
        .await
        .unwrap();
    let e = whereabouts::cni::handle(&store, &check("10.2.0.9/28", "c2"))
        .await
        .unwrap_err();
    assert_eq!(e.code, Code::CheckMismatch);
    assert!(
        e.msg
            .starts_with("pool n1-10.2.0.4-30 holds 10.2.0.5 for this attachment"),
        "{}",
        e.msg
    );
    let e = whereabouts::cni::handle(&store, &check("10.2.0.5/28", "c9"))
        .await
        .unwrap_err();
    assert!(
        e.msg
            .starts_with("pool n1-10.2.0.0-30, n1-10.2.0.4-30 holds no address for container c9"),
        "{}",
        e.msg
    );
}
