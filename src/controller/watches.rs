//! The operator's watches: each kind into its reflector cache, pod events into cleanup jobs, Node
//! and NodeSlicePool changes into a new slice plan. Watch errors are logged and the watch goes on
//! (the stream backs off and relists): a transient API failure must never stop the operator.

use std::collections::{HashMap, HashSet};
use std::sync::Arc;

use futures::StreamExt;
use k8s_openapi::api::apps::v1::StatefulSet;
use k8s_openapi::api::core::v1::{Node, NodeStatus, Pod};
use kube::api::Api;
use kube::runtime::reflector;
use kube::runtime::{WatchStreamExt, watcher};
use kube::{Client, ResourceExt};
use tokio::sync::{Notify, mpsc};

use super::Job;
use super::cleanup::{self, Trigger};
use super::holders;
use super::relist::Relist;
use crate::crd::{IPAMClaim, IPPool, NodeSlicePool, OverlappingRangeIPReservation};

/// The writers of the caches the watches fill (the NAD cache is the webhook's, filled elsewhere).
pub(super) struct Writers {
    pub pods: reflector::store::Writer<Pod>,
    pub pools: reflector::store::Writer<IPPool>,
    pub reservations: reflector::store::Writer<OverlappingRangeIPReservation>,
    pub nodes: reflector::store::Writer<Node>,
    pub slice_pools: reflector::store::Writer<NodeSlicePool>,
    pub statefulsets: reflector::store::Writer<StatefulSet>,
    pub claims: reflector::store::Writer<IPAMClaim>,
}

/// What the watches wake: the node slice planner, and the check of held addresses.
pub(super) struct Wakes {
    pub slices: Arc<Notify>,
    pub holders: Arc<Notify>,
}

/// Runs every watch; returns (after logging which) if one ever ends. Pod events queue cleanup
/// jobs on `jobs`; Node and NodeSlicePool changes wake the slice planner; StatefulSet and
/// IPAMClaim changes, and pod deletions, wake the check of held addresses.
pub(super) async fn all(
    client: Client,
    namespace: &str,
    w: Writers,
    jobs: mpsc::UnboundedSender<Job>,
    wakes: Wakes,
) {
    let slices_changed = wakes.slices;
    // Pod events read the nodes' health: a lost node's evicted pods are due, others are not.
    let nodes = w.nodes.as_reader();
    let pod_events = pod_events(client.clone(), w.pods, nodes, jobs, wakes.holders.clone());
    let pool_watch = logged_watch(
        Api::<IPPool>::namespaced(client.clone(), namespace),
        w.pools,
        "pool",
    );
    let res_watch = logged_watch(
        Api::<OverlappingRangeIPReservation>::namespaced(client.clone(), namespace),
        w.reservations,
        "reservation",
    );
    let node_watch = notifying_watch(
        watcher(Api::<Node>::all(client.clone()), watcher::Config::default())
            .default_backoff()
            .modify(trim_node)
            .reflect(w.nodes),
        "node",
        slices_changed.clone(),
        node_set_changes(),
    );
    let statefulset_watch = notifying_watch(
        watcher(
            Api::<StatefulSet>::all(client.clone()),
            watcher::Config::default(),
        )
        .default_backoff()
        .modify(holders::trim_statefulset)
        .reflect(w.statefulsets),
        "statefulset",
        wakes.holders.clone(),
        ordinal_changes(),
    );
    let claim_watch = notifying_watch(
        watcher(
            Api::<IPAMClaim>::all(client.clone()),
            watcher::Config::default(),
        )
        .default_backoff()
        .modify(holders::trim_claim)
        .reflect(w.claims),
        "ipamclaim",
        wakes.holders,
        any_change,
    );
    let slice_watch = notifying_watch(
        watcher(
            Api::<NodeSlicePool>::namespaced(client, namespace),
            watcher::Config::default(),
        )
        .default_backoff()
        .reflect(w.slice_pools),
        "nodeslicepool",
        slices_changed,
        any_change,
    );
    tokio::select! {
        () = pod_events => tracing::error!("pod watch ended"),
        () = pool_watch => tracing::error!("pool watch ended"),
        () = res_watch => tracing::error!("reservation watch ended"),
        () = node_watch => tracing::error!("node watch ended"),
        () = slice_watch => tracing::error!("nodeslicepool watch ended"),
        () = statefulset_watch => tracing::error!("statefulset watch ended"),
        () = claim_watch => tracing::error!("ipamclaim watch ended"),
    }
}

