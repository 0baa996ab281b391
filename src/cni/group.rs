//! Group allocation, for the node agent: the ADDs of one pool that arrive together claim their
//! addresses together and are recorded with one pool write.
//!
//! A plugin process per ADD pays for its own connection, pool read, claims list and pool write,
//! and concurrent writers of one pool make the API server re-run every losing write. The agent
//! queues its node's ADDs per pool and runs each queue as a group: one pool read, one claims
//! list, the reservations created concurrently, one write recording every claimed entry.
//!
//! The rules are those of [`allocate`](super::allocate::allocate): claim first (create-or-409 on
//! the address's reservation), then record, conditional on the pool's resourceVersion; a claim
//! that may back an entry is never undone. So agents on other nodes, plugins in direct mode and
//! upstream's plugin can all write the same pool. Anything out of the ordinary (an attachment
//! that already holds an entry or an unrecorded claim, a group that keeps losing its writes) is
//! handed to the one-by-one path, which knows how to adopt and reuse.

use std::collections::{BTreeSet, HashSet};

use futures::StreamExt;

use super::allocate::{
    AllocError, Allocated, Claim, ObjectRoom, Scope, allocate, claim, ensure_pool, exhausted,
    jitter, pending_claims, remove_entries, reservation_of, same_owner, unclaim,
};
use super::protocol::Attachment;
use crate::config::RangeConfig;
use crate::crd::IPAllocation;
use crate::ipam::naming::reservation_name;
use crate::store::{Pool, PoolWrite, Store, StoreError};

/// Rounds of claim-and-write before the rest of a group goes one by one.
const GROUP_ROUNDS: u32 = 8;
/// Jobs going the one-by-one way at once.
const ALONE_AT_ONCE: usize = 16;
/// Reservations created at once: enough to hide the API server's latency, few enough that one
/// group does not crowd out every other client of the connection pool.
const CLAIMS_IN_FLIGHT: usize = 32;

/// One ADD's request for an address of one pool.
#[derive(Debug, Clone)]
pub struct Job {
    pub range: RangeConfig,
    pub network_name: Option<String>,
    pub overlapping: bool,
    pub who: Attachment,
}

impl Job {
    pub fn new(range: &RangeConfig, scope: Scope<'_>, who: &Attachment) -> Self {
        Job {
            range: range.clone(),
            network_name: scope.network_name.map(str::to_owned),
            overlapping: scope.overlapping,
            who: who.clone(),
        }
    }

    fn scope(&self) -> Scope<'_> {
        Scope {
            network_name: self.network_name.as_deref(),
            overlapping: self.overlapping,
        }
    }

    fn ip(&self, offset: u128) -> std::net::IpAddr {
        self.range
            .range
            .addr_at(offset)
            .expect("picked offsets lie in the range")
    }
}

/// Where one job of a group stands.
enum State {
    /// Needs an address.
    Open,
    /// Claimed `offset` (with the reservation's UID when ranges may overlap), not yet recorded.
    Held {
        offset: u128,
        uid: Option<String>,
    },
    /// Goes the one-by-one way.
    Alone,
    Finished(Result<Allocated, AllocError>),
}

struct Slot {
    job: Job,
    state: State,
    conflicts: u32,
}

impl Slot {
    fn unsettled(&self) -> bool {
        matches!(self.state, State::Open | State::Held { .. })
    }
}

/// Allocates one address for each job, all from the same pool; the results are in job order.
pub async fn allocate_group<S: Store>(
    store: &S,
    jobs: Vec<Job>,
) -> Vec<Result<Allocated, AllocError>> {
    allocate_group_from(store, jobs, None).await.0
}

