//! What `whereabouts-operator audit` reports: every inconsistency of the stored objects, with the
//! evidence for it, decided purely from one snapshot of them. `repair` applies the fixes of the
//! findings marked repairable, each write conditional on what the report saw.
//!
//! The rules are the operator's own (`ownership`, [`super::audit`]): an entry is stale when its
//! pod is gone or has another UID, or lives on with another address on that interface; held
//! entries (sticky, claimed) are their holders' and never stale here.

use std::collections::{BTreeMap, HashMap};
use std::net::IpAddr;

use serde::{Deserialize, Serialize};

use super::audit::{LivePods, Stale, Unguarded, expected_reservations, held_twice, unclaimed};
use super::migration::{Observation, crd_message, upstream_message};
use super::pools::{PoolView, SliceIndex};
use crate::crd::size::{ALERT_SHARE, POOL_OBJECT_BUDGET};
use crate::crd::{
    IPAllocation, IPPool, NetworkAttachmentDefinition, NodeSlicePool,
    OverlappingRangeIPReservationSpec,
};
use crate::ipam::naming::reservation_name;

/// A reservation as listed: name, UID, resourceVersion, spec, the address it claims (from our
/// annotation, when present) and its age in seconds.
#[derive(Debug, Clone, Default)]
pub struct ListedReservation {
    pub name: String,
    pub uid: String,
    pub resource_version: String,
    pub spec: OverlappingRangeIPReservationSpec,
    pub age: Option<u64>,
}

/// Everything one audit reads.
#[derive(Default)]
pub struct Snapshot {
    pub pools: Vec<IPPool>,
    pub slice_pools: Vec<std::sync::Arc<NodeSlicePool>>,
    pub reservations: Vec<ListedReservation>,
    pub pods: LivePods,
    pub nads: Vec<NetworkAttachmentDefinition>,
    /// Reservations younger than this may be claims whose entry is being written right now.
    pub min_age: u64,
    /// The installed CRDs and upstream's components (see [`super::migration`]).
    pub migration: Observation,
}

/// Where an entry is: enough to release it again (pool, its range and network) and to say so.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct EntryAt {
    pub pool: String,
    pub range: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub network: Option<String>,
    pub offset: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub address: Option<String>,
    pub entry: IPAllocation,
    /// Seconds since its reservation was made, when it has one.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub age_seconds: Option<u64>,
}

/// One inconsistency, with its evidence.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "kebab-case")]
pub enum Finding {
    /// An entry whose pod is gone (or has another UID), or lives on with another address on the
    /// entry's interface. Repair: remove the entry and its reservation.
    StaleEntry {
        at: EntryAt,
        why: String,
        /// The pod lives on with another address on that interface: the operator's audit frees
        /// it (it re-reads the pod's network-status); `repair` never removes an entry whose pod
        /// exists.
        #[serde(default)]
        superseded: bool,
    },
    /// A reservation that no pool entry implies (an ADD killed between claim and record, or a
    /// pool edited by hand). Repair: delete it, at the UID and resourceVersion seen.
    OrphanReservation {
        name: String,
        uid: String,
        resource_version: String,
        spec: OverlappingRangeIPReservationSpec,
        #[serde(default, skip_serializing_if = "Option::is_none")]
        age_seconds: Option<u64>,
        /// Younger than the minimum age: maybe a claim being recorded; not repaired.
        recent: bool,
    },
    /// An entry without its reservation (written by a plugin with `enable_overlapping_ranges`
    /// false, or upstream mid-write). Repair: create the reservation, if nobody holds it.
    MissingReservation { at: EntryAt, reservation: String },
    /// One address of one network held by two pods: entries of different pods in two pools
    /// (overlapping ranges whose reservations were missing), or an entry whose reservation names
    /// another pod (`claimed_by`: a reservation deleted by name and taken again). Not repaired:
    /// one of the pods must get a new address.
    DuplicateAddress {
        address: String,
        network: Option<String>,
        holders: Vec<EntryAt>,
        #[serde(default, skip_serializing_if = "Option::is_none")]
        claimed_by: Option<String>,
    },
    /// An entry whose key is not an offset inside the pool's range. Not repaired.
    OutsideRange {
        pool: String,
        range: String,
        key: String,
        entry: IPAllocation,
    },
    /// A pool object near the largest size the API server stores.
    PoolNearlyFull {
        pool: String,
        entries: usize,
        bytes: usize,
        budget: usize,
    },
    /// A NAD the validator refuses.
    InvalidNad { nad: String, problems: Vec<String> },
    /// An installed CRD of ours that lacks fields we write (the API server prunes them), or is
    /// not installed (`version` none). Not repaired: apply our CRDs.
    CrdMissingFields {
        crd: String,
        version: Option<String>,
        missing: Vec<String>,
    },
    /// One of upstream whereabouts' components, still running next to ours. Not repaired:
    /// remove it.
    UpstreamComponent {
        workload: super::migration::upstream::Kind,
        namespace: String,
        name: String,
        evidence: String,
    },
}

