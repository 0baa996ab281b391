//! The pool audit: what the event path missed (pods deleted while the operator was down, DELs that
//! failed, force-deleted pods, orphan claims of killed ADDs).
//!
//! A cache can lag: a pod created a moment ago may not be in it while its address already is in a
//! pool. So a stale entry is released only when it was stale on two audits at least a grace period
//! apart, and only after the live pool and pod are read again right before the write.

use std::collections::{HashMap, HashSet};
use std::hash::Hash;
use std::net::IpAddr;
use std::time::{Duration, Instant};

use k8s_openapi::api::coordination::v1::Lease;
use kube::api::{Api, DeleteParams, ListParams, Preconditions};
use kube::{Resource, ResourceExt};

use super::Context;
use super::pools::PoolView;
use crate::alloc::Engine;
use crate::crd::IPAllocation;
use crate::ownership::{
    NETWORK_STATUS_ANNOTATION, addresses_by_interface, is_stale, is_superseded,
    parse_network_status, runtime_uid,
};
use crate::store::{Datastore, StoreError, TURN_LABEL, TURN_SECONDS};

mod claims;
mod doubles;
pub use claims::{
    ORPHAN_CLAIM_AGE, Restored, Unguarded, expected_reservations, last_written, unclaimed,
};
pub use doubles::held_twice;

/// Remembers when each suspect was first seen stale; a suspect is due once it has stayed stale
/// for the grace period. Suspects that stop being stale are forgotten.
#[derive(Debug, Default)]
pub struct Suspects<K: Eq + Hash + Clone> {
    first_seen: HashMap<K, Instant>,
}

impl<K: Eq + Hash + Clone> Suspects<K> {
    /// Records this audit's stale set and returns the suspects now due for release.
    pub fn observe(
        &mut self,
        now: Instant,
        stale: impl IntoIterator<Item = K>,
        grace: Duration,
    ) -> Vec<K> {
        let stale: HashSet<K> = stale.into_iter().collect();
        self.first_seen.retain(|k, _| stale.contains(k));
        let mut due = Vec::new();
        for k in stale {
            let first = *self.first_seen.entry(k.clone()).or_insert(now);
            if now.duration_since(first) >= grace {
                due.push(k);
            }
        }
        due
    }

    pub fn forget(&mut self, k: &K) {
        self.first_seen.remove(k);
    }

    pub fn is_empty(&self) -> bool {
        self.first_seen.is_empty()
    }
}

/// A stale pool entry: pool, offset, container id.
pub type EntryKey = (String, u128, String);

/// What one audit found.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct Report {
    /// Stale entries per pool (released ones included).
    pub stale: HashMap<String, usize>,
    /// Reservations without a pool entry (old enough to be swept), plus pool entries of guarded
    /// networks without their claim.
    pub orphans: usize,
    /// Missing claims of pool entries that were re-created.
    pub restored_claims: usize,
    /// Pool entries whose address another pod's claim holds, found when re-creating the claim.
    pub foreign_claims: usize,
    /// Addresses two pods have held for the grace period (entries, or an entry and its claim).
    pub held_twice: usize,
    pub released: usize,
    pub released_orphans: usize,
    /// Pools' writer turns removed because their plugin was killed while holding them.
    pub abandoned_turns: usize,
}

/// Live pods by podref: their UIDs, and the addresses their network-status lists per interface.
#[derive(Debug, Default)]
pub struct LivePods {
    pub uids: HashMap<String, String>,
    pub interfaces: HashMap<String, HashMap<String, Vec<IpAddr>>>,
}

impl LivePods {
    /// Why `entry` (holding `ip`) is stale, if it is: its pod is gone, or the pod lives on with
    /// another address on the entry's interface.
    /// A held entry is its holder's (see `controller::holders`), never stale here.
    pub fn staleness(&self, entry: &IPAllocation, ip: Option<IpAddr>) -> Option<Stale> {
        if entry.is_held() {
            return None;
        }
        if is_stale(entry, &self.uids) {
            return Some(Stale::PodGone);
        }
        let interfaces = self.interfaces.get(&entry.podref)?;
        ip.filter(|ip| is_superseded(entry, *ip, interfaces))
            .map(|_| Stale::Superseded)
    }
}

/// Why an entry no longer belongs to a living attachment.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Stale {
    PodGone,
    Superseded,
}

