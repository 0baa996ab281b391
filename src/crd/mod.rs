//! Wire types of the stored objects, byte-compatible with upstream whereabouts.
//!
//! Field names and omission rules follow the upstream Go types (`ifname` and `containerid` are
//! omitted when empty). `poduid` is our addition: an optional field recording `K8S_POD_UID`, so the
//! operator never confuses two pods of one name. Upstream ignores it; an upstream CRD would prune it,
//! which is why the CRDs in `crds/` (generated from these types) carry it.

pub mod claim;
pub mod pod;
pub mod size;

use std::collections::BTreeMap;

use kube::CustomResource;
use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

pub const GROUP: &str = "whereabouts.cni.cncf.io";

/// One allocated address of a pool, keyed in the pool by its decimal offset.
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, Eq, JsonSchema)]
pub struct IPAllocation {
    /// Container ID of the attachment.
    pub id: String,
    /// `<namespace>/<pod name>`.
    pub podref: String,
    /// The pod interface (`net1`); absent in entries of very old upstream versions.
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub ifname: String,
    /// UID of the pod (from `K8S_POD_UID`), when the runtime passed it.
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub poduid: String,
    /// The node whose plugin wrote the entry. Ours, like `poduid`: the node-limits policy lets a
    /// node's credentials add or remove only entries that name that node, and CNI GC frees only
    /// its own node's. Empty in entries written by upstream or before this field existed.
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub node: String,
    /// The IPAMClaim (`<namespace>/<name>`) that holds this address past its pods: DEL, CNI GC
    /// and pod cleanup leave the entry alone, deleting the claim frees it.
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub ipamclaimref: String,
    /// The StatefulSet whose pod holds this address (`sticky_statefulset`): kept for the pod's
    /// ordinal while the StatefulSet exists and that ordinal is below its replicas. Our addition,
    /// ignored by upstream as `poduid` is.
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub statefulset: String,
}

impl IPAllocation {
    /// True when something other than its pod holds the address (an IPAMClaim, a StatefulSet
    /// ordinal): DEL, CNI GC and pod cleanup leave it; the operator frees it when the holder goes.
    pub fn is_held(&self) -> bool {
        !self.ipamclaimref.is_empty() || !self.statefulset.is_empty()
    }
}

#[derive(CustomResource, Serialize, Deserialize, Clone, Debug, Default, PartialEq, JsonSchema)]
#[kube(
    group = "whereabouts.cni.cncf.io",
    version = "v1alpha1",
    kind = "IPPool",
    plural = "ippools",
    namespaced,
    status = "IPPoolStatus",
    doc = "The allocations of one range in one network.",
    printcolumn = r#"{"name":"Range","type":"string","jsonPath":".spec.range"}"#,
    printcolumn = r#"{"name":"Size","type":"string","jsonPath":".status.size"}"#,
    printcolumn = r#"{"name":"Allocated","type":"integer","jsonPath":".status.allocated"}"#,
    printcolumn = r#"{"name":"Free","type":"string","jsonPath":".status.free"}"#,
    printcolumn = r#"{"name":"Held","type":"integer","priority":1,"jsonPath":".status.held"}"#,
    printcolumn = r#"{"name":"Age","type":"date","jsonPath":".metadata.creationTimestamp"}"#
)]
/// The range and its allocations.
pub struct IPPoolSpec {
    /// The range in CIDR notation, network address first (`192.168.2.0/24`).
    pub range: String,
    /// Allocated addresses keyed by their decimal offset from the network address.
    #[serde(default)]
    pub allocations: BTreeMap<String, IPAllocation>,
}

