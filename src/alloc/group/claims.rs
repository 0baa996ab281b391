//! A group's round of claims: an address picked for every open job, then all claimed at once.

use std::collections::{BTreeSet, HashSet};

use futures::StreamExt;

use super::{CLAIMS_IN_FLIGHT, Slot, State};
use crate::alloc::claim::{Claim, PendingClaim};
use crate::alloc::pool::ObjectRoom;
use crate::alloc::{AllocError, Engine};
use crate::store::{Datastore, Listing, Pool, StoreError};

/// Picks an address for every open job (lowest free first, each pick taken before the next) and
/// claims them all at once. True when some claim was lost to another claimant.
pub(super) async fn claim_open<S: Datastore>(
    engine: Engine<'_, S>,
    pool: &Pool,
    slots: &mut [Slot],
    skip: &mut BTreeSet<u128>,
    races: u32,
) -> Result<bool, StoreError> {
    if !slots.iter().any(|s| matches!(s.state, State::Open)) {
        return Ok(false);
    }
    let pending = if slots.iter().any(|s| s.job.target.overlapping) {
        engine.pending_claims(pool, None, Listing::Cached).await?
    } else {
        Vec::new()
    };
    let picked = pick_all(engine, pool, &pending, slots, skip, races);
    let claims = claim_all(engine.store, slots, picked).await;
    let mut lost = false;
    for (i, offset, claimed) in claims {
        let slot = &mut slots[i];
        slot.state = match claimed {
            Ok(Claim::Ours(made)) => State::Held {
                offset,
                uid: slot.job.target.overlapping.then_some(made.uid),
            },
            Ok(_) => {
                lost = true;
                skip.insert(offset);
                slot.conflicts += 1;
                State::Open
            }
            Err(e) => State::Finished(Err(AllocError::Datastore(e))),
        };
    }
    Ok(lost)
}

/// An address for every open job that can have one here, as (slot, offset); the others are
/// finished (exhausted, pool object full) or sent the one-by-one way.
fn pick_all<S: Datastore>(
    engine: Engine<'_, S>,
    pool: &Pool,
    pending: &[PendingClaim],
    slots: &mut [Slot],
    skip: &BTreeSet<u128>,
    races: u32,
) -> Vec<(usize, u128)> {
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
    let room = ObjectRoom::of(engine.target, pool);
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
        let who = &slot.job.who;
        if pending.iter().any(|p| p.is_of(who))
            || !interfaces.insert((who.podref.clone(), who.ifname.clone()))
        {
            slot.state = State::Alone;
            continue;
        }
        let range = &slot.job.target.range;
        match range.pick(&taken, races, |n| fastrand::usize(..n)) {
            Some(offset) => {
                taken.insert(offset);
                adding += 1;
                picked.push((i, offset));
            }
            None => slot.state = State::Finished(Err(AllocError::exhausted(&slot.job.target))),
        }
    }
    picked
}

/// Claims the picked addresses, [`CLAIMS_IN_FLIGHT`] at a time: (slot, offset, outcome).
async fn claim_all<S: Datastore>(
    store: &S,
    slots: &[Slot],
    picked: Vec<(usize, u128)>,
) -> Vec<(usize, u128, Result<Claim, StoreError>)> {
    futures::stream::iter(picked.into_iter().map(|(i, offset)| {
        let job = &slots[i].job;
        async move {
            if !job.target.overlapping {
                // No reservations: the pool entry itself is the claim.
                return (i, offset, Ok(Claim::Ours(Default::default())));
            }
            let ip = job.target.picked(offset);
            (
                i,
                offset,
                job.engine(store).claim(ip, &job.who, false).await,
            )
        }
    }))
    .buffer_unordered(CLAIMS_IN_FLIGHT)
    .collect()
    .await
}