/// The interfaces' addresses of a pod's network-status; a malformed annotation lists none.
fn interfaces_of(pod: &impl Resource) -> HashMap<String, Vec<IpAddr>> {
    pod.meta()
        .annotations
        .as_ref()
        .and_then(|a| a.get(NETWORK_STATUS_ANNOTATION))
        .and_then(|text| parse_network_status(text).ok())
        .map(|statuses| addresses_by_interface(&statuses))
        .unwrap_or_default()
}

/// Live pods, from the cache.
fn live_pods(ctx: &Context) -> LivePods {
    let mut live = LivePods::default();
    for p in ctx.caches.pods.state().iter() {
        live.add(p.as_ref());
    }
    // Deleted pods whose node's kubelet may still run them: live until their release is due.
    live.uids.extend(ctx.waiting.pods());
    live
}

impl LivePods {
    /// Adds a pod (an object, or its metadata alone: the network-status is an annotation).
    pub fn add(&mut self, pod: &impl Resource) {
        let meta = pod.meta();
        let podref = format!(
            "{}/{}",
            meta.namespace.as_deref().unwrap_or_default(),
            meta.name.as_deref().unwrap_or_default()
        );
        self.uids.insert(podref.clone(), runtime_uid(meta));
        let interfaces = interfaces_of(pod);
        if !interfaces.is_empty() {
            self.interfaces.insert(podref, interfaces);
        }
    }
}

/// Stale entries of every cached pool.
pub fn stale_entries(pools: &[PoolView], live: &LivePods) -> Vec<EntryKey> {
    pools
        .iter()
        .flat_map(|p| {
            p.entries
                .iter()
                .filter(|(o, e)| live.staleness(e, p.ip(**o)).is_some())
                .map(|(o, e)| (p.name.clone(), *o, e.id.clone()))
        })
        .collect()
}

pub struct Auditor {
    entries: Suspects<EntryKey>,
    /// Reservations by (name, uid, resourceVersion): one that changes is observed afresh, and
    /// the delete is conditional on the version seen.
    orphans: Suspects<(String, String, String)>,
    /// Pool entries of guarded networks without their claim.
    unclaimed: Suspects<EntryKey>,
    /// Addresses two pods hold: the claim's name and the holders.
    doubles: Suspects<doubles::HeldTwice>,
    /// Writer-turn Leases by (name, uid, resourceVersion): one seen unchanged on two audits at
    /// least the grace period apart was abandoned by a killed plugin.
    turns: Suspects<(String, String, String)>,
}

impl Auditor {
    pub fn new() -> Self {
        Auditor {
            entries: Suspects::default(),
            orphans: Suspects::default(),
            unclaimed: Suspects::default(),
            doubles: Suspects::default(),
            turns: Suspects::default(),
        }
    }

    /// True while stale suspects wait for their second observation.
    pub fn has_suspects(&self) -> bool {
        !self.entries.is_empty() || !self.orphans.is_empty() || !self.unclaimed.is_empty()
    }

    pub async fn run_once(&mut self, ctx: &Context) -> Result<Report, StoreError> {
        let (pools, unreadable) = ctx.readable_pools();
        let live = live_pods(ctx);
        let stale = stale_entries(&pools, &live);
        let now = Instant::now();
        // First: it cannot fail, and the rest can.
        let mut report = Report {
            abandoned_turns: self.sweep_turns(ctx, now).await,
            ..Default::default()
        };
        for (pool, _, _) in &stale {
            *report.stale.entry(pool.clone()).or_default() += 1;
        }
        for key in self.entries.observe(now, stale, ctx.opts.stale_grace) {
            if self.release_stale(ctx, &key).await? {
                report.released += 1;
            }
            self.entries.forget(&key);
        }
        // The ranges that take no claims: every NAD's config parsed, once per audit.
        let unguarded = Unguarded::of(ctx.caches.nads.state().iter().map(|n| n.as_ref()));
        report.held_twice = self.report_held_twice(ctx, &pools, &unguarded, now);
        let (orphans, due, unclaimed) =
            self.claims(ctx, &pools, &unguarded, &live, unreadable, now);
        report.orphans = orphans + unclaimed.len();
        if !due.is_empty() {
            report.released_orphans = self.release_orphans(ctx, due).await?;
        }
        self.restore_claims(ctx, &pools, unclaimed, now, &mut report)
            .await?;
        Ok(report)
    }