/// What the operator last counted in a pool (at most every few seconds per pool, so a busy pool
/// is not rewritten for every ADD). A subresource: it never races the plugins' writes of `spec`.
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, Eq, JsonSchema)]
pub struct IPPoolStatus {
    /// Addresses of the range a pod may get: the CIDR less its network and broadcast addresses
    /// (the NAD's range_start, range_end and exclude narrow this further; see the network metrics).
    /// A decimal string: an IPv6 range holds more than an integer column can show.
    pub size: String,
    /// Entries in `spec.allocations` inside the range.
    pub allocated: u64,
    /// `size` less `allocated`, a decimal string.
    pub free: String,
    /// Entries kept past their pods: sticky StatefulSet ordinals and IPAMClaims.
    #[serde(default)]
    pub held: u64,
    /// When the operator counted (RFC 3339).
    #[serde(
        rename = "lastUpdated",
        default,
        skip_serializing_if = "String::is_empty"
    )]
    pub last_updated: String,
}

#[derive(
    CustomResource, Serialize, Deserialize, Clone, Debug, Default, PartialEq, Eq, JsonSchema,
)]
#[kube(
    group = "whereabouts.cni.cncf.io",
    version = "v1alpha1",
    kind = "OverlappingRangeIPReservation",
    plural = "overlappingrangeipreservations",
    namespaced,
    doc = "A cluster-wide claim on one address of a network, so that overlapping ranges never hand it out twice.",
    printcolumn = r#"{"name":"Pod","type":"string","jsonPath":".spec.podref"}"#,
    printcolumn = r#"{"name":"Interface","type":"string","jsonPath":".spec.ifname"}"#,
    printcolumn = r#"{"name":"Age","type":"date","jsonPath":".metadata.creationTimestamp"}"#
)]
/// Who holds the address (the reservation's name encodes the address and network).
pub struct OverlappingRangeIPReservationSpec {
    /// Container ID of the attachment.
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub containerid: String,
    /// `<namespace>/<pod name>`.
    pub podref: String,
    /// The pod interface (`net1`).
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub ifname: String,
    /// UID of the pod (from `K8S_POD_UID`), when the runtime passed it.
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub poduid: String,
    /// The node that made the claim, as on the pool entry.
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub node: String,
    /// The IPAMClaim holding the address, as on the pool entry.
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub ipamclaimref: String,
    /// The StatefulSet holding the address, as on the pool entry (so that a writer recording
    /// this claim for its claimant records the entry whole).
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub statefulset: String,
}

impl From<&IPAllocation> for OverlappingRangeIPReservationSpec {
    /// The claim that backs `entry`: the audit re-creates it when it went missing.
    fn from(entry: &IPAllocation) -> Self {
        OverlappingRangeIPReservationSpec {
            containerid: entry.id.clone(),
            podref: entry.podref.clone(),
            ifname: entry.ifname.clone(),
            poduid: entry.poduid.clone(),
            node: entry.node.clone(),
            ipamclaimref: entry.ipamclaimref.clone(),
            statefulset: entry.statefulset.clone(),
        }
    }
}

#[derive(
    CustomResource, Serialize, Deserialize, Clone, Debug, Default, PartialEq, Eq, JsonSchema,
)]
#[kube(
    group = "whereabouts.cni.cncf.io",
    version = "v1alpha1",
    kind = "NodeSlicePool",
    plural = "nodeslicepools",
    namespaced,
    status = "NodeSlicePoolStatus",
    doc = "The node slices of one range (upstream's fast IPAM, node_slice_size): each node allocates from the IPPools of its slices. Written by the operator; a node takes a free slice when its own are full.",
    printcolumn = r#"{"name":"Range","type":"string","jsonPath":".spec.range"}"#,
    printcolumn = r#"{"name":"Slice","type":"string","jsonPath":".spec.sliceSize"}"#,
    printcolumn = r#"{"name":"Age","type":"date","jsonPath":".metadata.creationTimestamp"}"#
)]
/// The range and how it is cut.
pub struct NodeSlicePoolSpec {
    /// The whole range, as a CIDR with the host bits cleared (`10.0.0.0/16`).
    pub range: String,
    /// The slice size as configured (`node_slice_size`, for example `/24` or `24`).
    #[serde(rename = "sliceSize")]
    pub slice_size: String,
}

/// The slices and the nodes they are assigned to.
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, Eq, JsonSchema)]
pub struct NodeSlicePoolStatus {
    /// Every slice of the range in ascending order, with the node it is assigned to.
    #[serde(default)]
    pub allocations: Vec<NodeSliceAllocation>,
}

