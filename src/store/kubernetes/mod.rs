//! The Kubernetes [`Datastore`]: IPPools, OverlappingRangeIPReservations and pools' writer turns
//! (Leases) in the pool namespace.
//!
//! Entries are added, and removed in batches, with merge patches carrying
//! `metadata.resourceVersion`: the whole write holds only against the version the caller read
//! (and checked owners in). Single entries are replaced or removed (the path without
//! reservations, GC, the audit) with JSON Patch `test` operations on that entry's container and
//! pod, which hold across unrelated writes; a failed test answers 422, a lost condition, not an
//! error. Either kind of write, when many processes send it for one pool at once, makes the API
//! server re-run the losers (docs/benchmarks.md), which is why busy pools are written in turns.

mod errors;
mod requests;
mod turns;
mod watch;

use std::collections::{BTreeMap, HashMap};

use k8s_openapi::api::coordination::v1::Lease;
use k8s_openapi::api::core::v1::Pod;
use kube::Client;
use kube::api::{Api, DeleteParams, GetParams, PostParams, Preconditions, WatchParams};
use serde_json::{Value, json};

use super::{
    CLAIMED_LABEL, Datastore, Listing, Made, POOL_LABEL, PodFacts, Pool, PoolClaim, PoolWrite,
    RELEASING_LABEL, RENEWED_ANNOTATION, Reservation, Result, TURN_SECONDS, Turn, TurnAttempt,
    Write, claim_bucket, now_secs, recent_buckets,
};
use crate::crd::{
    IPAMClaim, IPAMClaimStatus, IPAllocation, IPPool, NodeSlicePool, OverlappingRangeIPReservation,
    OverlappingRangeIPReservationSpec,
};
use errors::{api_code, error, is_unserved, retrying};
use requests::{claim_object, entry_path, owner_tests, pool_object};
pub use turns::turn_name;
pub use watch::KubeChanges;
use watch::to_pool;

#[derive(Clone)]
pub struct KubeStore {
    pools: Api<IPPool>,
    /// The pools, for watches: on a connection of their own when requests share one (see
    /// [`KubeStore::over_http2`]).
    watched_pools: Api<IPPool>,
    reservations: Api<OverlappingRangeIPReservation>,
    leases: Api<Lease>,
    slices: Api<NodeSlicePool>,
    /// For the objects of other namespaces: pods and IPAMClaims.
    client: Client,
    /// NodeSlicePools as last read or written by this store, with when (see
    /// [`Datastore::get_node_slice_pool_recent`]); shared by clones.
    recent_slices: std::sync::Arc<std::sync::Mutex<RecentSlices>>,
    /// One read of NodeSlicePools at a time: a burst of ADDs that find nothing recent waits for
    /// one read instead of each making its own.
    slice_reads: std::sync::Arc<tokio::sync::Mutex<()>>,
}

type RecentSlices = HashMap<String, (std::time::Instant, Option<NodeSlicePool>)>;

impl KubeStore {
    /// The node agent's store: its requests share one HTTP/2 connection (see
    /// [`crate::kubeconfig::http2_client`]), and its pool watches share another. HTTP/2 flow
    /// control is per connection too: what a stream received and its reader has not read yet
    /// holds part of the connection's window. Every write of a pool sends the whole object to
    /// each watch of it, and a waiter busy with a request does not read its watch meanwhile, so
    /// a few watches of a big pool fill the window, and then no response can arrive on that
    /// connection: every request waits for ever, those the waiters are busy with included
    /// (tests/e2e/connection.rs). On their own connection, an unread watch only delays the
    /// other watches, and every wait on a watch is bounded.
    pub fn over_http2(
        config: kube::Config,
        namespace: &str,
    ) -> std::result::Result<Self, kube::Error> {
        let requests = crate::kubeconfig::http2_client(config.clone())?;
        let watches = crate::kubeconfig::http2_client(config)?;
        Ok(KubeStore {
            watched_pools: Api::namespaced(watches, namespace),
            ..KubeStore::new(requests, namespace)
        })
    }

    /// A store whose requests and watches all go through `client`: kube-rs's own client opens
    /// a connection per request in flight, so they cannot hold each other up.
    pub fn new(client: Client, namespace: &str) -> Self {
        KubeStore {
            pools: Api::namespaced(client.clone(), namespace),
            watched_pools: Api::namespaced(client.clone(), namespace),
            reservations: Api::namespaced(client.clone(), namespace),
            leases: Api::namespaced(client.clone(), namespace),
            slices: Api::namespaced(client.clone(), namespace),
            recent_slices: Default::default(),
            slice_reads: Default::default(),
            client,
        }
    }
}

