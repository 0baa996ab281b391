//! The operator process against the real control plane: pod cleanup, audit, NAD reconciliation,
//! leader election.

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use serde_json::json;

use crate::harness::{Ns, OperatorProcess, eventually};

const NS_ANNOTATION: &str = "k8s.v1.cni.cncf.io/network-status";

/// Flags for an operator whose pools live in `ns`, with a fast audit for tests.
fn flags(ns: &Ns, leader_election: bool) -> Vec<String> {
    vec![
        format!("--pool-namespace={}", ns.name),
        format!("--leader-election={leader_election}"),
        "--audit-interval=1s".into(),
        "--stale-grace=2s".into(),
        "--orphan-claim-age=2s".into(),
    ]
}

fn status_annotation(ns: &Ns, ips: &[&str]) -> BTreeMap<String, String> {
    let status = json!([{"name": "cluster-default", "interface": "eth0", "ips": ["10.244.0.9"], "default": true},
                        {"name": format!("{}/macvlan", ns.name), "interface": "net1", "ips": ips, "default": false}]);
    BTreeMap::from([(NS_ANNOTATION.to_owned(), status.to_string())])
}

pub(crate) fn dual(ns: &Ns) -> serde_json::Value {
    ns.netconf(
        "1.0.0",
        json!({"ipRanges": [{"range": "10.70.0.0/24"}, {"range": "fd00:70::/64"}]}),
    )
}

/// A pod that got addresses from our plugin, with the network-status Multus would write.
pub(crate) fn attached_pod(
    ns: &Ns,
    name: &str,
    conf: &serde_json::Value,
    annotate: bool,
) -> (String, Vec<String>) {
    let uid_placeholder = ns.create_pod(name, &BTreeMap::new());
    let addrs = ns
        .cni(
            "ADD",
            conf,
            &format!("c-{name}"),
            "net1",
            name,
            &uid_placeholder,
        )
        .addresses();
    if annotate {
        let ips: Vec<&str> = addrs.iter().map(|a| a.split('/').next().unwrap()).collect();
        let ann = status_annotation(ns, &ips);
        let (k, v) = ann.iter().next().unwrap();
        ns.kubectl_ok(&["annotate", "pod", name, &format!("{k}={v}")]);
    }
    (uid_placeholder, addrs)
}

pub(crate) fn entries(ns: &Ns) -> usize {
    ns.allocations("10.70.0.0-24").len() + ns.allocations("fd00-70---64").len()
}

#[test]
fn deleted_pods_are_released_within_two_seconds() {
    let ns = Ns::new("op-delete");
    let mut op = OperatorProcess::start(ns.dir.path(), "op", &flags(&ns, false));
    op.wait_ready();
    let conf = dual(&ns);
    attached_pod(&ns, "a", &conf, true);
    let (_, keep) = attached_pod(&ns, "b", &conf, true);
    assert_eq!(entries(&ns), 4);
    assert_eq!(ns.reservations().len(), 4);
    let deleted = Instant::now();
    ns.kubectl_ok(&["delete", "pod", "a", "--wait=false"]);
    assert!(
        eventually(10, || entries(&ns) == 2 && ns.reservations().len() == 2),
        "not released: {:?}\n{}",
        ns.allocations("10.70.0.0-24"),
        op.log()
    );
    let took = deleted.elapsed();
    assert!(took < Duration::from_secs(2), "released after {took:?}");
    let left = ns.allocations("10.70.0.0-24");
    assert_eq!(
        left.values().next().unwrap()["podref"],
        format!("{}/b", ns.name)
    );
    assert_eq!(
        format!("10.70.0.{}/24", left.keys().next().unwrap()),
        keep[0]
    );
    // Counted once the release, reservation delete included, has returned.
    let counted = |m: Option<String>| {
        m.is_some_and(|m| m.contains("whereabouts_releases_total{reason=\"pod_deleted\"} 2"))
    };
    assert!(
        eventually(10, || counted(op.get("/metrics"))),
        "{:?}",
        op.get("/metrics")
    );
    let events = ns.kubectl_ok(&[
        "get",
        "events",
        "--field-selector",
        "reason=AddressReleased",
        "-o",
        "jsonpath={.items[*].message}",
    ]);
    assert!(
        events.contains("released 10.70.0.1 (10.70.0.0-24), fd00:70::1 (fd00-70---64) (Deleted)"),
        "{events}"
    );
}

