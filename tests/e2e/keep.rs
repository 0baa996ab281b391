//! Addresses that stay, end to end: the plugin binary against the real API server, the operator
//! freeing held addresses, the real StatefulSet controller (kube-controller-manager) recreating
//! pods, and upstream's v0.9.2 plugin on the same pools.

use std::collections::BTreeMap;
use std::process::Child;

use serde_json::{Value, json};

use crate::harness::{Cni, CniCall, Ns, OperatorProcess, eventually, upstream_spawn};

/// Our plugin for pod `pod` (its UID as the API server has it) with `extra` merged into the
/// network config.
fn add(ns: &Ns, conf: &Value, pod: &str, uid: &str) -> Cni {
    ns.cni("ADD", conf, &format!("c-{pod}-{uid}"), "net1", pod, uid)
}

fn with(conf: &Value, extra: Value) -> Value {
    let mut conf = conf.clone();
    for (k, v) in extra.as_object().unwrap() {
        conf[k] = v.clone();
    }
    conf
}

/// Upstream's plugin (v0.9.2) for pod `pod`, started now.
fn upstream_call(ns: &Ns, conf: &Value, pod: &str, command: &str) -> Child {
    upstream_spawn(ns, conf, command, &format!("c-up-{pod}"), pod)
}

/// Upstream ADDs for `pods`, one after another; the addresses they got. A failed ADD is retried
/// twice after its DEL, as a runtime does: upstream's ADD racing ours for the last free addresses
/// may lose its pick (it writes the pool before its reservation) and fail where a retry succeeds.
fn upstream_adds(ns: &Ns, conf: &Value, pods: &[String]) -> Vec<String> {
    let run = |p: &str, command: &str| {
        Cni::from(
            upstream_call(ns, conf, p, command)
                .wait_with_output()
                .unwrap(),
        )
    };
    pods.iter()
        .filter_map(|p| {
            let mut out = run(p, "ADD");
            for _ in 0..2 {
                if out.ok {
                    break;
                }
                run(p, "DEL");
                out = run(p, "ADD");
            }
            out.ok.then(|| out.addresses()).map(|a| a[0].clone())
        })
        .collect()
}

fn error_code(c: &Cni) -> u64 {
    c.stdout["code"].as_u64().unwrap_or_default()
}

fn events(ns: &Ns, reason: &str) -> Vec<String> {
    ns.get_json(&["events.v1.events.k8s.io"])
        .map(|l| {
            l["items"]
                .as_array()
                .unwrap()
                .iter()
                .filter(|e| e["reason"] == reason)
                .map(|e| e["note"].as_str().unwrap_or_default().to_owned())
                .collect()
        })
        .unwrap_or_default()
}