impl KubeStore {
    /// StatefulSet `<namespace>/<name>`, `None` when it does not exist (the operator's check
    /// before it frees a sticky address).
    pub async fn get_statefulset(
        &self,
        namespace: &str,
        name: &str,
    ) -> Result<Option<k8s_openapi::api::apps::v1::StatefulSet>> {
        let api: Api<k8s_openapi::api::apps::v1::StatefulSet> =
            Api::namespaced(self.client.clone(), namespace);
        retrying(|| api.get_opt(name))
            .await
            .map_err(|e| error("get", format!("statefulset {namespace}/{name}"), e))
    }

    /// Remembers a read of a NodeSlicePool (`Some`), or forgets it (`None`).
    fn remember_slices(&self, name: &str, read: Option<Option<NodeSlicePool>>) {
        let mut recent = self.recent_slices.lock().expect("not poisoned");
        match read {
            Some(pool) => recent.insert(name.to_owned(), (std::time::Instant::now(), pool)),
            None => recent.remove(name),
        };
    }
}

impl Datastore for KubeStore {
    async fn get_pool(&self, name: &str) -> Result<Option<Pool>> {
        let found = retrying(|| self.pools.get_opt(name))
            .await
            .map_err(|e| error("get", format!("ippool {name}"), e))?;
        Ok(found.map(|p| to_pool(name, p)))
    }

    async fn get_pool_cached(&self, name: &str) -> Result<Option<Pool>> {
        let params = GetParams::any();
        match retrying(|| self.pools.get_with(name, &params)).await {
            Ok(p) => Ok(Some(to_pool(name, p))),
            Err(e) if api_code(&e) == Some(404) && !is_unserved(&e) => Ok(None),
            Err(e) => Err(error("get", format!("ippool {name}"), e)),
        }
    }

    async fn create_pool(
        &self,
        name: &str,
        range: &str,
        labels: &BTreeMap<String, String>,
    ) -> Result<Write> {
        let pool = pool_object(name, range, labels);
        let post = PostParams::default();
        match retrying(|| self.pools.create(&post, &pool)).await {
            Ok(_) => Ok(Write::Done),
            Err(e) if api_code(&e) == Some(409) => Ok(Write::Conflict),
            Err(e) => Err(error("create", format!("ippool {name}"), e)),
        }
    }

    async fn add_allocations(
        &self,
        pool: &str,
        entries: &[(u128, IPAllocation)],
        resource_version: &str,
    ) -> Result<PoolWrite> {
        let allocations: serde_json::Map<String, Value> = entries
            .iter()
            .map(|(o, e)| {
                (
                    o.to_string(),
                    serde_json::to_value(e).expect("entries serialise"),
                )
            })
            .collect();
        self.patch_allocations(pool, allocations, resource_version)
            .await
    }

    async fn remove_allocations(
        &self,
        pool: &str,
        offsets: &[u128],
        resource_version: &str,
    ) -> Result<PoolWrite> {
        // Keys set to null are removed by a merge patch, all or nothing against the version whose
        // owners the caller checked.
        let allocations: serde_json::Map<String, Value> = offsets
            .iter()
            .map(|o| (o.to_string(), Value::Null))
            .collect();
        self.patch_allocations(pool, allocations, resource_version)
            .await
    }

    async fn touch_pool(&self, pool: &str, resource_version: &str) -> Result<PoolWrite> {
        self.touch(pool, resource_version).await
    }

    type Changes = KubeChanges;

    async fn watch_pool(&self, pool: &str, resource_version: &str) -> Result<KubeChanges> {
        let params = WatchParams::default().fields(&format!("metadata.name={pool}"));
        let stream = retrying(|| self.watched_pools.watch(&params, resource_version))
            .await
            .map_err(|e| error("watch", format!("ippool {pool}"), e))?;
        Ok(KubeChanges::new(pool, Box::pin(stream)))
    }

    async fn take_turn(&self, pool: &str, holder: &str) -> TurnAttempt {
        self.create_turn(pool, holder).await
    }

    async fn end_turn(&self, turn: &Turn) {
        if let Some(name) = turn_name(&turn.pool) {
            self.delete_lease(&name, &turn.uid, None).await;
        }
    }

    async fn turn_holder(&self, pool: &str) -> Option<(String, String)> {
        self.read_turn(pool).await
    }

    async fn break_turn(&self, pool: &str, uid: &str, rv: &str) {
        if let Some(name) = turn_name(pool) {
            tracing::warn!(lease = %name, "taking over a writer turn that stood still for {TURN_SECONDS} s");
            self.delete_lease(&name, uid, Some(rv)).await;
        }
    }

    async fn replace_allocation(
        &self,
        pool: &str,
        offset: u128,
        expected: &IPAllocation,
        entry: &IPAllocation,
    ) -> Result<Write> {
        let [a, b] = owner_tests(offset, expected);
        self.patch_pool(
            pool,
            json!([a, b, {"op": "replace", "path": entry_path(offset), "value": entry}]),
        )
        .await
    }