#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, Eq, JsonSchema)]
pub struct NodeSliceAllocation {
    /// The node that allocates from this slice; empty when the slice is free.
    #[serde(rename = "nodeName")]
    pub node_name: String,
    /// The slice, as a CIDR (`10.0.4.0/24`); its pool is `[<network_name>-]<node>-<slice>`.
    #[serde(rename = "sliceRange")]
    pub slice_range: String,
}

/// The Multus NetworkAttachmentDefinition; `spec.config` is the network config as a JSON string.
#[derive(
    CustomResource, Serialize, Deserialize, Clone, Debug, Default, PartialEq, Eq, JsonSchema,
)]
#[kube(
    group = "k8s.cni.cncf.io",
    version = "v1",
    kind = "NetworkAttachmentDefinition",
    plural = "network-attachment-definitions",
    singular = "network-attachment-definition",
    shortname = "net-attach-def",
    namespaced,
    doc = "A secondary network a pod can attach to (Multus)."
)]
/// The network's CNI configuration.
pub struct NetworkAttachmentDefinitionSpec {
    /// The CNI network configuration (a plugin config or a conflist) as a JSON string.
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub config: String,
}

/// A persistent address request (KubeVirt's ipam-extensions, OVN-Kubernetes): the pods that refer
/// to it in their network-selection element (`ipam-claim-reference`) get the addresses in its
/// status, allocated once and kept until the claim is deleted.
#[derive(
    CustomResource, Serialize, Deserialize, Clone, Debug, Default, PartialEq, Eq, JsonSchema,
)]
#[kube(
    group = "k8s.cni.cncf.io",
    version = "v1alpha1",
    kind = "IPAMClaim",
    plural = "ipamclaims",
    namespaced,
    status = "IPAMClaimStatus",
    doc = "A claim on persistent IP addresses of one network and interface, kept across the pods that refer to it.",
    printcolumn = r#"{"name":"Network","type":"string","jsonPath":".spec.network"}"#,
    printcolumn = r#"{"name":"Interface","type":"string","jsonPath":".spec.interface"}"#,
    printcolumn = r#"{"name":"IPs","type":"string","jsonPath":".status.ips"}"#,
    printcolumn = r#"{"name":"Owner","type":"string","jsonPath":".status.ownerPod.name"}"#,
    printcolumn = r#"{"name":"Age","type":"date","jsonPath":".metadata.creationTimestamp"}"#
)]
pub struct IPAMClaimSpec {
    /// The network the claim is for (the network config's `name`).
    pub network: String,
    /// The pod interface the addresses are for (`net1`).
    pub interface: String,
}

/// What the IPAM recorded for the claim.
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, Eq, JsonSchema)]
pub struct IPAMClaimStatus {
    /// The claimed addresses with their prefix lengths (`10.0.0.5/24`); set once.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub ips: Vec<String>,
    /// The pod the addresses were last given to.
    #[serde(rename = "ownerPod", default, skip_serializing_if = "Option::is_none")]
    pub owner_pod: Option<OwnerPod>,
    /// `IPsAllocated`, with reason `SuccessfulAllocation`, `SubnetExhausted`,
    /// `IPAddressConflict` or `InternalError`.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub conditions: Vec<ClaimCondition>,
}

/// A `metav1.Condition` (the k8s-openapi type has no schema to generate the CRD from).
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, Eq, JsonSchema)]
pub struct ClaimCondition {
    /// `IPsAllocated`.
    #[serde(rename = "type")]
    pub type_: String,
    /// `True`, `False` or `Unknown`.
    pub status: String,
    /// Why, in one CamelCase word.
    pub reason: String,
    /// Why, in words.
    pub message: String,
    /// RFC 3339, when the status last changed.
    #[serde(rename = "lastTransitionTime")]
    pub last_transition_time: String,
    #[serde(
        rename = "observedGeneration",
        default,
        skip_serializing_if = "Option::is_none"
    )]
    /// The claim's `metadata.generation` the condition was set for.
    pub observed_generation: Option<i64>,
}

