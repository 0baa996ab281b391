//! Claiming and releasing one address of one range, without a lock.
//!
//! ADD claims first, then records: with overlapping ranges on, the reservation object of the
//! chosen address is created (atomic create-or-409); only its owner then records the pool entry,
//! conditional on the pool's resourceVersion, recording at the same time every other claim of the
//! pool whose entry is still missing (group commit, see `claim_and_record`). A process killed
//! between the two writes leaves a claim without a pool entry, which the next writer records or the
//! operator's audit removes, never a duplicate. Upstream writes the pool first and then checks the
//! reservation, so a mixed fleet stays safe: whichever writes the reservation first wins and the
//! other moves on.
//!
//! Losing a claim costs one request and a new pick; picks after a lost race spread over the lowest
//! free addresses so that concurrent claimants stop colliding.
//!
//! DEL removes only entries that still hold the container being deleted, then the reservation if
//! it belongs to the same pod, so an address re-bound to a newer container is never released.

use std::collections::BTreeSet;
use std::net::IpAddr;

use thiserror::Error;

use super::protocol::Attachment;
use crate::config::RangeConfig;
use crate::crd::{IPAllocation, OverlappingRangeIPReservationSpec};
use crate::ipam::naming::reservation_name;
use crate::store::{Pool, Store, StoreError, Write};

/// Attempts per range before giving up with "try again later".
const MAX_CONFLICTS: u32 = 400;

#[derive(Debug, Error)]
pub enum AllocError {
    #[error(
        "no free address in range {cidr} (window {first} to {last}{excludes}): all {size} addresses are allocated"
    )]
    Exhausted {
        cidr: String,
        first: IpAddr,
        last: IpAddr,
        excludes: String,
        size: u128,
    },
    #[error("pool {pool}: gave up after {attempts} lost races for an address")]
    TooManyConflicts { pool: String, attempts: u32 },
    #[error(transparent)]
    Store(#[from] StoreError),
}

/// The network a range belongs to and how its addresses are protected.
#[derive(Debug, Clone, Copy)]
pub struct Scope<'a> {
    pub network_name: Option<&'a str>,
    pub overlapping: bool,
}

impl Attachment {
    fn entry(&self) -> IPAllocation {
        IPAllocation {
            id: self.container_id.clone(),
            podref: self.podref.clone(),
            ifname: self.ifname.clone(),
            poduid: self.pod_uid.clone(),
            ipamclaimref: String::new(),
        }
    }

    fn reservation(&self) -> OverlappingRangeIPReservationSpec {
        OverlappingRangeIPReservationSpec {
            containerid: self.container_id.clone(),
            podref: self.podref.clone(),
            ifname: self.ifname.clone(),
            poduid: self.pod_uid.clone(),
            ipamclaimref: String::new(),
        }
    }
}

/// The outcome of an allocation and how many races it lost on the way (for benchmarks and logs).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Allocated {
    pub ip: IpAddr,
    pub conflicts: u32,
}

pub async fn allocate<S: Store>(
    store: &S,
    range: &RangeConfig,
    scope: Scope<'_>,
    who: &Attachment,
) -> Result<Allocated, AllocError> {
    let mut skip = BTreeSet::new();
    let (mut conflicts, mut races) = (0, 0);
    loop {
        if conflicts >= MAX_CONFLICTS {
            return Err(AllocError::TooManyConflicts {
                pool: range.pool_name.clone(),
                attempts: conflicts,
            });
        }
        let pool = ensure_pool(store, range).await?;
        if let Some((offset, entry)) = pool.entry_of(&who.podref, &who.ifname) {
            match reuse(store, range, scope, &pool, offset, entry, who).await? {
                Some(ip) => return Ok(Allocated { ip, conflicts }),
                None => {
                    conflicts += 1;
                    continue;
                }
            }
        }
        let mut taken: BTreeSet<u128> = pool.allocations.keys().copied().collect();
        taken.extend(&skip);
        let Some(offset) = range.range.pick(&taken, races, |n| fastrand::usize(..n)) else {
            return Err(exhausted(range));
        };
        match claim_and_record(store, range, scope, &pool, offset, who).await? {
            Ok(ip) => return Ok(Allocated { ip, conflicts }),
            Err(lost) => {
                skip.insert(offset);
                conflicts += 1;
                if lost == Claim::Race {
                    races += 1;
                    backoff(races).await;
                }
            }
        }
    }
}

