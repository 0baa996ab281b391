//! Claiming and releasing one address of one range, without a lock.
//!
//! ADD claims first, then records: with overlapping ranges on, the reservation object of the
//! chosen address is created (atomic create-or-409); only its owner then records the pool entry,
//! conditional on the pool's resourceVersion. A process killed between the two writes leaves a
//! claim without a pool entry, which the next writer records or the operator's audit removes,
//! never a duplicate. Upstream writes the pool first and then checks the reservation, so a mixed
//! fleet stays safe: whichever writes the reservation first wins and the other moves on.
//!
//! Alone, a claimant records its entry with one write. When the claims list shows others claiming
//! from the same pool, writing concurrently would make the API server re-run every losing write
//! (docs/benchmarks.md), so claimants take turns: one takes the pool's writer turn and records
//! every pending claim in one write (group commit), the rest wait on a watch of the pool and are
//! usually recorded by that write. The turn guards nothing; every write is conditional, and a turn
//! left by a killed process is taken over after [`TURN_SECONDS`].
//!
//! Losing a claim costs one request and a new pick; picks spread over the lowest free addresses
//! in proportion to the claims in flight, so that concurrent claimants rarely collide, while a
//! claimant alone still takes the lowest free address.
//!
//! DEL removes only entries that still hold the container being deleted, then the reservation if
//! it belongs to the same pod, so an address re-bound to a newer container is never released.
//! Concurrent DELs of one pool announce their releases on their reservations and take turns the
//! same way, one write removing every announced entry.

use std::collections::BTreeSet;
use std::net::IpAddr;
use std::time::Duration;

use thiserror::Error;

use super::protocol::Attachment;
use crate::config::RangeConfig;
use crate::crd::{IPAllocation, OverlappingRangeIPReservationSpec, size};
use crate::ipam::naming::reservation_name;
use crate::store::{
    Pool, PoolChanges, PoolWrite, Store, StoreError, TURN_SECONDS, TurnAttempt, Write,
};

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
    /// One more entry would grow the pool's object past what the API server can store.
    #[error(
        "pool {pool} cannot hold another entry: its {entries} entries take about {bytes} bytes, and an IPPool object must stay under {budget} bytes (etcd's request limit, 1.5 MiB by default, less room for metadata); split the range into smaller ranges (one NAD each, or range_start/range_end windows) or use node slices (docs/reliability.md, Limits)"
    )]
    PoolFull {
        pool: String,
        entries: usize,
        bytes: usize,
        budget: usize,
    },
    #[error("pool {pool}: gave up after {attempts} lost races for an address")]
    TooManyConflicts { pool: String, attempts: u32 },
    #[error(transparent)]
    Store(#[from] StoreError),
    /// The node agent could not finish the allocation (it is shutting down).
    #[error("node agent: {0}")]
    Agent(String),
}

/// The network a range belongs to and how its addresses are protected.
#[derive(Debug, Clone, Copy)]
pub struct Scope<'a> {
    pub network_name: Option<&'a str>,
    pub overlapping: bool,
}

