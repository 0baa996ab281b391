//! The pool's writer turn: when several claimants (or releasers) of one pool are at work, one at a
//! time takes the turn and writes everybody's pending work in one write (group commit); the others
//! wait on a watch of the pool and are usually done when that write lands.
//!
//! The turn only spares the API server concurrent writes of one object, it guards nothing: every
//! write is still conditional on the pool's resourceVersion, so a claimant that cannot get a turn
//! (no Lease permissions) or finds it abandoned by a killed holder just writes.

use std::time::Duration;

use tokio::time::Instant;

use super::{Engine, Owned, neighbours};
use crate::crd::IPAllocation;
use crate::retry::MAX_CONFLICTS;
use crate::store::{
    Datastore, Listing, Pool, PoolChanges, StoreError, TURN_SECONDS, Turn, TurnAttempt,
};

/// How long a claimant waits for the turn holder's next write before it tries the turn again:
/// longer the more claimants there are, so that all of them together ask about as often.
fn turn_wait(contenders: usize) -> Duration {
    Duration::from_millis((contenders as u64 * 4).clamp(40, 200))
}

/// How long a claimant waits, after a write without its entry, for the writer's follow-up.
const SETTLE: Duration = Duration::from_millis(25);
/// Writes a turn holder makes after its own entry is in, for claims that arrived meanwhile.
pub(super) const FOLLOW_UP_WRITES: u32 = 2;
/// Whatever keeps the turn busy or stuck (a holder that cannot see this claim or release, a turn
/// nobody can break): after this long, write without it.
const PATIENCE: Duration = Duration::from_secs(2 * TURN_SECONDS);

/// What waiting for the turn holder's write brought.
enum Waited {
    /// A newer version of the pool.
    Fresh(Pool),
    /// Nothing new: try the turn again.
    Nothing,
    /// The pool is gone.
    Gone,
    /// The pool cannot be watched (no rights): write without waiting for others.
    Unwatchable,
}

/// A claimant's state while it waits for a turn.
struct Waiting<C> {
    changes: Option<C>,
    stale: StaleTurn,
    /// Set right after a write that did not finish our business: its writer usually follows up
    /// within milliseconds with what came in meanwhile, so wait for that before asking for the
    /// turn, instead of asking on every write. Set from the start when several others are at it:
    /// one of them most likely holds the turn already.
    settling: bool,
    contenders: usize,
}

