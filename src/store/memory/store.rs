//! The [`Datastore`] operations of a [`MemoryStore`], and watches of its pools.

use std::collections::BTreeMap;
use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex};

use tokio::sync::watch;

use super::{MemoryStore, State};
use crate::crd::{
    IPAMClaim, IPAMClaimStatus, IPAllocation, NodeSlicePool, OverlappingRangeIPReservationSpec,
};
use crate::store::{
    Datastore, Listing, PodFacts, Pool, PoolChanges, PoolClaim, PoolWrite, Reservation, Result,
    Turn, TurnAttempt, Write,
};

/// Watches a pool of a [`MemoryStore`].
pub struct MemoryChanges {
    state: Arc<Mutex<State>>,
    writes: watch::Receiver<u64>,
    pool: String,
    seen: String,
}

impl PoolChanges for MemoryChanges {
    fn ended(&self) -> bool {
        !self.state.lock().unwrap().pools.contains_key(&self.pool)
    }

    async fn next(&mut self, wait: std::time::Duration) -> Result<Option<Pool>> {
        let deadline = tokio::time::Instant::now() + wait;
        loop {
            self.writes.borrow_and_update();
            let current = self.state.lock().unwrap().pool(&self.pool);
            match current {
                None => return Ok(None),
                Some(p) if p.resource_version != self.seen => {
                    self.seen = p.resource_version.clone();
                    return Ok(Some(p));
                }
                Some(_) => {}
            }
            match tokio::time::timeout_at(deadline, self.writes.changed()).await {
                Ok(Ok(())) => continue,
                _ => return Ok(None),
            }
        }
    }
}

/// The `test` operations the Kubernetes store sends with an entry's removal or replacement
/// (`store::kubernetes::requests`), as the API server applies them: `id` and `podref` unchanged.
fn patch_tests_hold(current: &IPAllocation, expected: &IPAllocation) -> bool {
    current.id == expected.id && current.podref == expected.podref
}

impl MemoryStore {
    /// A patch of reservation `name` that holds only while it is the object `uid` at
    /// `resource_version`, as a merge patch carrying both does: `change` edits the state, and
    /// the reservation gets a new version.
    async fn patch_at(
        &self,
        kind: &'static str,
        name: &str,
        uid: &str,
        resource_version: &str,
        change: impl FnOnce(&mut State),
    ) -> Result<Write> {
        self.pause().await;
        self.check("patch", name)?;
        self.counted(kind);
        let rv = self.next.fetch_add(1, Ordering::Relaxed).to_string();
        let mut s = self.state.lock().unwrap();
        match s.reservations.get_mut(name) {
            None => Ok(Write::Missing),
            Some(r) if r.uid != uid || r.resource_version != resource_version => {
                Ok(Write::Conflict)
            }
            Some(r) => {
                r.resource_version = rv;
                change(&mut s);
                Ok(Write::Done)
            }
        }
    }
}

impl Datastore for MemoryStore {
    async fn get_pool(&self, name: &str) -> Result<Option<Pool>> {
        self.pause().await;
        self.check("get", name)?;
        self.counted("get_pool");
        Ok(self.state.lock().unwrap().pool(name))
    }

    async fn get_pool_cached(&self, name: &str) -> Result<Option<Pool>> {
        self.pause().await;
        self.check("get", name)?;
        self.counted("get_pool");
        Ok(self.cached().pool(name))
    }

    async fn create_pool(
        &self,
        name: &str,
        range: &str,
        labels: &BTreeMap<String, String>,
    ) -> Result<Write> {
        self.check("create", name)?;
        let mut s = self.state.lock().unwrap();
        if s.pools.contains_key(name) {
            return Ok(Write::Conflict);
        }
        s.pools
            .insert(name.into(), (range.into(), BTreeMap::new(), 1));
        s.pool_labels.insert(name.into(), labels.clone());
        drop(s);
        self.writes.send_modify(|n| *n += 1);
        Ok(Write::Done)
    }

