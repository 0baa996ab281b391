//! The allocation engine: claiming and releasing addresses of one pool, without a lock. The CNI
//! plugin ([`crate::cni`]), the node agent ([`crate::agent`]) and the operator
//! ([`crate::controller`]) all go through it; it knows nothing of CNI configs or NADs, only of a
//! [`Target`] (a pool, its address range, its network, whether ranges may overlap) and of the
//! [`Owner`] an address is for.
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
//! (docs/benchmarks.md), so claimants take turns ([`turn`]): one takes the pool's writer turn and
//! records every pending claim in one write (group commit), the rest wait on a watch of the pool
//! and are usually recorded by that write. The turn guards nothing; every write is conditional,
//! and a turn left by a killed process is taken over after [`TURN_SECONDS`](crate::store::TURN_SECONDS).
//!
//! Losing a claim costs one request and a new pick; picks spread over the lowest free addresses
//! in proportion to the claims in flight, so that concurrent claimants rarely collide, while a
//! claimant alone still takes the lowest free address.
//!
//! DEL removes only entries that still hold the container being deleted, then the reservation if
//! it belongs to the same pod, so an address re-bound to a newer container is never released.
//! Concurrent DELs of one pool announce their releases on their reservations and take turns the
//! same way, one write removing every announced entry ([`release`]).
//!
//! The node agent allocates the ADDs (releases the DELs) of one pool that arrive together as a
//! group ([`group`]), under the same rules.
//!
//! | file | concern |
//! |------|---------|
//! | [`add`] | one ADD's address: pick, claim, record, reuse |
//! | [`exact`] | a requested address: that one, or why not |
//! | [`claim`] | reservations: claim, unclaim, the claims still waiting for their entry |
//! | [`turn`] | the pool's writer turn and the group-commit writes made in it |
//! | [`release`] | one DEL's entries, and removing many entries in one write |
//! | [`announce`] | announcing a release, so that no writer turn writes its entry back |
//! | [`group`] | the node agent's groups of ADDs and DELs |
//! | [`pool`] | reading or creating a pool, and what its object can still hold |

pub mod add;
pub mod announce;
pub mod claim;
pub mod exact;
pub mod group;
pub mod neighbours;
pub mod pool;
pub mod release;
pub mod turn;

use std::net::IpAddr;

use thiserror::Error;

use crate::crd::IPAllocation;
use crate::ipam::AddrRange;
use crate::ipam::naming::{pool_labels, reservation_name};
use crate::store::{Datastore, Pool, StoreError};

pub use crate::ownership::{Holder, Owned, Owner};
pub use claim::CLAIM_LIFETIME;
pub use group::Job;
pub use release::remove_entries;

/// What addresses are allocated from: one pool and the range its offsets count in, the network
/// that scopes its reservations, and whether reservations are kept (ranges may overlap).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Target {
    /// The IPPool's name.
    pub pool: String,
    pub range: AddrRange,
    /// The `network_name` of the config: reservations are named within it.
    pub network: Option<String>,
    /// Whether addresses are claimed by reservation objects first (`enable_overlapping_ranges`).
    pub overlapping: bool,
    /// The node whose slice this pool is (node slices only): recorded in the pool's labels.
    pub node: Option<String>,
}

impl Target {
    /// The address at `offset`, `None` when it lies outside the range's CIDR (a malformed pool).
    pub fn ip(&self, offset: u128) -> Option<IpAddr> {
        self.range.addr_at(offset)
    }

    /// The address of an offset this engine picked (from the range, so always inside it).
    fn picked(&self, offset: u128) -> IpAddr {
        self.ip(offset).expect("picked offsets lie in the range")
    }

    /// The labels of this target's pool (see [`crate::ipam::naming::pool_labels`]).
    pub fn pool_labels(&self) -> std::collections::BTreeMap<String, String> {
        pool_labels(
            self.network.as_deref(),
            self.range.cidr(),
            self.node.as_deref(),
        )
    }

    /// The name of the reservation guarding `ip` in this target's network.
    pub fn reservation(&self, ip: IpAddr) -> String {
        reservation_name(self.network.as_deref(), ip)
    }
}