/// The pod a claim's addresses were last given to.
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, Eq, JsonSchema)]
pub struct OwnerPod {
    /// The pod's name (in the claim's namespace).
    pub name: String,
}

/// NodeSlicePool as upstream defines it: `status` is part of the object, not a subresource (the
/// derive would make one), so one PUT writes spec and status, by the operator and by a node
/// taking a free slice, exactly as upstream's controller writes it.
fn node_slice_pool_crd()
-> k8s_openapi::apiextensions_apiserver::pkg::apis::apiextensions::v1::CustomResourceDefinition {
    use kube::CustomResourceExt;
    let mut crd = NodeSlicePool::crd();
    for version in &mut crd.spec.versions {
        version.subresources = None;
    }
    crd
}

/// Every CRD this project ships, in the order `crds/` lists them.
pub fn all() -> Vec<(
    &'static str,
    k8s_openapi::apiextensions_apiserver::pkg::apis::apiextensions::v1::CustomResourceDefinition,
)> {
    use kube::CustomResourceExt;
    vec![
        ("ippools.yaml", IPPool::crd()),
        (
            "overlappingrangeipreservations.yaml",
            OverlappingRangeIPReservation::crd(),
        ),
        ("nodeslicepools.yaml", node_slice_pool_crd()),
        ("ipamclaims.yaml", IPAMClaim::crd()),
        (
            "network-attachment-definitions.yaml",
            NetworkAttachmentDefinition::crd(),
        ),
    ]
}

/// The YAML text of a CRD as checked in under `crds/`.
pub fn to_yaml(
    crd: &k8s_openapi::apiextensions_apiserver::pkg::apis::apiextensions::v1::CustomResourceDefinition,
) -> String {
    format!(
        "# Generated by `whereabouts-operator crds`; do not edit.\n{}",
        // One line per description, as kubectl prints them, rather than folded blocks.
        serde_saphyr::to_string_with_options(
            crd,
            serde_saphyr::ser_options! { prefer_block_scalars: false },
        )
        .expect("CRDs serialise")
    )
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn upstream_pool_reads_and_writes_back_identically() {
        let upstream = json!({"range": "192.168.2.0/24", "allocations": {"5": {"id": "abc", "podref": "ns/p", "ifname": "net1"}, "18446744073709551620": {"id": "x", "podref": "ns/q"}}});
        let spec: IPPoolSpec = serde_json::from_value(upstream.clone()).unwrap();
        assert_eq!(spec.allocations["5"].ifname, "net1");
        assert_eq!(serde_json::to_value(&spec).unwrap(), upstream);
    }

    /// `kubectl explain` describes every field: each property of every CRD has a description
    /// (from the Rust doc comments).
    #[test]
    fn every_crd_field_is_described() {
        fn walk(node: &serde_json::Value, path: &str, missing: &mut Vec<String>) {
            for (k, v) in node["properties"].as_object().into_iter().flatten() {
                if v.get("description").is_none()
                    && !["apiVersion", "kind", "metadata"].contains(&k.as_str())
                {
                    missing.push(format!("{path}.{k}"));
                }
                walk(v, &format!("{path}.{k}"), missing);
            }
            for nested in ["items", "additionalProperties"] {
                if node[nested].is_object() {
                    walk(&node[nested], &format!("{path}[]"), missing);
                }
            }
        }
        let mut missing = Vec::new();
        for (file, crd) in all() {
            for v in &crd.spec.versions {
                let schema = serde_json::to_value(&v.schema).unwrap();
                walk(&schema["openAPIV3Schema"], file, &mut missing);
            }
        }
        assert!(
            missing.is_empty(),
            "fields without a description: {missing:?}"
        );
    }

    #[test]
    fn generated_crds_match_the_checked_in_files() {
        let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("crds");
        for (file, crd) in all() {
            let on_disk = std::fs::read_to_string(dir.join(file)).unwrap_or_default();
            assert_eq!(
                on_disk,
                to_yaml(&crd),
                "crds/{file} drifted from the Rust types: run `make crds`"
            );
        }
    }
}