#[test]
fn a_statefulset_replacement_keeps_its_address() {
    let ns = Ns::new("op-sts");
    let mut op = OperatorProcess::start(ns.dir.path(), "op", &flags(&ns, false));
    op.wait_ready();
    let conf = ns.netconf("1.0.0", json!({"range": "10.71.0.0/24"}));
    let old_uid = ns.create_pod("web-0", &BTreeMap::new());
    let old = ns
        .cni("ADD", &conf, "c-old", "net1", "web-0", &old_uid)
        .addresses();
    // The replacement takes the name at once and is attached before the operator can act.
    ns.kubectl_ok(&["delete", "pod", "web-0", "--wait=false"]);
    let new_uid = ns.create_pod("web-0", &BTreeMap::new());
    assert_ne!(old_uid, new_uid);
    let new = ns
        .cni("ADD", &conf, "c-new", "net1", "web-0", &new_uid)
        .addresses();
    let new2 = ns
        .cni("ADD", &conf, "c-new", "net2", "web-0", &new_uid)
        .addresses();
    std::thread::sleep(Duration::from_secs(4)); // event path and two audits have run
    let pool = ns.allocations("10.71.0.0-24");
    let ours: Vec<_> = pool
        .values()
        .filter(|e| e["poduid"] == new_uid.as_str())
        .collect();
    assert_eq!(
        ours.len(),
        2,
        "the new pod's entries survive: {pool:?}\n{}",
        op.log()
    );
    assert_eq!(pool.len(), 2, "nothing of the old pod is left: {pool:?}");
    assert!(old == new || pool.len() == 2);
    assert_ne!(new, new2);
}

#[test]
fn pods_deleted_while_the_operator_was_down_are_released_after_it_starts() {
    let ns = Ns::new("op-down");
    let conf = dual(&ns);
    attached_pod(&ns, "gone", &conf, true);
    attached_pod(&ns, "alive", &conf, true);
    ns.kubectl_ok(&["delete", "pod", "gone"]);
    // An entry whose pod never existed (a DEL that never came), without a UID.
    ns.cni("ADD", &conf, "c-ghost", "net1", "ghost", "")
        .addresses();
    assert_eq!(entries(&ns), 6);
    let mut op = OperatorProcess::start(ns.dir.path(), "op", &flags(&ns, false));
    op.wait_ready();
    assert!(
        eventually(15, || entries(&ns) == 2),
        "{:?}\n{}",
        ns.allocations("10.70.0.0-24"),
        op.log()
    );
    assert!(
        eventually(5, || ns.reservations().len() == 2),
        "{:?}",
        ns.reservations()
    );
    // Counted once the release, reservation delete included, has returned.
    let counted = |m: Option<String>| {
        m.is_some_and(|m| m.contains("whereabouts_releases_total{reason=\"audit\"} 4"))
    };
    assert!(
        eventually(10, || counted(op.get("/metrics"))),
        "{:?}",
        op.get("/metrics")
    );
    assert!(eventually(5, || !op
        .get("/metrics")
        .unwrap()
        .contains("whereabouts_stale_reservations")
        || !op.get("/metrics").unwrap().lines().any(|l| l
            .starts_with("whereabouts_stale_reservations{")
            && !l.ends_with(" 0"))));
}

#[test]
fn a_force_deleted_pod_without_annotation_is_released() {
    let ns = Ns::new("op-force");
    let mut op = OperatorProcess::start(ns.dir.path(), "op", &flags(&ns, false));
    op.wait_ready();
    let conf = ns.netconf("1.0.0", json!({"range": "10.72.0.0/24"}));
    attached_pod(&ns, "f", &conf, false);
    ns.kubectl_ok(&["delete", "pod", "f", "--force", "--grace-period=0"]);
    assert!(
        eventually(10, || ns.allocations("10.72.0.0-24").is_empty()),
        "{}",
        op.log()
    );
    assert!(ns.reservations().is_empty());
}