impl Attachment {
    /// The entries a DEL of this attachment releases: its container's on its interface (an
    /// entry without an interface name, as very old upstream versions wrote, counts as its own).
    pub(super) fn entries_in<'p>(
        &self,
        pool: &'p Pool,
    ) -> impl Iterator<Item = (u128, &'p IPAllocation)> + use<'p, '_> {
        pool.allocations
            .iter()
            .filter(|(_, e)| {
                e.id == self.container_id && (e.ifname == self.ifname || e.ifname.is_empty())
            })
            .map(|(o, e)| (*o, e))
    }

    pub(super) fn entry(&self) -> IPAllocation {
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
    // After a lost claim the pool snapshot is kept: the fresh claims list says what changed.
    let mut snapshot: Option<Pool> = None;
    let mut unverified = None;
    loop {
        if conflicts >= MAX_CONFLICTS {
            return Err(AllocError::TooManyConflicts {
                pool: range.pool_name.clone(),
                attempts: conflicts,
            });
        }
        let pool = match snapshot.take() {
            Some(pool) => pool,
            None => ensure_pool(store, range, conflicts == 0).await?,
        };
        if let Some((offset, entry)) = pool.entry_of(&who.podref, &who.ifname) {
            match reuse(store, range, scope, &pool, offset, entry, who).await? {
                Some(ip) => return Ok(Allocated { ip, conflicts }),
                None => {
                    conflicts += 1;
                    continue;
                }
            }
        }
        // Claims whose pool entries are still being written are taken too, and how many there
        // are tells whether others are allocating from this pool right now.
        let pending = if scope.overlapping {
            pending_claims(store, range, &pool, None).await?
        } else {
            Vec::new()
        };
        // An address lost without reading it back: a race if the winner claimed it for this
        // pool, else a steady reservation of an overlapping range.
        if let Some(lost) = unverified.take()
            && pending.iter().any(|p| p.offset == lost)
        {
            races += 1;
            backoff(races).await;
        }
        // How many others are claiming from this pool right now, as far as we can tell.
        let contenders = pending.iter().filter(|p| !p.is_of(who)).count() + races as usize;
        // An earlier attempt of this container claimed an address but did not record it: finish
        // that, if the claim (listed from the API server's cache) still exists.
        let own = match pending
            .iter()
            .find(|p| p.is_of(who) && !skip.contains(&p.offset))
        {
            Some(own) => {
                let name = range
                    .range
                    .addr_at(own.offset)
                    .map(|ip| reservation_name(scope.network_name, ip));
                let current = match name {
                    Some(name) => store.get_reservation(&name).await?,
                    None => None,
                };
                current.filter(|r| r.uid == own.uid).map(|_| own)
            }
            None => None,
        };
        let attempt = match own {
            Some(own) => Attempt {
                offset: own.offset,
                claimed: Some(own.uid.clone()),
                verify: true,
            },
            None => {
                let mut taken: BTreeSet<u128> = pool.allocations.keys().copied().collect();
                taken.extend(&skip);
                taken.extend(pending.iter().map(|p| p.offset));
                let room = ObjectRoom::of(range, &pool);
                if let Some(full) = room.full(&who.entry(), pending.len() + 1) {
                    return Err(full);
                }
                let spread = races + contenders_hint(pending.len());
                let Some(offset) = range.range.pick(&taken, spread, |n| fastrand::usize(..n))
                else {
                    return Err(exhausted(range));
                };
                // A first lost claim is almost always a concurrent claimant: skip the read
                // that would tell it from a steady reservation of an overlapping range.
                Attempt {
                    offset,
                    claimed: None,
                    verify: conflicts > 0,
                }
            }
        };
        let (offset, adopted) = (attempt.offset, attempt.claimed.is_some());
        match claim_and_record(store, range, scope, &pool, attempt, who, contenders).await? {
            Ok(ip) => return Ok(Allocated { ip, conflicts }),
            Err(lost) => {
                skip.insert(offset);
                conflicts += 1;
                match lost {
                    Claim::Race => {
                        races += 1;
                        backoff(races).await;
                    }
                    Claim::Lost => unverified = Some(offset),
                    Claim::Ours(_) | Claim::Occupied => {}
                }
                // Without reservations the pool is the only record of who holds what, and an
                // adopted claim that could not be recorded means the pool has moved on: re-read.
                if scope.overlapping && !adopted {
                    snapshot = Some(pool);
                }
            }
        }
    }
}

/// One try at an address.
struct Attempt {
    offset: u128,
    /// The reservation's UID when the address is already claimed for this attachment.
    claimed: Option<String>,
    /// Whether a lost claim is read back to tell a race from a steady reservation.
    verify: bool,
}

/// How far to spread the first pick when `pending` other claims are in flight: claimants that
/// read the same pool at the same moment would otherwise all go for the same lowest address.
fn contenders_hint(pending: usize) -> u32 {
    usize::BITS - pending.leading_zeros()
}

