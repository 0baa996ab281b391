//! The operator's control loops: pod cleanup, pool audit, NAD/pool reconciliation.
//!
//! One watch per kind feeds a reflector cache (Pods trimmed to what cleanup needs, NADs, IPPools,
//! reservations); decisions read the caches and only the final writes go to the API server, each
//! conditional. Only the leader writes; a replica that is not leader keeps its caches warm so it can
//! take over at once. Events missed while not leading, or while the operator was down, are caught
//! by the audit, which runs on start and then periodically.

pub mod audit;
pub mod claim_records;
pub mod cleanup;
pub mod deferral;
pub mod findings;
pub mod holders;
mod loops;
pub mod migration;
pub mod nads;
pub mod pools;
pub mod relist;
pub mod slices;
pub mod status;
pub mod usage;
mod watches;
mod worker;

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use k8s_openapi::api::apps::v1::StatefulSet;
use k8s_openapi::api::core::v1::{Node, ObjectReference, Pod};
use kube::api::{Api, DeleteParams, Preconditions};
use kube::runtime::events::{Event, EventType, Recorder, Reporter};
use kube::runtime::reflector::{self, Store};
use kube::{Client, Resource};
use tokio::sync::{Notify, mpsc, watch};

use crate::crd::{
    IPAMClaim, IPPool, NetworkAttachmentDefinition, NodeSlicePool, OverlappingRangeIPReservation,
};
use crate::metrics::Metrics;
use crate::store::kubernetes::KubeStore;
use worker::{Job, cleanup_worker};

#[derive(Debug, Clone)]
pub struct Options {
    pub pool_namespace: String,
    pub audit_interval: Duration,
    pub stale_grace: Duration,
    /// The youngest claim (by its last write) the audit sweeps as an orphan
    /// ([`audit::ORPHAN_CLAIM_AGE`] by default).
    pub orphan_claim_age: Duration,
    /// How long the kubelet of a Ready node may take to DEL a deleted pod's sandboxes before the
    /// operator frees its addresses (see [`deferral`]).
    pub deleted_pod_grace: Duration,
    pub dry_run: bool,
    pub leader_election: bool,
    /// This replica's identity in the Lease (the pod name in a cluster).
    pub identity: String,
}

pub struct Caches {
    pub pods: Store<Pod>,
    pub nads: Store<NetworkAttachmentDefinition>,
    pub pools: Store<IPPool>,
    pub reservations: Store<OverlappingRangeIPReservation>,
    /// Nodes, trimmed to their metadata: who gets node slices.
    pub nodes: Store<Node>,
    pub slice_pools: Store<NodeSlicePool>,
    /// StatefulSets, trimmed to their replicas: who keeps sticky addresses.
    pub statefulsets: Store<StatefulSet>,
    /// IPAMClaims, trimmed to their names and records: who keeps claimed addresses.
    pub claims: Store<IPAMClaim>,
}

impl Caches {
    /// Empty caches around the shared NAD cache, and the writers the watches fill them through.
    fn new(nads: Store<NetworkAttachmentDefinition>) -> (Caches, watches::Writers) {
        let (pods, pods_w) = reflector::store::<Pod>();
        let (pools, pools_w) = reflector::store::<IPPool>();
        let (reservations, res_w) = reflector::store::<OverlappingRangeIPReservation>();
        let (nodes, nodes_w) = reflector::store::<Node>();
        let (slice_pools, slices_w) = reflector::store::<NodeSlicePool>();
        let (statefulsets, statefulsets_w) = reflector::store::<StatefulSet>();
        let (claims, claims_w) = reflector::store::<IPAMClaim>();
        let caches = Caches {
            statefulsets,
            claims,
            pods,
            nads,
            pools,
            reservations,
            nodes,
            slice_pools,
        };
        let writers = watches::Writers {
            pods: pods_w,
            pools: pools_w,
            reservations: res_w,
            nodes: nodes_w,
            slice_pools: slices_w,
            statefulsets: statefulsets_w,
            claims: claims_w,
        };
        (caches, writers)
    }
}

pub struct Context {
    pub client: Client,
    pub store: KubeStore,
    pub caches: Caches,
    pub opts: Options,
    /// The operator's metrics, shared with the webhook and rendered on the admin port.
    pub metrics: Arc<Metrics>,
    /// Deleted pods whose release waits for their node's kubelet (see [`deferral`]).
    pub waiting: deferral::Waiting,
    recorder: Recorder,
    leader: watch::Receiver<bool>,
}

impl Context {
    /// A context over given caches; `run` builds one from its watches, tests from fixtures.
    pub fn new(
        client: Client,
        opts: Options,
        caches: Caches,
        leader: watch::Receiver<bool>,
        metrics: Arc<Metrics>,
    ) -> Context {
        let reporter = Reporter {
            controller: "whereabouts-operator".into(),
            instance: Some(opts.identity.clone()),
        };
        Context {
            store: KubeStore::new(client.clone(), &opts.pool_namespace),
            recorder: Recorder::new(client.clone(), reporter),
            client,
            caches,
            opts,
            metrics,
            waiting: Default::default(),
            leader,
        }
    }

