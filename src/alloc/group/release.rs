//! A group's releases: the DELs of one pool that arrive together, removed with one pool write.

use std::collections::BTreeSet;
use std::net::IpAddr;

use futures::StreamExt;

use super::{CLAIMS_IN_FLIGHT, Job};
use crate::alloc::announce::{HeldClaim, announce, withdraw};
use crate::alloc::claim::PendingClaim;
use crate::alloc::{Engine, Owner, remove_entries};
use crate::crd::IPAllocation;
use crate::store::{Datastore, Listing, Pool, StoreError};

/// Deletes the unrecorded claims of `jobs` (see [`Engine::withdraw_claims`]) with one claims list.
async fn withdraw_claims<S: Datastore>(
    store: &S,
    pool: &Pool,
    jobs: &[&Job],
) -> Result<(), StoreError> {
    let target = &jobs[0].target;
    if !target.overlapping {
        return Ok(());
    }
    let engine = Engine::new(store, target);
    let pending = (engine.pending_claims(pool, None, Listing::Consistent)).await?;
    let mine: Vec<PendingClaim> = (pending.into_iter())
        .filter(|claim| jobs.iter().any(|j| claim.is_of(&j.who)))
        .collect();
    let owners: Vec<&Owner> = jobs.iter().map(|j| &j.who).collect();
    withdraw(store, target, &mine, &owners).await
}

/// Releases the entries of each job's container and interface, all from the same pool: one pool
/// read, each entry's reservation read (for the version to delete it at) and, when a claims list
/// may still show it, its release announced ([`announce`]), one conditional write removing every
/// entry still held by its container, then the reservations of the removed entries, each at the
/// version read or made, so that one a new container of the pod took over meanwhile is kept. The
/// DELs of a node's scaled-down deployment cost one pool write instead of one each. Results in
/// job order: the addresses released.
pub async fn release_group<S: Datastore>(
    store: &S,
    jobs: &[Job],
) -> Vec<Result<Vec<IpAddr>, StoreError>> {
    match release_all(store, jobs).await {
        Ok(released) => released.into_iter().map(Ok).collect(),
        // DEL is idempotent: the runtime retries it.
        Err(e) => jobs.iter().map(|_| Err(e.clone())).collect(),
    }
}

async fn release_all<S: Datastore>(
    store: &S,
    jobs: &[Job],
) -> Result<Vec<Vec<IpAddr>>, StoreError> {
    let Some(first) = jobs.first() else {
        return Ok(Vec::new());
    };
    let Some(pool) = store.get_pool(&first.target.pool).await? else {
        return Ok(jobs.iter().map(|_| Vec::new()).collect());
    };
    // (job, offset, entry) of every entry to release.
    let mut mine: Vec<(usize, u128, IPAllocation)> = Vec::new();
    for (j, job) in jobs.iter().enumerate() {
        mine.extend(job.who.entries_in(&pool).map(|(o, e)| (j, o, e.clone())));
    }
    // The jobs with nothing recorded: an ADD of theirs may have claimed and been cut off.
    let unrecorded: Vec<&Job> = jobs
        .iter()
        .enumerate()
        .filter(|(j, _)| !mine.iter().any(|(m, _, _)| m == j))
        .map(|(_, job)| job)
        .collect();
    if !unrecorded.is_empty() {
        withdraw_claims(store, &pool, &unrecorded).await?;
    }
    if mine.is_empty() {
        return Ok(jobs.iter().map(|_| Vec::new()).collect());
    }
    let mut reservations = read_reservations(store, jobs, &mine).await?;
    announce(store, &mut reservations, CLAIMS_IN_FLIGHT).await?;
    let announced: BTreeSet<u128> = mine
        .iter()
        .zip(&reservations)
        .filter(|(_, r)| r.as_ref().is_some_and(|h| h.announced))
        .map(|((_, o, _), _)| *o)
        .collect();
    let entries: Vec<(u128, IPAllocation)> = mine.iter().map(|(_, o, e)| (*o, e.clone())).collect();
    let read = Some(pool.clone());
    let gone: BTreeSet<u128> = remove_entries(store, &pool.name, &entries, read, &announced)
        .await?
        .into_iter()
        .map(|(o, _)| o)
        .collect();
    let deletes = mine
        .iter()
        .zip(&reservations)
        .filter(|((_, o, _), _)| gone.contains(o))
        .filter_map(|(_, r)| r.as_ref())
        .map(|h| store.delete_reservation(&h.name, &h.uid, Some(&h.resource_version)))
        .collect::<Vec<_>>();
    futures::stream::iter(deletes)
        .buffer_unordered(CLAIMS_IN_FLIGHT)
        .collect::<Vec<_>>()
        .await
        .into_iter()
        .collect::<Result<Vec<_>, _>>()?;
    let mut released: Vec<Vec<IpAddr>> = jobs.iter().map(|_| Vec::new()).collect();
    for (j, offset, _) in &mine {
        if let Some(ip) = jobs[*j]
            .target
            .ip(*offset)
            .filter(|_| gone.contains(offset))
        {
            released[*j].push(ip);
        }
    }
    Ok(released)
}

/// The reservation of each entry (when it names the entry's pod), in `mine`'s order.
async fn read_reservations<S: Datastore>(
    store: &S,
    jobs: &[Job],
    mine: &[(usize, u128, IPAllocation)],
) -> Result<Vec<Option<HeldClaim>>, StoreError> {
    let reads: Vec<_> = mine
        .iter()
        .map(|(j, offset, entry)| {
            let job = &jobs[*j];
            async move {
                // An entry outside the range's CIDR (a malformed pool) has no reservation.
                let ip = job.target.ip(*offset).filter(|_| job.target.overlapping);
                let Some(ip) = ip else {
                    return Ok(None);
                };
                let name = job.target.reservation(ip);
                let held = job.engine(store).reservation_of(&name, entry).await?;
                Ok(held.map(HeldClaim::of))
            }
        })
        .collect();
    futures::stream::iter(reads)
        .buffered(CLAIMS_IN_FLIGHT)
        .collect::<Vec<Result<_, StoreError>>>()
        .await
        .into_iter()
        .collect()
}
