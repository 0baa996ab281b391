//! The audit and claims (reservations): which orphan claims are old enough to sweep, and which
//! pool entries lost the claim that guards their address, to be re-created.
//!
//! A claim without a pool entry is usually an ADD at work: it claimed the address and has not
//! recorded it yet, for as long as [`CLAIM_LIFETIME`] after its last write. So the sweep spares
//! any claim written more recently than the operator's `--orphan-claim-age` (default
//! [`ORPHAN_CLAIM_AGE`]), judged by the API server's timestamps on the claim itself, not by when
//! the operator first saw it.
//!
//! A pool entry without its claim is usually a writer mid-way (upstream writes the pool before
//! the reservation) but may be lasting: upstream's DEL deletes reservations by name with no
//! precondition, so it can delete a claim of ours. Meanwhile a pool of another network that
//! overlaps this range would hand the address out again; the audit re-creates the claim once the
//! entry has gone without it for the grace period (create-if-absent).

use std::collections::{BTreeSet, HashSet};
use std::time::{Duration, Instant};

use kube::ResourceExt;
use kube::api::{Api, ListParams};

use super::{Auditor, EntryKey, LivePods, Report};
use crate::alloc::CLAIM_LIFETIME;
use crate::controller::Context;
use crate::controller::pools::{KnownBy, PoolView};
use crate::crd::{
    IPAllocation, IPPool, NetworkAttachmentDefinition, OverlappingRangeIPReservation,
};
use crate::ipam::naming::reservation_name;
use crate::nad_check::check_spec_config;
use crate::ownership::Owned;
use crate::store::{Datastore, RENEWED_ANNOTATION, StoreError, Write, now_secs};

/// The default youngest claim the sweep takes: [`CLAIM_LIFETIME`] and a minute for the clocks of
/// nodes and the API server to disagree.
pub const ORPHAN_CLAIM_AGE: Duration = Duration::from_secs(CLAIM_LIFETIME.as_secs() + 60);

/// When `r` was last written, in seconds since the epoch: the latest of its creation, its
/// managed fields' times and its renewal annotation. `None` when it carries none of them.
pub fn last_written(r: &OverlappingRangeIPReservation) -> Option<i64> {
    let meta = &r.metadata;
    let created = meta.creation_timestamp.iter().map(|t| t.0.as_second());
    let managed = meta
        .managed_fields
        .iter()
        .flatten()
        .filter_map(|f| f.time.as_ref())
        .map(|t| t.0.as_second());
    let renewed = r
        .annotations()
        .get(RENEWED_ANNOTATION)
        .and_then(|v| v.parse::<i64>().ok());
    created.chain(managed).chain(renewed).max()
}

/// Whether `r` was last written at least `age` before `now` (seconds since the epoch). A claim
/// with no time on it (not one the API server made) is judged by the sightings alone.
pub fn old_enough(r: &OverlappingRangeIPReservation, now: i64, age: Duration) -> bool {
    last_written(r).is_none_or(|at| now - at >= age.as_secs() as i64)
}

/// Whether `r`'s pod still reports the address it guards (Multus's `network-status`), as the same
/// incarnation when the claim records one. Such a claim is spared by the sweep even without a
/// pool entry: the pod holds the address, and the claim is all that keeps every pool of its range
/// from handing it out again. Upstream v0.9.2's ADD leaves exactly that when its pool write fails
/// (retries used up on a busy pool, an API server crash): it still creates the reservation and
/// reports success. In the chaos tier, sweeping such a claim let upstream give the address to a
/// second pod. It is swept once the pod is gone or reports another address.
pub fn reported_by_its_pod(r: &OverlappingRangeIPReservation, live: &LivePods) -> bool {
    let spec = &r.spec;
    if !spec.poduid.is_empty() && live.uids.get(&spec.podref) != Some(&spec.poduid) {
        return false;
    }
    let Some(interfaces) = live.interfaces.get(&spec.podref) else {
        return false;
    };
    let name = r.name_any();
    interfaces.values().flatten().any(|ip| {
        let bare = reservation_name(None, *ip);
        name == bare || name.ends_with(&format!("-{bare}"))
    })
}

