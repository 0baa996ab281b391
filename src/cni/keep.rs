//! Addresses that stay past a pod. An ADD on a network that keeps addresses reads its pod, then
//! gives the attachment its holder: the IPAMClaim its network-selection element refers to
//! (`allowPersistentIPs`), else its StatefulSet (`sticky_statefulset`). A claim's `status.ips` are
//! the addresses to give again; after a first allocation they are written there, with the pod, the
//! `IPsAllocated` condition and the node that wrote them ([`RECORDED_BY`]).

use std::collections::BTreeSet;
use std::net::IpAddr;

use super::Request;
use super::protocol::{CniError, Code};
use super::requested::{self, Requested};
use crate::alloc::{Engine, Holder, Owner, Target};
use crate::crd::claim::{RECORDED_BY, now_rfc3339, recorded_by, recorder};
use crate::crd::{ClaimCondition, IPAMClaim, IPAMClaimStatus, IPAllocation, OwnerPod};
use crate::store::{Datastore, NETWORKS_ANNOTATION, StoreError, Write};

/// The attachment with its holder, and the claim behind it, if any.
pub struct Kept {
    pub who: Owner,
    pub claim: Option<IPAMClaim>,
}

/// Reads what keeps this ADD's addresses (nothing is read on networks that keep none).
pub async fn resolve<S: Datastore>(store: &S, req: &Request) -> Result<Kept, CniError> {
    let mut who = req.attachment.clone();
    if !req.keep.sticky_statefulset && !req.keep.persistent_ips {
        return Ok(Kept { who, claim: None });
    }
    let (ns, name) = (&req.args.pod_namespace, &req.args.pod_name);
    let pod = store
        .get_pod(ns, name)
        .await
        .map_err(datastore)?
        .ok_or_else(|| {
            CniError::new(
                Code::TryAgainLater,
                format!(
                    "pod {ns}/{name} is not in the API server: cannot tell which addresses it keeps"
                ),
            )
        })?;
    if req.keep.persistent_ips
        && let Some(claim_name) = claim_reference(pod.networks.as_deref(), &who.ifname)?
    {
        let claim = store
            .get_ipam_claim(ns, &claim_name)
            .await
            .map_err(datastore)?
            .ok_or_else(|| {
                CniError::new(
                    Code::TryAgainLater,
                    format!("IPAMClaim {ns}/{claim_name}, which pod {ns}/{name} refers to for interface {}, does not exist", who.ifname),
                )
            })?;
        check_claim_spec(&claim, &req.conf.name, &who.ifname)?;
        who.holder = Holder::Claim(format!("{ns}/{claim_name}"));
        return Ok(Kept {
            who,
            claim: Some(claim),
        });
    }
    if req.keep.sticky_statefulset
        && let Some(statefulset) = pod.statefulset
    {
        who.holder = Holder::StatefulSet(statefulset);
    }
    Ok(Kept { who, claim: None })
}

/// A claim is for one network and interface (KubeVirt names both): a reference from another is
/// a mistake to name, not an address to give.
fn check_claim_spec(claim: &IPAMClaim, network: &str, ifname: &str) -> Result<(), CniError> {
    let spec = &claim.spec;
    if spec.network == network && spec.interface == ifname {
        return Ok(());
    }
    Err(CniError::new(
        Code::InvalidConfig,
        format!(
            "IPAMClaim {} is for network {:?} interface {:?}, but this ADD is for network {network:?} interface {ifname:?}",
            key(claim),
            spec.network,
            spec.interface
        ),
    ))
}

/// The `ipam-claim-reference` of the pod's network-selection element for interface `ifname`
/// ([`crate::crd::claim::claim_reference`]).
pub fn claim_reference(networks: Option<&str>, ifname: &str) -> Result<Option<String>, CniError> {
    crate::crd::claim::claim_reference(networks, ifname).map_err(|e| {
        CniError::new(
            Code::InvalidConfig,
            format!("pod annotation {NETWORKS_ANNOTATION} is not a list of network-selection elements: {e}"),
        )
    })
}

