//! Which pool entries belong to which pod: the rules every release decision rests on.
//!
//! Pod UID, not `namespace/name`, identifies a pod over time (StatefulSets reuse names). An entry
//! belongs to a pod when its podref matches and its recorded UID matches; entries written without a
//! UID (by upstream, or by a runtime that did not pass `K8S_POD_UID`) belong to the pod only if the
//! address is one that pod's Multus network-status lists. Pure functions, tested without a cluster.
//!
//! Every decision compares two [`Owner`]s with one of its named comparisons ([`owner`]); the
//! functions here apply them to what the operator and CNI GC know of live pods.

mod owner;

use std::collections::HashMap;
use std::net::IpAddr;

use serde::Deserialize;

use crate::config::Problem;
use crate::crd::IPAllocation;

pub use owner::{Holder, Incarnation, LivePod, Owned, Owner};

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
    if entry.is_held() {
        return false;
    }
    let live = LivePod {
        podref: &pod.podref,
        uid: &pod.uid,
    };
    match entry.incarnation(&live) {
        Incarnation::Same => true,
        Incarnation::Other => false,
        Incarnation::Unknown => pod.addresses.contains(&ip),
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
        Some(uid) => {
            let live = LivePod {
                podref: &entry.podref,
                uid,
            };
            entry.incarnation(&live) == Incarnation::Other
        }
    }
}

#[cfg(test)]
mod tests;
