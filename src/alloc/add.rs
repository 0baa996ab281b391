//! One ADD's address of one target: reuse the attachment's entry if it has one, adopt a claim an
//! earlier attempt left, or pick a free address, claim it and record it.

use std::collections::BTreeSet;
use std::net::IpAddr;

use super::claim::{Claim, PendingClaim};
use super::pool::ObjectRoom;
use super::{AllocError, Allocated, Engine, Owner};
use crate::crd::IPAllocation;
use crate::retry::{LOST_RACE, MAX_CONFLICTS};
use crate::store::{Datastore, Listing, Made, Pool, PoolWrite, StoreError, Write};

/// One try at an address.
pub(super) struct Attempt {
    pub(super) offset: u128,
    /// The reservation's UID when the address is already claimed for this attachment.
    pub(super) claimed: Option<String>,
    /// Whether a lost claim is read back to tell a race from a steady reservation.
    pub(super) verify: bool,
}

/// What one allocation has learnt over its attempts.
#[derive(Default)]
struct Progress {
    /// Addresses lost in earlier attempts: not picked again.
    skip: BTreeSet<u128>,
    conflicts: u32,
    /// Losses to claimants still racing us, which spread the next picks wider.
    races: u32,
    /// After a lost claim the pool snapshot is kept: the fresh claims list says what changed.
    snapshot: Option<Pool>,
    /// An address lost without reading it back: a race if the winner claimed it for this pool,
    /// else a steady reservation of an overlapping range.
    unverified: Option<u128>,
    /// Set once the pool showed an entry this attachment holds: from then on the pool is read
    /// consistently, never from the cache or an earlier snapshot.
    confirm: bool,
}

impl Progress {
    /// Counts the unverified loss as a race once the claims list shows its winner in this pool.
    async fn verify_loss(&mut self, pending: &[PendingClaim]) {
        if let Some(lost) = self.unverified.take()
            && pending.iter().any(|p| p.offset == lost)
        {
            self.races += 1;
            LOST_RACE.pause(self.races).await;
        }
    }

    /// Takes note of a lost address; `snapshot` is the pool to try again from, if still good.
    async fn lost(&mut self, offset: u128, claim: Claim, snapshot: Option<Pool>) {
        self.skip.insert(offset);
        self.conflicts += 1;
        match claim {
            Claim::Race => {
                self.races += 1;
                LOST_RACE.pause(self.races).await;
            }
            Claim::Lost => self.unverified = Some(offset),
            Claim::Ours(_) | Claim::Occupied => {}
        }
        self.snapshot = snapshot;
    }
}

/// How far to spread the first pick when `pending` other claims are in flight: claimants that
/// read the same pool at the same moment would otherwise all go for the same lowest address.
fn contenders_hint(pending: usize) -> u32 {
    usize::BITS - pending.leading_zeros()
}

