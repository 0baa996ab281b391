//! Pools you can read in kubectl: the operator keeps IPPool status (size, allocated, free, held)
//! on the status subresource, and both plugins keep working on pools that carry it.

use serde_json::json;

use crate::harness::{Cni, CniCall, Ns, OperatorProcess, eventually, free_port, http_get_at, repo};

#[test]
fn kubectl_get_ippools_shows_size_allocated_and_free() {
    let ns = Ns::new("status");
    let _op = OperatorProcess::for_namespace(&ns);
    let conf = ns.netconf("1.0.0", json!({"range": "10.165.0.0/28"}));
    let mut taken: std::collections::BTreeSet<String> = ns
        .cni_pods("ADD", &conf, 0..3)
        .iter()
        .map(|r| r.addresses()[0].clone())
        .collect();
    let status = |ns: &Ns| ns.get_json(&["ippool", "10.165.0.0-28"]).unwrap()["status"].clone();
    assert!(
        eventually(20, || status(&ns)["allocated"] == 3),
        "{}",
        status(&ns)
    );
    let s = status(&ns);
    assert_eq!(
        (s["size"].as_str(), s["free"].as_str()),
        (Some("14"), Some("11"))
    );
    assert!(
        s["lastUpdated"].as_str().is_some_and(|t| t.ends_with('Z')),
        "{s}"
    );
    let table = ns.kubectl_ok(&["get", "ippools"]);
    let header: Vec<&str> = table.lines().next().unwrap().split_whitespace().collect();
    assert_eq!(
        header,
        ["NAME", "RANGE", "SIZE", "ALLOCATED", "FREE", "AGE"],
        "{table}"
    );
    let row: Vec<&str> = table.lines().nth(1).unwrap().split_whitespace().collect();
    assert_eq!(
        &row[..5],
        ["10.165.0.0-28", "10.165.0.0/28", "14", "3", "11"],
        "{table}"
    );
    // Upstream's plugin on a pool that carries a status: its JSON patch of the entries still
    // applies, and the next count includes its entry.
    let up = CniCall {
        command: "ADD",
        conf: &conf,
        container: "c-up",
        ifname: "net1",
        netns: "/var/run/netns/none",
        args: &format!(
            "IgnoreUnknown=1;K8S_POD_NAMESPACE={};K8S_POD_NAME=up;K8S_POD_UID=u",
            ns.name
        ),
        path: None,
    }
    .spawn(repo().join("bench/bin/whereabouts-upstream"));
    let up = Cni::from(up.wait_with_output().unwrap());
    assert!(
        taken.insert(up.addresses()[0].clone()),
        "{:?}",
        up.addresses()
    );
    assert!(taken.insert(ns.cni_pod("ADD", &conf, 3).addresses()[0].clone()));
    assert!(
        eventually(30, || status(&ns)["allocated"] == 5),
        "{}",
        status(&ns)
    );
    // A plugin's write of spec never touches the status, and the status write never the spec.
    assert_eq!(ns.allocations("10.165.0.0-28").len(), 5);
}

/// The operator's default listener, `[::]`, answers IPv6 peers (an IPv6-only cluster's kubelet
/// and Prometheus) and IPv4 peers alike.
#[test]
fn the_operator_answers_probes_over_ipv6_and_ipv4_on_its_default_address() {
    let ns = Ns::new("dualstack");
    let port = free_port();
    let mut op = OperatorProcess::start_at(
        &format!("[::]:{port}"),
        ns.dir.path(),
        "op",
        &[
            format!("--pool-namespace={}", ns.name),
            "--leader-election=false".into(),
        ],
        &[],
    );
    op.wait_ready();
    for ip in ["::1", "127.0.0.1"] {
        let answer = http_get_at(ip, port, "/readyz").unwrap_or_default();
        assert!(answer.starts_with("HTTP/1.1 200"), "{ip}: {answer:?}");
    }
}