/// Claims `offset` and records it in the pool: `Ok(Ok(ip))`, or `Ok(Err(claim))` saying how the
/// address was lost.
///
/// The pool write is conditional on the pool's resourceVersion, which the API server checks before
/// doing anything else: a stale write costs one cheap 409, not a retry loop inside the API server.
/// Many concurrent writers of one pool would still each need their own winning turn, so after a
/// lost write the loser records, together with its own entry, every claim of this pool whose
/// entry is still missing (group commit): one winning write serves everybody pending, and the
/// others find their entries already there when they re-read the pool.
async fn claim_and_record<S: Store>(
    store: &S,
    range: &RangeConfig,
    scope: Scope<'_>,
    pool: &Pool,
    offset: u128,
    who: &Attachment,
) -> Result<Result<IpAddr, Claim>, AllocError> {
    let ip = range
        .range
        .addr_at(offset)
        .expect("picked offsets lie in the range");
    let claim = if scope.overlapping {
        match claim(store, &range.pool_name, scope.network_name, ip, who).await? {
            Claim::Ours(uid) => Some(uid),
            lost => return Ok(Err(lost)),
        }
    } else {
        None
    };
    let entry = who.entry();
    let mut pool = pool.clone();
    for attempt in 0..MAX_CONFLICTS {
        match pool.allocations.get(&offset) {
            Some(e) if e.id == entry.id && e.podref == entry.podref => return Ok(Ok(ip)),
            Some(_) => break, // recorded for someone else (a writer that takes no reservations)
            None => {}
        }
        let mut entries = vec![(offset, entry.clone())];
        if attempt > 0 && scope.overlapping {
            entries.extend(pending_claims(store, range, &pool, offset).await?);
        }
        match store
            .add_allocations(&range.pool_name, &entries, &pool.resource_version)
            .await?
        {
            Write::Done => return Ok(Ok(ip)),
            Write::Missing => break,
            Write::Conflict => {
                jitter(attempt).await;
                match store.get_pool(&range.pool_name).await? {
                    Some(fresh) => pool = fresh,
                    None => break,
                }
            }
        }
    }
    if let Some(uid) = claim {
        unclaim(store, scope.network_name, ip, &uid).await?;
    }
    Ok(Err(Claim::Race))
}

/// Entries for this pool's claims that the pool does not hold yet (other than `own`).
async fn pending_claims<S: Store>(
    store: &S,
    range: &RangeConfig,
    pool: &Pool,
    own: u128,
) -> Result<Vec<(u128, IPAllocation)>, StoreError> {
    Ok(store
        .claims_of(&range.pool_name)
        .await?
        .into_iter()
        .filter_map(|(ip, spec)| {
            let offset = range.range.offset_of(ip)?;
            let entry = IPAllocation {
                id: spec.containerid,
                podref: spec.podref,
                ifname: spec.ifname,
                poduid: spec.poduid,
                ipamclaimref: spec.ipamclaimref,
            };
            (offset != own && !pool.allocations.contains_key(&offset)).then_some((offset, entry))
        })
        .collect())
}

/// A short random pause after a lost pool write, so that losers do not re-read in lockstep.
async fn jitter(attempt: u32) {
    let cap_ms = 5u64 << attempt.min(4);
    tokio::time::sleep(std::time::Duration::from_millis(fastrand::u64(0..=cap_ms))).await;
}

/// The outcome of trying to claim an address.
#[derive(Debug, Clone, PartialEq, Eq)]
enum Claim {
    /// Ours, with the reservation's UID (new, or left by an earlier attempt of this attachment).
    Ours(String),
    /// Lost to a claimant that is probably still racing us: spread the next pick.
    Race,
    /// Held steadily by another pod (an overlapping range): just try the next address.
    Occupied,
}

async fn claim<S: Store>(
    store: &S,
    pool: &str,
    network_name: Option<&str>,
    ip: IpAddr,
    who: &Attachment,
) -> Result<Claim, StoreError> {
    let name = reservation_name(network_name, ip);
    for _ in 0..3 {
        if let (Write::Done, uid) = store
            .create_reservation(&name, &who.reservation(), pool, ip)
            .await?
        {
            return Ok(Claim::Ours(uid));
        }
        match store.get_reservation(&name).await? {
            Some(r) if r.spec.podref == who.podref && r.spec.ifname == who.ifname => {
                return Ok(Claim::Ours(r.uid));
            }
            Some(r) if r.is_recent() => return Ok(Claim::Race),
            Some(_) => return Ok(Claim::Occupied),
            None => continue, // released between our create and get: try again
        }
    }
    Ok(Claim::Race)
}

async fn unclaim<S: Store>(
    store: &S,
    network_name: Option<&str>,
    ip: IpAddr,
    uid: &str,
) -> Result<(), StoreError> {
    store
        .delete_reservation(&reservation_name(network_name, ip), uid)
        .await
        .map(|_| ())
}

