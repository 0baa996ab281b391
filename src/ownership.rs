//! Which pool entries belong to which pod: the rules every release decision rests on.
//!
//! Pod UID, not `namespace/name`, identifies a pod over time (StatefulSets reuse names). An entry
//! belongs to a pod when its podref matches and its recorded UID matches; entries written without a
//! UID (by upstream, or by a runtime that did not pass `K8S_POD_UID`) belong to the pod only if the
//! address is one that pod's Multus network-status lists. Pure functions, tested without a cluster.

use std::collections::HashMap;
use std::net::IpAddr;

use serde::Deserialize;

use crate::config::Problem;
use crate::crd::IPAllocation;

pub const NETWORK_STATUS_ANNOTATION: &str = "k8s.v1.cni.cncf.io/network-status";

pub use crate::crd::pod::{MIRROR_ANNOTATION, runtime_uid};

/// One entry of the Multus `network-status` annotation.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
pub struct NetworkStatus {
    /// `<namespace>/<nad name>` (or a bare name for the default network).
    pub name: String,
    #[serde(default)]
    pub interface: String,
    #[serde(default)]
    pub ips: Vec<String>,
    #[serde(default)]
    pub default: bool,
}

/// Parses the annotation; the problem names the annotation and what is wrong with it.
pub fn parse_network_status(text: &str) -> Result<Vec<NetworkStatus>, Problem> {
    serde_json::from_str(text).map_err(|e| {
        Problem::at(
            format!("annotation {NETWORK_STATUS_ANNOTATION}"),
            format!("is not a network-status list: {e}"),
        )
    })
}

/// The secondary (non-default) attachments with the addresses Multus reported for them.
pub fn secondary_addresses(statuses: &[NetworkStatus]) -> Vec<IpAddr> {
    statuses
        .iter()
        .filter(|s| !s.default)
        .flat_map(|s| {
            s.ips
                .iter()
                .filter_map(|ip| ip.split('/').next()?.parse().ok())
        })
        .collect()
}

/// A pod as the release decisions see it.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct PodIdentity {
    pub podref: String,
    pub uid: String,
    /// Addresses from the pod's network-status (secondary networks only).
    pub addresses: Vec<IpAddr>,
}

/// True when `entry` (holding `ip`) belongs to `pod`.
/// A held entry (see [`IPAllocation::is_held`]) belongs to its holder, never to a pod.
pub fn belongs_to(entry: &IPAllocation, ip: IpAddr, pod: &PodIdentity) -> bool {
    if entry.podref != pod.podref || entry.is_held() {
        return false;
    }
    if entry.poduid.is_empty() {
        pod.addresses.contains(&ip)
    } else {
        entry.poduid == pod.uid
    }
}

/// The addresses the pod's network-status lists per interface name (secondary networks only).
pub fn addresses_by_interface(statuses: &[NetworkStatus]) -> HashMap<String, Vec<IpAddr>> {
    let mut out: HashMap<String, Vec<IpAddr>> = HashMap::new();
    for s in statuses
        .iter()
        .filter(|s| !s.default && !s.interface.is_empty())
    {
        out.entry(s.interface.clone()).or_default().extend(
            s.ips
                .iter()
                .filter_map(|ip| ip.split('/').next()?.parse::<IpAddr>().ok()),
        );
    }
    out
}

/// True when `entry` (holding `ip`) is an earlier attachment of a pod that lives on with another
/// address on the same interface: the pod's network-status lists addresses of `ip`'s family on
/// the entry's interface, and not `ip`. That is what a sandbox attempt leaves behind when its ADD
/// was killed after its claim was made: the runtime's DEL found nothing yet to release, and the
/// next sandbox got another address. Without a network-status (no Multus), or without the
/// interface in it, nothing is superseded. The caller checks that the entry is this pod's (UID).
pub fn is_superseded(
    entry: &IPAllocation,
    ip: IpAddr,
    interfaces: &HashMap<String, Vec<IpAddr>>,
) -> bool {
    if entry.ifname.is_empty() {
        return false;
    }
    let Some(listed) = interfaces.get(&entry.ifname) else {
        return false;
    };
    listed.iter().any(|l| l.is_ipv4() == ip.is_ipv4()) && !listed.contains(&ip)
}

/// True when no living pod owns `entry`: no pod of that name exists, or the one that exists has
/// another UID than the one recorded. An entry without a UID whose pod name exists is never stale
/// (it may be the same pod). A held entry is never stale by its pod (see [`is_pod_gone`]).
pub fn is_stale(entry: &IPAllocation, live: &HashMap<String, String>) -> bool {
    !entry.is_held() && is_pod_gone(entry, live)
}

