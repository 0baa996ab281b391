//! Releasing a pod's addresses when the pod goes away.
//!
//! A pod is due when it is deleted, reaches phase Succeeded or Failed, or is marked for deletion
//! after its node was lost (the taint manager's eviction, or `NodeLost`, of a pod whose node is
//! not Ready). A graceful termination on a live node is not due: drains, preemption and evictions
//! mark the pod (`DisruptionTarget`) when its containers start stopping, and they may run for
//! the whole grace period; the kubelet's DEL frees the addresses when the sandbox goes. Its entries are found in the pool cache by the ownership rules (podref
//! and UID, or the network-status addresses for UID-less entries) and removed with conditional
//! writes, so an entry re-bound to a newer pod of the same name in the meantime is never touched.

use std::collections::{BTreeMap, BTreeSet};

use k8s_openapi::api::core::v1::{Node, ObjectReference, Pod, PodSpec, PodStatus};
use kube::ResourceExt;
use kube::runtime::reflector::{ObjectRef, Store};

use super::Context;
use super::pools::{PoolView, entries_of_pod};
use crate::alloc::announce::{HeldClaim, announce};
use crate::alloc::remove_entries;
use crate::crd::IPAllocation;
use crate::ownership::{
    MIRROR_ANNOTATION, NETWORK_STATUS_ANNOTATION, Owned, PodIdentity, parse_network_status,
    secondary_addresses,
};
use crate::store::StoreError;
use crate::store::{CLAIMED_LABEL, Datastore, listable_claim};