/// A pool's writer turn left by a killed plugin is removed by the audit once it has stood still
/// for the grace period; other Leases are not touched.
#[test]
fn the_audit_removes_an_abandoned_writer_turn() {
    let ns = Ns::new("op-turn");
    let lease = |name: &str, labels: serde_json::Value| {
        json!({"apiVersion": "coordination.k8s.io/v1", "kind": "Lease",
               "metadata": {"name": name, "labels": labels},
               "spec": {"holderIdentity": "killed", "leaseDurationSeconds": 5}})
        .to_string()
    };
    for (name, labels) in [
        (
            "whereabouts-10.73.0.0-24",
            json!({"whereabouts.cni.cncf.io/writer-turn": "true"}),
        ),
        ("someone-elses", json!({})),
    ] {
        let out = ns.apply(&lease(name, labels));
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
    }
    let mut op = OperatorProcess::start(ns.dir.path(), "op", &flags(&ns, false));
    op.wait_ready();
    let gone = eventually(20, || {
        !ns.kubectl_ok(&["get", "leases", "-o", "name"])
            .contains("whereabouts-10.73.0.0-24")
    });
    assert!(gone, "{}", op.log());
    assert!(
        op.log().contains("abandoned by a killed plugin"),
        "{}",
        op.log()
    );
    let leases = ns.kubectl_ok(&["get", "leases", "-o", "name"]);
    assert!(leases.contains("someone-elses"), "{leases}");
}

#[test]
fn a_pod_on_a_foreign_network_causes_no_write_and_no_error() {
    let ns = Ns::new("op-foreign");
    let mut op = OperatorProcess::start(ns.dir.path(), "op", &flags(&ns, false));
    op.wait_ready();
    let conf = ns.netconf("1.0.0", json!({"range": "10.73.0.0/24"}));
    attached_pod(&ns, "mine", &conf, true);
    // The operator writes the pool's status once it counts the entry; from then on it is settled.
    assert!(eventually(20, || ns
        .get_json(&["ippool", "10.73.0.0-24"])
        .unwrap()["status"]["allocated"]
        == 1));
    let rv =
        ns.get_json(&["ippool", "10.73.0.0-24"]).unwrap()["metadata"]["resourceVersion"].clone();
    let hostlocal = BTreeMap::from([(NS_ANNOTATION.to_owned(), json!([{"name": format!("{}/hostlocal", ns.name), "interface": "net1", "ips": ["10.73.0.1"]}]).to_string())]);
    ns.create_pod("foreign", &hostlocal);
    ns.kubectl_ok(&["delete", "pod", "foreign"]);
    std::thread::sleep(Duration::from_secs(3));
    assert_eq!(
        ns.get_json(&["ippool", "10.73.0.0-24"]).unwrap()["metadata"]["resourceVersion"],
        rv,
        "no write to the pool"
    );
    assert_eq!(ns.allocations("10.73.0.0-24").len(), 1);
    let log = op.log();
    assert!(
        !log.contains("ERROR") && !log.contains("release failed"),
        "{log}"
    );
}

#[test]
fn only_the_leader_writes_and_another_replica_takes_over() {
    let ns = Ns::new("op-leader");
    let mut a = OperatorProcess::start(ns.dir.path(), "replica-a", &flags(&ns, true));
    a.wait_ready();
    assert!(
        eventually(20, || a
            .get("/metrics")
            .unwrap()
            .contains("whereabouts_leader 1")),
        "{}",
        a.log()
    );
    // The standby audits once an hour: what it releases after the takeover, its kept jobs do.
    let mut b_flags = flags(&ns, true);
    b_flags.retain(|f| !f.starts_with("--audit-interval"));
    b_flags.push("--audit-interval=1h".into());
    let mut b = OperatorProcess::start(ns.dir.path(), "replica-b", &b_flags);
    b.wait_ready();
    let lease = ns.get_json(&["lease", "whereabouts-operator"]).unwrap();
    assert_eq!(lease["spec"]["holderIdentity"], "replica-a");
    assert!(b.get("/metrics").unwrap().contains("whereabouts_leader 0"));
    let conf = ns.netconf("1.0.0", json!({"range": "10.74.0.0/24"}));
    attached_pod(&ns, "one", &conf, true);
    attached_pod(&ns, "two", &conf, true);
    ns.kubectl_ok(&["delete", "pod", "one"]);
    assert!(eventually(10, || ns.allocations("10.74.0.0-24").len() == 1));
    assert!(
        !b.log().contains("released"),
        "the follower wrote: {}",
        b.log()
    );
    a.kill();
    ns.kubectl_ok(&["delete", "pod", "two"]);
    // The Lease of a killed leader expires (15 s) before the follower takes over; it then runs
    // the release of the pod deleted meanwhile, whose event it kept while standing by.
    assert!(
        eventually(40, || ns.allocations("10.74.0.0-24").is_empty()),
        "{}",
        b.log()
    );
    assert_eq!(
        ns.get_json(&["lease", "whereabouts-operator"]).unwrap()["spec"]["holderIdentity"],
        "replica-b"
    );
}

