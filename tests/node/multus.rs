//! The path users take (issue 26): Multus is the node's CNI, pods select NADs with
//! `k8s.v1.cni.cncf.io/networks`, Multus runs macvlan, ipvlan or bridge with our IPAM and writes
//! `k8s.v1.cni.cncf.io/network-status`. Nothing here writes a network-status: Multus does.

use std::collections::{BTreeMap, BTreeSet};
use std::net::IpAddr;

use serde_json::{Value, json};

use crate::addresses::{logged, pooled};
use crate::cluster::{POOL_NAMESPACE, Workload, get_json, kubectl, node, wait_until};

/// A NetworkAttachmentDefinition `name` in the workload's namespace, whose config is `config`
/// (the CNI config as users write it: cniVersion and name added here).
pub fn nad(w: &Workload, name: &str, mut config: Value) {
    config["cniVersion"] = json!("1.0.0");
    config["name"] = json!(name);
    let doc = json!({"apiVersion": "k8s.cni.cncf.io/v1", "kind": "NetworkAttachmentDefinition",
        "metadata": {"name": name, "namespace": w.ns}, "spec": {"config": config.to_string()}});
    w.apply(&doc.to_string());
}

/// The macvlan config of a NAD on the node's portless macvlan master.
pub fn macvlan(ipam: Value) -> Value {
    json!({"type": "macvlan", "master": node().get("MACVLAN_MASTER"), "mode": "bridge", "ipam": ipam})
}

/// The bridge config of a NAD on the node's portless NAD bridge.
pub fn bridge(ipam: Value) -> Value {
    json!({"type": "bridge", "bridge": node().get("NAD_BRIDGE"), "ipam": ipam})
}

/// What a NAD pod runs: every address it holds (IPv4 and IPv6), then idles.
const NAD_POD_COMMAND: &str = "ip -o addr show; trap 'exit 0' TERM; while true; do sleep 1; done";

/// A bare pod `name` selecting `networks` (the annotation's value).
pub fn nad_pod(w: &Workload, name: &str, networks: &str) {
    let annotations = json!({"k8s.v1.cni.cncf.io/networks": networks}).to_string();
    w.apply(&format!(
        "apiVersion: v1\nkind: Pod\nmetadata:\n  name: {name}\n  labels: {{app: {name}}}\n  \
         annotations: {annotations}\nspec:\n{}\n",
        w.pod_spec_running(2, NAD_POD_COMMAND)
    ));
}

/// Interface -> (network name, addresses), from the network-status Multus wrote on the pod.
fn network_status(pod: &Value) -> BTreeMap<String, (String, BTreeSet<String>)> {
    let text = pod["metadata"]["annotations"]["k8s.v1.cni.cncf.io/network-status"]
        .as_str()
        .unwrap_or_else(|| panic!("no network-status on {}", pod["metadata"]["name"]));
    let list: Vec<Value> = serde_json::from_str(text).expect("network-status is JSON");
    list.iter()
        .map(|n| {
            let ips = n["ips"].as_array().into_iter().flatten();
            (
                n["interface"].as_str().unwrap_or_default().to_string(),
                (
                    n["name"].as_str().unwrap_or_default().to_string(),
                    ips.map(|i| i.as_str().unwrap().to_string()).collect(),
                ),
            )
        })
        .collect()
}

/// Waits until pod `name` runs, and returns it.
pub fn running(w: &Workload, name: &str) -> Value {
    w.wait_running(&format!("app={name}"), 1, 120).remove(0)
}

#[test]
fn a_pod_on_two_nads_holds_the_addresses_multus_reports_and_the_pools_record() {
    two_nads_agree(&Workload::new("multus"));
}

