//! IPAMClaim records checked against their pods. A node's credentials may record the first
//! addresses of any claim: the API server cannot tell which node a claim's pod runs on, so the
//! claims policy can only make each record name the node that wrote it (`RecordedBy`,
//! [`crate::crd::claim`]). The operator can tell: a record is made by the ADD of the claim's owner
//! pod, so while it is fresh that pod exists, runs on the node the record names, and refers to the
//! claim for the claim's interface. A fresh record that does not is reported: a Warning Event
//! `ClaimRecordUnverified` on the claim, and `whereabouts_claim_records_unverified_total`.
//!
//! It is reported, not undone: a pod deleted right after its ADD looks the same as a forged
//! record, and clearing a claim's addresses would move a VM's address. A record already older than
//! [`FRESH`] when the operator first sees it (after an outage) is not checked: its pod may be long
//! gone for honest reasons. Its age is the API server's (the time of the status's managedFields
//! entries), never the condition's own time, which the writing node sets and could backdate.

use std::collections::HashSet;
use std::time::Duration;

use k8s_openapi::api::core::v1::ObjectReference;
use k8s_openapi::jiff::Timestamp;

use super::Context;
use crate::crd::IPAMClaim;
use crate::crd::claim::{claim_reference, record_condition};
use crate::store::{NETWORKS_ANNOTATION, StoreError};

/// How long after it was written a record is checked.
pub const FRESH: Duration = Duration::from_secs(600);

/// A claim's record: what a node wrote, and when.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct Record {
    pub namespace: String,
    pub claim: String,
    pub uid: String,
    pub interface: String,
    pub ips: Vec<String>,
    pub owner_pod: String,
    pub node: String,
    /// When the claim's status was last written, by the API server's clock.
    pub written: Option<Timestamp>,
}

impl Record {
    /// The claim's record, when a node wrote one (an owner pod, named in `RecordedBy`).
    pub fn of(c: &IPAMClaim) -> Option<Record> {
        let status = c.status.as_ref()?;
        let recorded = record_condition(status)?;
        Some(Record {
            namespace: c.metadata.namespace.clone()?,
            claim: c.metadata.name.clone()?,
            uid: c.metadata.uid.clone().unwrap_or_default(),
            interface: c.spec.interface.clone(),
            ips: status.ips.clone(),
            owner_pod: status.owner_pod.as_ref()?.name.clone(),
            node: recorded.message.clone(),
            written: status_written(c),
        })
    }

    /// Whether it was written less than [`FRESH`] before `now` (one of unknown age is not).
    pub fn is_fresh(&self, now: Timestamp) -> bool {
        self.written
            .is_some_and(|w| now.duration_since(w).as_secs_f64() < FRESH.as_secs_f64())
    }
}

/// When the claim's status was last written, as the API server recorded it: the latest `time` of
/// the managedFields entries of the status subresource.
fn status_written(c: &IPAMClaim) -> Option<Timestamp> {
    (c.metadata.managed_fields.iter().flatten())
        .filter(|m| m.subresource.as_deref() == Some("status"))
        .filter_map(|m| m.time.as_ref().map(|t| t.0))
        .max()
}

/// What the API server says of a record's owner pod.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct OwnerSeen {
    pub node: Option<String>,
    /// The claim its network-selection element for the claim's interface refers to.
    pub refers_to: Option<String>,
}

/// Why a record cannot be verified against its owner pod (`None`: absent), if it cannot.
pub fn why_unverified(r: &Record, pod: Option<&OwnerSeen>) -> Option<String> {
    let pod_name = format!("{}/{}", r.namespace, r.owner_pod);
    let Some(pod) = pod else {
        return Some(format!("its owner pod {pod_name} does not exist"));
    };
    if pod.node.as_deref() != Some(r.node.as_str()) {
        let on = pod.node.as_deref().unwrap_or("no node");
        return Some(format!("its owner pod {pod_name} runs on {on}"));
    }
    if pod.refers_to.as_deref() != Some(r.claim.as_str()) {
        return Some(format!(
            "its owner pod {pod_name} does not refer to it for interface {}",
            r.interface
        ));
    }
    None
}

/// Checks every fresh record not checked before (`checked`, pruned to the fresh records the cache
/// still holds: one that went stale is never checked again). Returns how many were reported.
pub async fn check(ctx: &Context, checked: &mut HashSet<Record>) -> Result<usize, StoreError> {
    let now = Timestamp::now();
    let fresh: HashSet<Record> = (ctx.caches.claims.state().iter())
        .filter_map(|c| Record::of(c))
        .filter(|r| r.is_fresh(now))
        .collect();
    checked.retain(|r| fresh.contains(r));
    let mut reported = 0;
    for record in fresh {
        if checked.contains(&record) {
            continue;
        }
        let pod = owner_now(ctx, &record).await?;
        if let Some(why) = why_unverified(&record, pod.as_ref()) {
            report(ctx, &record, &why).await;
            reported += 1;
        }
        checked.insert(record);
    }
    Ok(reported)
}