/// The NAD ranges that take no claims (`enable_overlapping_ranges` false): the entries of their
/// pools have none, by design. Every other pool's entries have one (the setting is on by default,
/// upstream's too), the pools of a network no NAD describes any more included.
#[derive(Debug, Default)]
pub struct Unguarded(Vec<(Option<String>, ipnet::IpNet, bool)>);

impl Unguarded {
    pub fn of<'a>(nads: impl IntoIterator<Item = &'a NetworkAttachmentDefinition>) -> Unguarded {
        let ranges = nads
            .into_iter()
            .flat_map(|nad| check_spec_config(&nad.spec.config).ranges)
            .filter(|r| !r.overlapping)
            .map(|r| (r.network_name, r.range.cidr(), r.slices.is_some()))
            .collect();
        Unguarded(ranges)
    }

    /// Whether `pool` is of such a range: the range itself, or one of its node slices.
    pub fn covers(&self, pool: &PoolView) -> bool {
        let cidr = pool.range.cidr();
        self.0.iter().any(|(network, range, sliced)| {
            *network == pool.network_name
                && if *sliced {
                    range.contains(&cidr)
                } else {
                    *range == cidr
                }
        })
    }
}

/// An entry that should have a claim and has none: its pool, offset, entry and the claim's name.
pub type Unclaimed<'a> = (&'a PoolView, u128, &'a IPAllocation, String);

/// The entries whose claim (by name) is not among `claims`, outside unguarded ranges.
pub fn unclaimed<'a>(
    pools: &'a [PoolView],
    claims: &HashSet<&str>,
    unguarded: &Unguarded,
) -> Vec<Unclaimed<'a>> {
    pools
        .iter()
        .filter(|p| !unguarded.covers(p))
        .flat_map(|p| {
            p.entries.iter().filter_map(move |(offset, e)| {
                let ip = p.ip(*offset)?;
                let name = reservation_name(p.network_name.as_deref(), ip);
                (!claims.contains(name.as_str())).then_some((p, *offset, e, name))
            })
        })
        .collect()
}

/// What a restore of one entry's claim did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Restored {
    /// The claim was re-created.
    Made,
    /// Nothing to do: the entry is gone or changed, or its claim is back.
    NotNeeded,
    /// Another pod's claim holds the address: two pods on one address.
    Foreign,
}

/// Re-creates the claim of the entry `key` if the pool, read afresh, still holds that entry and
/// the claim is still missing.
pub async fn restore(
    ctx: &Context,
    view: &PoolView,
    key: &EntryKey,
) -> Result<Restored, StoreError> {
    let (pool, offset, id) = key;
    let Some(fresh) = ctx.store.get_pool(pool).await? else {
        return Ok(Restored::NotNeeded);
    };
    let Some(entry) = fresh.allocations.get(offset).filter(|e| e.id == *id) else {
        return Ok(Restored::NotNeeded);
    };
    let Some(ip) = view.ip(*offset) else {
        return Ok(Restored::NotNeeded);
    };
    let name = reservation_name(view.network_name.as_deref(), ip);
    if ctx.opts.dry_run {
        tracing::info!(reservation = %name, pool, pod = %entry.podref, "dry run: would re-create a missing claim");
        return Ok(Restored::NotNeeded);
    }
    let (written, _) = ctx
        .store
        .create_reservation(&name, &entry.into(), pool, ip)
        .await?;
    if written == Write::Done {
        tracing::warn!(reservation = %name, pool, pod = %entry.podref, "re-created the missing claim of a pool entry");
        return Ok(Restored::Made);
    }
    Ok(match ctx.store.get_reservation(&name).await? {
        Some(r) if !r.spec.same_claimant(entry) => {
            tracing::error!(reservation = %name, pool, pod = %entry.podref, holder = %r.spec.podref, "the address of a pool entry is claimed by another pod: two pods may hold it");
            Restored::Foreign
        }
        _ => Restored::NotNeeded,
    })
}

