//! Reading a pool (creating it on first use), going on after a conditional write, and telling
//! whether the pool's object can hold more entries.

use super::{AllocError, Engine, Target};
use crate::crd::{IPAllocation, size};
use crate::retry::LOST_WRITE;
use crate::store::{Datastore, Pool, PoolWrite, StoreError};

impl<S: Datastore> Engine<'_, S> {
    /// Reads the pool, creating it on first use. The first read of an ADD may come from the API
    /// server's cache (five times cheaper for a pool of a few hundred entries than a read from
    /// etcd): if it is a moment old, the conditional write fails and everything after reads from
    /// etcd.
    pub async fn ensure_pool(&self, cached: bool) -> Result<Pool, StoreError> {
        let (store, name) = (self.store, &self.target.pool);
        let first = if cached {
            store.get_pool_cached(name).await?
        } else {
            store.get_pool(name).await?
        };
        if let Some(pool) = first {
            return Ok(pool);
        }
        let cidr = self.target.range.cidr().to_string();
        let labels = self.target.pool_labels();
        for _ in 0..3 {
            store.create_pool(name, &cidr, &labels).await?;
            if let Some(pool) = store.get_pool(name).await? {
                return Ok(pool);
            }
            store.create_pool(name, &cidr, &labels).await?;
        }
        store
            .get_pool(name)
            .await?
            .ok_or_else(|| StoreError::Malformed {
                op: "get",
                object: format!("ippool {name}"),
                message: "created but not readable".into(),
            })
    }

    /// The pool to go on from after a conditional write: the version written, or after a lost
    /// write a fresh read following a short random pause (so that losers do not re-read in
    /// lockstep). `None` when the pool is gone.
    pub(super) async fn next_version(
        &self,
        written: PoolWrite,
        attempt: u32,
    ) -> Result<Option<Pool>, StoreError> {
        match written {
            PoolWrite::Done(fresh) => Ok(Some(fresh)),
            PoolWrite::Missing => Ok(None),
            PoolWrite::Conflict => {
                LOST_WRITE.pause(attempt).await;
                self.store.get_pool(&self.target.pool).await
            }
        }
    }
}

/// What one snapshot of a pool's object holds, to tell whether more entries still fit (see
/// [`size`]). Computed once per snapshot: counting the entries costs a pass over all of them.
pub struct ObjectRoom {
    pool: String,
    entries: usize,
    bytes: usize,
    /// The widest offset of the range: an entry's offset is not known before its pick.
    widest: u128,
}

impl ObjectRoom {
    pub fn of(target: &Target, pool: &Pool) -> Self {
        ObjectRoom {
            pool: pool.name.clone(),
            entries: pool.allocations.len(),
            bytes: pool.stored_bytes(),
            widest: target.range.size(),
        }
    }

    /// `Some(error)` when `count` more entries like `entry` would not fit in the pool's object.
    pub fn full(&self, entry: &IPAllocation, count: usize) -> Option<AllocError> {
        let more = count * size::entry_bytes(self.widest, entry);
        (self.bytes + more > size::POOL_OBJECT_BUDGET).then(|| AllocError::PoolFull {
            pool: self.pool.clone(),
            entries: self.entries,
            bytes: self.bytes,
            budget: size::POOL_OBJECT_BUDGET,
        })
    }
}