/// Returns the address an attachment already holds (ADD is idempotent), refreshing its container
/// and pod UID: a StatefulSet pod recreated under the same name gets its address back, and the
/// operator then sees the new pod's UID on it. `None` when the entry must not be reused.
async fn reuse<S: Store>(
    store: &S,
    range: &RangeConfig,
    scope: Scope<'_>,
    pool: &Pool,
    offset: u128,
    entry: &crate::crd::IPAllocation,
    who: &Attachment,
) -> Result<Option<IpAddr>, StoreError> {
    let ip = range
        .range
        .addr_at(offset)
        .filter(|_| range.range.is_allocatable(offset));
    let claimed = match ip {
        Some(ip) if scope.overlapping => matches!(
            claim(store, &pool.name, scope.network_name, ip, who).await?,
            Claim::Ours(_)
        ),
        Some(_) => true,
        None => false,
    };
    if !claimed {
        // Outside today's window, or another pod holds the address's reservation: let it go.
        tracing::warn!(pool = %pool.name, offset = %offset, "not reusing the attachment's old entry");
        store.remove_allocation(&pool.name, offset, entry).await?;
        return Ok(None);
    }
    let fresh = who.entry();
    let stale = entry.id != fresh.id || (!fresh.poduid.is_empty() && entry.poduid != fresh.poduid);
    if stale
        && store
            .replace_allocation(&pool.name, offset, entry, &fresh)
            .await?
            != Write::Done
    {
        return Ok(None);
    }
    Ok(ip)
}

async fn ensure_pool<S: Store>(store: &S, range: &RangeConfig) -> Result<Pool, StoreError> {
    for _ in 0..3 {
        if let Some(pool) = store.get_pool(&range.pool_name).await? {
            return Ok(pool);
        }
        store
            .create_pool(&range.pool_name, &range.range.cidr().to_string())
            .await?;
    }
    store
        .get_pool(&range.pool_name)
        .await?
        .ok_or_else(|| StoreError::Malformed {
            op: "get",
            object: format!("ippool {}", range.pool_name),
            message: "created but not readable".into(),
        })
}

fn exhausted(range: &RangeConfig) -> AllocError {
    let (first, last) = range.range.window();
    let excludes = range.range.excludes();
    let excludes = if excludes.is_empty() {
        String::new()
    } else {
        format!(
            ", exclude {}",
            excludes
                .iter()
                .map(ToString::to_string)
                .collect::<Vec<_>>()
                .join(",")
        )
    };
    AllocError::Exhausted {
        cidr: range.range.cidr().to_string(),
        first,
        last,
        excludes,
        size: range.range.size(),
    }
}

/// Jittered exponential backoff once losses pile up; the first few retries go at once because a
/// lost key race is resolved by picking another address, not by waiting.
async fn backoff(conflicts: u32) {
    if conflicts > 3 {
        let cap_ms = 2u64.saturating_pow(conflicts.min(7));
        tokio::time::sleep(std::time::Duration::from_millis(fastrand::u64(0..=cap_ms))).await;
    }
}

/// Releases every entry of `who`'s container and interface in this range, and their reservations.
/// Returns the released addresses. Entries re-bound to another container are left alone.
pub async fn release<S: Store>(
    store: &S,
    range: &RangeConfig,
    scope: Scope<'_>,
    who: &Attachment,
) -> Result<Vec<IpAddr>, StoreError> {
    let Some(pool) = store.get_pool(&range.pool_name).await? else {
        return Ok(Vec::new());
    };
    let mine: Vec<(u128, IPAllocation)> = pool
        .allocations
        .iter()
        .filter(|(_, e)| {
            e.id == who.container_id && (e.ifname == who.ifname || e.ifname.is_empty())
        })
        .map(|(o, e)| (*o, e.clone()))
        .collect();
    release_entries(store, range, scope, &pool.name, &mine).await
}

/// Removes the given entries (each only while it still holds the same container and pod), then
/// the reservation of each removed address when it names the same pod.
pub async fn release_entries<S: Store>(
    store: &S,
    range: &RangeConfig,
    scope: Scope<'_>,
    pool: &str,
    entries: &[(u128, IPAllocation)],
) -> Result<Vec<IpAddr>, StoreError> {
    let mut released = Vec::new();
    for (offset, entry) in entries {
        if store.remove_allocation(pool, *offset, entry).await? != Write::Done {
            continue;
        }
        let Some(ip) = range.range.addr_at(*offset) else {
            continue;
        };
        released.push(ip);
        if scope.overlapping {
            let name = reservation_name(scope.network_name, ip);
            if let Some(r) = store
                .get_reservation(&name)
                .await?
                .filter(|r| r.spec.podref == entry.podref)
            {
                store.delete_reservation(&name, &r.uid).await?;
            }
        }
    }
    Ok(released)
}