/// [`allocate_group`], starting from `known`, a version of the pool this caller read or wrote a
/// moment ago (instead of reading it), and returning the version the group left, if it knows it.
/// A stale `known` costs one lost write and a re-read, never a wrong allocation.
pub async fn allocate_group_from<S: Store>(
    store: &S,
    jobs: Vec<Job>,
    known: Option<Pool>,
) -> (Vec<Result<Allocated, AllocError>>, Option<Pool>) {
    let mut slots: Vec<Slot> = jobs
        .into_iter()
        .map(|job| Slot {
            job,
            state: State::Open,
            conflicts: 0,
        })
        .collect();
    if slots.is_empty() {
        return (Vec::new(), known);
    }
    let mut last = match rounds(store, &mut slots, known).await {
        Ok(pool) => Some(pool),
        Err(e) => {
            // A claim already made stays: the runtime's retry of this ADD adopts it.
            for slot in slots.iter_mut().filter(|s| s.unsettled()) {
                slot.state = State::Finished(Err(AllocError::Store(e.clone())));
            }
            None
        }
    };
    for slot in slots.iter_mut().filter(|s| s.unsettled()) {
        slot.state = State::Alone;
    }
    if slots.iter().any(|s| matches!(s.state, State::Alone)) {
        // The one-by-one path writes the pool on its own: what this group saw is outdated.
        last = None;
    }
    // Bounded: the one-by-one path may wait on watches of the pool, and a burst of them (the
    // retries after an agent restart) must not take every stream of the agent's connection.
    let alone: Vec<_> = slots
        .iter()
        .filter(|s| matches!(s.state, State::Alone))
        .map(|s| allocate(store, &s.job.range, s.job.scope(), &s.job.who))
        .collect();
    let alone: Vec<_> = futures::stream::iter(alone)
        .buffered(ALONE_AT_ONCE)
        .collect()
        .await;
    let mut alone = alone.into_iter();
    let results = slots
        .into_iter()
        .map(|s| match s.state {
            State::Finished(result) => result,
            _ => alone.next().expect("one result per job gone alone"),
        })
        .collect();
    (results, last)
}

/// Claims and records until every job is settled or the rounds run out.
/// Returns the last version of the pool seen.
async fn rounds<S: Store>(
    store: &S,
    slots: &mut [Slot],
    known: Option<Pool>,
) -> Result<Pool, StoreError> {
    let range = slots[0].job.range.clone();
    let mut pool = match known {
        Some(pool) => pool,
        None => ensure_pool(store, &range, true).await?,
    };
    let mut skip = BTreeSet::new();
    let mut races = 0;
    for round in 0..GROUP_ROUNDS {
        settle(store, &pool, slots, &mut skip).await?;
        if !slots.iter().any(Slot::unsettled) {
            return Ok(pool);
        }
        let lost = claim_open(store, &range, &pool, slots, &mut skip, races).await?;
        if lost {
            races += 1;
        }
        let entries: Vec<(u128, IPAllocation)> = slots
            .iter()
            .filter_map(|s| match s.state {
                State::Held { offset, .. } => Some((offset, s.job.who.entry())),
                _ => None,
            })
            .collect();
        if entries.is_empty() {
            continue;
        }
        match store
            .add_allocations(&pool.name, &entries, &pool.resource_version)
            .await?
        {
            PoolWrite::Done(fresh) => pool = fresh,
            PoolWrite::Conflict => {
                jitter(round).await;
                pool = ensure_pool(store, &range, false).await?;
            }
            PoolWrite::Missing => pool = ensure_pool(store, &range, false).await?,
        }
    }
    settle(store, &pool, slots, &mut skip).await?;
    Ok(pool)
}

/// Finishes the jobs whose claims the pool records, re-opens those whose address went to a writer
/// that takes no reservations, and sends attachments that already hold an entry the one-by-one
/// way (which reuses it).
async fn settle<S: Store>(
    store: &S,
    pool: &Pool,
    slots: &mut [Slot],
    skip: &mut BTreeSet<u128>,
) -> Result<(), StoreError> {
    for slot in slots.iter_mut() {
        match &slot.state {
            State::Held { offset, uid } => {
                let offset = *offset;
                match pool.allocations.get(&offset) {
                    Some(e) if same_owner(e, &slot.job.who.entry()) => {
                        slot.state = State::Finished(Ok(Allocated {
                            ip: slot.job.ip(offset),
                            conflicts: slot.conflicts,
                        }));
                    }
                    Some(_) => {
                        if let Some(uid) = uid {
                            let (network, ip) =
                                (slot.job.network_name.as_deref(), slot.job.ip(offset));
                            unclaim(store, network, ip, uid).await?;
                        }
                        skip.insert(offset);
                        slot.conflicts += 1;
                        slot.state = State::Open;
                    }
                    None => {}
                }
            }
            State::Open => {
                if pool
                    .entry_of(&slot.job.who.podref, &slot.job.who.ifname)
                    .is_some()
                {
                    slot.state = State::Alone;
                }
            }
            State::Alone | State::Finished(_) => {}
        }
    }
    Ok(())
}