/// A pod `two-nads` of `w` on two NADs: what Multus reports on every interface is what the pod
/// holds and what the pools record (shared by the thin and thick modes' tests).
pub fn two_nads_agree(w: &Workload) {
    // Legacy `range` and dual-stack `ipRanges` on one macvlan interface; a bridge on a second
    // (this machine's kernel has no ipvlan).
    nad(
        w,
        "mv-net",
        macvlan(json!({"type": "whereabouts", "range": "10.91.0.0/24",
            "ipRanges": [{"range": "10.92.0.0/24"}, {"range": "fd00:92::/120"}]})),
    );
    nad(
        w,
        "br-net",
        bridge(json!({"type": "whereabouts", "range": "10.93.0.0/24"})),
    );
    nad_pod(w, "two-nads", "mv-net, br-net");
    let pod = running(w, "two-nads");

    let status = network_status(&pod);
    let seen = logged(w, "two-nads");
    let pools = pooled(&format!("{}/two-nads", w.ns));
    let mv = format!("{}/mv-net", w.ns);
    let br = format!("{}/br-net", w.ns);
    let by_name = |name: &str| {
        status
            .iter()
            .find(|(_, (n, _))| n == name)
            .unwrap_or_else(|| panic!("{name} not in network-status {status:?}"))
    };
    let (mv_if, (_, mv_ips)) = by_name(&mv);
    let (_, (_, br_ips)) = by_name(&br);
    assert_eq!(
        mv_ips.len(),
        3,
        "one address per range on {mv_if}: {mv_ips:?}"
    );
    assert!(mv_ips.iter().any(|a| a.starts_with("10.91.")), "{mv_ips:?}");
    assert!(mv_ips.iter().any(|a| a.starts_with("10.92.")), "{mv_ips:?}");
    assert!(
        mv_ips.iter().any(|a| a.starts_with("fd00:92::")),
        "{mv_ips:?}"
    );
    assert!(br_ips.iter().all(|a| a.starts_with("10.93.")) && br_ips.len() == 1);
    // Every interface: what Multus reports is what the pod holds and what the pools record.
    for (ifname, (name, ips)) in &status {
        assert_eq!(
            seen.get(ifname),
            Some(ips),
            "{name} on {ifname}: pod sees {seen:?}"
        );
        assert_eq!(
            pools.get(ifname),
            Some(ips),
            "{name} on {ifname}: pools {pools:?}"
        );
    }
    assert_eq!(status.len(), 4, "eth0, net1 and the two NADs: {status:?}");
    assert_eq!(pools.len(), 4, "{pools:?}");
}

/// Deleting a pod frees its NAD addresses whoever acts first. Usually the kubelet's DEL through
/// Multus does, before the pod object goes, and the operator finds nothing. When that DEL cannot
/// (Multus lost its cache of the sandbox's delegates, as after a reboot that empties its cache
/// folder, and the pod is gone from the API: Multus then answers success without calling them),
/// the operator frees them from the pod's Multus network-status once the pod is gone.
#[test]
fn a_deleted_multus_pod_is_freed_by_the_kubelets_del_or_by_the_operator() {
    let w = Workload::new("multus-del");
    nad(
        &w,
        "del-net",
        macvlan(json!({"type": "whereabouts", "ipRanges": [
            {"range": "10.94.0.0/24"}, {"range": "fd00:94::/120"}]})),
    );
    for name in ["graceful", "forced"] {
        nad_pod(&w, name, "del-net");
        running(&w, name);
    }
    let podref = |name: &str| format!("{}/{name}", w.ns);
    assert_eq!(pooled(&podref("forced")).len(), 3, "eth0, net1, net2");

    // Graceful: the kubelet's DEL frees every address before the pod object goes.
    kubectl(
        &["-n", &w.ns, "delete", "pod", "graceful", "--wait=false"],
        None,
    );
    w.wait_gone("app=graceful", 60);
    let left = pooled(&podref("graceful"));
    assert!(left.is_empty(), "{left:?}");

    // Forced while the kubelet is down for a few seconds (the node stays Ready), and Multus's
    // cache of the sandbox lost: the kubelet's DEL succeeds and frees nothing.
    let sandbox = sandbox_of(&w.ns, "forced").expect("forced's sandbox");
    let cache = std::path::Path::new(node().get("NODE_DIR"))
        .join("multus-cache")
        .join(&sandbox);
    node().script("stop", "kubelet");
    let out = kubectl(
        &[
            "-n",
            &w.ns,
            "delete",
            "pod",
            "forced",
            "--grace-period=0",
            "--force",
        ],
        None,
    );
    let removed = std::fs::remove_file(&cache);
    node().script("start", "kubelet");
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    removed.unwrap_or_else(|e| panic!("{}: {e}", cache.display()));
    // Stopped (its network torn down by the DEL), long before the operator's grace is over.
    wait_until(60, "the kubelet stops forced's sandbox", || {
        (!sandbox_ready(&sandbox))
            .then_some(())
            .ok_or_else(|| format!("sandbox {sandbox} still ready"))
    });
    let held = pooled(&podref("forced"));
    assert_eq!(
        held.len(),
        3,
        "Multus's DEL without its cache freed nothing: {held:?}"
    );
    // The operator, from the network-status Multus wrote, once the pod is gone (after its
    // --deleted-pod-grace, 60 s, on a Ready node).
    wait_until(150, "the operator frees forced's addresses", || {
        let left = pooled(&podref("forced"));
        left.is_empty()
            .then_some(())
            .ok_or_else(|| format!("{left:?}"))
    });
}

