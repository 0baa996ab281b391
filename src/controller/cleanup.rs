//! Releasing a pod's addresses when the pod goes away.
//!
//! A pod is due when it is deleted, reaches phase Succeeded or Failed, or is marked for deletion
//! after its node was lost. Its entries are found in the pool cache by the ownership rules (podref
//! and UID, or the network-status addresses for UID-less entries) and removed with conditional
//! writes, so an entry re-bound to a newer pod of the same name in the meantime is never touched.

use std::collections::BTreeMap;

use k8s_openapi::api::core::v1::{ObjectReference, Pod, PodStatus};
use kube::ResourceExt;

use super::Context;
use super::pools::entries_of_pod;
use crate::cni::allocate::release_entries;
use crate::ownership::{
    NETWORK_STATUS_ANNOTATION, PodIdentity, parse_network_status, secondary_addresses,
};
use crate::store::StoreError;

/// Keeps only what cleanup needs, so a cache of 10,000 pods stays small: name, namespace, UID,
/// deletion state, the network-status annotation, phase, reason and the DisruptionTarget condition.
pub fn trim(pod: &mut Pod) {
    pod.spec = None;
    let m = &mut pod.metadata;
    m.managed_fields = None;
    m.labels = None;
    m.owner_references = None;
    if let Some(a) = m.annotations.as_mut() {
        a.retain(|k, _| k == NETWORK_STATUS_ANNOTATION);
    }
    if let Some(s) = pod.status.take() {
        let conditions = s.conditions.map(|c| {
            c.into_iter()
                .filter(|c| c.type_ == "DisruptionTarget")
                .collect()
        });
        pod.status = Some(PodStatus {
            phase: s.phase,
            reason: s.reason,
            conditions,
            ..Default::default()
        });
    }
}

/// Why a pod's addresses are released.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Trigger {
    Deleted,
    Finished,
    NodeLost,
}

/// For a pod that still exists: is it done with its addresses?
pub fn finished(pod: &Pod) -> Option<Trigger> {
    let status = pod.status.as_ref()?;
    if matches!(status.phase.as_deref(), Some("Succeeded") | Some("Failed")) {
        return Some(Trigger::Finished);
    }
    let evicted = status.reason.as_deref() == Some("NodeLost")
        || status
            .conditions
            .iter()
            .flatten()
            .any(|c| c.type_ == "DisruptionTarget" && c.status == "True");
    (pod.metadata.deletion_timestamp.is_some() && evicted).then_some(Trigger::NodeLost)
}

/// The identity the ownership rules need. A malformed annotation is logged and treated as absent:
/// UID-carrying entries are still matched.
pub fn identity(pod: &Pod) -> PodIdentity {
    let podref = format!("{}/{}", pod.namespace().unwrap_or_default(), pod.name_any());
    let addresses = match pod.annotations().get(NETWORK_STATUS_ANNOTATION) {
        None => Vec::new(),
        Some(text) => match parse_network_status(text) {
            Ok(statuses) => secondary_addresses(&statuses),
            Err(p) => {
                tracing::warn!(pod = %podref, "{p}");
                Vec::new()
            }
        },
    };
    PodIdentity {
        podref,
        uid: pod.uid().unwrap_or_default(),
        addresses,
    }
}

pub fn reference(pod: &PodIdentity) -> ObjectReference {
    let (namespace, name) = pod.podref.split_once('/').unwrap_or_default();
    ObjectReference {
        api_version: Some("v1".into()),
        kind: Some("Pod".into()),
        namespace: Some(namespace.into()),
        name: Some(name.into()),
        uid: Some(pod.uid.clone()),
        ..Default::default()
    }
}

/// What a cleanup did: addresses released (pool -> addresses), and whether anything was found.
#[derive(Debug, Default)]
pub struct Outcome {
    pub released: BTreeMap<String, Vec<std::net::IpAddr>>,
    pub found: usize,
}