    /// Removes pools' writer turns (Leases) abandoned by killed plugins, which would otherwise
    /// make the next claimants of that pool wait the turn length before taking it over. A turn
    /// lasts well under a second, so one unchanged over the grace period is abandoned; the delete
    /// is conditional on the UID and resourceVersion that were seen. Failures are logged only:
    /// nothing depends on this.
    async fn sweep_turns(&mut self, ctx: &Context, now: Instant) -> usize {
        let leases: Api<Lease> = Api::namespaced(ctx.client.clone(), &ctx.opts.pool_namespace);
        let listed = match leases
            .list_metadata(&ListParams::default().labels(TURN_LABEL))
            .await
        {
            Ok(list) => list.items,
            Err(e) => {
                tracing::debug!(error = %e, "cannot list pools' writer turns");
                return 0;
            }
        };
        let seen = listed.iter().map(|l| {
            (
                l.name_any(),
                l.uid().unwrap_or_default(),
                l.resource_version().unwrap_or_default(),
            )
        });
        let grace = ctx.opts.stale_grace.max(Duration::from_secs(TURN_SECONDS));
        let mut removed = 0;
        for key in self.turns.observe(now, seen.collect::<Vec<_>>(), grace) {
            self.turns.forget(&key);
            let (name, uid, rv) = &key;
            if ctx.opts.dry_run {
                tracing::info!(lease = %name, "dry run: would remove an abandoned writer turn");
                continue;
            }
            let params = DeleteParams {
                preconditions: Some(Preconditions {
                    uid: Some(uid.clone()),
                    resource_version: Some(rv.clone()),
                }),
                ..Default::default()
            };
            match leases.delete(name, &params).await {
                Ok(_) => {
                    tracing::info!(lease = %name, "removed a writer turn abandoned by a killed plugin");
                    removed += 1;
                }
                Err(e) => tracing::debug!(lease = %name, error = %e, "writer turn not removed"),
            }
        }
        removed
    }

    /// Re-reads the pool and the pod; releases the entry only if it is still there, unchanged, and
    /// still stale.
    async fn release_stale(
        &self,
        ctx: &Context,
        (pool, offset, id): &EntryKey,
    ) -> Result<bool, StoreError> {
        let Some(fresh) = ctx
            .caches
            .pools
            .state()
            .iter()
            .find(|p| p.name_any() == *pool)
            .and_then(|p| PoolView::from_pool_in(p, &ctx.slice_index()))
        else {
            return Ok(false);
        };
        let Some(live_pool) = ctx.store.get_pool(pool).await? else {
            return Ok(false);
        };
        let Some(entry) = live_pool
            .allocations
            .get(offset)
            .filter(|e| e.id == *id)
            .cloned()
        else {
            return Ok(false);
        };
        let ip = fresh.ip(*offset);
        let Some(why) = staleness_now(ctx, &entry, ip).await? else {
            return Ok(false);
        };
        if ctx.opts.dry_run {
            tracing::info!(pool, ?ip, pod = %entry.podref, "dry run: would release a stale entry");
            return Ok(false);
        }
        let target = fresh.target();
        let released = Engine::new(&ctx.store, &target)
            .release_entries(&[(*offset, entry.clone())])
            .await?;
        for ip in &released {
            tracing::info!(pool, %ip, pod = %entry.podref, "released a stale entry");
            ctx.pool_event(
                pool,
                false,
                "StaleAddressReleased",
                &match why {
                    Stale::PodGone => format!("released {ip}: pod {} no longer exists", entry.podref),
                    Stale::Superseded => format!(
                        "released {ip}: pod {} lives on with other addresses on {} (an earlier sandbox's)",
                        entry.podref, entry.ifname
                    ),
                },
            )
            .await;
        }
        ctx.metrics.record_releases("audit", released.len());
        Ok(!released.is_empty())
    }
}

impl Default for Auditor {
    fn default() -> Self {
        Self::new()
    }
}

/// Reads the pod from the API server (not the cache): gone, or replaced by a pod with another UID.
async fn staleness_now(
    ctx: &Context,
    entry: &IPAllocation,
    ip: Option<IpAddr>,
) -> Result<Option<Stale>, StoreError> {
    if !entry.podref.contains('/') {
        return Ok(None);
    }
    let pod = ctx.pod_now(&entry.podref).await?;
    let mut live = LivePods::default();
    if let Some(pod) = &pod {
        live.add(pod);
    }
    Ok(live.staleness(entry, ip))
}

#[cfg(test)]
mod tests;