/// The sandbox id of pod `ns/name` as the runtime lists it.
fn sandbox_of(ns: &str, name: &str) -> Option<String> {
    let out = node().crictl(&["pods", "-q", "--namespace", ns, "--name", name]);
    String::from_utf8_lossy(&out.stdout)
        .lines()
        .next()
        .map(str::to_string)
}

fn sandbox_ready(id: &str) -> bool {
    let out = node().crictl(&["pods", "-q", "--id", id, "--state", "ready"]);
    !String::from_utf8_lossy(&out.stdout).trim().is_empty()
}

/// Requested addresses (the selection element's `ips`, passed by Multus as the `ips` capability)
/// and an IPAMClaim (`ipam-claim-reference`) through Multus on the real node.
#[test]
fn requested_and_claimed_addresses_reach_the_plugin_through_multus() {
    let w = Workload::new("multus-keep");
    let mut requested = macvlan(json!({"type": "whereabouts", "range": "10.95.0.0/24"}));
    requested["capabilities"] = json!({"ips": true});
    nad(&w, "req-net", requested);
    let claimed = bridge(json!({"type": "whereabouts", "range": "10.89.0.0/28",
        "allowPersistentIPs": true}));
    nad(&w, "vm-net", claimed);
    let claim = json!({"apiVersion": "k8s.cni.cncf.io/v1alpha1", "kind": "IPAMClaim",
        "metadata": {"name": "vm1.vm-net", "namespace": w.ns},
        "spec": {"network": "vm-net", "interface": "vm0"}});
    w.apply(&claim.to_string());
    let networks = json!([
        {"name": "req-net", "ips": ["10.95.0.77/24"]},
        {"name": "vm-net", "interface": "vm0", "ipam-claim-reference": "vm1.vm-net"}
    ])
    .to_string();

    nad_pod(&w, "launcher-a", &networks);
    let pod = running(&w, "launcher-a");
    let status = network_status(&pod);
    let (req_if, (_, req)) = status
        .iter()
        .find(|(_, (n, _))| n.ends_with("/req-net"))
        .expect("req-net in network-status");
    let req_if = req_if.clone();
    assert_eq!(
        req,
        &BTreeSet::from(["10.95.0.77".to_string()]),
        "{status:?}"
    );
    let vm = status["vm0"].1.clone();
    assert_eq!(vm.len(), 1, "{status:?}");
    let claim_ips =
        get_json(&["-n", &w.ns, "get", "ipamclaim", "vm1.vm-net"]).unwrap()["status"]["ips"]
            .clone();
    let first = vm.iter().next().unwrap().clone();
    assert_eq!(claim_ips, json!([format!("{first}/28")]));

    // The VM's pod goes and the next one comes: the claim's address follows it.
    kubectl(&["-n", &w.ns, "delete", "pod", "launcher-a"], None);
    w.wait_gone("app=launcher-a", 60);
    let kept = pooled(&format!("{}/launcher-a", w.ns));
    assert_eq!(
        kept.get("vm0"),
        Some(&vm),
        "the claim keeps its entry: {kept:?}"
    );
    assert!(
        !kept.contains_key(&req_if),
        "the requested address is freed: {kept:?}"
    );
    nad_pod(&w, "launcher-b", &networks);
    let pod = running(&w, "launcher-b");
    assert_eq!(network_status(&pod)["vm0"].1, vm);
}