/// The claim's `status.ips` as requested addresses.
pub fn claimed(claim: &IPAMClaim) -> Result<Vec<Requested>, CniError> {
    let ips = claim
        .status
        .as_ref()
        .map(|s| s.ips.as_slice())
        .unwrap_or_default();
    ips.iter()
        .enumerate()
        .map(|(i, text)| {
            let ip = requested::parse(text).ok_or_else(|| {
                CniError::new(
                    Code::InvalidConfig,
                    format!(
                        "IPAMClaim {} status.ips[{i}]: {text:?} is not an IP address",
                        key(claim)
                    ),
                )
            })?;
            Ok(Requested {
                field: format!("IPAMClaim {} status.ips[{i}]", key(claim)),
                ip,
            })
        })
        .collect()
}

/// Records a successful allocation on the claim: its addresses (with their prefix lengths), the
/// pod, and `IPsAllocated`. Nothing is written when the claim already says all that. Written at
/// the version read; when another ADD wrote the claim meanwhile (the other pod of a live
/// migration), it is read again and written again if it still holds these addresses, else this
/// ADD fails to be retried: the addresses the claim records are the claim's.
pub async fn record<S: Datastore>(
    store: &S,
    claim: &IPAMClaim,
    ips: &[ipnet::IpNet],
    pod: &str,
    node: Option<&str>,
) -> Result<(), CniError> {
    let texts: Vec<String> = ips.iter().map(ToString::to_string).collect();
    let ours: BTreeSet<IpAddr> = ips.iter().map(ipnet::IpNet::addr).collect();
    let mut claim = claim.clone();
    for _ in 0..RECORD_ATTEMPTS {
        let mut status = claim.status.clone().unwrap_or_default();
        // The claim's addresses, whatever their order or prefix length, may only grow (a range
        // added to the network): a claim recording others was given them by another ADD.
        let recorded: BTreeSet<IpAddr> = status
            .ips
            .iter()
            .filter_map(|t| requested::parse(t))
            .collect();
        if !recorded.is_subset(&ours) {
            let recorded: Vec<String> = recorded.iter().map(ToString::to_string).collect();
            return Err(CniError::new(
                Code::TryAgainLater,
                format!(
                    "IPAMClaim {} records {} but this ADD was given {}: another pod's ADD recorded the claim first; retrying takes the claim's addresses",
                    key(&claim),
                    recorded.join(", "),
                    texts.join(", ")
                ),
            ));
        }
        let owner = Some(OwnerPod {
            name: pod.to_owned(),
        });
        let allocated = condition(
            "True",
            "SuccessfulAllocation",
            "addresses allocated by whereabouts",
        );
        if status.ips == texts
            && status.owner_pod == owner
            && has_condition(&status, &allocated)
            && node.is_none_or(|n| recorder(&status) == Some(n))
        {
            return Ok(());
        }
        status.ips = texts.clone();
        status.owner_pod = owner;
        set_condition(&mut status, allocated);
        // Written anew: its time says when the record was made (for people; the operator
        // measures a record's age by the API server's clock).
        if let Some(node) = node {
            status.conditions.retain(|c| c.type_ != RECORDED_BY);
            status.conditions.push(recorded_by(node));
        }
        if store
            .write_ipam_claim_status(&claim, &status)
            .await
            .map_err(datastore)?
            == Write::Done
        {
            return Ok(());
        }
        let (ns, name) = (
            claim.metadata.namespace.clone().unwrap_or_default(),
            claim.metadata.name.clone().unwrap_or_default(),
        );
        match store.get_ipam_claim(&ns, &name).await.map_err(datastore)? {
            Some(fresh) => claim = fresh,
            None => break,
        }
    }
    Err(CniError::new(
        Code::TryAgainLater,
        format!(
            "IPAMClaim {} changed while its addresses were allocated; retrying takes the claim's addresses",
            key(&claim)
        ),
    ))
}

/// Writes of a claim's status lost to other writers before an ADD gives up (and is retried).
const RECORD_ATTEMPTS: usize = 5;

/// Says on the claim why its addresses could not be given (best effort: the ADD's own error is
/// what the runtime reports).
pub async fn report_failure<S: Datastore>(store: &S, claim: &IPAMClaim, error: &CniError) {
    let reason = match error.code {
        Code::Exhausted => "SubnetExhausted",
        Code::AddressUnavailable => "IPAddressConflict",
        _ => "InternalError",
    };
    let mut status = claim.status.clone().unwrap_or_default();
    set_condition(&mut status, condition("False", reason, &error.msg));
    if let Err(e) = store.write_ipam_claim_status(claim, &status).await {
        tracing::warn!(claim = %key(claim), error = %e, "could not report the failure on the IPAMClaim");
    }
}

