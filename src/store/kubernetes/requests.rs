//! The requests behind the [`Datastore`](crate::store::Datastore) operations that take more than one
//! call of kube's API: conditional pool patches, reservation patches, claims lists, Lease deletes.

use std::collections::BTreeMap;

use kube::api::{DeleteParams, ListParams, Patch, PatchParams, Preconditions};
use kube::core::ObjectMeta;
use serde_json::{Value, json};

use super::KubeStore;
use super::errors::{api_code, error, retrying};
use super::watch::to_pool;
use crate::crd::{
    IPAllocation, IPPool, IPPoolSpec, OverlappingRangeIPReservation,
    OverlappingRangeIPReservationSpec,
};
use crate::store::{
    CLAIMED_LABEL, IP_ANNOTATION, Listing, POOL_LABEL, PoolClaim, PoolWrite, Result,
    TAKEN_AGAIN_ANNOTATION, TURN_SECONDS, Write, claim_bucket, now_secs,
};

impl KubeStore {
    pub(super) async fn patch_pool(&self, pool: &str, ops: Value) -> Result<Write> {
        let params = PatchParams::default();
        let patch: json_patch::Patch =
            serde_json::from_value(ops).expect("patch operations are well-formed");
        let patch = Patch::Json::<()>(patch);
        match retrying(|| self.pools.patch(pool, &params, &patch)).await {
            Ok(_) => Ok(Write::Done),
            Err(e) => match api_code(&e) {
                Some(404) => Ok(Write::Missing),
                // A failed `test`, or (a pool stored with `allocations: null`) a missing parent.
                Some(422) | Some(409) => Ok(Write::Conflict),
                _ => Err(error("patch", format!("ippool {pool}"), e)),
            },
        }
    }

    /// Merges `allocations` (an entry to add, or null to remove) into the pool, if it is still at
    /// `resource_version`: the API server compares it before applying anything and answers 409 at
    /// once when the pool moved on.
    pub(super) async fn patch_allocations(
        &self,
        pool: &str,
        allocations: serde_json::Map<String, Value>,
        resource_version: &str,
    ) -> Result<PoolWrite> {
        let body = json!({"metadata": {"resourceVersion": resource_version}, "spec": {"allocations": allocations}});
        self.merge_pool(pool, &body).await
    }

    /// Sets the pool's [`TAKEN_AGAIN_ANNOTATION`] to a value it has never had (the time in
    /// nanoseconds), if the pool is still at `resource_version`: a merge patch that changes
    /// nothing would not move the version.
    pub(super) async fn touch(&self, pool: &str, resource_version: &str) -> Result<PoolWrite> {
        let nanos = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap_or_default()
            .as_nanos()
            .to_string();
        let body = json!({"metadata": {
            "resourceVersion": resource_version,
            "annotations": {TAKEN_AGAIN_ANNOTATION: nanos},
        }});
        self.merge_pool(pool, &body).await
    }

    /// A merge patch of the pool that names the resourceVersion it expects in `body`: the API
    /// server answers 409 at once when the pool moved on.
    async fn merge_pool(&self, pool: &str, body: &Value) -> Result<PoolWrite> {
        let (params, patch) = (PatchParams::default(), Patch::Merge(body));
        match retrying(|| self.pools.patch(pool, &params, &patch)).await {
            Ok(written) => Ok(PoolWrite::Done(to_pool(pool, written))),
            Err(e) => match api_code(&e) {
                Some(404) => Ok(PoolWrite::Missing),
                Some(409) => Ok(PoolWrite::Conflict),
                _ => Err(error("patch", format!("ippool {pool}"), e)),
            },
        }
    }

    /// A conditional merge patch of a reservation; returns the new resourceVersion on success.
    pub(super) async fn patch_reservation(
        &self,
        name: &str,
        body: &Value,
    ) -> Result<(Write, String)> {
        let (params, patch) = (PatchParams::default(), Patch::Merge(body));
        match retrying(|| self.reservations.patch(name, &params, &patch)).await {
            Ok(r) => Ok((Write::Done, r.metadata.resource_version.unwrap_or_default())),
            Err(e) => match api_code(&e) {
                Some(404) => Ok((Write::Missing, String::new())),
                Some(409 | 422) => Ok((Write::Conflict, String::new())),
                _ => Err(error(
                    "patch",
                    format!("overlappingrangeipreservation {name}"),
                    e,
                )),
            },
        }
    }