/// The pool lookups of an owner; whose entry is whose is decided by [`Owner`]'s comparisons.
impl Owner {
    /// The entries a DEL of this attachment releases: its container's on its interface
    /// ([`Owned::same_attachment`]), unless something else holds them.
    pub fn entries_in<'p>(
        &self,
        pool: &'p Pool,
    ) -> impl Iterator<Item = (u128, &'p IPAllocation)> + use<'p, '_> {
        pool.allocations
            .iter()
            .filter(|(_, e)| !e.is_held() && e.same_attachment(self))
            .map(|(o, e)| (*o, e))
    }

    /// The entry this attachment already holds in `pool`, which an ADD returns again: its
    /// claim's, else its pod interface's ([`Owned::same_pod_interface`]) on a node it may
    /// rewrite ([`Owned::may_rewrite`]): another node's is a pod of that name that may still run
    /// there, which the operator frees once it is gone.
    pub fn held_entry<'p>(&self, pool: &'p Pool) -> Option<(u128, &'p IPAllocation)> {
        match &self.holder {
            Holder::Claim(_) => self.claim_entries(pool).next(),
            _ => pool
                .allocations
                .iter()
                .find(|(_, e)| e.same_pod_interface(self) && self.may_rewrite(*e))
                .map(|(o, e)| (*o, e)),
        }
    }

    /// Every entry of this attachment's claim in `pool` (none without a claim): normally one, two
    /// when ADDs of two pods of the claim raced to make its first allocation.
    pub fn claim_entries<'p>(
        &self,
        pool: &'p Pool,
    ) -> impl Iterator<Item = (u128, &'p IPAllocation)> + use<'p, '_> {
        pool.allocations
            .iter()
            .filter(|(_, e)| e.same_claim(self))
            .map(|(o, e)| (*o, e))
    }
}

/// The outcome of an allocation and how many races it lost on the way (for benchmarks and logs).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Allocated {
    pub ip: IpAddr,
    pub conflicts: u32,
}

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
    /// A requested address that cannot be given: outside the window, excluded, or held.
    #[error("requested address {ip} {why}")]
    Unavailable { ip: IpAddr, why: String },
    #[error("pool {pool}: gave up after {attempts} lost races for an address")]
    TooManyConflicts { pool: String, attempts: u32 },
    #[error(transparent)]
    Datastore(#[from] StoreError),
    /// The node agent could not finish the allocation (it is shutting down).
    #[error("node agent: {0}")]
    Agent(String),
}

impl AllocError {
    /// No address left in `target`'s window.
    pub fn exhausted(target: &Target) -> AllocError {
        let range = &target.range;
        let (first, last) = range.window();
        let excludes: Vec<String> = range.excludes().iter().map(ToString::to_string).collect();
        let excludes = if excludes.is_empty() {
            String::new()
        } else {
            format!(", exclude {}", excludes.join(","))
        };
        AllocError::Exhausted {
            cidr: range.cidr().to_string(),
            first,
            last,
            excludes,
            size: range.size(),
        }
    }
}

/// The engine over one target: the store and the target every step of an allocation or release
/// needs, carried together instead of in every parameter list.
pub struct Engine<'a, S> {
    pub store: &'a S,
    pub target: &'a Target,
}

impl<S> Clone for Engine<'_, S> {
    fn clone(&self) -> Self {
        *self
    }
}

impl<S> Copy for Engine<'_, S> {}

impl<'a, S: Datastore> Engine<'a, S> {
    pub fn new(store: &'a S, target: &'a Target) -> Self {
        Engine { store, target }
    }
}

/// How an ADD claims, and a DEL releases, each range's address: by this process alone
/// ([`Direct`]), or handed to the node agent, which claims (releases) the addresses of many ADDs
/// (DELs) of one pool together.
pub trait Allocate<S: Datastore>: Sync {
    fn allocate(
        &self,
        store: &S,
        target: &Target,
        who: &Owner,
    ) -> impl Future<Output = Result<Allocated, AllocError>> + Send;

    fn release(
        &self,
        store: &S,
        target: &Target,
        who: &Owner,
    ) -> impl Future<Output = Result<Vec<IpAddr>, StoreError>> + Send;
}

/// Each ADD claims and records its own addresses ([`Engine::allocate`]), each DEL releases its
/// own ([`Engine::release`]).
pub struct Direct;

impl<S: Datastore> Allocate<S> for Direct {
    async fn allocate(
        &self,
        store: &S,
        target: &Target,
        who: &Owner,
    ) -> Result<Allocated, AllocError> {
        Engine::new(store, target).allocate(who).await
    }

    async fn release(
        &self,
        store: &S,
        target: &Target,
        who: &Owner,
    ) -> Result<Vec<IpAddr>, StoreError> {
        Engine::new(store, target).release(who).await
    }
}