/// Picks an address for every open job (lowest free first, each pick taken before the next) and
/// claims them all at once. True when some claim was lost to another claimant.
async fn claim_open<S: Store>(
    store: &S,
    range: &RangeConfig,
    pool: &Pool,
    slots: &mut [Slot],
    skip: &mut BTreeSet<u128>,
    races: u32,
) -> Result<bool, StoreError> {
    if !slots.iter().any(|s| matches!(s.state, State::Open)) {
        return Ok(false);
    }
    let pending = if slots.iter().any(|s| s.job.overlapping) {
        pending_claims(store, range, pool, None).await?
    } else {
        Vec::new()
    };
    let mut taken: BTreeSet<u128> = pool.allocations.keys().copied().collect();
    taken.extend(skip.iter());
    taken.extend(pending.iter().map(|p| p.offset));
    for slot in slots.iter() {
        if let State::Held { offset, .. } = slot.state {
            taken.insert(offset);
        }
    }
    // One address per pod interface: a second ADD of the same interface in the group (a retry
    // while the first is still queued) goes after the group, and finds the first one's entry.
    let mut interfaces: HashSet<(String, String)> = slots
        .iter()
        .filter(|s| matches!(s.state, State::Held { .. }))
        .map(|s| (s.job.who.podref.clone(), s.job.who.ifname.clone()))
        .collect();
    let mut picked = Vec::new();
    // Entries this group will add, the pending claims' included: the pool object must hold them.
    let mut adding = pending.len();
    let room = ObjectRoom::of(range, pool);
    for (i, slot) in slots.iter_mut().enumerate() {
        if !matches!(slot.state, State::Open) {
            continue;
        }
        if let Some(full) = room.full(&slot.job.who.entry(), adding + 1) {
            slot.state = State::Finished(Err(full));
            continue;
        }
        // An unrecorded claim of an earlier attempt of this attachment: the one-by-one path
        // adopts it.
        if pending.iter().any(|p| p.is_of(&slot.job.who))
            || !interfaces.insert((slot.job.who.podref.clone(), slot.job.who.ifname.clone()))
        {
            slot.state = State::Alone;
            continue;
        }
        match slot
            .job
            .range
            .range
            .pick(&taken, races, |n| fastrand::usize(..n))
        {
            Some(offset) => {
                taken.insert(offset);
                adding += 1;
                picked.push((i, offset));
            }
            None => slot.state = State::Finished(Err(exhausted(&slot.job.range))),
        }
    }
    let claims: Vec<(usize, u128, Result<Claim, StoreError>)> =
        futures::stream::iter(picked.into_iter().map(|(i, offset)| {
            let job = &slots[i].job;
            async move {
                if !job.overlapping {
                    // No reservations: the pool entry itself is the claim.
                    return (i, offset, Ok(Claim::Ours(String::new())));
                }
                let (network, ip) = (job.network_name.as_deref(), job.ip(offset));
                let claimed = claim(store, &job.range.pool_name, network, ip, &job.who, false);
                (i, offset, claimed.await)
            }
        }))
        .buffer_unordered(CLAIMS_IN_FLIGHT)
        .collect()
        .await;
    let mut lost = false;
    for (i, offset, claimed) in claims {
        let slot = &mut slots[i];
        slot.state = match claimed {
            Ok(Claim::Ours(uid)) => State::Held {
                offset,
                uid: slot.job.overlapping.then_some(uid),
            },
            Ok(_) => {
                lost = true;
                skip.insert(offset);
                slot.conflicts += 1;
                State::Open
            }
            Err(e) => State::Finished(Err(AllocError::Store(e))),
        };
    }
    Ok(lost)
}

