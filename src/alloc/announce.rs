//! Announcing a release before the entry goes: what keeps a writer turn from writing it back.
//!
//! A writer turn records, with its own entry, every claim of the pool that the pool does not hold
//! yet ([`super::turn`]). Between a release's removal of an entry and its deletion of the
//! reservation, that reservation looks exactly like such a claim, and a turn holder that lists it
//! then would write the entry back for an attachment whose release has completed: an entry with
//! no reservation guarding its address. So every releaser (the plugin's DEL, the agent's groups,
//! the operator) first labels the reservation as releasing when a claims list may still show it
//! ([`listable_claim`]), and the turn holder lists claims consistently after reading the pool it
//! writes ([`crate::store::Listing::Consistent`]): whichever pool version its write is
//! conditional on, an entry missing there was announced before it, so the list cannot show it as
//! a claim. Older reservations (most releases) are never listed as claims and cost nothing more.

use futures::StreamExt;

use super::claim::PendingClaim;
use super::{Owner, Target};
use crate::crd::IPAllocation;
use crate::retry::{LOST_WRITE, MAX_CONFLICTS};
use crate::store::{Datastore, PoolWrite, StoreError, Write, listable_claim};

/// A reservation that a release deletes once its entry is gone, at the version it saw or made (a
/// reservation taken over by a new container of the pod meanwhile changed version, and is kept).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HeldClaim {
    pub name: String,
    pub uid: String,
    pub resource_version: String,
    /// The claim bucket of the reservation's last claim ([`crate::store::CLAIMED_LABEL`]).
    pub claimed: Option<i64>,
    /// Set once its release is announced.
    pub announced: bool,
}

impl HeldClaim {
    pub fn of(r: crate::store::Reservation) -> Self {
        HeldClaim {
            name: r.name,
            uid: r.uid,
            resource_version: r.resource_version,
            claimed: r.claimed,
            announced: false,
        }
    }
}

/// Announces the release on every reservation of `held` that a claims list may still show,
/// `parallel` at a time, and takes the version each announcement made. A reservation that
/// changed meanwhile, or that these rights may not label (an older install's RBAC), is left
/// unannounced: it is deleted at the version seen, if at all.
pub async fn announce<S: Datastore>(
    store: &S,
    held: &mut [Option<HeldClaim>],
    parallel: usize,
) -> Result<(), StoreError> {
    let marks: Vec<_> = held
        .iter_mut()
        .flatten()
        .filter(|h| listable_claim(h.claimed))
        .map(|h| mark(store, h))
        .collect();
    futures::stream::iter(marks)
        .buffer_unordered(parallel.max(1))
        .collect::<Vec<Result<(), StoreError>>>()
        .await
        .into_iter()
        .collect()
}

async fn mark<S: Datastore>(store: &S, h: &mut HeldClaim) -> Result<(), StoreError> {
    match store
        .mark_releasing(&h.name, &h.uid, &h.resource_version)
        .await
    {
        Ok((Write::Done, rv)) => {
            (h.resource_version, h.announced) = (rv, true);
            Ok(())
        }
        Ok(_) => Ok(()),
        Err(e) if e.kind() == "forbidden" => Ok(()),
        Err(e) => Err(e),
    }
}

/// Deletes `claims`: claims of the attachments `owners` (being deleted) that their pool did not
/// record when their DEL read it, because their ADD was cut off between claiming and recording.
/// A writer turn may be recording them right now, from a claims list read before this DEL: so
/// each is announced first, then the pool is moved on (an entry written back meanwhile is removed
/// with that write, else the pool is only touched), which fails every turn write still
/// conditional on a version from before the announcements; those turns read again, and their
/// lists show the announcements. Only then are the claims deleted, each at the version announced.
pub async fn withdraw<S: Datastore>(
    store: &S,
    target: &Target,
    claims: &[PendingClaim],
    owners: &[&Owner],
) -> Result<(), StoreError> {
    if claims.is_empty() {
        return Ok(());
    }
    let mut held = Vec::with_capacity(claims.len());
    for claim in claims {
        let Some(ip) = target.ip(claim.offset) else {
            continue;
        };
        let r = store.get_reservation(&target.reservation(ip)).await?;
        held.push(r.filter(|r| r.uid == claim.uid).map(HeldClaim::of));
    }
    announce(store, &mut held, 8).await?;
    move_pool_on(store, &target.pool, owners).await?;
    for h in held.iter().flatten() {
        store
            .delete_reservation(&h.name, &h.uid, Some(&h.resource_version))
            .await?;
    }
    Ok(())
}

/// Writes the pool once at its current version: removing any entry of `owners` that a writer
/// turn recorded, or only touching it.
async fn move_pool_on<S: Datastore>(
    store: &S,
    pool: &str,
    owners: &[&Owner],
) -> Result<(), StoreError> {
    for attempt in 0..MAX_CONFLICTS {
        let Some(current) = store.get_pool(pool).await? else {
            return Ok(());
        };
        let recorded: Vec<(u128, IPAllocation)> = (owners.iter())
            .flat_map(|who| who.entries_in(&current))
            .map(|(o, e)| (o, e.clone()))
            .collect();
        let written = if recorded.is_empty() {
            store.touch_pool(pool, &current.resource_version).await?
        } else {
            let offsets: Vec<u128> = recorded.iter().map(|(o, _)| *o).collect();
            (store.remove_allocations(pool, &offsets, &current.resource_version)).await?
        };
        match written {
            PoolWrite::Conflict => LOST_WRITE.pause(attempt).await,
            PoolWrite::Done(_) | PoolWrite::Missing => return Ok(()),
        }
    }
    Err(StoreError::Api {
        op: "patch",
        object: format!("ippool {pool}"),
        code: 409,
        message: format!("gave up after {MAX_CONFLICTS} conflicting writes"),
    })
}