impl Finding {
    /// Whether `repair` has a fix for it.
    pub fn repairable(&self) -> bool {
        match self {
            Finding::StaleEntry { superseded, .. } => !superseded,
            Finding::MissingReservation { .. } => true,
            Finding::OrphanReservation { recent, .. } => !recent,
            _ => false,
        }
    }

    pub fn kind(&self) -> &'static str {
        match self {
            Finding::StaleEntry { .. } => "stale-entry",
            Finding::OrphanReservation { .. } => "orphan-reservation",
            Finding::MissingReservation { .. } => "missing-reservation",
            Finding::DuplicateAddress { .. } => "duplicate-address",
            Finding::OutsideRange { .. } => "outside-range",
            Finding::PoolNearlyFull { .. } => "pool-nearly-full",
            Finding::InvalidNad { .. } => "invalid-nad",
            Finding::CrdMissingFields { .. } => "crd-missing-fields",
            Finding::UpstreamComponent { .. } => "upstream-component",
        }
    }
}

impl std::fmt::Display for Finding {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let kind = self.kind();
        match self {
            Finding::StaleEntry { at, why, .. } => write!(f, "{kind}: {}: {why}", at_words(at)),
            Finding::OrphanReservation {
                name,
                spec,
                age_seconds,
                recent,
                ..
            } => write!(
                f,
                "{kind}: overlappingrangeipreservation {name} (pod {}, container {}{}) has no pool entry{}",
                spec.podref,
                spec.containerid,
                age_words(*age_seconds),
                if *recent {
                    "; recent, maybe still being recorded: not repaired"
                } else {
                    ""
                }
            ),
            Finding::MissingReservation { at, reservation } => write!(
                f,
                "{kind}: {} has no overlappingrangeipreservation {reservation}",
                at_words(at)
            ),
            Finding::DuplicateAddress {
                address,
                holders,
                claimed_by,
                ..
            } => {
                let mut who: Vec<String> = holders.iter().map(at_words).collect();
                who.extend(
                    claimed_by
                        .iter()
                        .map(|c| format!("its reservation names {c}")),
                );
                write!(
                    f,
                    "{kind}: {address} is held by more than one pod: {}",
                    who.join("; ")
                )
            }
            Finding::OutsideRange {
                pool,
                range,
                key,
                entry,
            } => write!(
                f,
                "{kind}: pool {pool} entry {key:?} (pod {}) is not an offset inside {range}",
                entry.podref
            ),
            Finding::PoolNearlyFull {
                pool,
                entries,
                bytes,
                budget,
            } => write!(
                f,
                "{kind}: pool {pool} holds {entries} entries, about {bytes} of {budget} bytes one object may take"
            ),
            Finding::InvalidNad { nad, problems } => {
                write!(f, "{kind}: {nad}: {}", problems.join("; "))
            }
            Finding::CrdMissingFields {
                crd,
                version,
                missing,
            } => write!(
                f,
                "{kind}: {}",
                crd_message(crd, version.as_deref(), missing)
            ),
            Finding::UpstreamComponent {
                workload,
                namespace,
                name,
                evidence,
            } => write!(
                f,
                "{kind}: {}",
                upstream_message(*workload, namespace, name, evidence)
            ),
        }
    }
}