    async fn add_allocations(
        &self,
        pool: &str,
        entries: &[(u128, IPAllocation)],
        resource_version: &str,
    ) -> Result<PoolWrite> {
        self.write_at(pool, resource_version, |allocations| {
            for (offset, entry) in entries {
                allocations.insert(*offset, entry.clone());
            }
        })
        .await
    }

    async fn remove_allocations(
        &self,
        pool: &str,
        offsets: &[u128],
        resource_version: &str,
    ) -> Result<PoolWrite> {
        self.write_at(pool, resource_version, |allocations| {
            for offset in offsets {
                allocations.remove(offset);
            }
        })
        .await
    }

    async fn touch_pool(&self, pool: &str, resource_version: &str) -> Result<PoolWrite> {
        self.write_at(pool, resource_version, |_| {}).await
    }

    type Changes = MemoryChanges;

    async fn watch_pool(&self, pool: &str, resource_version: &str) -> Result<MemoryChanges> {
        self.check("watch", pool)?;
        self.counted("watch");
        Ok(MemoryChanges {
            state: self.state.clone(),
            writes: self.writes.subscribe(),
            pool: pool.into(),
            seen: resource_version.into(),
        })
    }

    async fn take_turn(&self, pool: &str, _holder: &str) -> TurnAttempt {
        self.pause().await;
        if self.check("create", pool).is_err() {
            return TurnAttempt::Unavailable;
        }
        self.counted("take_turn");
        let mut s = self.state.lock().unwrap();
        if s.turns.contains_key(pool) {
            return TurnAttempt::Busy;
        }
        let uid = format!("turn-{}", self.next.fetch_add(1, Ordering::Relaxed));
        s.turns.insert(pool.into(), uid.clone());
        TurnAttempt::Taken(Turn {
            pool: pool.into(),
            uid,
        })
    }

    async fn end_turn(&self, turn: &Turn) {
        let mut s = self.state.lock().unwrap();
        if s.turns.get(&turn.pool) == Some(&turn.uid) {
            s.turns.remove(&turn.pool);
        }
    }

    async fn turn_holder(&self, pool: &str) -> Option<(String, String)> {
        let s = self.state.lock().unwrap();
        s.turns.get(pool).map(|uid| (uid.clone(), uid.clone()))
    }

    async fn break_turn(&self, pool: &str, uid: &str, _rv: &str) {
        self.counted("break_turn");
        let mut s = self.state.lock().unwrap();
        if s.turns.get(pool).map(String::as_str) == Some(uid) {
            s.turns.remove(pool);
        }
    }

    async fn replace_allocation(
        &self,
        pool: &str,
        offset: u128,
        expected: &IPAllocation,
        entry: &IPAllocation,
    ) -> Result<Write> {
        self.with_pool("patch", pool, |allocations, _| {
            match allocations.get_mut(&offset) {
                Some(current) if patch_tests_hold(current, expected) => {
                    *current = entry.clone();
                    Write::Done
                }
                _ => Write::Conflict,
            }
        })
    }

    async fn remove_allocation(
        &self,
        pool: &str,
        offset: u128,
        expected: &IPAllocation,
    ) -> Result<Write> {
        self.with_pool("patch", pool, |allocations, _| {
            match allocations.get(&offset) {
                Some(current) if patch_tests_hold(current, expected) => {
                    allocations.remove(&offset);
                    Write::Done
                }
                _ => Write::Conflict,
            }
        })
    }

    async fn create_reservation(
        &self,
        name: &str,
        spec: &OverlappingRangeIPReservationSpec,
        pool: &str,
        ip: std::net::IpAddr,
    ) -> Result<(Write, crate::store::Made)> {
        self.pause().await;
        self.check("create", name)?;
        let mut s = self.state.lock().unwrap();
        if s.reservations.contains_key(name) {
            return Ok((Write::Conflict, Default::default()));
        }
        let uid = format!("uid-{}", self.next.fetch_add(1, Ordering::Relaxed));
        let version = self.next.fetch_add(1, Ordering::Relaxed).to_string();
        let now = crate::store::now_secs();
        s.reservations.insert(
            name.into(),
            Reservation {
                name: name.into(),
                uid: uid.clone(),
                spec: spec.clone(),
                created: Some(now),
                claimed: Some(crate::store::claim_bucket(now)),
                // Kept in `State::releasing`, as labels are; `get_reservation` fills it in.
                releasing: false,
                resource_version: version.clone(),
            },
        );
        s.claims.insert(name.into(), (pool.into(), ip));
        let made = crate::store::Made {
            uid,
            resource_version: version,
        };
        Ok((Write::Done, made))
    }