#[test]
fn a_dual_stack_nad_creates_both_pools_and_deleting_it_removes_them() {
    let ns = Ns::new("op-nad");
    let mut op = OperatorProcess::start(ns.dir.path(), "op", &flags(&ns, false));
    op.wait_ready();
    let config = json!({"cniVersion": "1.0.0", "name": "dual", "type": "macvlan", "master": "eth0",
        "ipam": {"type": "whereabouts", "network_name": "e2e-nad", "ipRanges": [{"range": "10.75.0.0/24"}, {"range": "fd00:75::/64"}]}});
    let nad = format!(
        "apiVersion: k8s.cni.cncf.io/v1\nkind: NetworkAttachmentDefinition\nmetadata:\n  name: dual\n  namespace: {}\nspec:\n  config: '{}'\n",
        ns.name, config
    );
    let out = ns.apply(&nad);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let pools = ["e2e-nad-10.75.0.0-24", "e2e-nad-fd00-75---64"];
    assert!(
        eventually(10, || pools
            .iter()
            .all(|p| ns.get_json(&["ippool", p]).is_some())),
        "{}",
        op.log()
    );
    let pool = ns.get_json(&["ippool", pools[1]]).unwrap();
    assert_eq!(pool["spec"]["range"], "fd00:75::/64");
    assert_eq!(
        pool["metadata"]["annotations"]["whereabouts.cni.cncf.io/networks"],
        format!("{}/dual", ns.name)
    );
    // The pool says what it is: nobody parses its name.
    let labels = &pool["metadata"]["labels"];
    assert_eq!(labels["whereabouts.cni.cncf.io/network"], "e2e-nad");
    assert_eq!(labels["whereabouts.cni.cncf.io/range"], "fd00-75---64");
    ns.kubectl_ok(&["delete", "network-attachment-definition", "dual"]);
    assert!(
        eventually(40, || pools
            .iter()
            .all(|p| ns.get_json(&["ippool", p]).is_none())),
        "{}",
        op.log()
    );
}

/// A Node object with a Ready condition of `status`, deleted when dropped (no kubelet runs it:
/// this control plane has none).
struct FakeNode {
    name: String,
}

impl FakeNode {
    fn new(ns: &Ns, ready: &str) -> FakeNode {
        let name = format!("fake-{}", ns.name);
        let node = json!({"apiVersion": "v1", "kind": "Node", "metadata": {"name": name}});
        ns.kubectl_ok_stdin(&["create", "-f", "-"], &node.to_string());
        let n = FakeNode { name };
        n.set_ready(ns, ready);
        n
    }

    fn set_ready(&self, ns: &Ns, status: &str) {
        let now = "2026-01-01T00:00:00Z";
        let patch = json!({"status": {"conditions": [{"type": "Ready", "status": status, "reason": "Test",
            "lastHeartbeatTime": now, "lastTransitionTime": now}]}});
        ns.kubectl_ok(&[
            "patch",
            "node",
            &self.name,
            "--subresource=status",
            "--type=merge",
            "-p",
            &patch.to_string(),
        ]);
    }
}

impl Drop for FakeNode {
    fn drop(&mut self) {
        let _ = crate::harness::kubectl_raw(
            crate::harness::admin_kubeconfig(),
            &["delete", "node", &self.name, "--wait=false"],
            None,
        );
    }
}