    /// The cached pools that parse (see [`pools::PoolView::from_pool`]).
    pub fn pool_views(&self) -> Vec<pools::PoolView> {
        self.readable_pools().0
    }

    /// [`Context::pool_views`], and how many cached pools do not parse, from one snapshot of the
    /// cache.
    pub fn readable_pools(&self) -> (Vec<pools::PoolView>, usize) {
        let slices = self.slice_index();
        let cached = self.caches.pools.state();
        let views: Vec<_> = cached
            .iter()
            .filter_map(|p| pools::PoolView::from_pool_in(p, &slices))
            .collect();
        let unreadable = cached.len() - views.len();
        (views, unreadable)
    }

    /// Which cached pools are node slices, and of which network.
    pub fn slice_index(&self) -> pools::SliceIndex {
        pools::SliceIndex::new(&self.caches.slice_pools.state())
    }

    pub fn is_leader(&self) -> bool {
        *self.leader.borrow()
    }

    /// Publishes a Kubernetes Event; failing to publish is logged, never fatal.
    pub async fn event(&self, about: &ObjectReference, warning: bool, reason: &str, note: &str) {
        let event = Event {
            type_: if warning {
                EventType::Warning
            } else {
                EventType::Normal
            },
            reason: reason.into(),
            note: Some(note.into()),
            action: reason.into(),
            secondary: None,
        };
        if let Err(e) = self.recorder.publish(&event, about).await {
            tracing::warn!(error = %e, reason, "could not publish an event");
        }
    }

    /// The metadata of the pod `podref` (`<namespace>/<name>`) read now from the API server, not
    /// from the cache (which may lag a deletion or a replacement); `None` when it does not exist.
    pub async fn pod_now(
        &self,
        podref: &str,
    ) -> Result<Option<kube::core::PartialObjectMeta<Pod>>, crate::store::StoreError> {
        let Some((namespace, name)) = podref.split_once('/') else {
            return Ok(None);
        };
        let api: Api<Pod> = Api::namespaced(self.client.clone(), namespace);
        (api.get_metadata_opt(name).await).map_err(|e| pod_read_error(podref, e))
    }

    /// As [`Context::pod_now`], the whole pod (its spec too: the node it is bound to).
    pub async fn full_pod_now(
        &self,
        namespace: &str,
        name: &str,
    ) -> Result<Option<Pod>, crate::store::StoreError> {
        let api: Api<Pod> = Api::namespaced(self.client.clone(), namespace);
        (api.get_opt(name).await).map_err(|e| pod_read_error(&format!("{namespace}/{name}"), e))
    }

    pub async fn pool_event(&self, pool: &str, warning: bool, reason: &str, note: &str) {
        let about = ObjectReference {
            api_version: Some("whereabouts.cni.cncf.io/v1alpha1".into()),
            kind: Some("IPPool".into()),
            namespace: Some(self.opts.pool_namespace.clone()),
            name: Some(pool.into()),
            ..Default::default()
        };
        self.event(&about, warning, reason, note).await;
    }
}

fn pod_read_error(podref: &str, e: kube::Error) -> crate::store::StoreError {
    crate::store::StoreError::Api {
        op: "get",
        object: format!("pod {podref}"),
        code: 0,
        message: e.to_string(),
    }
}

/// Deletes `object` only if it is still at the resourceVersion this controller saw (a writer that
/// changed it since wins). True when it was deleted, false when it changed or was gone.
pub(crate) async fn delete_unchanged<K>(api: &Api<K>, object: &K) -> Result<bool, kube::Error>
where
    K: Resource + Clone + serde::de::DeserializeOwned + std::fmt::Debug,
{
    let params = DeleteParams {
        preconditions: Some(Preconditions {
            resource_version: object.meta().resource_version.clone(),
            uid: None,
        }),
        ..Default::default()
    };
    let name = object.meta().name.clone().unwrap_or_default();
    match api.delete(&name, &params).await {
        Ok(_) => Ok(true),
        Err(kube::Error::Api(s)) if s.code == 409 || s.code == 404 => Ok(false),
        Err(e) => Err(e),
    }
}

/// What `run` reports to the admin endpoints.
#[derive(Debug, Default)]
pub struct Health {
    /// Every cache has listed its objects once.
    pub caches_synced: AtomicBool,
    /// Leader election is running (or disabled).
    pub election_running: AtomicBool,
}