/// Claims `offset` and records it in the pool: `Ok(Ok(ip))`, or `Ok(Err(claim))` saying how the
/// address was lost.
async fn claim_and_record<S: Store>(
    store: &S,
    range: &RangeConfig,
    scope: Scope<'_>,
    pool: &Pool,
    attempt: Attempt,
    who: &Attachment,
    contenders: usize,
) -> Result<Result<IpAddr, Claim>, AllocError> {
    let offset = attempt.offset;
    let ip = range
        .range
        .addr_at(offset)
        .expect("picked offsets lie in the range");
    if !scope.overlapping {
        // No reservations: the pool entry itself is the claim, so there is nothing to record for
        // anyone else and no reason to wait for a turn.
        return Ok(
            match write_own(store, pool.clone(), offset, &who.entry()).await? {
                true => Ok(ip),
                false => Err(Claim::Race),
            },
        );
    }
    // A claim adopted from an earlier attempt may be backing that attempt's entry: never undo it.
    let adopted = attempt.claimed.is_some();
    let uid = match attempt.claimed {
        Some(uid) => uid,
        None => match claim(
            store,
            &range.pool_name,
            scope.network_name,
            ip,
            who,
            attempt.verify,
        )
        .await?
        {
            Claim::Ours(uid) => uid,
            lost => return Ok(Err(lost)),
        },
    };
    let entry = who.entry();
    let recorded = if contenders > 0 {
        record_in_turn(store, range, pool.clone(), offset, &entry, contenders).await?
    } else {
        match store
            .add_allocations(
                &pool.name,
                &[(offset, entry.clone())],
                &pool.resource_version,
            )
            .await?
        {
            PoolWrite::Done(_) => true,
            PoolWrite::Missing => false,
            // Someone else wrote meanwhile: from here on, behave as under contention.
            PoolWrite::Conflict => match store.get_pool(&pool.name).await? {
                Some(fresh) => record_in_turn(store, range, fresh, offset, &entry, 1).await?,
                None => false,
            },
        }
    };
    if recorded {
        return Ok(Ok(ip));
    }
    // Lost to a writer that takes no reservations, or the pool went away. A writer recording
    // pending claims may have written our entry in the meantime: take it out again, then the claim.
    store.remove_allocation(&pool.name, offset, &entry).await?;
    if !adopted {
        unclaim(store, scope.network_name, ip, &uid).await?;
    }
    Ok(Err(Claim::Race))
}

/// Records one entry without reservations: retries while the offset stays free.
async fn write_own<S: Store>(
    store: &S,
    mut pool: Pool,
    offset: u128,
    entry: &IPAllocation,
) -> Result<bool, StoreError> {
    for attempt in 0..MAX_CONFLICTS {
        if pool.allocations.contains_key(&offset) {
            return Ok(false);
        }
        match store
            .add_allocations(
                &pool.name,
                &[(offset, entry.clone())],
                &pool.resource_version,
            )
            .await?
        {
            PoolWrite::Done(_) => return Ok(true),
            lost => match next_version(store, &pool.name, lost, attempt).await? {
                Some(fresh) => pool = fresh,
                None => return Ok(false),
            },
        }
    }
    Ok(false)
}

/// The pool to go on from after a conditional write: the version written, or after a lost write
/// a fresh read following a short random pause (so that losers do not re-read in lockstep).
/// `None` when the pool is gone.
async fn next_version<S: Store>(
    store: &S,
    pool: &str,
    written: PoolWrite,
    attempt: u32,
) -> Result<Option<Pool>, StoreError> {
    match written {
        PoolWrite::Done(fresh) => Ok(Some(fresh)),
        PoolWrite::Missing => Ok(None),
        PoolWrite::Conflict => {
            jitter(attempt).await;
            store.get_pool(pool).await
        }
    }
}

/// How long a claimant waits for the turn holder's next write before it tries the turn again:
/// longer the more claimants there are, so that all of them together ask about as often.
fn turn_wait(contenders: usize) -> Duration {
    Duration::from_millis((contenders as u64 * 4).clamp(40, 200))
}
/// How long a claimant waits, after a write without its entry, for the writer's follow-up.
const SETTLE: Duration = Duration::from_millis(25);
/// Writes a turn holder makes after its own entry is in, for claims that arrived meanwhile.
const FOLLOW_UP_WRITES: u32 = 2;