#[test]
fn requested_addresses_are_reserved_and_refused_with_reasons() {
    let ns = Ns::new("requested");
    let conf = ns.netconf(
        "1.0.0",
        json!({"ipRanges": [{"range": "10.160.0.0/28"}, {"range": "fd00:160::/124"}]}),
    );
    let uid = ns.create_pod("fixed", &BTreeMap::new());
    let ips = json!({"runtimeConfig": {"ips": ["10.160.0.3/28", "fd00:160::3/124"]}});
    let fixed = add(&ns, &with(&conf, ips), "fixed", &uid);
    assert_eq!(fixed.addresses(), ["10.160.0.3/28", "fd00:160::3/124"]);
    let pool = ns.allocations("10.160.0.0-28");
    assert_eq!(pool["3"]["podref"], format!("{}/fixed", ns.name));
    assert!(ns.reservations().contains_key("10.160.0.3"));
    // args.cni.ips, for an address someone holds: refused, naming the holder; nothing taken.
    let other = add(
        &ns,
        &with(&conf, json!({"args": {"cni": {"ips": ["10.160.0.3"]}}})),
        "other",
        "uid-other",
    );
    assert!(!other.ok);
    assert_eq!(error_code(&other), 102, "{}", other.stdout);
    let msg = other.stdout["msg"].as_str().unwrap();
    assert!(
        msg.contains(&format!(
            "requested address 10.160.0.3 is held by pod {}/fixed",
            ns.name
        )),
        "{msg}"
    );
    assert_eq!(ns.allocations("10.160.0.0-28").len(), 1, "all or nothing");
    // Outside every range: refused before anything is written.
    let out = add(
        &ns,
        &with(&conf, json!({"runtimeConfig": {"ips": ["10.161.0.3/24"]}})),
        "other",
        "uid-other",
    );
    assert_eq!(error_code(&out), 102);
    assert!(
        out.stdout["msg"]
            .as_str()
            .unwrap()
            .contains("is outside every range of this network (10.160.0.0/28, fd00:160::/124)"),
        "{}",
        out.stdout
    );
    // Upstream's plugin on the same pools fills the range around the requested address.
    let ups: Vec<String> = (0..14).map(|i| format!("up{i}")).collect();
    let got = upstream_adds(&ns, &conf, &ups);
    assert_eq!(got.len(), 13, "13 free addresses of 14: {got:?}");
    assert!(!got.contains(&"10.160.0.3/28".to_owned()), "{got:?}");
    assert_eq!(
        ns.allocations("10.160.0.0-28")["3"]["podref"],
        format!("{}/fixed", ns.name)
    );
}

/// The StatefulSet's pods as the API server has them: name -> UID.
fn statefulset_pods(ns: &Ns) -> BTreeMap<String, String> {
    let list = ns.get_json(&["pods", "-l", "app=web"]).unwrap();
    list["items"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|p| p["metadata"]["deletionTimestamp"].is_null())
        .map(|p| {
            (
                p["metadata"]["name"].as_str().unwrap().to_owned(),
                p["metadata"]["uid"].as_str().unwrap().to_owned(),
            )
        })
        .collect()
}

fn wait_for_pods(ns: &Ns, want: &[&str]) -> BTreeMap<String, String> {
    let mut pods = BTreeMap::new();
    assert!(
        eventually(60, || {
            pods = statefulset_pods(ns);
            pods.keys().map(String::as_str).collect::<Vec<_>>() == want
        }),
        "StatefulSet pods: {pods:?}, wanted {want:?}"
    );
    pods
}