    async fn remove_allocation(
        &self,
        pool: &str,
        offset: u128,
        expected: &IPAllocation,
    ) -> Result<Write> {
        let [a, b] = owner_tests(offset, expected);
        self.patch_pool(
            pool,
            json!([a, b, {"op": "remove", "path": entry_path(offset)}]),
        )
        .await
    }

    async fn create_reservation(
        &self,
        name: &str,
        spec: &OverlappingRangeIPReservationSpec,
        pool: &str,
        ip: std::net::IpAddr,
    ) -> Result<(Write, Made)> {
        let obj = claim_object(name, spec, pool, ip);
        let post = PostParams::default();
        match retrying(|| self.reservations.create(&post, &obj)).await {
            Ok(created) => Ok((
                Write::Done,
                Made {
                    uid: created.metadata.uid.unwrap_or_default(),
                    resource_version: created.metadata.resource_version.unwrap_or_default(),
                },
            )),
            Err(e) if api_code(&e) == Some(409) => Ok((Write::Conflict, Made::default())),
            Err(e) => Err(error(
                "create",
                format!("overlappingrangeipreservation {name}"),
                e,
            )),
        }
    }

    async fn claims_of(&self, pool: &str, listing: Listing) -> Result<Vec<PoolClaim>> {
        let [a, b, c] = recent_buckets(now_secs());
        let selector =
            format!("{POOL_LABEL}={pool},{CLAIMED_LABEL} in ({a},{b},{c}),!{RELEASING_LABEL}");
        self.list_claims(pool, &selector, listing).await
    }

    async fn releases_of(&self, pool: &str) -> Result<Vec<PoolClaim>> {
        let [a, b, c] = recent_buckets(now_secs());
        let selector = format!("{POOL_LABEL}={pool},{RELEASING_LABEL} in ({a},{b},{c})");
        self.list_claims(pool, &selector, Listing::Cached).await
    }

    async fn mark_releasing(
        &self,
        name: &str,
        uid: &str,
        resource_version: &str,
    ) -> Result<(Write, String)> {
        // A uid in a patch must match the object's (it is immutable): a reservation re-made since
        // it was read fails the patch (409 or 422), a lost condition; so does a newer version.
        let bucket = claim_bucket(now_secs()).to_string();
        let body = json!({"metadata": {
            "uid": uid,
            "resourceVersion": resource_version,
            "labels": {RELEASING_LABEL: bucket},
        }});
        self.patch_reservation(name, &body).await
    }

    async fn take_over_reservation(
        &self,
        name: &str,
        uid: &str,
        resource_version: &str,
        spec: &OverlappingRangeIPReservationSpec,
    ) -> Result<Write> {
        let body = json!({
            "metadata": {"uid": uid, "resourceVersion": resource_version, "labels": {RELEASING_LABEL: null}},
            "spec": spec,
        });
        Ok(self.patch_reservation(name, &body).await?.0)
    }

    async fn settle_claim(&self, name: &str, made: &Made) -> Result<Write> {
        if made.uid.is_empty() || made.resource_version.is_empty() {
            return Ok(Write::Conflict); // not conditional on anything: leave it
        }
        let body = json!({"metadata": {
            "uid": made.uid,
            "resourceVersion": made.resource_version,
            "labels": {CLAIMED_LABEL: null},
        }});
        Ok(self.patch_reservation(name, &body).await?.0)
    }

    async fn renew_claim(&self, name: &str, uid: &str, resource_version: &str) -> Result<Write> {
        let now = now_secs();
        let body = json!({"metadata": {
            "uid": uid,
            "resourceVersion": resource_version,
            // A release announced by an earlier DEL of this container (cut off before it removed
            // the entry) is withdrawn: the entry is being taken again, and a later DEL of another
            // container would otherwise sweep it as announced (see `releases_of`).
            "labels": {CLAIMED_LABEL: claim_bucket(now).to_string(), RELEASING_LABEL: null},
            "annotations": {RENEWED_ANNOTATION: now.to_string()},
        }});
        Ok(self.patch_reservation(name, &body).await?.0)
    }

    async fn get_reservation(&self, name: &str) -> Result<Option<Reservation>> {
        let found = retrying(|| self.reservations.get_opt(name))
            .await
            .map_err(|e| error("get", format!("overlappingrangeipreservation {name}"), e))?;
        Ok(found.map(|r| {
            let labels = r.metadata.labels.unwrap_or_default();
            Reservation {
                name: name.to_owned(),
                uid: r.metadata.uid.unwrap_or_default(),
                resource_version: r.metadata.resource_version.unwrap_or_default(),
                created: r.metadata.creation_timestamp.map(|t| t.0.as_second()),
                claimed: labels.get(CLAIMED_LABEL).and_then(|b| b.parse().ok()),
                releasing: labels.contains_key(RELEASING_LABEL),
                spec: r.spec,
            }
        }))
    }