/// Watches every pod (trimmed to what cleanup needs) into the cache behind `writer`, and queues
/// on `tx` the release of each pod that is deleted or has finished. Watch errors are logged and
/// the watch goes on (the stream backs off and relists): a transient API failure must never stop
/// the operator.
fn pod_events(
    client: Client,
    writer: reflector::store::Writer<Pod>,
    nodes: reflector::Store<Node>,
    tx: mpsc::UnboundedSender<Job>,
    holders_changed: Arc<Notify>,
) -> impl std::future::Future<Output = ()> {
    let cache = writer.as_reader();
    let mut relist = Relist::default();
    let pod_watch = watcher(Api::<Pod>::all(client), watcher::Config::default())
        .default_backoff()
        .modify(cleanup::trim)
        .reflect(writer);
    pod_watch.for_each(move |event| {
        let vanished = match &event {
            Ok(e) => relist.vanished(e, &cache),
            Err(_) => Vec::new(),
        };
        if !vanished.is_empty() {
            tracing::info!(
                pods = vanished.len(),
                "pods deleted while the pod watch was down (its relist no longer lists them): released as deleted"
            );
        }
        if matches!(&event, Ok(watcher::Event::Delete(_))) || !vanished.is_empty() {
            // A StatefulSet scaled down frees its ordinals' addresses once their pods are gone.
            holders_changed.notify_one();
        }
        for p in &vanished {
            let _ = tx.send(job_of(p, Trigger::Deleted));
        }
        if let Some(job) = due_job(&event, &nodes) {
            let _ = tx.send(job);
        }
        futures::future::ready(())
    })
}

/// The release a pod event makes due: a deleted pod's, or a finished one's (see
/// [`cleanup::finished`]: a graceful termination is not).
fn due_job(
    event: &Result<watcher::Event<Pod>, watcher::Error>,
    nodes: &reflector::Store<Node>,
) -> Option<Job> {
    let due = match event {
        Ok(watcher::Event::Delete(p)) => Some((p, Trigger::Deleted)),
        Ok(watcher::Event::Apply(p)) | Ok(watcher::Event::InitApply(p)) => {
            cleanup::finished(p, cleanup::node_health(p, nodes)).map(|t| (p, t))
        }
        Ok(_) => None,
        Err(e) => {
            tracing::warn!(error = %e, "pod watch failed; retrying");
            None
        }
    };
    due.map(|(p, trigger)| job_of(p, trigger))
}

fn job_of(p: &Pod, trigger: Trigger) -> Job {
    Job {
        pod: cleanup::identity(p),
        trigger,
        attempt: 0,
        node: cleanup::node_of(p),
        since: std::time::Instant::now(),
    }
}

/// Watches `api` into the cache behind `writer`; errors are logged as `kind`'s and the watch
/// goes on.
fn logged_watch<K>(
    api: Api<K>,
    writer: reflector::store::Writer<K>,
    kind: &'static str,
) -> impl std::future::Future<Output = ()>
where
    K: kube::Resource<DynamicType = ()>
        + Clone
        + serde::de::DeserializeOwned
        + std::fmt::Debug
        + Send
        + Sync
        + 'static,
{
    watcher(api, watcher::Config::default())
        .default_backoff()
        .reflect(writer)
        .for_each(move |e| log_watch_error(kind, e))
}

/// A node's name and its Ready condition (is its kubelet there to run DELs?) are all that matter
/// here: the rest of a Node object is dropped from the cache.
fn trim_node(node: &mut Node) {
    node.spec = None;
    node.status = node.status.take().map(|s| NodeStatus {
        conditions: s
            .conditions
            .map(|c| c.into_iter().filter(|c| c.type_ == "Ready").collect()),
        ..Default::default()
    });
    node.metadata.managed_fields = None;
    node.metadata.annotations = None;
    node.metadata.labels = None;
}