/// Reservation names every pool entry implies.
///
/// A pool's labels, or the NodeSlicePool that describes it, name its network. An unlabelled node
/// slice's pool (`[<network>-]<node>-<slice>`, upstream's) that no NodeSlicePool describes
/// (deleted by hand, or not cached yet) reads as a pool of network `<network>-<node>`: so that its
/// live reservations are never taken for orphans, every shorter `-`-separated prefix of such a
/// pool's network (and the unnamed network) counts as expected too. That only spares some true
/// orphans.
pub fn expected_reservations(pools: &[PoolView]) -> BTreeSet<String> {
    let mut expected = BTreeSet::new();
    for p in pools {
        let network = p.network_name.as_deref().unwrap_or_default();
        let guesses = (p.known_by == KnownBy::Name).then(|| {
            network
                .match_indices('-')
                .map(|(i, _)| Some(&network[..i]))
                .chain([None])
        });
        let prefixes: Vec<Option<&str>> = guesses
            .into_iter()
            .flatten()
            .chain([p.network_name.as_deref()])
            .collect();
        for ip in p.entries.keys().filter_map(|o| p.ip(*o)) {
            expected.extend(prefixes.iter().map(|n| reservation_name(*n, ip)));
        }
    }
    expected
}

impl Auditor {
    /// This audit's claims: how many orphans there are (no pool entry implies them, old enough),
    /// those due for the sweep (seen twice), and the entries of guarded pools whose claim is
    /// missing.
    pub(super) fn claims(
        &mut self,
        ctx: &Context,
        pools: &[PoolView],
        unguarded: &Unguarded,
        live: &LivePods,
        unreadable: usize,
        now: Instant,
    ) -> (usize, Vec<(String, String, String)>, Vec<EntryKey>) {
        let expected = expected_reservations(pools);
        let cached = ctx.caches.reservations.state();
        let names: HashSet<String> = cached.iter().map(|r| r.name_any()).collect();
        // A pool that cannot be read (its name or range does not parse) implies reservations
        // nobody can name: none is taken for an orphan while one is cached.
        if unreadable > 0 {
            tracing::warn!(
                unreadable,
                "pools that cannot be read: no reservation is swept as an orphan until they are fixed or removed"
            );
        }
        let (wall, age) = (now_secs(), ctx.opts.orphan_claim_age);
        let orphans: Vec<(String, String, String)> = cached
            .iter()
            .filter(|r| unreadable == 0 && !expected.contains(&r.name_any()))
            .filter(|r| old_enough(r, wall, age) && !reported_by_its_pod(r, live))
            .map(|r| {
                let rv = r.resource_version().unwrap_or_default();
                (r.name_any(), r.uid().unwrap_or_default(), rv)
            })
            .collect();
        let names: HashSet<&str> = names.iter().map(String::as_str).collect();
        let unclaimed: Vec<EntryKey> = unclaimed(pools, &names, unguarded)
            .into_iter()
            .map(|(p, offset, e, _)| (p.name.clone(), offset, e.id.clone()))
            .collect();
        if !unclaimed.is_empty() {
            tracing::warn!(
                unclaimed = unclaimed.len(),
                "pool entries without their claim (upstream mid-write, or its DEL deleted it): re-created if it stays so"
            );
        }
        let count = orphans.len();
        let due = self.orphans.observe(now, orphans, ctx.opts.stale_grace);
        (count, due, unclaimed)
    }