#[test]
fn a_statefulset_pod_keeps_its_address_through_a_force_delete_and_loses_it_on_scale_down() {
    let ns = Ns::new("sticky");
    let _op = OperatorProcess::for_namespace(&ns);
    let sts = json!({"apiVersion": "apps/v1", "kind": "StatefulSet",
        "metadata": {"name": "web", "namespace": ns.name},
        "spec": {"replicas": 2, "serviceName": "web", "podManagementPolicy": "Parallel", "selector": {"matchLabels": {"app": "web"}},
            "template": {"metadata": {"labels": {"app": "web"}},
                "spec": {"automountServiceAccountToken": false, "containers": [{"name": "c", "image": "registry.invalid/pause"}]}}}});
    let out = ns.apply(&sts.to_string());
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let pods = wait_for_pods(&ns, &["web-0", "web-1"]);
    let conf = ns.netconf(
        "1.0.0",
        json!({"range": "10.162.0.0/27", "sticky_statefulset": true}),
    );
    assert_eq!(
        add(&ns, &conf, "web-0", &pods["web-0"]).addresses(),
        ["10.162.0.1/27"]
    );
    assert_eq!(
        add(&ns, &conf, "web-1", &pods["web-1"]).addresses(),
        ["10.162.0.2/27"]
    );
    assert_eq!(ns.allocations("10.162.0.0-27")["1"]["statefulset"], "web");
    // A node failure: web-0 is force-deleted without a DEL, and the controller makes a new one.
    ns.kubectl_ok(&["delete", "pod", "web-0", "--grace-period=0", "--force"]);
    let mut fresh = BTreeMap::new();
    assert!(eventually(60, || {
        fresh = statefulset_pods(&ns);
        fresh.get("web-0").is_some_and(|uid| *uid != pods["web-0"])
    }));
    // Meanwhile a flood of dynamic ADDs (ours and upstream's) fills the rest of the range.
    let flood: Vec<String> = (0..20).map(|i| format!("flood{i}")).collect();
    let uids: Vec<String> = flood
        .iter()
        .map(|p| ns.create_pod(p, &BTreeMap::new()))
        .collect();
    let ours: Vec<Child> = flood
        .iter()
        .zip(&uids)
        .map(|(p, uid)| {
            CniCall {
                command: "ADD",
                conf: &conf,
                container: &format!("c-{p}"),
                ifname: "net1",
                netns: "/var/run/netns/none",
                args: &format!(
                    "IgnoreUnknown=1;K8S_POD_NAMESPACE={};K8S_POD_NAME={p};K8S_POD_UID={uid}",
                    ns.name
                ),
                path: None,
            }
            .spawn(crate::harness::whereabouts_bin())
        })
        .collect();
    let ups: Vec<String> = (0..10).map(|i| format!("up{i}")).collect();
    let up_got = upstream_adds(&ns, &conf, &ups);
    let ours: Vec<Cni> = ours
        .into_iter()
        .map(|c| Cni::from(c.wait_with_output().unwrap()))
        .collect();
    let mut flooded: Vec<String> = ours
        .iter()
        .filter(|c| c.ok)
        .map(|c| c.addresses()[0].clone())
        .collect();
    flooded.extend(up_got);
    let failed: Vec<&Cni> = ours.iter().filter(|c| !c.ok).collect();
    assert_eq!(
        flooded.len(),
        28,
        "the other 28 addresses: {flooded:?}; our failed ADDs: {failed:?}"
    );
    assert!(
        !flooded
            .iter()
            .any(|a| a == "10.162.0.1/27" || a == "10.162.0.2/27"),
        "{flooded:?}"
    );
    // Upstream's writes of the pool kept the fields it does not know.
    let pool = ns.allocations("10.162.0.0-27");
    assert_eq!(pool["1"]["statefulset"], "web", "{:?}", pool["1"]);
    assert_eq!(pool["2"]["statefulset"], "web", "{:?}", pool["2"]);
    // The replacement gets its address back.
    assert_eq!(
        add(&ns, &conf, "web-0", &fresh["web-0"]).addresses(),
        ["10.162.0.1/27"]
    );
    assert_eq!(
        ns.allocations("10.162.0.0-27")["1"]["poduid"],
        fresh["web-0"].as_str()
    );
    // Scaled to one: web-1's address is freed by the operator, with an Event.
    ns.kubectl_ok(&["scale", "statefulset", "web", "--replicas=1"]);
    assert!(
        eventually(60, || !ns.allocations("10.162.0.0-27").contains_key("2")),
        "web-1's address was not freed: {:?}",
        ns.allocations("10.162.0.0-27").get("2")
    );
    assert!(!ns.reservations().contains_key("10.162.0.2"));
    assert!(eventually(20, || events(&ns, "HeldAddressReleased")
        .iter()
        .any(
            |n| n.contains("10.162.0.2") && n.contains("has 1 replicas")
        )));
    assert!(
        ns.allocations("10.162.0.0-27").contains_key("1"),
        "web-0 keeps its address"
    );
    // The StatefulSet deleted (its pods with it): the last sticky address is freed.
    ns.kubectl_ok(&["delete", "statefulset", "web"]);
    assert!(eventually(60, || !ns
        .allocations("10.162.0.0-27")
        .contains_key("1")));
}

fn vm_pod(ns: &Ns, pod: &str, claim: &str) -> String {
    let networks = json!([{"name": "e2e-net", "ipam-claim-reference": claim}]).to_string();
    ns.create_pod(
        pod,
        &BTreeMap::from([("k8s.v1.cni.cncf.io/networks".to_owned(), networks)]),
    )
}

