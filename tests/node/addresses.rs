//! What a pod holds, what Multus and the kubelet report, and what the pools record: read the same
//! way by every node test. Pods print `ip -o addr show` (both families) when they start.

use std::collections::{BTreeMap, BTreeSet};
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};

use serde_json::Value;

use crate::cluster::{
    NET2_POOL, POD_POOL, POD_POOL6, POOL_NAMESPACE, Workload, entries_of, get_json, reservations_of,
};

/// Interface -> addresses, as the pod's own log shows them (global scope: no loopback, no
/// link-local).
pub fn logged(w: &Workload, pod: &str) -> BTreeMap<String, BTreeSet<String>> {
    let mut by_if: BTreeMap<String, BTreeSet<String>> = BTreeMap::new();
    for line in w.logs(pod).lines() {
        let words: Vec<&str> = line.split_whitespace().collect();
        if words.len() < 4 || !matches!(words[2], "inet" | "inet6") || words[1] == "lo" {
            continue;
        }
        let ip = words[3].split('/').next().unwrap_or_default();
        if !ip.starts_with("fe80") {
            by_if
                .entry(words[1].trim_end_matches(':').to_string())
                .or_default()
                .insert(ip.to_string());
        }
    }
    by_if
}

/// Interface -> addresses of `podref`'s entries in every IPPool (pool range + entry offset).
pub fn pooled(podref: &str) -> BTreeMap<String, BTreeSet<String>> {
    let mut by_if: BTreeMap<String, BTreeSet<String>> = BTreeMap::new();
    let pools = get_json(&["-n", POOL_NAMESPACE, "get", "ippools"]).unwrap();
    for pool in pools["items"].as_array().unwrap() {
        let range: ipnet::IpNet = pool["spec"]["range"].as_str().unwrap().parse().unwrap();
        let entries = pool["spec"]["allocations"].as_object().cloned();
        for (offset, e) in entries.into_iter().flatten() {
            if e["podref"] != podref {
                continue;
            }
            let offset: u128 = offset.parse().unwrap();
            let ip = match range.network() {
                IpAddr::V4(a) => Ipv4Addr::from(u32::from(a) + offset as u32).to_string(),
                IpAddr::V6(a) => Ipv6Addr::from(u128::from(a) + offset).to_string(),
            };
            let ifname = e["ifname"].as_str().unwrap_or_default().to_string();
            by_if.entry(ifname).or_default().insert(ip);
        }
    }
    by_if
}

/// The pods' eth0 IPv4 addresses (status.podIP): all distinct, or a panic naming the duplicates.
pub fn distinct_pod_ips(pods: &[Value]) -> BTreeSet<String> {
    let ips: Vec<String> = pods
        .iter()
        .map(|p| {
            p["status"]["podIP"]
                .as_str()
                .unwrap_or_default()
                .to_string()
        })
        .collect();
    let set: BTreeSet<String> = ips.iter().cloned().collect();
    assert_eq!(set.len(), ips.len(), "duplicate pod IPs: {ips:?}");
    assert!(!set.contains(""), "a pod without an IP: {ips:?}");
    set
}

/// status.podIPs of a pod, as strings.
fn pod_ips(pod: &Value) -> BTreeSet<String> {
    let ips = pod["status"]["podIPs"].as_array().into_iter().flatten();
    ips.filter_map(|i| i["ip"].as_str().map(str::to_string))
        .collect()
}

/// Every pod is dual-stack on eth0 (an IPv4 and an IPv6 address from our pools, both in
/// status.podIPs, IPv4 first as the node's family) and holds one address on net1; what each pod
/// holds on every interface is exactly what the pools record for it; no address twice; and the
/// pools and reservations hold nothing else of this namespace.
pub fn check_pods_against_pools(w: &Workload, pods: &[Value]) {
    distinct_pod_ips(pods);
    let mut held = BTreeSet::new();
    for p in pods {
        let name = p["metadata"]["name"].as_str().unwrap();
        let seen = logged(w, name);
        let eth0 = seen.get("eth0").cloned().unwrap_or_default();
        assert_eq!(eth0, pod_ips(p), "{name}: eth0 {seen:?} vs status.podIPs");
        assert_eq!(p["status"]["podIPs"][0]["ip"], p["status"]["podIP"]);
        let v6: Vec<&String> = eth0.iter().filter(|a| a.contains(':')).collect();
        assert!(
            eth0.len() == 2 && v6.len() == 1 && v6[0].starts_with("fd00:85::"),
            "{name}: eth0 is not dual-stack from fd00:85::/116: {eth0:?}"
        );
        assert!(seen.contains_key("net1"), "{name}: no net1: {seen:?}");
        let podref = format!("{}/{name}", w.ns);
        assert_eq!(
            pooled(&podref),
            seen,
            "{name}: what it holds vs its pool entries"
        );
        for ip in seen.values().flatten() {
            assert!(held.insert(ip.clone()), "{ip} held twice");
        }
    }
    for pool in [POD_POOL, POD_POOL6, NET2_POOL] {
        assert_eq!(entries_of(pool, &w.ns).len(), pods.len(), "{pool}");
    }
    assert_eq!(reservations_of(&w.ns), 3 * pods.len(), "reservations");
}