/// Records a claimed entry while others are claiming from the same pool: one claimant at a time
/// takes the pool's writer turn and records every pending claim in one write (group commit); the
/// others watch the pool and are usually done when that write lands. True when the entry is in
/// the pool; false when the offset went to a writer that takes no reservations.
///
/// The turn only spares the API server concurrent writes of one object, it guards nothing: every
/// write is still conditional on the pool's resourceVersion, so a claimant that cannot get a turn
/// (no Lease permissions) or finds it abandoned by a killed holder just writes.
async fn record_in_turn<S: Store>(
    store: &S,
    range: &RangeConfig,
    pool: Pool,
    offset: u128,
    entry: &IPAllocation,
    contenders: usize,
) -> Result<bool, StoreError> {
    let done = |pool: &Pool| pool.allocations.get(&offset).map(|e| same_owner(e, entry));
    let work = |fresh: Pool| write_pending(store, range, fresh, offset, entry);
    in_turn(store, pool, &entry.id, contenders, done, work).await
}

/// The turn protocol shared by recording claims and releasing entries: until `done` says how it
/// ended (`Some`), either take the pool's writer turn and run `work` on a fresh read of the pool
/// (which does this claimant's write and everybody else's pending one), or wait on a watch of
/// the pool for another turn holder's write to do it.
async fn in_turn<S, D, W, F>(
    store: &S,
    mut pool: Pool,
    holder: &str,
    contenders: usize,
    done: D,
    work: W,
) -> Result<bool, StoreError>
where
    S: Store,
    D: Fn(&Pool) -> Option<bool>,
    W: Fn(Pool) -> F,
    F: std::future::Future<Output = Result<bool, StoreError>>,
{
    let mut changes: Option<S::Changes> = None;
    let mut stale = StaleTurn::default();
    // Set right after a write that did not finish our business: its writer usually follows up
    // within milliseconds with what came in meanwhile, so wait for that before asking for the
    // turn, instead of asking on every write. Set from the start when several others are at it:
    // one of them most likely holds the turn already.
    let mut settling = contenders >= 2;
    let started = tokio::time::Instant::now();
    loop {
        if let Some(outcome) = done(&pool) {
            return Ok(outcome);
        }
        // Bounded: whatever keeps the turn busy or stuck (a holder that cannot see this claim or
        // release, a turn nobody can break), after twice the turn length write without it.
        if started.elapsed() >= Duration::from_secs(2 * TURN_SECONDS) {
            tracing::debug!(pool = %pool.name, "waited too long for a turn; writing without it");
            return work(pool).await;
        }
        if !settling {
            match store.take_turn(&pool.name, holder).await {
                TurnAttempt::Taken(turn) => {
                    // Writers before us have just finished: start from the pool as they left it.
                    let outcome = match store.get_pool(&pool.name).await {
                        Ok(Some(fresh)) => work(fresh).await,
                        Ok(None) => Ok(false),
                        Err(e) => Err(e),
                    };
                    store.end_turn(&turn).await;
                    return outcome;
                }
                TurnAttempt::Unavailable => return work(pool).await,
                TurnAttempt::Busy => {}
            }
        }
        let watch = match changes.as_mut() {
            Some(watch) => watch,
            None => match store.watch_pool(&pool.name, &pool.resource_version).await {
                Ok(watch) => changes.insert(watch),
                // Rights without watch: write without waiting for others.
                Err(e) if e.kind() == "forbidden" => return work(pool).await,
                Err(e) => return Err(e),
            },
        };
        let wait = if settling {
            SETTLE
        } else {
            turn_wait(contenders)
        };
        let wait = wait + Duration::from_millis(fastrand::u64(0..=wait.as_millis() as u64));
        let was_settling = std::mem::replace(&mut settling, false);
        match watch.next(wait).await? {
            Some(fresh) => {
                pool = fresh;
                settling = true;
            }
            None if watch.ended() => {
                changes = None;
                match store.get_pool(&pool.name).await? {
                    Some(fresh) => pool = fresh,
                    None => return Ok(false),
                }
            }
            None if was_settling => {}
            // No write for a while: try the turn again, and take it over if its holder is gone.
            None => {
                if stale.abandoned(store, &pool.name).await {
                    store.break_turn(&pool.name, &stale.uid, &stale.rv).await;
                }
            }
        }
    }
}

/// Tells an abandoned writer turn from a busy one: the same Lease object, unchanged, for longer
/// than a turn may last, measured on this process's monotonic clock (node clocks may disagree).
#[derive(Default)]
struct StaleTurn {
    uid: String,
    rv: String,
    since: Option<tokio::time::Instant>,
}