impl<S: Datastore> Engine<'_, S> {
    /// Allocates `who` an address of the target (the one it already holds, if any).
    pub async fn allocate(self, who: &Owner) -> Result<Allocated, AllocError> {
        let mut progress = Progress::default();
        loop {
            let conflicts = progress.conflicts;
            if conflicts >= MAX_CONFLICTS {
                return Err(AllocError::TooManyConflicts {
                    pool: self.target.pool.clone(),
                    attempts: conflicts,
                });
            }
            let pool = match progress.snapshot.take() {
                Some(pool) if !progress.confirm => pool,
                _ => {
                    self.ensure_pool(conflicts == 0 && !progress.confirm)
                        .await?
                }
            };
            if let Some((offset, entry)) = who.held_entry(&pool) {
                if !progress.confirm {
                    // Seen in the API server's cache, the entry may be one a DEL has just
                    // removed, and reusing an entry of the same container writes nothing: the
                    // ADD would hand out an address no entry records. Read it consistently.
                    progress.confirm = true;
                    continue;
                }
                match self.reuse(&pool, offset, entry, who).await? {
                    Some(ip) => return Ok(Allocated { ip, conflicts }),
                    None => progress.conflicts += 1,
                }
                continue;
            }
            if let Some(ip) = self.try_once(pool, who, &mut progress).await? {
                return Ok(Allocated {
                    ip,
                    conflicts: progress.conflicts,
                });
            }
        }
    }

    /// One attempt from one snapshot of the pool: `None` when the address was lost.
    async fn try_once(
        &self,
        pool: Pool,
        who: &Owner,
        progress: &mut Progress,
    ) -> Result<Option<IpAddr>, AllocError> {
        let overlapping = self.target.overlapping;
        // Claims whose pool entries are still being written are taken too, and how many there
        // are tells whether others are allocating from this pool right now.
        let pending = if overlapping {
            self.pending_claims(&pool, None, Listing::Cached).await?
        } else {
            Vec::new()
        };
        progress.verify_loss(&pending).await;
        let contenders = pending.iter().filter(|p| !p.is_of(who)).count() + progress.races as usize;
        let attempt = match self.adoptable(&pending, who, &progress.skip).await? {
            Some(own) => own,
            None => self.pick(&pool, &pending, who, progress)?,
        };
        let (offset, adopted) = (attempt.offset, attempt.claimed.is_some());
        match self
            .claim_and_record(&pool, attempt, who, contenders)
            .await?
        {
            Ok(ip) => Ok(Some(ip)),
            Err(lost) => {
                // Without reservations the pool is the only record of who holds what, and an
                // adopted claim that could not be recorded means the pool has moved on: re-read.
                let keep = (overlapping && !adopted).then_some(pool);
                progress.lost(offset, lost, keep).await;
                Ok(None)
            }
        }
    }

    /// An earlier attempt of this container claimed an address but did not record it: finish
    /// that, if the claim (listed from the API server's cache) still exists.
    async fn adoptable(
        &self,
        pending: &[PendingClaim],
        who: &Owner,
        skip: &BTreeSet<u128>,
    ) -> Result<Option<Attempt>, StoreError> {
        let Some(own) = pending
            .iter()
            .find(|p| p.is_of(who) && !skip.contains(&p.offset))
        else {
            return Ok(None);
        };
        let Some(ip) = self.target.ip(own.offset) else {
            return Ok(None);
        };
        let name = self.target.reservation(ip);
        let Some(current) = self.store.get_reservation(&name).await? else {
            return Ok(None);
        };
        // Renewed before it is recorded: it may be older than the audit's sweep spares (see
        // CLAIM_LIFETIME), and the sweep deletes only the version it saw.
        let renewed = current.uid == own.uid
            && self
                .store
                .renew_claim(&name, &current.uid, &current.resource_version)
                .await?
                == Write::Done;
        Ok(renewed.then(|| Attempt {
            offset: own.offset,
            claimed: Some(own.uid.clone()),
            verify: true,
        }))
    }

    /// Picks a free address, neither recorded, nor claimed, nor lost before.
    fn pick(
        &self,
        pool: &Pool,
        pending: &[PendingClaim],
        who: &Owner,
        progress: &Progress,
    ) -> Result<Attempt, AllocError> {
        let mut taken: BTreeSet<u128> = pool.allocations.keys().copied().collect();
        taken.extend(&progress.skip);
        taken.extend(pending.iter().map(|p| p.offset));
        let room = ObjectRoom::of(self.target, pool);
        if let Some(full) = room.full(&who.entry(), pending.len() + 1) {
            return Err(full);
        }
        let spread = progress.races + contenders_hint(pending.len());
        let offset = self
            .target
            .range
            .pick(&taken, spread, |n| fastrand::usize(..n))
            .ok_or_else(|| AllocError::exhausted(self.target))?;
        // A first lost claim is almost always a concurrent claimant: skip the read that would
        // tell it from a steady reservation of an overlapping range.
        Ok(Attempt {
            offset,
            claimed: None,
            verify: progress.conflicts > 0,
        })
    }

    /// Claims the attempt's address and records it in the pool: `Ok(Ok(ip))`, or `Ok(Err(claim))`
    /// saying how the address was lost.
    pub(super) async fn claim_and_record(
        &self,
        pool: &Pool,
        attempt: Attempt,
        who: &Owner,
        contenders: usize,
    ) -> Result<Result<IpAddr, Claim>, AllocError> {
        let offset = attempt.offset;
        let ip = self.target.picked(offset);
        if !self.target.overlapping {
            // No reservations: the pool entry itself is the claim, so there is nothing to record
            // for anyone else and no reason to wait for a turn.
            let written = self.write_own(pool.clone(), offset, &who.entry()).await?;
            return Ok(if written { Ok(ip) } else { Err(Claim::Race) });
        }
        // A claim adopted from an earlier attempt may be backing that attempt's entry: never
        // undo it.
        let adopted = attempt.claimed.is_some();
        let made = match attempt.claimed {
            Some(uid) => Made {
                uid,
                ..Made::default()
            },
            None => match self.claim(ip, who, attempt.verify).await? {
                Claim::Ours(made) => made,
                lost => return Ok(Err(lost)),
            },
        };
        let entry = who.entry();
        if self.record(pool, offset, &entry, contenders).await? {
            if contenders > 0 {
                self.settle(ip, &made).await;
            }
            return Ok(Ok(ip));
        }
        let uid = made.uid;
        // Lost to a writer that takes no reservations, or the pool went away. A writer recording
        // pending claims may have written our entry in the meantime: take it out again, then the
        // claim.
        self.store
            .remove_allocation(&pool.name, offset, &entry)
            .await?;
        if !adopted {
            self.unclaim(ip, &uid).await?;
        }
        Ok(Err(Claim::Race))
    }

    /// Records a claimed entry: with one write when alone, in the pool's writer turn when others
    /// are claiming too (or a first write found out they are).
    async fn record(
        &self,
        pool: &Pool,
        offset: u128,
        entry: &IPAllocation,
        contenders: usize,
    ) -> Result<bool, StoreError> {
        if contenders > 0 {
            return self
                .record_in_turn(pool.clone(), offset, entry, contenders)
                .await;
        }
        let one = [(offset, entry.clone())];
        match self
            .store
            .add_allocations(&pool.name, &one, &pool.resource_version)
            .await?
        {
            PoolWrite::Done(_) => Ok(true),
            PoolWrite::Missing => Ok(false),
            // Someone else wrote meanwhile: from here on, behave as under contention.
            PoolWrite::Conflict => match self.store.get_pool(&pool.name).await? {
                Some(fresh) => self.record_in_turn(fresh, offset, entry, 1).await,
                None => Ok(false),
            },
        }
    }

    /// Takes our recorded claim off the claims lists of the others claiming from this pool
    /// ([`Datastore::settle_claim`]). Only worth a write when others are claiming: a lone ADD's
    /// claim leaves the lists within a few claim buckets anyway. Nothing depends on it: a claim
    /// left listed costs the lists its size, and its release an announcement.
    async fn settle(&self, ip: IpAddr, made: &Made) {
        let name = self.target.reservation(ip);
        if let Err(e) = self.store.settle_claim(&name, made).await {
            tracing::debug!(reservation = %name, error = %e, "could not take a recorded claim off the claims lists");
        }
    }

    /// Records one entry without reservations: retries while the offset stays free.
    async fn write_own(
        &self,
        mut pool: Pool,
        offset: u128,
        entry: &IPAllocation,
    ) -> Result<bool, StoreError> {
        for attempt in 0..MAX_CONFLICTS {
            if pool.allocations.contains_key(&offset) {
                return Ok(false);
            }
            let one = [(offset, entry.clone())];
            match self
                .store
                .add_allocations(&pool.name, &one, &pool.resource_version)
                .await?
            {
                PoolWrite::Done(_) => return Ok(true),
                lost => match self.next_version(lost, attempt).await? {
                    Some(fresh) => pool = fresh,
                    None => return Ok(false),
                },
            }
        }
        Ok(false)
    }

    /// Returns the address an attachment already holds (ADD is idempotent), refreshing its
    /// container and pod UID: a StatefulSet pod recreated under the same name gets its address
    /// back, and the operator then sees the new pod's UID on it. `None` when the entry must not
    /// be reused.
    pub(super) async fn reuse(
        &self,
        pool: &Pool,
        offset: u128,
        entry: &IPAllocation,
        who: &Owner,
    ) -> Result<Option<IpAddr>, StoreError> {
        let ip = self
            .target
            .ip(offset)
            .filter(|_| self.target.range.is_allocatable(offset));
        let claimed = match ip {
            Some(ip) if self.target.overlapping => self.claim_again(ip, who).await?,
            Some(_) => Some(false),
            None => None,
        };
        let Some(withdrew) = claimed else {
            // Outside today's window, or another pod holds the address's reservation: let it go.
            tracing::warn!(pool = %pool.name, offset = %offset, "not reusing the attachment's old entry");
            self.store
                .remove_allocation(&pool.name, offset, entry)
                .await?;
            return Ok(None);
        };
        let fresh = who.entry();
        let stale =
            entry.id != fresh.id || (!fresh.poduid.is_empty() && entry.poduid != fresh.poduid);
        let written = if stale {
            self.store
                .replace_allocation(&pool.name, offset, entry, &fresh)
                .await?
                == Write::Done
        } else if withdrew {
            // The renewal withdrew a release its container's cut-off DEL had announced. A sweep
            // that listed that announcement before would still remove the entry with a write
            // conditional on the version it read, since taking the same entry again changes
            // nothing: move the pool on (the version read here showed the entry), and that
            // write fails and reads the announcements again. Only then: in a storm, entries
            // that writer turns recorded for others are taken again by the hundred, and each
            // needless write of the pool made every other writer's write lose.
            matches!(
                self.store
                    .touch_pool(&pool.name, &pool.resource_version)
                    .await?,
                PoolWrite::Done(_)
            )
        } else {
            true
        };
        Ok(ip.filter(|_| written))
    }
}