/// True when the pod `entry` records is gone: no pod of that name, or one with another UID.
pub fn is_pod_gone(entry: &IPAllocation, live: &HashMap<String, String>) -> bool {
    match live.get(&entry.podref) {
        None => true,
        Some(uid) => !entry.poduid.is_empty() && *uid != entry.poduid,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_mirror_pod_answers_for_its_static_pod() {
        use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;
        let meta = ObjectMeta {
            uid: Some("mirror-uid".into()),
            annotations: Some([(MIRROR_ANNOTATION.to_owned(), "6f1c2a".to_owned())].into()),
            ..Default::default()
        };
        let live = HashMap::from([("kube-system/etcd-n1".to_owned(), runtime_uid(&meta))]);
        assert!(!is_stale(&entry("kube-system/etcd-n1", "6f1c2a"), &live));
        assert!(is_stale(&entry("kube-system/etcd-n1", "mirror-uid"), &live));
    }

    fn entry(podref: &str, uid: &str) -> IPAllocation {
        IPAllocation {
            id: "c".into(),
            podref: podref.into(),
            poduid: uid.into(),
            ..Default::default()
        }
    }

    #[test]
    fn uid_decides_when_recorded() {
        let old = PodIdentity {
            podref: "ns/web-0".into(),
            uid: "old".into(),
            addresses: vec![],
        };
        let ip: IpAddr = "10.0.0.5".parse().unwrap();
        assert!(belongs_to(&entry("ns/web-0", "old"), ip, &old));
        // The StatefulSet replacement's entry is never the old pod's.
        assert!(!belongs_to(&entry("ns/web-0", "new"), ip, &old));
        assert!(!belongs_to(&entry("ns/web-1", "old"), ip, &old));
    }

    #[test]
    fn without_uid_the_network_status_decides() {
        let statuses = parse_network_status(
            r#"[{"name":"kindnet","interface":"eth0","ips":["10.244.0.5"],"default":true},
            {"name":"ns/macvlan","interface":"net1","ips":["10.0.0.5","fd00::5"],"mac":"aa:bb"}]"#,
        )
        .unwrap();
        let pod = PodIdentity {
            podref: "ns/p".into(),
            uid: "u".into(),
            addresses: secondary_addresses(&statuses),
        };
        assert_eq!(pod.addresses.len(), 2);
        assert!(belongs_to(
            &entry("ns/p", ""),
            "10.0.0.5".parse().unwrap(),
            &pod
        ));
        assert!(belongs_to(
            &entry("ns/p", ""),
            "fd00::5".parse().unwrap(),
            &pod
        ));
        assert!(!belongs_to(
            &entry("ns/p", ""),
            "10.0.0.6".parse().unwrap(),
            &pod
        ));
        assert!(
            !belongs_to(&entry("ns/p", ""), "10.244.0.5".parse().unwrap(), &pod),
            "default network addresses are not ours"
        );
    }

    #[test]
    fn held_entries_are_never_a_pods() {
        let live = HashMap::new();
        let claimed = IPAllocation {
            ipamclaimref: "vms/vm1.net".into(),
            ..entry("ns/gone", "x")
        };
        let sticky = IPAllocation {
            statefulset: "web".into(),
            ..entry("ns/web-0", "x")
        };
        for held in [&claimed, &sticky] {
            assert!(!is_stale(held, &live));
            assert!(is_pod_gone(held, &live));
            let pod = PodIdentity {
                podref: held.podref.clone(),
                uid: "x".into(),
                addresses: vec![],
            };
            assert!(!belongs_to(held, "10.0.0.5".parse().unwrap(), &pod));
        }
    }

    #[test]
    fn staleness() {
        let live = HashMap::from([("ns/a".to_owned(), "ua".to_owned())]);
        assert!(!is_stale(&entry("ns/a", "ua"), &live));
        assert!(!is_stale(&entry("ns/a", ""), &live));
        assert!(is_stale(&entry("ns/a", "older"), &live));
        assert!(is_stale(&entry("ns/gone", "x"), &live));
    }

    #[test]
    fn an_earlier_sandbox_entry_is_superseded_by_the_listed_address() {
        let statuses = parse_network_status(
            r#"[{"name":"kindnet","interface":"eth0","ips":["10.244.0.5"],"default":true},
            {"name":"ns/macvlan","interface":"net1","ips":["10.0.0.7","fd00::7"]}]"#,
        )
        .unwrap();
        let by_if = addresses_by_interface(&statuses);
        let on = |ifname: &str| IPAllocation {
            ifname: ifname.into(),
            ..entry("ns/p", "u")
        };
        let ip = |s: &str| -> IpAddr { s.parse().unwrap() };
        // The sandbox that lives holds .7; an entry of the same interface at .5 is left over.
        assert!(is_superseded(&on("net1"), ip("10.0.0.5"), &by_if));
        assert!(is_superseded(&on("net1"), ip("fd00::5"), &by_if));
        assert!(!is_superseded(&on("net1"), ip("10.0.0.7"), &by_if));
        // Another interface, an entry without an interface, a family the status does not list:
        // nothing to compare with, so never superseded.
        assert!(!is_superseded(&on("net2"), ip("10.0.0.5"), &by_if));
        assert!(!is_superseded(&on(""), ip("10.0.0.5"), &by_if));
        let v4_only = addresses_by_interface(
            &parse_network_status(r#"[{"name":"ns/m","interface":"net1","ips":["10.0.0.7"]}]"#)
                .unwrap(),
        );
        assert!(!is_superseded(&on("net1"), ip("fd00::5"), &v4_only));
        // The default network's interface is not ours to judge.
        assert!(!is_superseded(&on("eth0"), ip("10.244.0.6"), &by_if));
    }

    #[test]
    fn bad_annotation_is_a_problem_not_a_panic() {
        let e = parse_network_status("{not json").unwrap_err();
        assert!(e.to_string().starts_with(
            "annotation k8s.v1.cni.cncf.io/network-status is not a network-status list"
        ));
        assert!(parse_network_status(r#"[{"ips":["x"]}]"#).is_err());
    }
}