/// Issue 25: a drain (the Eviction API, which `kubectl drain` and the cluster autoscaler call)
/// starts a graceful termination: the API server marks the pod `DisruptionTarget:
/// EvictionByEvictionAPI` and its containers run on for its grace period. Its address stays
/// with it (it was freed 0.1 s after the eviction, for the replacement to take). Only once its
/// node is lost and the taint manager evicts it is it freed.
#[test]
fn a_drained_pod_keeps_its_address_until_its_node_is_lost() {
    let ns = Ns::new("op-drain");
    let node = FakeNode::new(&ns, "True");
    let mut op = OperatorProcess::start(ns.dir.path(), "op", &flags(&ns, false));
    op.wait_ready();
    let pod = json!({"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "drained", "namespace": ns.name},
        "spec": {"nodeName": node.name, "terminationGracePeriodSeconds": 600, "automountServiceAccountToken": false,
                 "containers": [{"name": "c", "image": "registry.invalid/pause"}]}});
    let uid = ns.kubectl_ok_stdin(
        &["create", "-f", "-", "-o", "jsonpath={.metadata.uid}"],
        &pod.to_string(),
    );
    let conf = ns.netconf("1.0.0", json!({"range": "10.73.0.0/24"}));
    let addrs = ns
        .cni("ADD", &conf, "c-drained", "net1", "drained", &uid)
        .addresses();
    assert_eq!(addrs, ["10.73.0.1/24"]);
    let eviction = json!({"apiVersion": "policy/v1", "kind": "Eviction",
        "metadata": {"name": "drained", "namespace": ns.name}});
    ns.kubectl_ok_stdin(
        &[
            "create",
            "--raw",
            &format!("/api/v1/namespaces/{}/pods/drained/eviction", ns.name),
            "-f",
            "-",
        ],
        &eviction.to_string(),
    );
    let marked = |reason: &str| {
        let p = ns.get_json(&["pod", "drained"]).unwrap();
        p["metadata"]["deletionTimestamp"].is_string()
            && p["status"]["conditions"]
                .as_array()
                .into_iter()
                .flatten()
                .any(|c| {
                    c["type"] == "DisruptionTarget"
                        && c["status"] == "True"
                        && c["reason"] == reason
                })
    };
    assert!(
        eventually(10, || marked("EvictionByEvictionAPI")),
        "{:#}",
        ns.get_json(&["pod", "drained"]).unwrap()
    );
    // Terminating, its containers running on: the address stays through audits and the replacement
    // takes another.
    std::thread::sleep(Duration::from_secs(5));
    assert_eq!(
        ns.allocations("10.73.0.0-24").len(),
        1,
        "freed during a graceful termination\n{}",
        op.log()
    );
    let replacement = ns.create_pod("replacement", &BTreeMap::new());
    let addrs = ns
        .cni(
            "ADD",
            &conf,
            "c-replacement",
            "net1",
            "replacement",
            &replacement,
        )
        .addresses();
    assert_eq!(addrs, ["10.73.0.2/24"]);
    // The node is lost and the taint manager evicts the pod (as the node lifecycle controller
    // does after the unreachable taint's toleration): now it is freed, and the replacement keeps
    // its own.
    node.set_ready(&ns, "Unknown");
    let cond = json!({"status": {"conditions": [{"type": "DisruptionTarget", "status": "True",
        "reason": "DeletionByTaintManager", "message": "Taint manager: deleting due to NoExecute taint",
        "lastTransitionTime": "2026-01-01T00:00:00Z"}]}});
    ns.kubectl_ok(&[
        "patch",
        "pod",
        "drained",
        "--subresource=status",
        "--type=strategic",
        "-p",
        &cond.to_string(),
    ]);
    assert!(
        eventually(15, || ns.allocations("10.73.0.0-24").len() == 1
            && ns.allocations("10.73.0.0-24").contains_key("2")),
        "{:?}\n{}",
        ns.allocations("10.73.0.0-24"),
        op.log()
    );
    let _ = ns.kubectl(
        &["delete", "pod", "drained", "--force", "--grace-period=0"],
        None,
    );
}