    /// Our reservations of `pool` matching a label selector, with their addresses, as fresh as
    /// `listing` asks (see [`Listing`]).
    pub(super) async fn list_claims(
        &self,
        pool: &str,
        selector: &str,
        listing: Listing,
    ) -> Result<Vec<PoolClaim>> {
        // No resourceVersion: a consistent read (served from the watch cache once it caught up
        // with etcd, on the API servers we support). "0": whatever the cache has.
        let params = match listing {
            Listing::Cached => ListParams::default().labels(selector).match_any(),
            Listing::Consistent => ListParams::default().labels(selector),
        };
        let list = retrying(|| self.reservations.list(&params))
            .await
            .map_err(|e| {
                error(
                    "list",
                    format!("overlappingrangeipreservations of {pool}"),
                    e,
                )
            })?;
        Ok(list
            .items
            .into_iter()
            .filter_map(|r| {
                Some(PoolClaim {
                    ip: r
                        .metadata
                        .annotations
                        .as_ref()?
                        .get(IP_ANNOTATION)?
                        .parse()
                        .ok()?,
                    uid: r.metadata.uid.unwrap_or_default(),
                    spec: r.spec,
                })
            })
            .collect())
    }

    pub(super) async fn delete_lease(&self, name: &str, uid: &str, rv: Option<&str>) {
        let params = DeleteParams {
            preconditions: Some(Preconditions {
                uid: Some(uid.to_owned()),
                resource_version: rv.map(str::to_owned),
            }),
            ..Default::default()
        };
        match retrying(|| self.leases.delete(name, &params)).await {
            Ok(_) => {}
            Err(e) if matches!(api_code(&e), Some(404 | 409)) => {}
            Err(e) => {
                tracing::warn!(lease = %name, error = %e, "cannot give back the pool's writer turn; it expires in {TURN_SECONDS} s")
            }
        }
    }
}

pub(super) fn entry_path(offset: u128) -> String {
    format!("/spec/allocations/{offset}")
}

/// `test` operations that hold while the entry still belongs to `expected`'s container and pod.
pub(super) fn owner_tests(offset: u128, expected: &IPAllocation) -> [Value; 2] {
    let path = entry_path(offset);
    [
        json!({"op": "test", "path": format!("{path}/id"), "value": expected.id}),
        json!({"op": "test", "path": format!("{path}/podref"), "value": expected.podref}),
    ]
}

/// A new, empty pool with `labels` (what it is; none when empty).
pub(super) fn pool_object(name: &str, range: &str, labels: &BTreeMap<String, String>) -> IPPool {
    IPPool {
        metadata: ObjectMeta {
            name: Some(name.to_owned()),
            labels: (!labels.is_empty()).then(|| labels.clone()),
            ..Default::default()
        },
        spec: IPPoolSpec {
            range: range.to_owned(),
            allocations: Default::default(),
        },
        status: None,
    }
}

/// A claim of `ip` for `spec`, labelled with its pool and the time bucket it was made in, so that
/// the pool's next writer finds it (`claims_of`).
pub(super) fn claim_object(
    name: &str,
    spec: &OverlappingRangeIPReservationSpec,
    pool: &str,
    ip: std::net::IpAddr,
) -> OverlappingRangeIPReservation {
    // Label values are at most 63 characters: a longer pool name only loses group commit.
    let labels = (pool.len() <= 63).then(|| {
        [
            (POOL_LABEL.to_owned(), pool.to_owned()),
            (
                CLAIMED_LABEL.to_owned(),
                claim_bucket(now_secs()).to_string(),
            ),
        ]
        .into()
    });
    let metadata = ObjectMeta {
        name: Some(name.to_owned()),
        labels,
        annotations: Some([(IP_ANNOTATION.to_owned(), ip.to_string())].into()),
        ..Default::default()
    };
    OverlappingRangeIPReservation {
        metadata,
        spec: spec.clone(),
    }
}