/// The owner pod as the API server has it now (the pod cache keeps neither the networks
/// annotation nor, before it lists, the pod).
async fn owner_now(ctx: &Context, r: &Record) -> Result<Option<OwnerSeen>, StoreError> {
    let pod = ctx.full_pod_now(&r.namespace, &r.owner_pod).await?;
    Ok(pod.map(|p| {
        let networks = (p.metadata.annotations.as_ref()).and_then(|a| a.get(NETWORKS_ANNOTATION));
        OwnerSeen {
            node: p.spec.and_then(|s| s.node_name),
            refers_to: claim_reference(networks.map(String::as_str), &r.interface)
                .ok()
                .flatten(),
        }
    }))
}

async fn report(ctx: &Context, r: &Record, why: &str) {
    let note = format!(
        "the record of IPAMClaim {}/{} ({}, owner pod {}) names node {} as its writer, but {why}: \
         compare the addresses with the VM's; a node that records a claim its pods do not use may \
         be compromised",
        r.namespace,
        r.claim,
        r.ips.join(", "),
        r.owner_pod,
        r.node
    );
    tracing::warn!(claim = %format!("{}/{}", r.namespace, r.claim), node = %r.node, why, "an IPAMClaim record could not be verified");
    let about = ObjectReference {
        uid: Some(r.uid.clone()).filter(|u| !u.is_empty()),
        ..super::holders::ipam_claim_object(&r.namespace, &r.claim)
    };
    ctx.event(&about, true, "ClaimRecordUnverified", &note)
        .await;
    ctx.metrics.claim_records_unverified.inc();
}

#[cfg(test)]
mod tests {
    use super::*;
    use k8s_openapi::apimachinery::pkg::apis::meta::v1::{ManagedFieldsEntry, Time};

    fn record() -> Record {
        Record {
            namespace: "vms".into(),
            claim: "vm1.net".into(),
            uid: "u".into(),
            interface: "net1".into(),
            ips: vec!["10.0.0.5/24".into()],
            owner_pod: "launcher".into(),
            node: "a".into(),
            written: Some(at("2026-12-06T10:00:00Z")),
        }
    }

    fn at(t: &str) -> Timestamp {
        t.parse().unwrap()
    }

    #[test]
    fn a_record_is_verified_by_a_pod_on_its_node_that_refers_to_the_claim() {
        let r = record();
        let seen = |node: Option<&str>, claim: Option<&str>| OwnerSeen {
            node: node.map(Into::into),
            refers_to: claim.map(Into::into),
        };
        assert_eq!(
            why_unverified(&r, Some(&seen(Some("a"), Some("vm1.net")))),
            None
        );
        let cases = [
            (None, "its owner pod vms/launcher does not exist"),
            (
                Some(seen(Some("b"), Some("vm1.net"))),
                "its owner pod vms/launcher runs on b",
            ),
            (
                Some(seen(None, Some("vm1.net"))),
                "its owner pod vms/launcher runs on no node",
            ),
            (
                Some(seen(Some("a"), None)),
                "its owner pod vms/launcher does not refer to it for interface net1",
            ),
            (
                Some(seen(Some("a"), Some("vm2.net"))),
                "its owner pod vms/launcher does not refer to it for interface net1",
            ),
        ];
        for (pod, why) in cases {
            assert_eq!(
                why_unverified(&r, pod.as_ref()).as_deref(),
                Some(why),
                "{pod:?}"
            );
        }
    }

    #[test]
    fn only_a_fresh_record_is_checked() {
        let r = record();
        assert!(r.is_fresh(at("2026-12-06T10:09:59Z")));
        assert!(!r.is_fresh(at("2026-12-06T10:10:00Z")));
        let bad = Record {
            written: None,
            ..record()
        };
        assert!(!bad.is_fresh(at("2026-12-06T10:00:01Z")));
    }

    #[test]
    fn a_claim_without_a_node_record_has_nothing_to_check() {
        let mut c = IPAMClaim::new("vm1.net", Default::default());
        c.metadata.namespace = Some("vms".into());
        assert_eq!(Record::of(&c), None);
        let mut status = crate::crd::IPAMClaimStatus {
            ips: vec!["10.0.0.5/24".into()],
            owner_pod: Some(crate::crd::OwnerPod {
                name: "launcher".into(),
            }),
            ..Default::default()
        };
        c.status = Some(status.clone());
        assert_eq!(Record::of(&c), None, "written before records named a node");
        // The condition says 2001: the age is the API server's, from the status's managers.
        let mut backdated = crate::crd::claim::recorded_by("a");
        backdated.last_transition_time = "2001-01-01T00:00:00Z".into();
        status.conditions.push(backdated);
        c.status = Some(status);
        let entry = |subresource: Option<&str>, t: &str| ManagedFieldsEntry {
            subresource: subresource.map(Into::into),
            time: Some(Time(at(t))),
            ..Default::default()
        };
        c.metadata.managed_fields = Some(vec![
            entry(None, "2026-12-06T11:00:00Z"),
            entry(Some("status"), "2026-12-06T10:00:00Z"),
            entry(Some("status"), "2026-12-06T10:05:00Z"),
        ]);
        let r = Record::of(&c).unwrap();
        assert_eq!((r.node.as_str(), r.owner_pod.as_str()), ("a", "launcher"));
        assert_eq!(r.written, Some(at("2026-12-06T10:05:00Z")));
        assert!(r.is_fresh(at("2026-12-06T10:14:00Z")));
    }
}