/// Runs the controllers until `shutdown` resolves. The NAD cache is shared with the webhook (one
/// watch per kind); `nad_changed` is notified on every NAD event. The usage collector is
/// registered into `metrics`, which the controllers count into.
pub async fn run(
    client: Client,
    opts: Options,
    health: Arc<Health>,
    nads: Store<NetworkAttachmentDefinition>,
    nad_changed: Arc<Notify>,
    metrics: Arc<Metrics>,
    shutdown: impl std::future::Future<Output = ()>,
) -> anyhow::Result<()> {
    let (caches, writers) = Caches::new(nads);
    let (jobs_tx, jobs_rx) = mpsc::unbounded_channel::<Job>();
    metrics.register_collector(Box::new(usage::UsageCollector::new(
        caches.pools.clone(),
        caches.slice_pools.clone(),
        caches.nads.clone(),
    )));
    // Node slices are planned again when a node comes or goes, their objects change, or after
    // every NAD pass.
    let slices_changed = Arc::new(Notify::new());
    let holders_changed = Arc::new(Notify::new());
    let namespace = opts.pool_namespace.clone();
    let wakes = watches::Wakes {
        slices: slices_changed.clone(),
        holders: holders_changed.clone(),
    };
    let watches = watches::all(client.clone(), &namespace, writers, jobs_tx.clone(), wakes);

    let (leader, election) = elect(&client, &opts, &metrics).await?;
    health.election_running.store(true, Ordering::Relaxed);
    let ctx = Arc::new(Context::new(client, opts, caches, leader, metrics));

    let loops = run_loops(
        ctx.clone(),
        health,
        (jobs_tx, jobs_rx),
        [nad_changed, slices_changed, holders_changed],
    );
    tokio::select! {
        () = watches => {}
        _ = loops => {}
        // Not behind the caches: a missing CRD is one reason they never sync.
        () = migration::run(ctx.clone()) => {}
        _ = shutdown => tracing::info!("shutting down"),
    }
    drop(ctx); // closes the leader channel: the election task releases the Lease
    if let Some(task) = election {
        let _ = tokio::time::timeout(Duration::from_secs(5), task).await;
    }
    Ok(())
}

/// The controllers' loops (pod cleanup, pool audit, NAD/pool reconciliation), started once the
/// caches they read are synced.
async fn run_loops(
    ctx: Arc<Context>,
    health: Arc<Health>,
    (jobs_tx, jobs_rx): (mpsc::UnboundedSender<Job>, mpsc::UnboundedReceiver<Job>),
    [nad_changed, slices_changed, holders_changed]: [Arc<Notify>; 3],
) {
    caches_synced(ctx.clone(), health).await;
    tokio::join!(
        cleanup_worker(ctx.clone(), jobs_rx, jobs_tx),
        loops::audit_loop(ctx.clone()),
        loops::nad_loop(ctx.clone(), nad_changed, slices_changed.clone()),
        loops::slice_loop(ctx.clone(), slices_changed),
        loops::holder_loop(ctx.clone(), holders_changed),
        loops::status_loop(ctx)
    );
}

/// Resolves once the caches cleanup and audit read have listed their objects, and says so on
/// the admin port. NADs are not waited for: cleanup and audit do not need them, and a cluster
/// without the NAD CRD still gets its pods cleaned.
async fn caches_synced(ctx: Arc<Context>, health: Arc<Health>) {
    let c = &ctx.caches;
    let _ = tokio::join!(
        c.pods.wait_until_ready(),
        c.pools.wait_until_ready(),
        c.reservations.wait_until_ready(),
        // Which pools are node slices (and of which network) is read from these.
        c.slice_pools.wait_until_ready()
    );
    health.caches_synced.store(true, Ordering::Relaxed);
    tracing::info!("caches synced");
}

type ElectionTask = tokio::task::JoinHandle<
    Result<kube_lease_manager::LeaseManager, kube_lease_manager::LeaseManagerError>,
>;

/// Leader election on a coordination.k8s.io Lease in the pool namespace; without it this replica
/// always leads.
async fn elect(
    client: &Client,
    opts: &Options,
    metrics: &Arc<Metrics>,
) -> anyhow::Result<(watch::Receiver<bool>, Option<ElectionTask>)> {
    if !opts.leader_election {
        let (tx, rx) = watch::channel(true);
        std::mem::forget(tx); // the value never changes
        metrics.set_leader(true);
        return Ok((rx, None));
    }
    let manager =
        kube_lease_manager::LeaseManagerBuilder::new(client.clone(), "whereabouts-operator")
            .with_namespace(&opts.pool_namespace)
            .with_identity(&opts.identity)
            .with_duration(15)
            .with_grace(5)
            .build()
            .await?;
    let (mut rx, task) = manager.watch().await;
    let mut observer = rx.clone();
    let metrics = metrics.clone();
    tokio::spawn(async move {
        loop {
            let leading = *observer.borrow_and_update();
            metrics.set_leader(leading);
            tracing::info!(leading, "leadership");
            if observer.changed().await.is_err() {
                break;
            }
        }
    });
    rx.mark_changed();
    Ok((rx, Some(task)))
}