/// Keeps only what cleanup needs, so a cache of 10,000 pods stays small: name, namespace, UID,
/// deletion state, the network-status annotation, the node, phase, reason and the
/// DisruptionTarget condition.
pub fn trim(pod: &mut Pod) {
    pod.spec = pod.spec.take().map(|s| PodSpec {
        node_name: s.node_name,
        ..Default::default()
    });
    let m = &mut pod.metadata;
    m.managed_fields = None;
    m.labels = None;
    m.owner_references = None;
    if let Some(a) = m.annotations.as_mut() {
        a.retain(|k, _| k == NETWORK_STATUS_ANNOTATION || k == MIRROR_ANNOTATION);
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

/// What the operator's Node cache says of a pod's node.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum NodeHealth {
    /// Ready: its kubelet runs the pod's containers and will run its DEL.
    Ready,
    /// NotReady or Unknown: its kubelet may be gone, or only cut off.
    NotReady,
    /// No such node (or the pod names none): nothing of the pod runs anywhere.
    Gone,
}

/// The node `pod` is bound to, if any.
pub fn node_of(pod: &Pod) -> Option<String> {
    pod.spec
        .as_ref()?
        .node_name
        .clone()
        .filter(|n| !n.is_empty())
}

/// The health of `pod`'s node, from `nodes` (trimmed by the watch to their Ready condition).
pub fn node_health(pod: &Pod, nodes: &Store<Node>) -> NodeHealth {
    health_of(node_of(pod).as_deref(), nodes)
}

/// The health of the node named `name` (none: a pod never scheduled), from `nodes`.
pub fn health_of(name: Option<&str>, nodes: &Store<Node>) -> NodeHealth {
    let Some(node) = name.and_then(|n| nodes.get(&ObjectRef::new(n))) else {
        return NodeHealth::Gone;
    };
    let ready = node
        .status
        .as_ref()
        .and_then(|s| s.conditions.as_ref())
        .into_iter()
        .flatten()
        .any(|c| c.type_ == "Ready" && c.status == "True");
    if ready {
        NodeHealth::Ready
    } else {
        NodeHealth::NotReady
    }
}

/// The DisruptionTarget reason of a pod whose node was lost: the taint manager evicts the pods of
/// a node that went NotReady or Unknown (as upstream whereabouts frees them).
const TAINT_MANAGER: &str = "DeletionByTaintManager";

/// For a pod that still exists: is it done with its addresses? Finished pods are; a pod marked
/// for deletion is only when its node is lost (the taint manager's eviction, or `NodeLost`) and
/// that node is not Ready. Every other termination is graceful: drains and autoscaler scale-down
/// (`EvictionByEvictionAPI`), preemption (`PreemptionByScheduler`), `DeletionByPodGC`,
/// `TerminationByKubelet` and plain deletes leave the containers running for their grace period,
/// and the kubelet's DEL frees the addresses when the sandbox goes.
pub fn finished(pod: &Pod, node: NodeHealth) -> Option<Trigger> {
    let status = pod.status.as_ref()?;
    if matches!(status.phase.as_deref(), Some("Succeeded") | Some("Failed")) {
        return Some(Trigger::Finished);
    }
    if pod.metadata.deletion_timestamp.is_none() || node == NodeHealth::Ready {
        return None;
    }
    let lost = status.reason.as_deref() == Some("NodeLost")
        || status.conditions.iter().flatten().any(|c| {
            c.type_ == "DisruptionTarget"
                && c.status == "True"
                && c.reason.as_deref() == Some(TAINT_MANAGER)
        });
    lost.then_some(Trigger::NodeLost)
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
    release_pods(ctx, &[(pod.clone(), trigger)])
        .await
        .pop()
        .expect("one outcome per pod")
}

/// An entry due for release: offset, entry, and the index of its pod in the batch.
type Due = (u128, IPAllocation, usize);

/// Requests in flight at once for the independent per-address and per-pod calls (reservation
/// deletes, events); the pool itself is written once per batch.
const PARALLEL_CALLS: usize = 8;

/// Releases the entries of many pods: each pool is written once for all of them (see
/// [`remove_entries`]), then the released addresses' reservations are deleted and one event per
/// pod is published. Returns one outcome per pod, in order; a pool that cannot be written makes
/// an error for every pod with entries in it, for the retry queue.
pub async fn release_pods(
    ctx: &Context,
    pods: &[(PodIdentity, Trigger)],
) -> Vec<Result<Outcome, StoreError>> {
    let views = ctx.pool_views();
    let mut outcomes: Vec<Result<Outcome, StoreError>> =
        pods.iter().map(|_| Ok(Outcome::default())).collect();
    let mut by_pool: BTreeMap<&str, (&PoolView, Vec<Due>)> = BTreeMap::new();
    for (i, (pod, _)) in pods.iter().enumerate() {
        for (view, entries) in entries_of_pod(&views, pod) {
            if let Ok(o) = &mut outcomes[i] {
                o.found += entries.len();
            }
            let slot = by_pool.entry(&view.name).or_insert((view, Vec::new()));
            slot.1.extend(entries.into_iter().map(|(o, e)| (o, e, i)));
        }
    }
    let uidless: BTreeSet<usize> = by_pool
        .values()
        .flat_map(|(_, due)| due.iter())
        .filter(|(_, e, _)| e.poduid.is_empty())
        .map(|(_, _, i)| *i)
        .collect();
    let keep = replaced(ctx, pods, &uidless, &mut outcomes).await;
    for (_, due) in by_pool.values_mut() {
        due.retain(|(_, e, i)| !(e.poduid.is_empty() && keep.contains(i)) && outcomes[*i].is_ok());
    }
    by_pool.retain(|_, (_, due)| !due.is_empty());
    for (pool, (view, entries)) in by_pool {
        if ctx.opts.dry_run {
            for (offset, entry, _) in &entries {
                tracing::info!(pod = %entry.podref, pool, ip = ?view.ip(*offset), "dry run: would release");
            }
            continue;
        }
        let result = release_in_pool(ctx, view, &entries).await;
        for (offset, _, i) in &entries {
            match (&result, &mut outcomes[*i]) {
                (Ok(removed), Ok(o)) if removed.contains(offset) => {
                    let ips = o.released.entry(pool.to_owned()).or_default();
                    ips.extend(view.ip(*offset));
                }
                (Ok(_), _) => {}
                (Err(e), slot) => *slot = Err(e.clone()),
            }
        }
    }
    publish_released(ctx, pods, &outcomes).await;
    outcomes
}

/// Of the pods at `indices` (those with UID-less entries due), the ones whose name a live pod of
/// another incarnation carries now: an entry without a pod UID (upstream's plugin, a runtime that
/// passes no `K8S_POD_UID`) matched by name and address may be that replacement's, refreshed by
/// its ADD, so it is kept. A failed read makes that pod's outcome an error, for the retry queue.
async fn replaced(
    ctx: &Context,
    pods: &[(PodIdentity, Trigger)],
    indices: &BTreeSet<usize>,
    outcomes: &mut [Result<Outcome, StoreError>],
) -> BTreeSet<usize> {
    let mut keep = BTreeSet::new();
    let list: Vec<usize> = indices.iter().copied().collect();
    for chunk in list.chunks(PARALLEL_CALLS) {
        let reads = chunk.iter().map(|i| ctx.pod_now(&pods[*i].0.podref));
        for (i, read) in chunk.iter().zip(futures::future::join_all(reads).await) {
            let uid = read.map(|p| p.map(|p| p.metadata.uid.unwrap_or_default()));
            match uid {
                Ok(Some(uid)) if uid != pods[*i].0.uid => {
                    tracing::info!(pod = %pods[*i].0.podref, %uid, "a pod of that name lives: its entries without a pod UID are kept");
                    keep.insert(*i);
                }
                Ok(_) => {}
                Err(e) => outcomes[*i] = Err(e),
            }
        }
    }
    keep
}

/// One pool's part of a batch: the entries' reservations read, and announced where a claims
/// list may still show them (see [`crate::alloc::announce`]), the entries removed in one
/// conditional write, then their reservations deleted. Returns the offsets removed.
async fn release_in_pool(
    ctx: &Context,
    view: &PoolView,
    entries: &[Due],
) -> Result<BTreeSet<u128>, StoreError> {
    let wanted: Vec<(u128, IPAllocation)> =
        entries.iter().map(|(o, e, _)| (*o, e.clone())).collect();
    let mut held = Vec::with_capacity(wanted.len());
    for chunk in wanted.chunks(PARALLEL_CALLS) {
        let reads = chunk
            .iter()
            .map(|(offset, entry)| held_reservation(ctx, view, *offset, entry));
        for read in futures::future::join_all(reads).await {
            held.push(read?);
        }
    }
    announce(&ctx.store, &mut held, PARALLEL_CALLS).await?;
    let announced = (wanted.iter().zip(&held))
        .filter(|(_, h)| h.as_ref().is_some_and(|h| h.announced))
        .map(|((o, _), _)| *o)
        .collect();
    let removed = remove_entries(&ctx.store, &view.name, &wanted, None, &announced).await?;
    ctx.metrics.record_releases("pod_deleted", removed.len());
    let removed: BTreeSet<u128> = removed.into_iter().map(|(o, _)| o).collect();
    // A reservation that cannot be deleted now does not undo the release (the address is free
    // in the pool); it is left for the audit, which removes claims without an entry.
    let due: Vec<&HeldClaim> = (wanted.iter().zip(&held))
        .filter(|((o, _), _)| removed.contains(o))
        .filter_map(|(_, h)| h.as_ref())
        .collect();
    for chunk in due.chunks(PARALLEL_CALLS) {
        let deletes = chunk.iter().map(|h| {
            ctx.store
                .delete_reservation(&h.name, &h.uid, Some(&h.resource_version))
        });
        for deleted in futures::future::join_all(deletes).await {
            if let Err(e) = deleted {
                tracing::warn!(pool = %view.name, error = %e, "reservation of a released address not deleted; the audit will");
                ctx.metrics.record_release_error("pod_deleted");
            }
        }
    }
    Ok(removed)
}

/// The reservation of an address to release, if it names the same pod, at the version to
/// delete it at: a reservation taken over by a new container of the pod since (a StatefulSet
/// replacement) changed version and is kept. The reservation cache supplies it; one the cache
/// does not have yet, or that a claims list may still show (announced first, which takes the
/// current version), is read.
async fn held_reservation(
    ctx: &Context,
    view: &PoolView,
    offset: u128,
    entry: &IPAllocation,
) -> Result<Option<HeldClaim>, StoreError> {
    let Some(name) = view.reservation_of(offset) else {
        return Ok(None);
    };
    let key = ObjectRef::new(&name).within(&ctx.opts.pool_namespace);
    if let Some(r) = ctx.caches.reservations.get(&key) {
        let claimed = r.labels().get(CLAIMED_LABEL).and_then(|b| b.parse().ok());
        if !listable_claim(claimed) {
            return Ok(r.spec.same_claimant(entry).then(|| HeldClaim {
                name,
                uid: r.uid().unwrap_or_default(),
                resource_version: r.resource_version().unwrap_or_default(),
                claimed,
                announced: false,
            }));
        }
    }
    Ok(ctx
        .store
        .get_reservation(&name)
        .await?
        .filter(|r| r.spec.same_claimant(entry))
        .map(HeldClaim::of))
}

/// One event per pod that had addresses released (the recorder folds events of one reason on one
/// object into a series), published a few at a time.
async fn publish_released(
    ctx: &Context,
    pods: &[(PodIdentity, Trigger)],
    outcomes: &[Result<Outcome, StoreError>],
) {
    let due: Vec<(ObjectReference, String)> = pods
        .iter()
        .zip(outcomes)
        .filter_map(|((pod, trigger), outcome)| {
            let released: Vec<String> = outcome
                .iter()
                .flat_map(|o| &o.released)
                .flat_map(|(pool, ips)| ips.iter().map(move |ip| format!("{ip} ({pool})")))
                .collect();
            (!released.is_empty()).then(|| {
                let note = format!("released {} ({trigger:?})", released.join(", "));
                (reference(pod), note)
            })
        })
        .collect();
    for chunk in due.chunks(PARALLEL_CALLS) {
        let events = chunk
            .iter()
            .map(|(about, note)| ctx.event(about, false, "AddressReleased", note));
        futures::future::join_all(events).await;
    }
}

#[cfg(test)]
mod tests;
