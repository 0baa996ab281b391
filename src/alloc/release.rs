//! Releasing: one DEL's entries of one target (announced, and removed in the pool's writer turn
//! when other DELs are at it too), and removing many entries of one pool in one write.

use std::collections::BTreeSet;
use std::net::IpAddr;

use super::turn::FOLLOW_UP_WRITES;
use super::{Engine, Owned, Owner};
use crate::crd::IPAllocation;
use crate::retry::{LOST_WRITE, MAX_CONFLICTS};
use crate::store::{Datastore, Pool, PoolWrite, StoreError, Write};

/// A reservation a DEL will delete once its entry is gone: (offset, name, uid, resourceVersion
/// to delete it at).
type Held = (u128, String, String, String);

/// The reservations of a DEL's entries: those it announced its release on, and those it could
/// not announce (no rights to, or the reservation changed meanwhile).
#[derive(Default)]
struct Announced {
    announced: Vec<Held>,
    unannounced: Vec<Held>,
}

impl<S: Datastore> Engine<'_, S> {
    /// Releases every entry of `who`'s container and interface in the target, and their
    /// reservations. Returns the released addresses. Entries re-bound to another container are
    /// left alone.
    ///
    /// Many DELs of one pool at once (a deployment scaled down, a node drained) would each write
    /// the pool, which costs the API server a re-run of every losing write. So a DEL first
    /// announces its release on its reservations; when others are releasing from the same pool,
    /// one of them takes the pool's writer turn and removes every announced entry in one write
    /// while the rest wait for it on a watch, as ADDs do for claims. Each DEL then deletes its own
    /// reservations.
    pub async fn release(self, who: &Owner) -> Result<Vec<IpAddr>, StoreError> {
        let Some(pool) = self.store.get_pool(&self.target.pool).await? else {
            return Ok(Vec::new());
        };
        let mine: Vec<(u128, IPAllocation)> =
            who.entries_in(&pool).map(|(o, e)| (o, e.clone())).collect();
        if mine.is_empty() {
            // Nothing recorded: an ADD of this container may have claimed and been cut off.
            self.withdraw_claims(&pool, who).await?;
            return Ok(Vec::new());
        }
        if !self.target.overlapping {
            return self.release_entries(&mine).await;
        }
        let held = self.announce(&mine).await?;
        // A release nobody else can see is done by this DEL alone.
        let others = if held.unannounced.is_empty() && held.announced.len() == mine.len() {
            self.other_releases(&pool.name, &mine).await?
        } else {
            0
        };
        let gone = if others == 0 {
            let announced = held.announced.iter().map(|h| h.0).collect();
            remove_entries(
                self.store,
                &pool.name,
                &mine,
                Some(pool.clone()),
                &announced,
            )
            .await?
            .into_iter()
            .map(|(o, _)| o)
            .collect()
        } else {
            self.remove_in_turn(pool, &mine, who, others).await?
        };
        for (offset, name, uid, rv) in held.announced.iter().chain(&held.unannounced) {
            if gone.contains(offset) {
                self.store.delete_reservation(name, uid, Some(rv)).await?;
            }
        }
        Ok(gone.iter().filter_map(|o| self.target.ip(*o)).collect())
    }

    /// Announces the release on each entry's reservation (only one that names this pod). Each
    /// reservation is deleted later at the version this DEL saw or made, so that one taken over
    /// by a new container of the pod meanwhile is kept.
    async fn announce(&self, mine: &[(u128, IPAllocation)]) -> Result<Announced, StoreError> {
        let mut held = Announced::default();
        for (offset, entry) in mine {
            let Some(ip) = self.target.ip(*offset) else {
                continue;
            };
            let name = self.target.reservation(ip);
            let Some(r) = self.reservation_of(&name, entry).await? else {
                continue;
            };
            match self
                .store
                .mark_releasing(&name, &r.uid, &r.resource_version)
                .await
            {
                Ok((Write::Done, rv)) => held.announced.push((*offset, name, r.uid, rv)),
                // Rights from before releases were announced: this DEL releases on its own.
                Ok(_) => held
                    .unannounced
                    .push((*offset, name, r.uid, r.resource_version)),
                Err(e) if e.kind() == "forbidden" => {
                    held.unannounced
                        .push((*offset, name, r.uid, r.resource_version))
                }
                Err(e) => return Err(e),
            }
        }
        Ok(held)
    }

    /// How many releases other than ours are announced in the pool right now.
    async fn other_releases(
        &self,
        pool: &str,
        mine: &[(u128, IPAllocation)],
    ) -> Result<usize, StoreError> {
        let own: BTreeSet<u128> = mine.iter().map(|(o, _)| *o).collect();
        let releases = self.store.releases_of(pool).await?;
        Ok(releases
            .iter()
            .filter(|c| {
                let offset = self.target.range.offset_of(c.ip);
                offset.is_some_and(|o| !own.contains(&o))
            })
            .count())
    }

    /// Removes our entries in the pool's writer turn, with the announced releases of our node.
    /// Returns the offsets gone from the pool, by us or by a turn holder; an offset now held by
    /// anyone else (re-bound to a newer container of the pod) keeps its reservation.
    async fn remove_in_turn(
        &self,
        pool: Pool,
        mine: &[(u128, IPAllocation)],
        who: &Owner,
        others: usize,
    ) -> Result<BTreeSet<u128>, StoreError> {
        let still_mine = |p: &Pool| {
            mine.iter()
                .any(|(o, e)| p.allocations.get(o).is_some_and(|c| c.same_container(e)))
        };
        let done = |p: &Pool| (!still_mine(p)).then_some(true);
        let work = |fresh: Pool| self.remove_pending(fresh, mine, who);
        let name = pool.name.clone();
        self.in_turn(pool, &who.container_id, others, done, work)
            .await?;
        let now = self.store.get_pool(&name).await?.unwrap_or_default();
        Ok(mine
            .iter()
            .map(|(o, _)| *o)
            .filter(|o| !now.allocations.contains_key(o))
            .collect())
    }

    /// A turn holder's work for DELs: removes its own entries and every release announced on its
    /// node ([`Owned::may_rewrite`]; each only while its entry still holds the announcing
    /// container) in one write conditional on the pool's resourceVersion, then follows up for
    /// releases announced meanwhile. Another node's releases wait for a turn of that node's.
    async fn remove_pending(
        &self,
        mut pool: Pool,
        mine: &[(u128, IPAllocation)],
        who: &Owner,
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
            let releases = self.store.releases_of(&pool.name).await?;
            let mut offsets: BTreeSet<u128> = releases
                .iter()
                .filter(|c| who.may_rewrite(&c.spec))
                .filter_map(|c| {
                    let o = self.target.range.offset_of(c.ip)?;
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
            let written = self
                .store
                .remove_allocations(&pool.name, &offsets, &pool.resource_version)
                .await?;
            match self.next_version(written, attempt).await? {
                Some(next) => pool = next,
                None => return Ok(true),
            }
        }
        Ok(false)
    }

    /// Removes the given entries of the target's pool (each only while it still holds the same
    /// container and pod), then the reservation of each removed address when it names the same
    /// pod.
    pub async fn release_entries(
        &self,
        entries: &[(u128, IPAllocation)],
    ) -> Result<Vec<IpAddr>, StoreError> {
        let (mut released, pool) = (Vec::new(), &self.target.pool);
        for (offset, entry) in entries {
            if self.store.remove_allocation(pool, *offset, entry).await? != Write::Done {
                continue;
            }
            let Some(ip) = self.target.ip(*offset) else {
                continue;
            };
            released.push(ip);
            if self.target.overlapping {
                let name = self.target.reservation(ip);
                if let Some(r) = self.reservation_of(&name, entry).await? {
                    self.store
                        .delete_reservation(&name, &r.uid, Some(&r.resource_version))
                        .await?;
                }
            }
        }
        Ok(released)
    }
}

