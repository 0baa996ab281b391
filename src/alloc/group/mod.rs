//! Group allocation, for the node agent: the ADDs of one pool that arrive together claim their
//! addresses together and are recorded with one pool write.
//!
//! A plugin process per ADD pays for its own connection, pool read, claims list and pool write,
//! and concurrent writers of one pool make the API server re-run every losing write. The agent
//! queues its node's ADDs per pool and runs each queue as a group: one pool read, one claims
//! list, the reservations created concurrently, one write recording every claimed entry.
//!
//! The rules are those of [`Engine::allocate`]: claim first (create-or-409 on the address's
//! reservation), then record, conditional on the pool's resourceVersion; a claim that may back an
//! entry is never undone. So agents on other nodes, plugins in direct mode and upstream's plugin
//! can all write the same pool. Anything out of the ordinary (an attachment that already holds an
//! entry or an unrecorded claim, a group that keeps losing its writes) is handed to the
//! one-by-one path, which knows how to adopt and reuse.

mod claims;
mod release;

use std::collections::BTreeSet;

use futures::StreamExt;

use super::{AllocError, Allocated, Engine, Owned, Owner, Target};
use crate::crd::IPAllocation;
use crate::retry::LOST_WRITE;
use crate::store::{Datastore, Pool, PoolWrite, StoreError};

pub use release::release_group;

/// Rounds of claim-and-write before the rest of a group goes one by one.
const GROUP_ROUNDS: u32 = 8;
/// How long a group claims and writes before the rest goes one by one: that path renews the
/// claims it finishes, so none is recorded after the audit could take it for abandoned (see
/// [`CLAIM_LIFETIME`](crate::alloc::CLAIM_LIFETIME)).
const GROUP_BUDGET: std::time::Duration =
    std::time::Duration::from_secs(crate::alloc::CLAIM_LIFETIME.as_secs() / 3);
/// Jobs going the one-by-one way at once.
const ALONE_AT_ONCE: usize = 16;
/// Reservations created at once: enough to hide the API server's latency, few enough that one
/// group does not crowd out every other client of the connection pool.
const CLAIMS_IN_FLIGHT: usize = 32;

/// One ADD's (or DEL's) request for an address of one pool.
#[derive(Debug, Clone)]
pub struct Job {
    pub target: Target,
    pub who: Owner,
}

impl Job {
    pub fn new(target: &Target, who: &Owner) -> Self {
        Job {
            target: target.clone(),
            who: who.clone(),
        }
    }

    fn engine<'a, S>(&'a self, store: &'a S) -> Engine<'a, S> {
        Engine {
            store,
            target: &self.target,
        }
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
pub async fn allocate_group<S: Datastore>(
    store: &S,
    jobs: Vec<Job>,
) -> Vec<Result<Allocated, AllocError>> {
    allocate_group_from(store, jobs, None).await.0
}

/// [`allocate_group`], starting from `known`, a version of the pool this caller read or wrote a
/// moment ago (instead of reading it), and returning the version the group left, if it knows it.
/// A stale `known` costs one lost write and a re-read, never a wrong allocation.
pub async fn allocate_group_from<S: Datastore>(
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
                slot.state = State::Finished(Err(AllocError::Datastore(e.clone())));
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
    (one_by_one(store, slots).await, last)
}

/// The results in job order, after running the jobs that go alone one by one. Bounded: the
/// one-by-one path may wait on watches of the pool, and a burst of them (the retries after an
/// agent restart) must not take every stream of the agent's connection.
async fn one_by_one<S: Datastore>(
    store: &S,
    slots: Vec<Slot>,
) -> Vec<Result<Allocated, AllocError>> {
    let alone: Vec<_> = slots
        .iter()
        .filter(|s| matches!(s.state, State::Alone))
        .map(|s| s.job.engine(store).allocate(&s.job.who))
        .collect();
    let alone: Vec<_> = futures::stream::iter(alone)
        .buffered(ALONE_AT_ONCE)
        .collect()
        .await;
    let mut alone = alone.into_iter();
    slots
        .into_iter()
        .map(|s| match s.state {
            State::Finished(result) => result,
            _ => alone.next().expect("one result per job gone alone"),
        })
        .collect()
}

/// Claims and records until every job is settled or the rounds run out.
/// Returns the last version of the pool seen.
async fn rounds<S: Datastore>(
    store: &S,
    slots: &mut [Slot],
    known: Option<Pool>,
) -> Result<Pool, StoreError> {
    let target = slots[0].job.target.clone();
    let engine = Engine::new(store, &target);
    let mut pool = match known {
        Some(pool) => pool,
        None => engine.ensure_pool(true).await?,
    };
    let mut skip = BTreeSet::new();
    let mut races = 0;
    let started = tokio::time::Instant::now();
    for round in 0..GROUP_ROUNDS {
        settle(store, &pool, slots, &mut skip).await?;
        if !slots.iter().any(Slot::unsettled) || started.elapsed() > GROUP_BUDGET {
            return Ok(pool);
        }
        if claims::claim_open(engine, &pool, slots, &mut skip, races).await? {
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
                LOST_WRITE.pause(round).await;
                pool = engine.ensure_pool(false).await?;
            }
            PoolWrite::Missing => pool = engine.ensure_pool(false).await?,
        }
    }
    settle(store, &pool, slots, &mut skip).await?;
    Ok(pool)
}

/// Finishes the jobs whose claims the pool records, re-opens those whose address went to a writer
/// that takes no reservations, and sends attachments that already hold an entry the one-by-one
/// way (which reuses it).
async fn settle<S: Datastore>(
    store: &S,
    pool: &Pool,
    slots: &mut [Slot],
    skip: &mut BTreeSet<u128>,
) -> Result<(), StoreError> {
    for slot in slots.iter_mut() {
        match &slot.state {
            State::Held { offset, uid } => {
                let (offset, uid) = (*offset, uid.clone());
                match pool.allocations.get(&offset) {
                    Some(e) if e.same_container(&slot.job.who) => {
                        slot.state = State::Finished(Ok(Allocated {
                            ip: slot.job.target.picked(offset),
                            conflicts: slot.conflicts,
                        }));
                    }
                    Some(_) => {
                        if let Some(uid) = uid {
                            let ip = slot.job.target.picked(offset);
                            slot.job.engine(store).unclaim(ip, &uid).await?;
                        }
                        skip.insert(offset);
                        slot.conflicts += 1;
                        slot.state = State::Open;
                    }
                    None => {}
                }
            }
            State::Open => {
                if slot.job.who.held_entry(pool).is_some() {
                    slot.state = State::Alone;
                }
            }
            State::Alone | State::Finished(_) => {}
        }
    }
    Ok(())
}