    async fn settle_claim(&self, name: &str, made: &crate::store::Made) -> Result<Write> {
        if made.resource_version.is_empty() {
            return Ok(Write::Conflict);
        }
        self.patch_at(
            "settle_claim",
            name,
            &made.uid,
            &made.resource_version,
            |s| {
                if let Some(r) = s.reservations.get_mut(name) {
                    r.claimed = None;
                }
            },
        )
        .await
    }

    async fn claims_of(&self, pool: &str, listing: Listing) -> Result<Vec<PoolClaim>> {
        self.pause().await;
        self.check("list", pool)?;
        self.counted("claims_of");
        let s = match listing {
            Listing::Cached => self.cached(),
            Listing::Consistent => self.state.lock().unwrap().clone(),
        };
        Ok(s.claims
            .iter()
            .filter(|(_, (p, _))| p == pool)
            .filter_map(|(name, (_, ip))| {
                let r = s.reservations.get(name)?;
                // Only recent claims, as the Kubernetes store's claim-time label selects them.
                let recent = crate::store::recent_buckets(crate::store::now_secs());
                if !recent.contains(&r.claimed?) || s.releasing.contains_key(name) {
                    return None;
                }
                Some(PoolClaim {
                    ip: *ip,
                    uid: r.uid.clone(),
                    spec: r.spec.clone(),
                })
            })
            .collect())
    }

    async fn releases_of(&self, pool: &str) -> Result<Vec<PoolClaim>> {
        self.pause().await;
        self.check("list", pool)?;
        self.counted("releases_of");
        let s = self.cached();
        let recent = crate::store::recent_buckets(crate::store::now_secs());
        Ok(s.releasing
            .iter()
            .filter(|(_, bucket)| recent.contains(bucket))
            .filter_map(|(name, _)| {
                let (p, ip) = s.claims.get(name)?;
                let r = s.reservations.get(name)?;
                (p == pool).then(|| PoolClaim {
                    ip: *ip,
                    uid: r.uid.clone(),
                    spec: r.spec.clone(),
                })
            })
            .collect())
    }

    async fn mark_releasing(
        &self,
        name: &str,
        uid: &str,
        resource_version: &str,
    ) -> Result<(Write, String)> {
        self.pause().await;
        self.check("patch", name)?;
        self.counted("mark_releasing");
        let rv = self.next.fetch_add(1, Ordering::Relaxed).to_string();
        let mut s = self.state.lock().unwrap();
        match s.reservations.get_mut(name) {
            None => Ok((Write::Missing, String::new())),
            Some(r) if r.uid != uid || r.resource_version != resource_version => {
                Ok((Write::Conflict, String::new()))
            }
            Some(r) => {
                r.resource_version = rv.clone();
                let bucket = crate::store::claim_bucket(crate::store::now_secs());
                s.releasing.insert(name.into(), bucket);
                Ok((Write::Done, rv))
            }
        }
    }

    async fn renew_claim(&self, name: &str, uid: &str, resource_version: &str) -> Result<Write> {
        self.patch_at("renew_claim", name, uid, resource_version, |s| {
            if let Some(r) = s.reservations.get_mut(name) {
                r.claimed = Some(crate::store::claim_bucket(crate::store::now_secs()));
            }
            s.releasing.remove(name);
        })
        .await
    }