/// Drives a reflected watch, logging its errors as `kind`'s and notifying `changed` on the
/// events `wanted` picks.
async fn notifying_watch<K, S>(
    stream: S,
    kind: &'static str,
    changed: Arc<Notify>,
    mut wanted: impl FnMut(&watcher::Event<K>) -> bool,
) where
    S: futures::Stream<Item = Result<watcher::Event<K>, watcher::Error>>,
{
    stream
        .for_each(|e| {
            if e.as_ref().is_ok_and(&mut wanted) {
                changed.notify_one();
            }
            log_watch_error(kind, e)
        })
        .await
}

/// Every change of an object, and the end of a (re)list.
fn any_change<K>(e: &watcher::Event<K>) -> bool {
    matches!(
        e,
        watcher::Event::Apply(_) | watcher::Event::Delete(_) | watcher::Event::InitDone
    )
}

/// A node that joins or leaves, and the end of a (re)list, but not the status updates every node
/// sends all the time: with thousands of nodes those would re-plan the slices without pause.
fn node_set_changes() -> impl FnMut(&watcher::Event<Node>) -> bool {
    let mut names = HashSet::new();
    move |e| match e {
        watcher::Event::Apply(n) => names.insert(n.name_any()),
        watcher::Event::InitApply(n) => {
            names.insert(n.name_any());
            false
        }
        watcher::Event::Delete(n) => {
            names.remove(&n.name_any());
            true
        }
        watcher::Event::Init => {
            names.clear();
            false
        }
        watcher::Event::InitDone => true,
    }
}

/// A StatefulSet that comes, goes, or changes its ordinals (replicas, `ordinals.start`), and the
/// end of a (re)list; not its status updates, which every rollout sends many of.
fn ordinal_changes() -> impl FnMut(&watcher::Event<StatefulSet>) -> bool {
    let mut seen: HashMap<(String, String), holders::Ordinals> = HashMap::new();
    move |e| {
        let key = |s: &StatefulSet| (s.namespace().unwrap_or_default(), s.name_any());
        match e {
            watcher::Event::Apply(s) | watcher::Event::InitApply(s) => {
                let changed =
                    seen.insert(key(s), holders::Ordinals::of(s)) != Some(holders::Ordinals::of(s));
                changed && matches!(e, watcher::Event::Apply(_))
            }
            watcher::Event::Delete(s) => {
                seen.remove(&key(s));
                true
            }
            watcher::Event::Init => {
                seen.clear();
                false
            }
            watcher::Event::InitDone => true,
        }
    }
}

fn log_watch_error<K>(
    kind: &str,
    event: Result<watcher::Event<K>, watcher::Error>,
) -> futures::future::Ready<()> {
    if let Err(e) = event {
        tracing::warn!(error = %e, "{kind} watch failed; retrying");
    }
    futures::future::ready(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn node(name: &str) -> Node {
        let mut n = Node::default();
        n.metadata.name = Some(name.into());
        n
    }

    #[test]
    fn only_ordinal_changes_wake_the_holder_check() {
        let sts = |replicas: i32| {
            let mut s = StatefulSet::default();
            s.metadata.name = Some("web".into());
            s.metadata.namespace = Some("ns".into());
            s.spec = Some(k8s_openapi::api::apps::v1::StatefulSetSpec {
                replicas: Some(replicas),
                ..Default::default()
            });
            s
        };
        let mut wanted = ordinal_changes();
        assert!(!wanted(&watcher::Event::InitApply(sts(3))));
        assert!(wanted(&watcher::Event::InitDone));
        assert!(!wanted(&watcher::Event::Apply(sts(3))), "a status update");
        assert!(wanted(&watcher::Event::Apply(sts(2))), "scaled down");
        assert!(wanted(&watcher::Event::Delete(sts(2))));
    }

    #[test]
    fn only_joining_and_leaving_nodes_re_plan_slices() {
        let mut wanted = node_set_changes();
        assert!(!wanted(&watcher::Event::Init));
        assert!(!wanted(&watcher::Event::InitApply(node("a"))));
        assert!(wanted(&watcher::Event::InitDone));
        assert!(
            !wanted(&watcher::Event::Apply(node("a"))),
            "a status update"
        );
        assert!(wanted(&watcher::Event::Apply(node("b"))), "a new node");
        assert!(!wanted(&watcher::Event::Apply(node("b"))));
        assert!(wanted(&watcher::Event::Delete(node("a"))));
        assert!(wanted(&watcher::Event::Apply(node("a"))), "back again");
    }
}