/// The webhook refuses a bad NAD, naming the field; a pod that selects it stays pending with
/// Multus's error in its events.
#[test]
fn a_nad_the_webhook_refuses_cannot_be_used_and_multus_says_why() {
    let w = Workload::new("multus-bad");
    let mut bad = macvlan(json!({"type": "whereabouts", "range": "10.97.0.0/24",
        "range_start": "10.98.0.1"}));
    bad["cniVersion"] = json!("1.0.0");
    bad["name"] = json!("bad-net");
    let doc = json!({"apiVersion": "k8s.cni.cncf.io/v1", "kind": "NetworkAttachmentDefinition",
        "metadata": {"name": "bad-net", "namespace": w.ns}, "spec": {"config": bad.to_string()}});
    let out = kubectl(&["apply", "-f", "-"], Some(&doc.to_string()));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "the webhook let bad-net in");
    assert!(
        err.contains("range_start") && err.contains("10.98.0.1"),
        "{err}"
    );

    nad_pod(&w, "on-bad", "bad-net");
    wait_until(60, "Multus's error for on-bad", || {
        let events = w.events("FailedCreatePodSandBox");
        events
            .iter()
            .any(|e| e.contains("bad-net") && e.contains("multus"))
            .then_some(())
            .ok_or_else(|| format!("{events:?}"))
    });
    let pod = get_json(&["-n", &w.ns, "get", "pod", "on-bad"]).unwrap();
    assert_ne!(pod["status"]["phase"], "Running");
    assert!(pooled(&format!("{}/on-bad", w.ns)).is_empty());
}

/// A network with `node_slice_size`: the operator gives the real node a slice, and the pod's
/// address comes from it.
#[test]
fn a_sliced_nad_gives_the_pod_an_address_from_the_nodes_slice() {
    let w = Workload::new("multus-slice");
    let net = w.ns.clone();
    nad(
        &w,
        "sliced",
        macvlan(
            json!({"type": "whereabouts", "network_name": net, "range": "10.99.0.0/24",
            "node_slice_size": "/28"}),
        ),
    );
    let node_name = node().get("NODE_NAME").to_string();
    let mut slice = String::new();
    wait_until(60, "a slice for the node", || {
        let pool = get_json(&["-n", POOL_NAMESPACE, "get", "nodeslicepool", &net]);
        let allocations = pool.map(|p| p["status"]["allocations"].clone());
        let mine = allocations
            .as_ref()
            .and_then(|a| a.as_array())
            .and_then(|a| a.iter().find(|s| s["nodeName"] == node_name.as_str()));
        match mine {
            Some(s) => {
                slice = s["sliceRange"].as_str().unwrap().to_string();
                Ok(())
            }
            None => Err(format!("{allocations:?}")),
        }
    });
    nad_pod(&w, "on-slice", "sliced");
    let pod = running(&w, "on-slice");
    let (_, ips) = network_status(&pod)
        .into_values()
        .find(|(n, _)| n.ends_with("/sliced"))
        .expect("sliced in network-status");
    let slice: ipnet::IpNet = slice.parse().unwrap();
    assert!(
        ips.iter()
            .all(|ip| slice.contains(&ip.parse::<IpAddr>().unwrap())),
        "{ips:?} outside the node's slice {slice}"
    );
}