#[test]
fn an_ipamclaim_keeps_its_addresses_across_pods_until_it_is_deleted() {
    let ns = Ns::new("ipamclaim");
    let _op = OperatorProcess::for_namespace(&ns);
    ns.create_ipam_claim("vm1.e2e-net", "e2e-net");
    let conf = with(
        &ns.netconf(
            "1.0.0",
            json!({"ipRanges": [{"range": "10.163.0.0/28"}, {"range": "fd00:163::/124"}]}),
        ),
        json!({"allowPersistentIPs": true}),
    );
    let uid = vm_pod(&ns, "launcher-a", "vm1.e2e-net");
    let first = add(&ns, &conf, "launcher-a", &uid).addresses();
    assert_eq!(first, ["10.163.0.1/28", "fd00:163::1/124"]);
    let status = ns.get_json(&["ipamclaim", "vm1.e2e-net"]).unwrap()["status"].clone();
    assert_eq!(status["ips"], json!(first));
    assert_eq!(status["ownerPod"]["name"], "launcher-a");
    assert_eq!(status["conditions"][0]["type"], "IPsAllocated");
    assert_eq!(status["conditions"][0]["reason"], "SuccessfulAllocation");
    // A live migration: source and target pods at once, both with the claim's addresses.
    let uid_b = vm_pod(&ns, "launcher-b", "vm1.e2e-net");
    let uid_c = vm_pod(&ns, "launcher-c", "vm1.e2e-net");
    let (b, c) = std::thread::scope(|s| {
        let b = s.spawn(|| add(&ns, &conf, "launcher-b", &uid_b));
        let c = s.spawn(|| add(&ns, &conf, "launcher-c", &uid_c));
        (b.join().unwrap(), c.join().unwrap())
    });
    assert_eq!(b.addresses(), first);
    assert_eq!(c.addresses(), first);
    // Every pod goes (DEL and delete): the addresses stay with the claim.
    for (pod, uid) in [
        ("launcher-a", &uid),
        ("launcher-b", &uid_b),
        ("launcher-c", &uid_c),
    ] {
        assert!(
            ns.cni("DEL", &conf, &format!("c-{pod}-{uid}"), "net1", pod, uid)
                .ok
        );
        ns.kubectl_ok(&["delete", "pod", pod, "--wait=false"]);
    }
    std::thread::sleep(std::time::Duration::from_secs(2)); // the operator's cleanup has run
    assert_eq!(ns.allocations("10.163.0.0-28").len(), 1);
    // Upstream's plugin cannot take them.
    let ups: Vec<String> = (0..14).map(|i| format!("up{i}")).collect();
    let got = upstream_adds(&ns, &conf, &ups);
    assert_eq!(got.len(), 13, "{got:?}");
    assert!(!got.contains(&first[0]), "{got:?}");
    // The VM's next pod gets them back.
    let uid_d = vm_pod(&ns, "launcher-d", "vm1.e2e-net");
    assert_eq!(add(&ns, &conf, "launcher-d", &uid_d).addresses(), first);
    // The claim deleted: the operator frees its addresses once no pod holds them.
    assert!(
        ns.cni(
            "DEL",
            &conf,
            &format!("c-launcher-d-{uid_d}"),
            "net1",
            "launcher-d",
            &uid_d
        )
        .ok
    );
    ns.kubectl_ok(&["delete", "pod", "launcher-d", "--wait=false"]);
    ns.kubectl_ok(&["delete", "ipamclaim", "vm1.e2e-net"]);
    assert!(
        eventually(60, || !ns.allocations("10.163.0.0-28").contains_key("1")),
        "{:?}",
        ns.allocations("10.163.0.0-28").get("1")
    );
    assert!(eventually(10, || !ns
        .allocations("fd00-163---124")
        .contains_key("1")));
    assert!(!ns.reservations().contains_key("10.163.0.1"));
    assert!(eventually(20, || events(&ns, "HeldAddressReleased")
        .iter()
        .any(|n| n.contains("IPAMClaim") && n.contains("was deleted"))));
}