/// Removes many entries of one pool in as few writes as possible, each only while it still holds
/// the same container and pod: the pool is read, the owners checked, and the entries still owned
/// removed in one write conditional on that read's resourceVersion (re-read and re-checked when
/// another writer got in between). Returns the entries removed. One write for a thousand entries
/// instead of a thousand concurrent writes of one object, which the API server serialises by
/// re-running them (docs/benchmarks.md).
///
/// `read` is a version of the pool the caller has just read, if any, to start from instead of
/// reading it again (a stale one only costs a lost write). `announced`: the offsets whose release
/// the caller announced; one found gone was removed by a turn holder that honoured the
/// announcement, and counts as removed.
pub async fn remove_entries<S: Datastore>(
    store: &S,
    pool: &str,
    entries: &[(u128, IPAllocation)],
    mut read: Option<Pool>,
    announced: &BTreeSet<u128>,
) -> Result<Vec<(u128, IPAllocation)>, StoreError> {
    // Offsets this call has tried to remove: one found gone after a lost write was removed by
    // that write (its answer lost on the way) or by another releaser, gone either way.
    let mut tried = announced.clone();
    for attempt in 0..MAX_CONFLICTS {
        let current = match read.take() {
            Some(version) => Some(version),
            None => store.get_pool(pool).await?,
        };
        let Some(current) = current else {
            let gone = entries.iter().filter(|(o, _)| tried.contains(o));
            return Ok(gone.cloned().collect());
        };
        let (mut gone, mut owned) = (Vec::new(), Vec::new());
        for (o, e) in entries {
            match current.allocations.get(o) {
                Some(c) if c.same_container(e) => owned.push((*o, e.clone())),
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
            PoolWrite::Conflict => LOST_WRITE.pause(attempt).await,
        }
    }
    Err(StoreError::Api {
        op: "patch",
        object: format!("ippool {pool}"),
        code: 409,
        message: format!("gave up after {MAX_CONFLICTS} conflicting writes"),
    })
}