impl StaleTurn {
    /// Reads the turn at most once per turn length, so waiting costs almost no requests.
    async fn abandoned<S: Store>(&mut self, store: &S, pool: &str) -> bool {
        let now = tokio::time::Instant::now();
        let turn = Duration::from_secs(TURN_SECONDS);
        if self.since.is_some_and(|t| now - t < turn) {
            return false;
        }
        let Some((uid, rv)) = store.turn_holder(pool).await else {
            self.since = None;
            return false;
        };
        if self.since.is_none() || uid != self.uid || rv != self.rv {
            (self.uid, self.rv, self.since) = (uid, rv, Some(now));
            return false;
        }
        true
    }
}

/// Writes the claimant's own entry and every other pending claim of the pool, each write
/// conditional on the pool's resourceVersion, then follows up for claims that arrived meanwhile.
async fn write_pending<S: Store>(
    store: &S,
    range: &RangeConfig,
    mut pool: Pool,
    offset: u128,
    entry: &IPAllocation,
) -> Result<bool, StoreError> {
    let mut follow_ups = 0;
    for attempt in 0..MAX_CONFLICTS {
        let recorded = match pool.allocations.get(&offset) {
            Some(e) if same_owner(e, entry) => true,
            Some(_) => return Ok(false),
            None => false,
        };
        let mut entries: Vec<(u128, IPAllocation)> =
            pending_claims(store, range, &pool, Some(offset))
                .await?
                .into_iter()
                .map(|p| (p.offset, p.entry))
                .collect();
        if recorded {
            if entries.is_empty() || follow_ups == FOLLOW_UP_WRITES {
                return Ok(true);
            }
            follow_ups += 1;
        } else {
            entries.push((offset, entry.clone()));
        }
        let written = store
            .add_allocations(&pool.name, &entries, &pool.resource_version)
            .await?;
        match next_version(store, &pool.name, written, attempt).await? {
            Some(next) => pool = next,
            None => return Ok(recorded),
        }
    }
    Ok(false)
}

pub(super) fn same_owner(current: &IPAllocation, expected: &IPAllocation) -> bool {
    current.id == expected.id && current.podref == expected.podref
}

/// A claim of the pool whose entry the pool does not hold yet.
pub(super) struct PendingClaim {
    pub(super) offset: u128,
    pub(super) uid: String,
    pub(super) entry: IPAllocation,
}

impl PendingClaim {
    /// Made by this very container for this interface (an earlier attempt of the same ADD).
    pub(super) fn is_of(&self, who: &Attachment) -> bool {
        self.entry.id == who.container_id
            && self.entry.podref == who.podref
            && self.entry.ifname == who.ifname
    }
}

/// This pool's claims that the pool does not hold yet (other than `own`).
pub(super) async fn pending_claims<S: Store>(
    store: &S,
    range: &RangeConfig,
    pool: &Pool,
    own: Option<u128>,
) -> Result<Vec<PendingClaim>, StoreError> {
    let claims = match store.claims_of(&range.pool_name).await {
        Ok(claims) => claims,
        // Rights from before claims were listed: each claimant then records only itself.
        Err(e) if e.kind() == "forbidden" => {
            tracing::warn!(error = %e, "cannot list claims (RBAC: list overlappingrangeipreservations); recording only our own");
            Vec::new()
        }
        Err(e) => return Err(e),
    };
    Ok(claims
        .into_iter()
        .filter_map(|c| {
            let offset = range.range.offset_of(c.ip)?;
            let entry = IPAllocation {
                id: c.spec.containerid,
                podref: c.spec.podref,
                ifname: c.spec.ifname,
                poduid: c.spec.poduid,
                ipamclaimref: c.spec.ipamclaimref,
            };
            (Some(offset) != own && !pool.allocations.contains_key(&offset)).then_some(
                PendingClaim {
                    offset,
                    uid: c.uid,
                    entry,
                },
            )
        })
        .collect())
}

/// A short random pause after a lost pool write, so that losers do not re-read in lockstep.
pub(super) async fn jitter(attempt: u32) {
    let cap_ms = 5u64 << attempt.min(4);
    tokio::time::sleep(std::time::Duration::from_millis(fastrand::u64(0..=cap_ms))).await;
}