/// Releases every entry of `pod` found in the pool cache.
pub async fn release_pod(
    ctx: &Context,
    pod: &PodIdentity,
    trigger: Trigger,
) -> Result<Outcome, StoreError> {
    let pools = ctx.pool_views();
    let mut outcome = Outcome::default();
    for (view, entries) in entries_of_pod(&pools, pod) {
        outcome.found += entries.len();
        if ctx.opts.dry_run {
            let ips: Vec<_> = entries.iter().filter_map(|(o, _)| view.ip(*o)).collect();
            tracing::info!(pod = %pod.podref, pool = %view.name, ?ips, ?trigger, "dry run: would release");
            continue;
        }
        let (range, scope) = view.release_target();
        let ips = release_entries(&ctx.store, &range, scope, &view.name, &entries).await?;
        crate::metrics::record_releases("pod_deleted", ips.len());
        outcome.released.insert(view.name.clone(), ips);
    }
    // One event per pod (the recorder folds events of one reason on one object into a series).
    let released: Vec<String> = outcome
        .released
        .iter()
        .flat_map(|(pool, ips)| ips.iter().map(move |ip| format!("{ip} ({pool})")))
        .collect();
    if !released.is_empty() {
        ctx.event(
            &reference(pod),
            false,
            "AddressReleased",
            &format!("released {} ({trigger:?})", released.join(", ")),
        )
        .await;
    }
    Ok(outcome)
}

#[cfg(test)]
mod tests {
    use super::*;
    use k8s_openapi::api::core::v1::PodCondition;
    use kube::api::ObjectMeta;

    fn pod(phase: &str) -> Pod {
        Pod {
            metadata: ObjectMeta {
                name: Some("web-0".into()),
                namespace: Some("ns".into()),
                uid: Some("u1".into()),
                annotations: Some(
                    [
                        (
                            NETWORK_STATUS_ANNOTATION.to_owned(),
                            r#"[{"name":"ns/net","ips":["10.0.0.5"]}]"#.to_owned(),
                        ),
                        ("big".to_owned(), "x".repeat(1000)),
                    ]
                    .into(),
                ),
                ..Default::default()
            },
            spec: Some(Default::default()),
            status: Some(PodStatus {
                phase: Some(phase.into()),
                host_ip: Some("192.0.2.1".into()),
                ..Default::default()
            }),
        }
    }

    #[test]
    fn trimming_keeps_what_cleanup_needs() {
        let mut p = pod("Running");
        trim(&mut p);
        assert!(p.spec.is_none());
        assert_eq!(p.annotations().len(), 1);
        assert_eq!(p.status.as_ref().unwrap().host_ip, None);
        assert_eq!(
            identity(&p),
            PodIdentity {
                podref: "ns/web-0".into(),
                uid: "u1".into(),
                addresses: vec!["10.0.0.5".parse().unwrap()]
            }
        );
    }

    #[test]
    fn finished_pods() {
        assert_eq!(finished(&pod("Running")), None);
        assert_eq!(finished(&pod("Succeeded")), Some(Trigger::Finished));
        assert_eq!(finished(&pod("Failed")), Some(Trigger::Finished));
        let mut lost = pod("Running");
        lost.metadata.deletion_timestamp = Some(
            k8s_openapi::apimachinery::pkg::apis::meta::v1::Time(Default::default()),
        );
        assert_eq!(
            finished(&lost),
            None,
            "a graceful deletion is not a lost node"
        );
        lost.status.as_mut().unwrap().conditions = Some(vec![PodCondition {
            type_: "DisruptionTarget".into(),
            status: "True".into(),
            ..Default::default()
        }]);
        assert_eq!(finished(&lost), Some(Trigger::NodeLost));
    }

    #[test]
    fn a_bad_annotation_still_gives_an_identity() {
        let mut p = pod("Running");
        p.annotations_mut()
            .insert(NETWORK_STATUS_ANNOTATION.into(), "{oops".into());
        assert!(identity(&p).addresses.is_empty());
    }
}