    async fn take_over_reservation(
        &self,
        name: &str,
        uid: &str,
        resource_version: &str,
        spec: &OverlappingRangeIPReservationSpec,
    ) -> Result<Write> {
        let spec = spec.clone();
        self.patch_at("take_over_reservation", name, uid, resource_version, |s| {
            if let Some(r) = s.reservations.get_mut(name) {
                r.spec = spec;
            }
            s.releasing.remove(name);
        })
        .await
    }

    async fn get_reservation(&self, name: &str) -> Result<Option<Reservation>> {
        self.pause().await;
        self.check("get", name)?;
        let s = self.state.lock().unwrap();
        Ok(s.reservations.get(name).map(|r| Reservation {
            releasing: s.releasing.contains_key(name),
            ..r.clone()
        }))
    }

    async fn delete_reservation(
        &self,
        name: &str,
        uid: &str,
        resource_version: Option<&str>,
    ) -> Result<Write> {
        self.delete_round_trip().await;
        self.check("delete", name)?;
        let mut s = self.state.lock().unwrap();
        match s.reservations.get(name) {
            None => Ok(Write::Missing),
            Some(r) if r.uid != uid => Ok(Write::Conflict),
            Some(r) if resource_version.is_some_and(|v| v != r.resource_version) => {
                Ok(Write::Conflict)
            }
            Some(_) => {
                s.reservations.remove(name);
                s.claims.remove(name);
                s.releasing.remove(name);
                Ok(Write::Done)
            }
        }
    }

    async fn get_node_slice_pool(&self, name: &str) -> Result<Option<NodeSlicePool>> {
        self.pause().await;
        self.check("get", name)?;
        Ok(self.state.lock().unwrap().slices.get(name).cloned())
    }

    async fn replace_node_slice_pool(&self, pool: &NodeSlicePool) -> Result<Write> {
        self.pause().await;
        let name = pool.metadata.name.clone().unwrap_or_default();
        self.check("update", &name)?;
        let mut s = self.state.lock().unwrap();
        let Some(stored) = s.slices.get_mut(&name) else {
            return Ok(Write::Missing);
        };
        if stored.metadata.resource_version != pool.metadata.resource_version {
            return Ok(Write::Conflict);
        }
        *stored = pool.clone();
        stored.metadata.resource_version =
            Some(self.next.fetch_add(1, Ordering::Relaxed).to_string());
        Ok(Write::Done)
    }

    async fn get_pod(&self, namespace: &str, name: &str) -> Result<Option<PodFacts>> {
        self.pause().await;
        let key = format!("{namespace}/{name}");
        self.check("get", &key)?;
        let s = self.state.lock().unwrap();
        // A pod made live with `set_pod` alone has only its UID.
        let uid_only = |uid: &String| PodFacts {
            uid: uid.clone(),
            ..Default::default()
        };
        Ok(s.pod_facts
            .get(&key)
            .cloned()
            .or_else(|| s.pods.get(&key).map(uid_only)))
    }

    async fn get_ipam_claim(&self, namespace: &str, name: &str) -> Result<Option<IPAMClaim>> {
        self.pause().await;
        let key = format!("{namespace}/{name}");
        self.check("get", &key)?;
        Ok(self.state.lock().unwrap().ipam_claims.get(&key).cloned())
    }

    async fn write_ipam_claim_status(
        &self,
        claim: &IPAMClaim,
        status: &IPAMClaimStatus,
    ) -> Result<Write> {
        self.pause().await;
        let key = format!(
            "{}/{}",
            claim.metadata.namespace.clone().unwrap_or_default(),
            claim.metadata.name.clone().unwrap_or_default()
        );
        self.check("update", &key)?;
        let mut s = self.state.lock().unwrap();
        let Some(stored) = s.ipam_claims.get_mut(&key) else {
            return Ok(Write::Missing);
        };
        if stored.metadata.resource_version != claim.metadata.resource_version {
            return Ok(Write::Conflict);
        }
        stored.status = Some(status.clone());
        stored.metadata.resource_version =
            Some(format!("c{}", self.next.fetch_add(1, Ordering::Relaxed)));
        Ok(Write::Done)
    }
}
