//! What an IPAMClaim says beyond its fields: the network-selection element of a pod that refers to
//! it, and the condition naming the node that recorded its addresses. Shared by the plugin, which
//! writes records, and the operator, which checks them against their pods.

use serde::Deserialize;

use super::{ClaimCondition, IPAMClaimStatus};

/// The condition that names the node whose credentials last recorded the claim's addresses or
/// owner pod: its message is the node's name, its transition time when it was written. The claims
/// policy (config/rbac/node-limits.yaml) requires a node's credentials to name their own node
/// here whenever they record either, so a claim always says which node wrote what it holds, and no
/// node can pass its record off as another's (docs/security.md).
pub const RECORDED_BY: &str = "whereabouts.cni.cncf.io/RecordedBy";

/// [`RECORDED_BY`] naming `node`, written now.
pub fn recorded_by(node: &str) -> ClaimCondition {
    ClaimCondition {
        type_: RECORDED_BY.into(),
        status: "True".into(),
        reason: "RecordedByNode".into(),
        message: node.into(),
        last_transition_time: now_rfc3339(),
        observed_generation: None,
    }
}

/// The claim's [`RECORDED_BY`], if any.
pub fn record_condition(status: &IPAMClaimStatus) -> Option<&ClaimCondition> {
    status.conditions.iter().find(|c| c.type_ == RECORDED_BY)
}

/// The node the claim's [`RECORDED_BY`] names, if any.
pub fn recorder(status: &IPAMClaimStatus) -> Option<&str> {
    record_condition(status).map(|c| c.message.as_str())
}

/// Now, as conditions write it.
pub fn now_rfc3339() -> String {
    k8s_openapi::jiff::Timestamp::now()
        .strftime("%Y-%m-%dT%H:%M:%SZ")
        .to_string()
}

/// One network-selection element, as far as claims go.
#[derive(Deserialize)]
struct Selection {
    #[serde(default)]
    interface: Option<String>,
    #[serde(rename = "ipam-claim-reference", default)]
    claim: Option<String>,
}

/// The `ipam-claim-reference` of the network-selection element for interface `ifname` in a pod's
/// `k8s.v1.cni.cncf.io/networks` annotation (`networks`). Multus names an element's interface
/// `net<position>` when it does not say, so both count. The annotation's short form
/// (`a,ns/b@eth1`) refers to no claims. Err: the annotation is a list that does not parse.
pub fn claim_reference(
    networks: Option<&str>,
    ifname: &str,
) -> Result<Option<String>, serde_json::Error> {
    let Some(text) = networks.map(str::trim).filter(|t| t.starts_with('[')) else {
        return Ok(None);
    };
    let elements: Vec<Selection> = serde_json::from_str(text)?;
    Ok(elements
        .into_iter()
        .enumerate()
        .find(|(i, e)| {
            e.interface
                .clone()
                .unwrap_or_else(|| format!("net{}", i + 1))
                == ifname
        })
        .and_then(|(_, e)| e.claim)
        .filter(|c| !c.is_empty()))
}