    async fn delete_reservation(
        &self,
        name: &str,
        uid: &str,
        resource_version: Option<&str>,
    ) -> Result<Write> {
        let params = DeleteParams {
            preconditions: Some(Preconditions {
                uid: Some(uid.to_owned()),
                resource_version: resource_version
                    .filter(|v| !v.is_empty())
                    .map(str::to_owned),
            }),
            ..Default::default()
        };
        match retrying(|| self.reservations.delete(name, &params)).await {
            Ok(_) => Ok(Write::Done),
            Err(e) => match api_code(&e) {
                Some(404) => Ok(Write::Missing),
                Some(409) => Ok(Write::Conflict),
                _ => Err(error(
                    "delete",
                    format!("overlappingrangeipreservation {name}"),
                    e,
                )),
            },
        }
    }

    async fn get_node_slice_pool(&self, name: &str) -> Result<Option<NodeSlicePool>> {
        let found = retrying(|| self.slices.get_opt(name))
            .await
            .map_err(|e| error("get", format!("nodeslicepool {name}"), e))?;
        self.remember_slices(name, Some(found.clone()));
        Ok(found)
    }

    async fn get_node_slice_pool_recent(
        &self,
        name: &str,
        max_age: std::time::Duration,
    ) -> Result<Option<NodeSlicePool>> {
        let recent = || {
            let recent = self.recent_slices.lock().expect("not poisoned");
            recent
                .get(name)
                .filter(|(at, _)| at.elapsed() <= max_age)
                .map(|(_, pool)| pool.clone())
        };
        if let Some(pool) = recent() {
            return Ok(pool);
        }
        let _one_read = self.slice_reads.lock().await;
        match recent() {
            Some(pool) => Ok(pool),
            None => self.get_node_slice_pool(name).await,
        }
    }

    async fn replace_node_slice_pool(&self, pool: &NodeSlicePool) -> Result<Write> {
        let name = pool.metadata.name.clone().unwrap_or_default();
        // The object carries the resourceVersion it was read at: a PUT is refused with 409 when
        // anyone wrote it since.
        let params = PostParams::default();
        // Whatever happens, what this store remembers of it is no longer current.
        self.remember_slices(&name, None);
        match retrying(|| self.slices.replace(&name, &params, pool)).await {
            Ok(_) => Ok(Write::Done),
            Err(e) if api_code(&e) == Some(409) => Ok(Write::Conflict),
            Err(e) if api_code(&e) == Some(404) && !is_unserved(&e) => Ok(Write::Missing),
            Err(e) => Err(error("update", format!("nodeslicepool {name}"), e)),
        }
    }

    async fn get_pod(&self, namespace: &str, name: &str) -> Result<Option<PodFacts>> {
        // Metadata only: owner, annotations and UID are all an ADD needs, and a full pod object
        // carries its containers' environment.
        let pods: Api<Pod> = Api::namespaced(self.client.clone(), namespace);
        let found = retrying(|| pods.get_metadata_opt(name))
            .await
            .map_err(|e| error("get", format!("pod {namespace}/{name}"), e))?;
        Ok(found.as_ref().map(|p| PodFacts::of(&p.metadata)))
    }

    async fn get_ipam_claim(&self, namespace: &str, name: &str) -> Result<Option<IPAMClaim>> {
        let claims: Api<IPAMClaim> = Api::namespaced(self.client.clone(), namespace);
        retrying(|| claims.get_opt(name))
            .await
            .map_err(|e| error("get", format!("ipamclaim {namespace}/{name}"), e))
    }

    async fn write_ipam_claim_status(
        &self,
        claim: &IPAMClaim,
        status: &IPAMClaimStatus,
    ) -> Result<Write> {
        let namespace = claim.metadata.namespace.clone().unwrap_or_default();
        let name = claim.metadata.name.clone().unwrap_or_default();
        let claims: Api<IPAMClaim> = Api::namespaced(self.client.clone(), &namespace);
        // The resourceVersion makes the write conditional: a claim another pod's ADD gave its
        // addresses meanwhile is not overwritten.
        let patch = json!({
            "metadata": {"resourceVersion": claim.metadata.resource_version},
            "status": status,
        });
        let params = kube::api::PatchParams::default();
        let patch = kube::api::Patch::Merge(&patch);
        match retrying(|| claims.patch_status(&name, &params, &patch)).await {
            Ok(_) => Ok(Write::Done),
            Err(e) if api_code(&e) == Some(409) => Ok(Write::Conflict),
            Err(e) if api_code(&e) == Some(404) && !is_unserved(&e) => Ok(Write::Missing),
            Err(e) => Err(error(
                "update",
                format!("ipamclaim {namespace}/{name} status"),
                e,
            )),
        }
    }
}