/// Issue 25: the kubelet passes a static pod's own UID (its config hash) as `K8S_POD_UID`, while
/// the mirror pod in the API has another UID and carries the hash in `kubernetes.io/config.mirror`.
/// Neither the audit nor CNI GC takes the running static pod's entry for a gone pod's (the audit
/// freed it after two audits, GC at once).
#[test]
fn a_static_pods_entry_stays_through_audits_and_gc() {
    let ns = Ns::new("op-static");
    let node = FakeNode::new(&ns, "True");
    let hash = "6f1c2a9e8d7b4c3a2f1e0d9c8b7a6f5e";
    let mirror = json!({"apiVersion": "v1", "kind": "Pod",
        "metadata": {"name": format!("etcd-{}", node.name), "namespace": ns.name,
                     "annotations": {"kubernetes.io/config.mirror": hash, "kubernetes.io/config.hash": hash}},
        "spec": {"nodeName": node.name, "automountServiceAccountToken": false,
                 "containers": [{"name": "c", "image": "registry.invalid/pause"}]}});
    let mirror_uid = ns.kubectl_ok_stdin(
        &["create", "-f", "-", "-o", "jsonpath={.metadata.uid}"],
        &mirror.to_string(),
    );
    assert_ne!(mirror_uid, hash);
    let name = format!("etcd-{}", node.name);
    let conf = ns.netconf("1.1.0", json!({"range": "10.74.0.0/24"}));
    let addrs = ns
        .cni("ADD", &conf, "c-static", "net1", &name, hash)
        .addresses();
    assert_eq!(addrs, ["10.74.0.1/24"]);
    // CNI GC with no valid attachment on this runtime's list: the static pod lives, so it stays.
    let mut gc = conf.clone();
    gc["cni.dev/valid-attachments"] = json!([]);
    let r = ns.cni("GC", &gc, "", "", "", "");
    assert!(r.ok, "{r:?}");
    assert_eq!(
        ns.allocations("10.74.0.0-24").len(),
        1,
        "GC freed a static pod's entry"
    );
    // Audits every second with a 2 s grace: several pass, the entry stays.
    let mut op = OperatorProcess::start(ns.dir.path(), "op", &flags(&ns, false));
    op.wait_ready();
    std::thread::sleep(Duration::from_secs(6));
    assert_eq!(
        ns.allocations("10.74.0.0-24").len(),
        1,
        "the audit freed a running static pod's entry\n{}",
        op.log()
    );
    // The static pod gone (its mirror with it): the audit frees the entry.
    ns.kubectl_ok(&["delete", "pod", &name, "--force", "--grace-period=0"]);
    assert!(
        eventually(20, || ns.allocations("10.74.0.0-24").is_empty()),
        "{}",
        op.log()
    );
}

/// A pod bound to `node` that got an address from our plugin; returns its UID.
fn bound_pod(ns: &Ns, name: &str, node: &FakeNode, conf: &serde_json::Value) -> String {
    let pod = json!({"apiVersion": "v1", "kind": "Pod", "metadata": {"name": name, "namespace": ns.name},
        "spec": {"nodeName": node.name, "automountServiceAccountToken": false,
                 "containers": [{"name": "c", "image": "registry.invalid/pause"}]}});
    let uid = ns.kubectl_ok_stdin(
        &["create", "-f", "-", "-o", "jsonpath={.metadata.uid}"],
        &pod.to_string(),
    );
    ns.cni("ADD", conf, &format!("c-{name}"), "net1", name, &uid)
        .addresses();
    uid
}