/// The outcome of trying to claim an address.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) enum Claim {
    /// Ours, with the reservation's UID (new, or left by an earlier attempt of this attachment).
    Ours(String),
    /// Lost to a claimant that is probably still racing us: spread the next pick.
    Race,
    /// Held steadily by another pod (an overlapping range): just try the next address.
    Occupied,
    /// Lost, not read back: the next claims list tells `Race` from `Occupied`.
    Lost,
}

pub(super) async fn claim<S: Store>(
    store: &S,
    pool: &str,
    network_name: Option<&str>,
    ip: IpAddr,
    who: &Attachment,
    verify: bool,
) -> Result<Claim, StoreError> {
    let name = reservation_name(network_name, ip);
    for _ in 0..3 {
        if let (Write::Done, uid) = store
            .create_reservation(&name, &who.reservation(), pool, ip)
            .await?
        {
            return Ok(Claim::Ours(uid));
        }
        if !verify {
            return Ok(Claim::Lost);
        }
        match store.get_reservation(&name).await? {
            Some(r) if r.spec.podref == who.podref && r.spec.ifname == who.ifname => {
                if r.spec.containerid == who.container_id {
                    return Ok(Claim::Ours(r.uid));
                }
                // This pod's interface under an earlier container (a StatefulSet replacement,
                // a sandbox re-created): make it ours at the version read, so that the earlier
                // container's DEL, which deletes only the version it saw, leaves it alone.
                let spec = who.reservation();
                return Ok(
                    match store
                        .take_over_reservation(&name, &r.uid, &r.resource_version, &spec)
                        .await?
                    {
                        Write::Done => Claim::Ours(r.uid),
                        _ => Claim::Race,
                    },
                );
            }
            Some(r) if r.is_recent() => return Ok(Claim::Race),
            Some(_) => return Ok(Claim::Occupied),
            None => continue, // released between our create and get: try again
        }
    }
    Ok(Claim::Race)
}

/// The reservation `name` when it names the pod of `entry`: the one a release of that entry may
/// delete (never another pod's claim on the same address, e.g. of an overlapping range).
pub(super) async fn reservation_of<S: Store>(
    store: &S,
    name: &str,
    entry: &IPAllocation,
) -> Result<Option<crate::store::Reservation>, StoreError> {
    Ok(store
        .get_reservation(name)
        .await?
        .filter(|r| r.spec.podref == entry.podref))
}