impl<S: Datastore> Engine<'_, S> {
    /// Records a claimed entry while others are claiming from the same pool (see the module
    /// docs). True when the entry is in the pool; false when the offset went to a writer that
    /// takes no reservations.
    pub(super) async fn record_in_turn(
        &self,
        pool: Pool,
        offset: u128,
        entry: &IPAllocation,
        contenders: usize,
    ) -> Result<bool, StoreError> {
        let done = |pool: &Pool| {
            pool.allocations
                .get(&offset)
                .map(|e| e.same_container(entry))
        };
        let work = |fresh: Pool| self.write_pending(fresh, offset, entry);
        self.in_turn(pool, &entry.id, contenders, done, work).await
    }

    /// The turn protocol shared by recording claims and releasing entries: until `done` says how
    /// it ended (`Some`), either take the pool's writer turn and run `work` on a fresh read of the
    /// pool (which does this claimant's write and everybody else's pending one), or wait on a
    /// watch of the pool for another turn holder's write to do it.
    pub(super) async fn in_turn<D, W, F>(
        &self,
        mut pool: Pool,
        holder: &str,
        contenders: usize,
        done: D,
        work: W,
    ) -> Result<bool, StoreError>
    where
        D: Fn(&Pool) -> Option<bool>,
        W: Fn(Pool) -> F,
        F: Future<Output = Result<bool, StoreError>>,
    {
        let mut waiting = Waiting {
            changes: None,
            stale: StaleTurn::default(),
            settling: contenders >= 2,
            contenders,
        };
        let started = Instant::now();
        loop {
            if let Some(outcome) = done(&pool) {
                return Ok(outcome);
            }
            if started.elapsed() >= PATIENCE {
                tracing::debug!(pool = %pool.name, "waited too long for a turn; writing without it");
                return work(pool).await;
            }
            if !waiting.settling {
                match self.store.take_turn(&pool.name, holder).await {
                    TurnAttempt::Taken(turn) => return self.work_in_turn(&turn, work).await,
                    TurnAttempt::Unavailable => return work(pool).await,
                    TurnAttempt::Busy => {}
                }
            }
            match waiting.wait(self.store, &pool).await? {
                Waited::Fresh(fresh) => pool = fresh,
                Waited::Nothing => {}
                Waited::Gone => return Ok(false),
                Waited::Unwatchable => return work(pool).await,
            }
        }
    }

    /// Runs `work` while holding `turn`, on the pool as the writers before us left it.
    async fn work_in_turn<W, F>(&self, turn: &Turn, work: W) -> Result<bool, StoreError>
    where
        W: Fn(Pool) -> F,
        F: Future<Output = Result<bool, StoreError>>,
    {
        let outcome = match self.store.get_pool(&turn.pool).await {
            Ok(Some(fresh)) => work(fresh).await,
            Ok(None) => Ok(false),
            Err(e) => Err(e),
        };
        self.store.end_turn(turn).await;
        outcome
    }

    /// Writes the claimant's own entry and every other pending claim of the pool, each write
    /// conditional on the pool's resourceVersion, then follows up for claims that arrived
    /// meanwhile.
    async fn write_pending(
        &self,
        mut pool: Pool,
        offset: u128,
        entry: &IPAllocation,
    ) -> Result<bool, StoreError> {
        let mut follow_ups = 0;
        for attempt in 0..MAX_CONFLICTS {
            let recorded = match pool.allocations.get(&offset) {
                Some(e) if e.same_container(entry) => true,
                Some(_) => return Ok(false),
                None => false,
            };
            let mut entries: Vec<(u128, IPAllocation)> = self
                .pending_claims(&pool, Some(offset), Listing::Consistent)
                .await?
                .into_iter()
                .map(|p| (p.offset, p.entry))
                .collect();
            neighbours::note(&entry.node, entries.iter().map(|(_, e)| e.node.as_str()));
            if recorded {
                if entries.is_empty() || follow_ups == FOLLOW_UP_WRITES {
                    return Ok(true);
                }
                follow_ups += 1;
            } else {
                entries.push((offset, entry.clone()));
            }
            let written = self
                .store
                .add_allocations(&pool.name, &entries, &pool.resource_version)
                .await?;
            match self.next_version(written, attempt).await? {
                Some(next) => pool = next,
                None => return Ok(recorded),
            }
        }
        Ok(false)
    }
}

impl<C: PoolChanges> Waiting<C> {
    /// Waits on a watch of the pool for the turn holder's next write, or for a while; after a
    /// wait without writes, checks whether the turn was abandoned and breaks it if so.
    async fn wait<S: Datastore<Changes = C>>(
        &mut self,
        store: &S,
        pool: &Pool,
    ) -> Result<Waited, StoreError> {
        let watch = match self.changes.as_mut() {
            Some(watch) => watch,
            None => match store.watch_pool(&pool.name, &pool.resource_version).await {
                Ok(watch) => self.changes.insert(watch),
                Err(e) if e.kind() == "forbidden" => return Ok(Waited::Unwatchable),
                Err(e) => return Err(e),
            },
        };
        let wait = if self.settling {
            SETTLE
        } else {
            turn_wait(self.contenders)
        };
        let wait = wait + Duration::from_millis(fastrand::u64(0..=wait.as_millis() as u64));
        let was_settling = std::mem::replace(&mut self.settling, false);
        match watch.next(wait).await? {
            Some(fresh) => {
                self.settling = true;
                Ok(Waited::Fresh(fresh))
            }
            None if watch.ended() => {
                self.changes = None;
                Ok(match store.get_pool(&pool.name).await? {
                    Some(fresh) => Waited::Fresh(fresh),
                    None => Waited::Gone,
                })
            }
            None if was_settling => Ok(Waited::Nothing),
            // No write for a while: try the turn again, and take it over if its holder is gone.
            None => {
                if self.stale.abandoned(store, &pool.name).await {
                    let stale = &self.stale;
                    store.break_turn(&pool.name, &stale.uid, &stale.rv).await;
                }
                Ok(Waited::Nothing)
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
    since: Option<Instant>,
}

impl StaleTurn {
    /// Reads the turn at most once per turn length, so waiting costs almost no requests.
    async fn abandoned<S: Datastore>(&mut self, store: &S, pool: &str) -> bool {
        let now = Instant::now();
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