fn at_words(at: &EntryAt) -> String {
    format!(
        "pool {} {} (offset {}) of pod {} container {}{}",
        at.pool,
        at.address.as_deref().unwrap_or("?"),
        at.offset,
        at.entry.podref,
        at.entry.id,
        age_words(at.age_seconds)
    )
}

fn age_words(age: Option<u64>) -> String {
    match age {
        Some(s) if s >= 3600 => format!(", {}h{}m old", s / 3600, s % 3600 / 60),
        Some(s) if s >= 60 => format!(", {}m old", s / 60),
        Some(s) => format!(", {s}s old"),
        None => String::new(),
    }
}

/// Every finding of a snapshot, in a stable order (by kind, then pool and address).
pub fn audit(snap: &Snapshot) -> Vec<Finding> {
    let slices = SliceIndex::new(&snap.slice_pools);
    let views: Vec<(PoolView, &IPPool)> = snap
        .pools
        .iter()
        .filter_map(|p| PoolView::from_pool_in(p, &slices).map(|v| (v, p)))
        .collect();
    let ages: HashMap<&str, Option<u64>> = snap
        .reservations
        .iter()
        .map(|r| (r.name.as_str(), r.age))
        .collect();
    let at = |v: &PoolView, offset: u128, entry: &IPAllocation| {
        let address = v.ip(offset);
        let age = address
            .and_then(|ip| ages.get(reservation_name(v.network_name.as_deref(), ip).as_str()))
            .copied()
            .flatten();
        EntryAt {
            pool: v.name.clone(),
            range: v.range.cidr().to_string(),
            network: v.network_name.clone(),
            offset: offset.to_string(),
            address: address.map(|a| a.to_string()),
            entry: entry.clone(),
            age_seconds: age,
        }
    };
    let mut out = Vec::new();
    for (v, _) in &views {
        for (offset, entry) in &v.entries {
            // An offset outside the range is an outside-range finding, not a release.
            let Some(ip) = v.ip(*offset) else { continue };
            let Some(stale) = snap.pods.staleness(entry, Some(ip)) else {
                continue;
            };
            let why = match stale {
                Stale::PodGone => format!(
                    "pod {} no longer exists (or is another pod of that name)",
                    entry.podref
                ),
                Stale::Superseded => format!(
                    "pod {} lives on with another address on {}",
                    entry.podref, entry.ifname
                ),
            };
            out.push(Finding::StaleEntry {
                at: at(v, *offset, entry),
                why,
                superseded: stale == Stale::Superseded,
            });
        }
    }
    let pools: Vec<PoolView> = views.iter().map(|(v, _)| v.clone()).collect();
    let unguarded = Unguarded::of(&snap.nads);
    out.extend(reservation_findings(snap, &pools, &unguarded, &at));
    out.extend(duplicates(snap, &pools, &unguarded, &at));
    for (v, pool) in &views {
        out.extend(outside_range(v, pool));
        out.extend(nearly_full(pool));
    }
    out.extend(invalid_nads(&snap.nads));
    out.extend(snap.migration.findings());
    out
}

type At<'a> = dyn Fn(&PoolView, u128, &IPAllocation) -> EntryAt + 'a;

/// Orphan reservations, and entries without their reservation.
fn reservation_findings(
    snap: &Snapshot,
    pools: &[PoolView],
    unguarded: &Unguarded,
    at: &At<'_>,
) -> Vec<Finding> {
    let expected = expected_reservations(pools);
    let mut out: Vec<Finding> = snap
        .reservations
        .iter()
        .filter(|r| !expected.contains(&r.name))
        .map(|r| Finding::OrphanReservation {
            name: r.name.clone(),
            uid: r.uid.clone(),
            resource_version: r.resource_version.clone(),
            spec: r.spec.clone(),
            age_seconds: r.age,
            recent: r.age.is_none_or(|a| a < snap.min_age),
        })
        .collect();
    let names: std::collections::HashSet<&str> =
        snap.reservations.iter().map(|r| r.name.as_str()).collect();
    for (v, offset, entry, reservation) in unclaimed(pools, &names, unguarded) {
        out.push(Finding::MissingReservation {
            at: at(v, offset, entry),
            reservation,
        });
    }
    out
}