/// Releases the entries of each job's container and interface, all from the same pool: one pool
/// read, each entry's reservation read (for the version to delete it at), one conditional write
/// removing every entry still held by its container, then the reservations of the removed
/// entries, each at the version read, so that one a new container of the pod took over meanwhile
/// is kept. The DELs of a node's scaled-down deployment cost one pool write instead of one each.
/// Results in job order: the addresses released.
pub async fn release_group<S: Store>(
    store: &S,
    jobs: &[Job],
) -> Vec<Result<Vec<std::net::IpAddr>, StoreError>> {
    match release_all(store, jobs).await {
        Ok(released) => released.into_iter().map(Ok).collect(),
        // DEL is idempotent: the runtime retries it.
        Err(e) => jobs.iter().map(|_| Err(e.clone())).collect(),
    }
}

async fn release_all<S: Store>(
    store: &S,
    jobs: &[Job],
) -> Result<Vec<Vec<std::net::IpAddr>>, StoreError> {
    let Some(first) = jobs.first() else {
        return Ok(Vec::new());
    };
    let Some(pool) = store.get_pool(&first.range.pool_name).await? else {
        return Ok(jobs.iter().map(|_| Vec::new()).collect());
    };
    // (job, offset, entry) of every entry to release.
    let mut mine: Vec<(usize, u128, IPAllocation)> = Vec::new();
    for (j, job) in jobs.iter().enumerate() {
        mine.extend(job.who.entries_in(&pool).map(|(o, e)| (j, o, e.clone())));
    }
    if mine.is_empty() {
        return Ok(jobs.iter().map(|_| Vec::new()).collect());
    }
    let reads: Vec<_> = mine
        .iter()
        .map(|(j, offset, entry)| {
            let job = &jobs[*j];
            async move {
                // An entry outside the range's CIDR (a malformed pool) has no reservation.
                let ip = job.range.range.addr_at(*offset).filter(|_| job.overlapping);
                let Some(ip) = ip else {
                    return Ok(None);
                };
                let name = reservation_name(job.network_name.as_deref(), ip);
                Ok(reservation_of(store, &name, entry)
                    .await?
                    .map(|r| (name, r.uid, r.resource_version)))
            }
        })
        .collect();
    let reservations: Vec<Option<(String, String, String)>> = futures::stream::iter(reads)
        .buffered(CLAIMS_IN_FLIGHT)
        .collect::<Vec<Result<_, StoreError>>>()
        .await
        .into_iter()
        .collect::<Result<_, _>>()?;
    let entries: Vec<(u128, IPAllocation)> = mine.iter().map(|(_, o, e)| (*o, e.clone())).collect();
    let gone: BTreeSet<u128> = remove_entries(store, &pool.name, &entries, Some(pool.clone()))
        .await?
        .into_iter()
        .map(|(o, _)| o)
        .collect();
    let deletes = mine
        .iter()
        .zip(&reservations)
        .filter(|((_, o, _), _)| gone.contains(o))
        .filter_map(|(_, r)| r.as_ref())
        .map(|(name, uid, rv)| store.delete_reservation(name, uid, Some(rv)))
        .collect::<Vec<_>>();
    futures::stream::iter(deletes)
        .buffer_unordered(CLAIMS_IN_FLIGHT)
        .collect::<Vec<_>>()
        .await
        .into_iter()
        .collect::<Result<Vec<_>, _>>()?;
    let mut released: Vec<Vec<std::net::IpAddr>> = jobs.iter().map(|_| Vec::new()).collect();
    for (j, offset, _) in &mine {
        if let Some(ip) = jobs[*j]
            .range
            .range
            .addr_at(*offset)
            .filter(|_| gone.contains(offset))
        {
            released[*j].push(ip);
        }
    }
    Ok(released)
}