pub(super) async fn unclaim<S: Store>(
    store: &S,
    network_name: Option<&str>,
    ip: IpAddr,
    uid: &str,
) -> Result<(), StoreError> {
    store
        .delete_reservation(&reservation_name(network_name, ip), uid, None)
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
            claim(store, &pool.name, scope.network_name, ip, who, true).await?,
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

/// Reads the pool, creating it on first use. The first read of an ADD may come from the API
/// server's cache (five times cheaper for a pool of a few hundred entries than a read from etcd):
/// if it is a moment old, the conditional write fails and everything after reads from etcd.
pub(super) async fn ensure_pool<S: Store>(
    store: &S,
    range: &RangeConfig,
    cached: bool,
) -> Result<Pool, StoreError> {
    let first = if cached {
        store.get_pool_cached(&range.pool_name).await?
    } else {
        store.get_pool(&range.pool_name).await?
    };
    if let Some(pool) = first {
        return Ok(pool);
    }
    for _ in 0..3 {
        store
            .create_pool(&range.pool_name, &range.range.cidr().to_string())
            .await?;
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

/// What one snapshot of a pool's object holds, to tell whether more entries still fit (see
/// [`size`]). Computed once per snapshot: counting the entries costs a pass over all of them.
pub(super) struct ObjectRoom {
    pool: String,
    entries: usize,
    bytes: usize,
    /// The widest offset of the range: an entry's offset is not known before its pick.
    widest: u128,
}

impl ObjectRoom {
    pub(super) fn of(range: &RangeConfig, pool: &Pool) -> Self {
        ObjectRoom {
            pool: pool.name.clone(),
            entries: pool.allocations.len(),
            bytes: pool.stored_bytes(),
            widest: range.range.size(),
        }
    }

    /// `Some(error)` when `count` more entries like `entry` would not fit in the pool's object.
    pub(super) fn full(&self, entry: &IPAllocation, count: usize) -> Option<AllocError> {
        let more = count * size::entry_bytes(self.widest, entry);
        (self.bytes + more > size::POOL_OBJECT_BUDGET).then(|| AllocError::PoolFull {
            pool: self.pool.clone(),
            entries: self.entries,
            bytes: self.bytes,
            budget: size::POOL_OBJECT_BUDGET,
        })
    }
}

pub(super) fn exhausted(range: &RangeConfig) -> AllocError {
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
///
/// Many DELs of one pool at once (a deployment scaled down, a node drained) would each write the
/// pool, which costs the API server a re-run of every losing write. So a DEL first announces its
/// release on its reservations; when others are releasing from the same pool, one of them takes
/// the pool's writer turn and removes every announced entry in one write while the rest wait for
/// it on a watch, as ADDs do for claims. Each DEL then deletes its own reservations.
pub async fn release<S: Store>(
    store: &S,
    range: &RangeConfig,
    scope: Scope<'_>,
    who: &Attachment,
) -> Result<Vec<IpAddr>, StoreError> {
    let Some(pool) = store.get_pool(&range.pool_name).await? else {
        return Ok(Vec::new());
    };
    let mine: Vec<(u128, IPAllocation)> =
        who.entries_in(&pool).map(|(o, e)| (o, e.clone())).collect();
    if mine.is_empty() || !scope.overlapping {
        return release_entries(store, range, scope, &pool.name, &mine).await;
    }
    // Announce the release on each entry's reservation (only one that names this pod).
    let (mut reservations, mut unannounced) = (Vec::new(), Vec::new());
    for (offset, entry) in &mine {
        let Some(ip) = range.range.addr_at(*offset) else {
            continue;
        };
        let name = reservation_name(scope.network_name, ip);
        let Some(r) = reservation_of(store, &name, entry).await? else {
            continue;
        };
        let announced = match store.mark_releasing(&name, &r.uid).await {
            Ok((Write::Done, rv)) => Some(rv),
            Ok(_) => None,
            // Rights from before releases were announced: this DEL releases on its own.
            Err(e) if e.kind() == "forbidden" => None,
            Err(e) => return Err(e),
        };
        // Each reservation is deleted at the version this DEL saw or made, so that one taken
        // over by a new container of the pod meanwhile is kept.
        match announced {
            Some(rv) => reservations.push((*offset, name, r.uid, rv)),
            None => unannounced.push((*offset, name, r.uid, r.resource_version)),
        }
    }
    let others = if unannounced.is_empty() && reservations.len() == mine.len() {
        let own: BTreeSet<u128> = mine.iter().map(|(o, _)| *o).collect();
        store
            .releases_of(&pool.name)
            .await?
            .iter()
            .filter(|c| {
                range
                    .range
                    .offset_of(c.ip)
                    .is_some_and(|o| !own.contains(&o))
            })
            .count()
    } else {
        0 // a release nobody else can see is done by this DEL alone
    };
    let gone: BTreeSet<u128> = if others == 0 {
        remove_entries(store, &pool.name, &mine, Some(pool.clone()))
            .await?
            .into_iter()
            .map(|(o, _)| o)
            .collect()
    } else {
        let still_mine = |p: &Pool| {
            mine.iter()
                .any(|(o, e)| p.allocations.get(o).is_some_and(|c| same_owner(c, e)))
        };
        let done = |p: &Pool| (!still_mine(p)).then_some(true);
        let work = |fresh: Pool| remove_pending(store, range, fresh, &mine);
        in_turn(store, pool.clone(), &who.container_id, others, done, work).await?;
        // Gone from the pool, by us or by a turn holder; an offset now held by anyone else
        // (re-bound to a newer container of the pod) keeps its reservation.
        let now = store.get_pool(&pool.name).await?.unwrap_or_default();
        mine.iter()
            .map(|(o, _)| *o)
            .filter(|o| !now.allocations.contains_key(o))
            .collect()
    };
    for (offset, name, uid, rv) in reservations.iter().chain(&unannounced) {
        if gone.contains(offset) {
            store.delete_reservation(name, uid, Some(rv)).await?;
        }
    }
    Ok(gone
        .iter()
        .filter_map(|o| range.range.addr_at(*o))
        .collect())
}

/// A turn holder's work for DELs: removes its own entries and every announced release of the
/// pool (each only while its entry still holds the announcing container) in one write
/// conditional on the pool's resourceVersion, then follows up for releases announced meanwhile.
async fn remove_pending<S: Store>(
    store: &S,
    range: &RangeConfig,
    mut pool: Pool,
    mine: &[(u128, IPAllocation)],
) -> Result<bool, StoreError> {
    let mut follow_ups = 0;
    for attempt in 0..MAX_CONFLICTS {
        let owned = |o: &u128, id: &str, podref: &str| {
            pool.allocations
                .get(o)
                .is_some_and(|c| c.id == id && c.podref == podref)
        };
        let ours: Vec<u128> = mine
            .iter()
            .filter(|(o, e)| owned(o, &e.id, &e.podref))
            .map(|(o, _)| *o)
            .collect();
        let mut offsets: BTreeSet<u128> = store
            .releases_of(&pool.name)
            .await?
            .iter()
            .filter_map(|c| {
                let o = range.range.offset_of(c.ip)?;
                owned(&o, &c.spec.containerid, &c.spec.podref).then_some(o)
            })
            .collect();
        if ours.is_empty() {
            if offsets.is_empty() || follow_ups == FOLLOW_UP_WRITES {
                return Ok(true);
            }
            follow_ups += 1;
        }
        offsets.extend(ours);
        let offsets: Vec<u128> = offsets.into_iter().collect();
        let written = store
            .remove_allocations(&pool.name, &offsets, &pool.resource_version)
            .await?;
        match next_version(store, &pool.name, written, attempt).await? {
            Some(next) => pool = next,
            None => return Ok(true),
        }
    }
    Ok(false)
}

/// Removes many entries of one pool in as few writes as possible, each only while it still holds
/// the same container and pod: the pool is read, the owners checked, and the entries still owned
/// removed in one write conditional on that read's resourceVersion (re-read and re-checked when
/// another writer got in between). Returns the entries removed. One write for a thousand entries
/// instead of a thousand concurrent writes of one object, which the API server serialises by
/// re-running them (docs/benchmarks.md).
///
/// `read` is a version of the pool the caller has just read, if any, to start from instead of
/// reading it again (a stale one only costs a lost write).
pub async fn remove_entries<S: Store>(
    store: &S,
    pool: &str,
    entries: &[(u128, IPAllocation)],
    mut read: Option<Pool>,
) -> Result<Vec<(u128, IPAllocation)>, StoreError> {
    // Offsets this call has tried to remove: one found gone after a lost write was removed by
    // that write (its answer lost on the way) or by another releaser, gone either way.
    let mut tried = BTreeSet::new();
    for attempt in 0..MAX_CONFLICTS {
        let current = match read.take() {
            Some(version) => Some(version),
            None => store.get_pool(pool).await?,
        };
        let Some(current) = current else {
            return Ok(entries
                .iter()
                .filter(|(o, _)| tried.contains(o))
                .cloned()
                .collect());
        };
        let (mut gone, mut owned) = (Vec::new(), Vec::new());
        for (o, e) in entries {
            match current.allocations.get(o) {
                Some(c) if same_owner(c, e) => owned.push((*o, e.clone())),
                None if tried.contains(o) => gone.push((*o, e.clone())),
                _ => {}
            }
        }
        if owned.is_empty() {
            return Ok(gone);
        }
        let offsets: Vec<u128> = owned.iter().map(|(o, _)| *o).collect();
        tried.extend(offsets.iter().copied());
        match store
            .remove_allocations(pool, &offsets, &current.resource_version)
            .await?
        {
            PoolWrite::Done(_) => {
                gone.extend(owned);
                return Ok(gone);
            }
            PoolWrite::Missing => return Ok(gone),
            PoolWrite::Conflict => jitter(attempt).await,
        }
    }
    Err(StoreError::Api {
        op: "patch",
        object: format!("ippool {pool}"),
        code: 409,
        message: format!("gave up after {MAX_CONFLICTS} conflicting writes"),
    })
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
            if let Some(r) = reservation_of(store, &name, entry).await? {
                store
                    .delete_reservation(&name, &r.uid, Some(&r.resource_version))
                    .await?;
            }
        }
    }
    Ok(released)
}