    /// Deletes orphan reservations after a fresh LIST of pools confirms no entry implies them.
    pub(super) async fn release_orphans(
        &mut self,
        ctx: &Context,
        due: Vec<(String, String, String)>,
    ) -> Result<usize, StoreError> {
        let api: Api<IPPool> = Api::namespaced(ctx.client.clone(), &ctx.opts.pool_namespace);
        let pools = api
            .list(&ListParams::default())
            .await
            .map_err(|e| StoreError::Api {
                op: "list",
                object: "ippools".into(),
                code: 0,
                message: e.to_string(),
            })?;
        let slices = ctx.slice_index();
        let views: Vec<_> = pools
            .items
            .iter()
            .filter_map(|p| PoolView::from_pool_in(p, &slices))
            .collect();
        if views.len() < pools.items.len() {
            return Ok(0);
        }
        let expected = expected_reservations(&views);
        let mut released = 0;
        for (name, uid, rv) in due {
            self.orphans
                .forget(&(name.clone(), uid.clone(), rv.clone()));
            if expected.contains(&name) {
                continue;
            }
            if ctx.opts.dry_run {
                tracing::info!(reservation = %name, "dry run: would delete an orphan reservation");
                continue;
            }
            // At the version seen twice: one re-made or taken over since is not this orphan.
            if ctx.store.delete_reservation(&name, &uid, Some(&rv)).await? == Write::Done {
                tracing::info!(reservation = %name, "deleted an orphan reservation");
                released += 1;
            }
        }
        ctx.metrics.record_releases("orphan", released);
        Ok(released)
    }
    /// Re-creates the claims of entries that have gone without one for the grace period.
    pub(super) async fn restore_claims(
        &mut self,
        ctx: &Context,
        pools: &[PoolView],
        unclaimed: Vec<EntryKey>,
        now: Instant,
        report: &mut Report,
    ) -> Result<(), StoreError> {
        for key in self.unclaimed.observe(now, unclaimed, ctx.opts.stale_grace) {
            self.unclaimed.forget(&key);
            let Some(view) = pools.iter().find(|p| p.name == key.0) else {
                continue;
            };
            match restore(ctx, view, &key).await? {
                Restored::Made => {
                    report.restored_claims += 1;
                    ctx.metrics.claims_restored.inc();
                }
                Restored::Foreign => report.foreign_claims += 1,
                Restored::NotNeeded => {}
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashMap;

    use k8s_openapi::apimachinery::pkg::apis::meta::v1::{ManagedFieldsEntry, Time};

    fn at(secs: i64) -> Time {
        Time(k8s_openapi::jiff::Timestamp::from_second(secs).unwrap())
    }

    fn claim(created: i64, managed: &[i64], renewed: Option<i64>) -> OverlappingRangeIPReservation {
        let mut r = OverlappingRangeIPReservation::new("10.0.0.9", Default::default());
        r.metadata.creation_timestamp = Some(at(created));
        r.metadata.managed_fields = Some(
            managed
                .iter()
                .map(|t| ManagedFieldsEntry {
                    time: Some(at(*t)),
                    ..Default::default()
                })
                .collect(),
        );
        if let Some(t) = renewed {
            r.annotations_mut()
                .insert(RENEWED_ANNOTATION.into(), t.to_string());
        }
        r
    }

    /// A claim without a pool entry whose pod still reports its address is not an orphan: an
    /// upstream one (no UID) of a pod that lists it, on any interface, with or without a
    /// network_name prefix; ours only for the same pod incarnation. Not when the pod is gone or
    /// reports another address.
    #[test]
    fn a_claim_whose_pod_reports_its_address_is_spared() {
        let mut live = LivePods::default();
        live.uids.insert("ns/a".into(), "uid-a".into());
        let addresses = |ips: &[&str]| -> HashMap<String, Vec<std::net::IpAddr>> {
            HashMap::from([(
                "net1".into(),
                ips.iter().map(|i| i.parse().unwrap()).collect(),
            )])
        };
        live.interfaces
            .insert("ns/a".into(), addresses(&["10.0.0.9", "fd00::9"]));
        let of = |name: &str, podref: &str, poduid: &str| {
            let spec = crate::crd::OverlappingRangeIPReservationSpec {
                podref: podref.into(),
                poduid: poduid.into(),
                ..Default::default()
            };
            OverlappingRangeIPReservation::new(name, spec)
        };
        assert!(reported_by_its_pod(&of("10.0.0.9", "ns/a", ""), &live));
        assert!(reported_by_its_pod(
            &of("shared-10.0.0.9", "ns/a", ""),
            &live
        ));
        assert!(reported_by_its_pod(&of("fd00--9", "ns/a", "uid-a"), &live));
        assert!(!reported_by_its_pod(
            &of("10.0.0.9", "ns/a", "uid-old"),
            &live
        ));
        assert!(!reported_by_its_pod(&of("10.0.0.19", "ns/a", ""), &live));
        assert!(!reported_by_its_pod(&of("10.0.0.9", "ns/gone", ""), &live));
    }

    #[test]
    fn a_claim_is_as_young_as_its_last_write() {
        let age = ORPHAN_CLAIM_AGE;
        assert_eq!(age, Duration::from_secs(180));
        let now = 10_000;
        assert!(old_enough(&claim(now - 181, &[now - 181], None), now, age));
        assert!(!old_enough(&claim(now - 179, &[], None), now, age));
        // Created long ago, but taken over or renewed a moment ago: a writer is at work.
        assert!(!old_enough(
            &claim(now - 900, &[now - 900, now - 5], None),
            now,
            age
        ));
        assert!(!old_enough(
            &claim(now - 900, &[now - 900], Some(now - 5)),
            now,
            age
        ));
        let mut untimed = claim(0, &[], None);
        untimed.metadata.creation_timestamp = None;
        untimed.metadata.managed_fields = None;
        assert!(old_enough(&untimed, now, age), "judged by its sightings");
    }

    fn nad(name: &str, ipam: serde_json::Value) -> NetworkAttachmentDefinition {
        let mut ipam = ipam;
        ipam["type"] = "whereabouts".into();
        let config = serde_json::json!({"cniVersion": "1.0.0", "name": name, "type": "macvlan", "ipam": ipam});
        NetworkAttachmentDefinition::new(
            name,
            crate::crd::NetworkAttachmentDefinitionSpec {
                config: config.to_string(),
            },
        )
    }

    #[test]
    fn entries_lack_a_claim_unless_their_range_takes_none() {
        use crate::controller::pools::tests::pool;
        let nads = [
            nad("on", serde_json::json!({"range": "10.0.0.0/24"})),
            nad(
                "off",
                serde_json::json!({"range": "10.0.1.0/24", "enable_overlapping_ranges": false}),
            ),
            nad(
                "sliced-off",
                serde_json::json!({"range": "10.1.0.0/16", "node_slice_size": "/24",
                "network_name": "s", "enable_overlapping_ranges": false}),
            ),
        ];
        let unguarded = Unguarded::of(&nads);
        let raw = [
            pool(
                "10.0.0.0-24",
                "10.0.0.0/24",
                &[(5, "ns/a", "u"), (6, "ns/b", "u")],
            ),
            pool("10.0.1.0-24", "10.0.1.0/24", &[(5, "ns/c", "u")]),
            // A slice pool of the unguarded sliced range, and a pool no NAD describes.
            pool("s-10.1.3.0-24", "10.1.3.0/24", &[(5, "ns/d", "u")]),
            pool("10.9.0.0-24", "10.9.0.0/24", &[(5, "ns/e", "u")]),
        ];
        let pools: Vec<PoolView> = raw.iter().filter_map(PoolView::from_pool).collect();
        assert_eq!(pools.len(), 4);
        let claims = HashSet::from(["10.0.0.5"]);
        let found: Vec<(String, u128, String)> = unclaimed(&pools, &claims, &unguarded)
            .into_iter()
            .map(|(p, o, _, name)| (p.name.clone(), o, name))
            .collect();
        assert_eq!(
            found,
            [
                ("10.0.0.0-24".to_owned(), 6, "10.0.0.6".to_owned()),
                ("10.9.0.0-24".to_owned(), 5, "10.9.0.5".to_owned()),
            ]
        );
    }
}