/// A DEL's part for addresses whose IPAMClaim is gone: the entries this attachment's container
/// holds in `target`'s pool for a claim that no longer exists are released like its own. Deleting
/// a claim frees its addresses once no pod holds them, and the pod whose sandbox this DEL removes
/// was the last to hold them here (the operator keeps the entry while a pod of the claim exists).
pub async fn release_unclaimed<S: Datastore>(
    store: &S,
    target: &Target,
    who: &Owner,
) -> Result<Vec<IpAddr>, StoreError> {
    let Some(pool) = store.get_pool(&target.pool).await? else {
        return Ok(Vec::new());
    };
    let held: Vec<(u128, IPAllocation)> = pool
        .allocations
        .iter()
        .filter(|(_, e)| {
            e.id == who.container_id && e.ifname == who.ifname && !e.ipamclaimref.is_empty()
        })
        .map(|(o, e)| (*o, e.clone()))
        .collect();
    let mut gone = Vec::new();
    for (offset, entry) in held {
        let (ns, name) = entry.ipamclaimref.split_once('/').unwrap_or_default();
        if store.get_ipam_claim(ns, name).await?.is_none() {
            gone.push((offset, entry));
        }
    }
    if gone.is_empty() {
        return Ok(Vec::new());
    }
    Engine::new(store, target).release_entries(&gone).await
}

fn condition(status: &str, reason: &str, message: &str) -> ClaimCondition {
    ClaimCondition {
        type_: "IPsAllocated".into(),
        status: status.into(),
        reason: reason.into(),
        message: message.into(),
        last_transition_time: now_rfc3339(),
        observed_generation: None,
    }
}

fn has_condition(status: &IPAMClaimStatus, c: &ClaimCondition) -> bool {
    status
        .conditions
        .iter()
        .any(|o| o.type_ == c.type_ && o.status == c.status && o.reason == c.reason)
}

/// Replaces the condition of the same type; its transition time moves only when its status does.
fn set_condition(status: &mut IPAMClaimStatus, mut c: ClaimCondition) {
    if let Some(old) = status.conditions.iter_mut().find(|o| o.type_ == c.type_) {
        if old.status == c.status {
            c.last_transition_time = old.last_transition_time.clone();
        }
        *old = c;
    } else {
        status.conditions.push(c);
    }
}

fn key(claim: &IPAMClaim) -> String {
    format!(
        "{}/{}",
        claim.metadata.namespace.as_deref().unwrap_or_default(),
        claim.metadata.name.as_deref().unwrap_or_default()
    )
}

fn datastore(e: StoreError) -> CniError {
    CniError::datastore(&e)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_element_of_the_interface_names_the_claim() {
        let text = r#"[{"name":"other"},{"name":"tenant","ipam-claim-reference":"vm1.tenant"},
            {"name":"x","interface":"eth7","ipam-claim-reference":"vm1.x"}]"#;
        let got = |ifname| claim_reference(Some(text), ifname).unwrap();
        assert_eq!(got("net2").as_deref(), Some("vm1.tenant"));
        assert_eq!(got("eth7").as_deref(), Some("vm1.x"));
        assert_eq!(got("net1"), None);
        assert_eq!(got("net3"), None, "the third element names its interface");
        assert_eq!(claim_reference(Some("a,ns/b@net2"), "net2").unwrap(), None);
        assert_eq!(claim_reference(None, "net1").unwrap(), None);
        let e = claim_reference(Some("[{"), "net1").unwrap_err();
        assert!(
            e.msg
                .starts_with("pod annotation k8s.v1.cni.cncf.io/networks is not"),
            "{}",
            e.msg
        );
    }

    #[test]
    fn conditions_keep_their_transition_time_while_unchanged() {
        let mut status = IPAMClaimStatus::default();
        let mut first = condition("True", "SuccessfulAllocation", "m");
        first.last_transition_time = "2020-01-01T00:00:00Z".into();
        set_condition(&mut status, first);
        set_condition(
            &mut status,
            condition("True", "SuccessfulAllocation", "again"),
        );
        assert_eq!(status.conditions.len(), 1);
        assert_eq!(
            status.conditions[0].last_transition_time,
            "2020-01-01T00:00:00Z"
        );
        set_condition(&mut status, condition("False", "SubnetExhausted", "full"));
        assert_eq!(status.conditions.len(), 1);
        assert_ne!(
            status.conditions[0].last_transition_time,
            "2020-01-01T00:00:00Z"
        );
    }
}