/// Addresses two pods hold (`audit::held_twice`, the operator's rule): their entries, and the
/// pod their reservation names when it is none of them.
fn duplicates(
    snap: &Snapshot,
    pools: &[PoolView],
    unguarded: &Unguarded,
    at: &At<'_>,
) -> Vec<Finding> {
    let claims: HashMap<&str, &OverlappingRangeIPReservationSpec> = snap
        .reservations
        .iter()
        .map(|r| (r.name.as_str(), &r.spec))
        .collect();
    // The holders' entries, described only for the addresses found (few, if any).
    let mut entries: BTreeMap<String, (Option<String>, IpAddr, Vec<EntryAt>)> =
        held_twice(pools, &claims, unguarded)
            .into_iter()
            .map(|(name, _)| (name, (None, IpAddr::from([0, 0, 0, 0]), Vec::new())))
            .collect();
    for v in pools {
        for (offset, entry) in &v.entries {
            let Some(ip) = v.ip(*offset) else { continue };
            let name = reservation_name(v.network_name.as_deref(), ip);
            if let Some(held) = entries.get_mut(&name) {
                (held.0, held.1) = (v.network_name.clone(), ip);
                held.2.push(at(v, *offset, entry));
            }
        }
    }
    entries
        .into_iter()
        .map(|(name, (network, ip, holders))| {
            let claimed_by = claims
                .get(name.as_str())
                .filter(|c| holders.iter().all(|h| h.entry.podref != c.podref))
                .map(|c| match c.ifname.as_str() {
                    "" => format!("pod {}", c.podref),
                    ifname => format!("pod {} ({ifname})", c.podref),
                });
            Finding::DuplicateAddress {
                address: ip.to_string(),
                network,
                holders,
                claimed_by,
            }
        })
        .collect()
}

/// Keys that are not a decimal offset inside the pool's CIDR.
fn outside_range(v: &PoolView, pool: &IPPool) -> Vec<Finding> {
    pool.spec
        .allocations
        .iter()
        .filter(|(k, _)| k.parse::<u128>().ok().and_then(|o| v.ip(o)).is_none())
        .map(|(k, e)| Finding::OutsideRange {
            pool: v.name.clone(),
            range: v.range.cidr().to_string(),
            key: k.clone(),
            entry: e.clone(),
        })
        .collect()
}

fn nearly_full(pool: &IPPool) -> Option<Finding> {
    let entries: Vec<(u128, IPAllocation)> = pool
        .spec
        .allocations
        .iter()
        .filter_map(|(k, e)| Some((k.parse().ok()?, e.clone())))
        .collect();
    let bytes = crate::crd::size::pool_bytes(&pool.spec.range, entries.iter().map(|(o, e)| (o, e)));
    (bytes as f64 >= POOL_OBJECT_BUDGET as f64 * ALERT_SHARE).then(|| Finding::PoolNearlyFull {
        pool: pool.metadata.name.clone().unwrap_or_default(),
        entries: entries.len(),
        bytes,
        budget: POOL_OBJECT_BUDGET,
    })
}

fn invalid_nads(nads: &[NetworkAttachmentDefinition]) -> Vec<Finding> {
    nads.iter()
        .filter_map(|nad| {
            let check = crate::nad_check::check_spec_config(&nad.spec.config);
            (!check.errors.is_empty()).then(|| Finding::InvalidNad {
                nad: format!(
                    "{}/{}",
                    nad.metadata.namespace.as_deref().unwrap_or_default(),
                    nad.metadata.name.as_deref().unwrap_or_default()
                ),
                problems: check.errors.iter().map(crate::nad_check::message).collect(),
            })
        })
        .collect()
}

#[cfg(test)]
mod tests;