/// Issue 25: a force delete removes the pod object while its node's kubelet is still stopping
/// the containers. The address is left to the kubelet's DEL for `--deleted-pod-grace` on a Ready
/// node, and held while the node is NotReady (a partition: the container may run on), through
/// audits; freed once the grace passes, or the node is deleted. They were freed at once.
#[test]
fn a_force_deleted_pods_address_waits_for_its_nodes_kubelet() {
    let ns = Ns::new("op-forcewait");
    let ready = FakeNode::new(&ns, "True");
    let lost = FakeNode {
        name: format!("lost-{}", ns.name),
    };
    let node = json!({"apiVersion": "v1", "kind": "Node", "metadata": {"name": lost.name}});
    ns.kubectl_ok_stdin(&["create", "-f", "-"], &node.to_string());
    lost.set_ready(&ns, "Unknown");
    let mut flags = flags(&ns, false);
    flags.push("--deleted-pod-grace=4s".into());
    let mut op = OperatorProcess::start(ns.dir.path(), "op", &flags);
    op.wait_ready();
    let conf = ns.netconf("1.0.0", json!({"range": "10.75.0.0/24"}));
    bound_pod(&ns, "on-ready", &ready, &conf);
    bound_pod(&ns, "on-lost", &lost, &conf);
    assert_eq!(ns.allocations("10.75.0.0-24").len(), 2);
    let deleted = Instant::now();
    for pod in ["on-ready", "on-lost"] {
        ns.kubectl_ok(&["delete", "pod", pod, "--force", "--grace-period=0"]);
    }
    let podrefs = || -> Vec<String> {
        let mut p: Vec<String> = ns
            .allocations("10.75.0.0-24")
            .values()
            .map(|e| e["podref"].as_str().unwrap().to_owned())
            .collect();
        p.sort();
        p
    };
    std::thread::sleep(Duration::from_secs(2));
    assert_eq!(
        podrefs().len(),
        2,
        "freed within the kubelet's grace\n{}",
        op.log()
    );
    // At least: tests running meanwhile may force-delete pods of their own NotReady nodes that
    // hold addresses too (pods that hold none, like node_limits' token pods, are not counted).
    let waiting = |reason: &str, n: u32| {
        op.get("/metrics").is_some_and(|m| {
            let key = format!("whereabouts_releases_waiting{{reason=\"{reason}\"}} ");
            m.lines()
                .filter_map(|l| l.strip_prefix(&key)?.parse::<u32>().ok())
                .any(|v| v >= n)
        })
    };
    // Counted while they wait: the Ready node's pod only within its grace (a loaded machine may
    // be past it by now), the NotReady node's for as long as the node stays so.
    let within_grace = deleted.elapsed() < Duration::from_secs(3);
    assert!(
        (!within_grace || waiting("kubelet_grace", 1)) && waiting("node_not_ready", 1),
        "{:?}",
        op.get("/metrics")
    );
    // The Ready node's pod: freed once the grace has passed, its DEL not having come.
    assert!(
        eventually(15, || podrefs() == [format!("{}/on-lost", ns.name)]),
        "{:?}\n{}",
        podrefs(),
        op.log()
    );
    assert!(deleted.elapsed() >= Duration::from_secs(4));
    // The NotReady node's pod: held through audits (every second, 2 s grace), past the grace.
    std::thread::sleep(Duration::from_secs(5));
    assert_eq!(podrefs(), [format!("{}/on-lost", ns.name)], "{}", op.log());
    // The node deleted: nothing of the pod runs anywhere, its address is freed.
    drop(lost);
    assert!(eventually(30, || podrefs().is_empty()), "{}", op.log());
}

/// Issue 25: a pool the operator cannot read (its range does not parse) implies reservations it
/// cannot name, so while one is cached no reservation is swept as an orphan; once it is gone the
/// true orphan is (the sweep deleted reservations of such pools).
#[test]
fn no_orphan_is_swept_while_a_pool_cannot_be_read() {
    let ns = Ns::new("op-unreadable");
    let apply = |v: serde_json::Value| {
        ns.kubectl_ok_stdin(&["apply", "-f", "-"], &v.to_string());
    };
    apply(
        json!({"apiVersion": "whereabouts.cni.cncf.io/v1alpha1", "kind": "IPPool",
        "metadata": {"name": "broken-pool", "namespace": ns.name},
        "spec": {"range": "not-a-cidr", "allocations": {"5": {"id": "c-x", "podref": format!("{}/x", ns.name)}}}}),
    );
    apply(
        json!({"apiVersion": "whereabouts.cni.cncf.io/v1alpha1", "kind": "OverlappingRangeIPReservation",
        "metadata": {"name": "10.76.0.5", "namespace": ns.name},
        "spec": {"podref": format!("{}/x", ns.name), "containerid": "c-x", "ifname": "net1"}}),
    );
    let mut op = OperatorProcess::start(ns.dir.path(), "op", &flags(&ns, false));
    op.wait_ready();
    // Audits every second with a 2 s grace: several pass.
    std::thread::sleep(Duration::from_secs(6));
    assert_eq!(
        ns.reservations().len(),
        1,
        "swept beside an unreadable pool\n{}",
        op.log()
    );
    assert!(
        op.log().contains("pools that cannot be read"),
        "{}",
        op.log()
    );
    ns.kubectl_ok(&["delete", "ippool", "broken-pool"]);
    assert!(
        eventually(20, || ns.reservations().is_empty()),
        "the orphan stayed\n{}",
        op.log()
    );
}
