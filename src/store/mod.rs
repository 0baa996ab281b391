//! The datastore seen by the CNI plugin and the operator: pools, their entries, and reservations.
//!
//! Every write is conditional, so no lock is needed:
//! - pool entries are added, or removed in batches, only if the pool is unchanged since it was
//!   read (a resourceVersion precondition); several entries can go in one write;
//! - a single entry is replaced or removed only if it still holds the container and pod we expect;
//! - a reservation is created only if no reservation of that address exists, and deleted only if it
//!   is still the object we looked at (UID precondition).
//!
//! A lost condition comes back as [`Write::Conflict`], never as an error: the caller decides.
//!
//! One thing is not a condition but a courtesy: a pool's *writer turn* (a short-lived Lease).
//! Many plugins writing one pool at the same moment are all correct but slow, because every
//! losing write still costs the API server a full decode-patch-validate-encode of the pool. So a
//! plugin that finds others claiming (or releasing) in the same pool takes the turn before writing
//! and records every pending claim (removes every announced release) at once, while the others
//! wait for that write on a watch. Nothing depends on the
//! turn for correctness: a writer without it (RBAC without Leases, a turn abandoned by a killed
//! process) is still held to the resourceVersion precondition.

pub mod claims;
pub mod kubernetes;
pub mod memory;

pub use claims::{
    CLAIM_BUCKET_SECONDS, CLAIMED_LABEL, Listing, RELEASING_LABEL, RENEWED_ANNOTATION,
    claim_bucket, listable_claim, recent_buckets,
};

use std::collections::BTreeMap;
use std::future::Future;

use thiserror::Error;

use crate::crd::{
    IPAMClaim, IPAMClaimStatus, IPAllocation, NodeSlicePool, OverlappingRangeIPReservationSpec,
};

/// A pool as read, with its allocations keyed by numeric offset.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Pool {
    pub name: String,
    pub range: String,
    pub allocations: BTreeMap<u128, IPAllocation>,
    pub resource_version: String,
}

impl Pool {
    /// The pool's estimated size as stored (see [`crate::crd::size`]).
    pub fn stored_bytes(&self) -> usize {
        crate::crd::size::pool_bytes(&self.range, &self.allocations)
    }

    /// Parses the stored keys. Keys that are not decimal offsets are kept out of the map (and so
    /// never touched) but reported, since they may be a newer upstream format.
    pub fn from_stored(
        name: String,
        range: String,
        stored: BTreeMap<String, IPAllocation>,
        resource_version: String,
    ) -> (Pool, Vec<String>) {
        let mut allocations = BTreeMap::new();
        let mut unparsed = Vec::new();
        for (key, entry) in stored {
            match key.parse::<u128>() {
                Ok(offset) => {
                    allocations.insert(offset, entry);
                }
                Err(_) => unparsed.push(key),
            }
        }
        (
            Pool {
                name,
                range,
                allocations,
                resource_version,
            },
            unparsed,
        )
    }
}

/// Labels a reservation with its pool, so that a writer of that pool can find the claims whose pool
/// entries are still pending and record them together with its own (group commit).
pub const POOL_LABEL: &str = "whereabouts.cni.cncf.io/pool";
/// The claimed address, on our reservations (the name encodes it only up to the network prefix).
pub const IP_ANNOTATION: &str = "whereabouts.cni.cncf.io/ip";
/// Set on a pool (to a fresh value) by an ADD that takes its attachment's entry again without
/// changing it: the write moves the pool to a new resourceVersion, so that a release sweep that
/// listed the announcements before the ADD withdrew its own cannot remove the entry with a write
/// conditional on the version it read (see [`Datastore::touch_pool`]).
pub const TAKEN_AGAIN_ANNOTATION: &str = "whereabouts.cni.cncf.io/taken-again";

/// The outcome of [`Datastore::add_allocations`] and [`Datastore::remove_allocations`].
#[derive(Debug, Clone, PartialEq)]
pub enum PoolWrite {
    /// Written; the pool as it is now (with its new resourceVersion).
    Done(Pool),
    /// The pool moved on since it was read.
    Conflict,
    /// The pool is not there.
    Missing,
}

/// How long a writer turn may stand unchanged before waiters take it as abandoned. A turn lasts a
/// few pool writes, well under a second; a killed holder costs the others this long.
pub const TURN_SECONDS: u64 = 5;

/// Marks the Leases that are pools' writer turns, so that the operator's audit can find turns
/// abandoned by killed plugins.
pub const TURN_LABEL: &str = "whereabouts.cni.cncf.io/writer-turn";

/// A pool's writer turn, held until [`Datastore::end_turn`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Turn {
    pub pool: String,
    pub uid: String,
}

/// The outcome of [`Datastore::take_turn`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum TurnAttempt {
    Taken(Turn),
    /// Another writer holds it.
    Busy,
    /// Turns cannot be taken here (no Lease permissions, a pool name too long for a Lease, an API
    /// failure): write without one.
    Unavailable,
}

/// Later versions of one pool, as a watch delivers them.
pub trait PoolChanges: Send {
    /// The next version of the pool, or `None` when none came within `wait` or the watch ended
    /// (the caller re-reads instead).
    fn next(
        &mut self,
        wait: std::time::Duration,
    ) -> impl Future<Output = Result<Option<Pool>>> + Send;
    /// True once the watch has ended (then `next` returns `None` at once).
    fn ended(&self) -> bool;
}

/// The outcome of a conditional write.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Write {
    Done,
    /// The condition did not hold (the key is taken, the entry changed, the object exists).
    Conflict,
    /// The object is not there.
    Missing,
}

/// A reservation made for a pool by our plugin: the claimed address and the reservation's UID.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PoolClaim {
    pub ip: std::net::IpAddr,
    pub uid: String,
    pub spec: OverlappingRangeIPReservationSpec,
}

/// A reservation as its maker made it: what a later write conditional on it names.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Made {
    pub uid: String,
    /// Empty when not known (a claim adopted or taken over): no write can then be conditional
    /// on it.
    pub resource_version: String,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Reservation {
    pub name: String,
    pub uid: String,
    pub spec: OverlappingRangeIPReservationSpec,
    /// Creation time in seconds since the epoch, when known.
    pub created: Option<i64>,
    /// The claim bucket of its last claim or renewal ([`CLAIMED_LABEL`]); none on reservations
    /// upstream made, which no claims list shows.
    pub claimed: Option<i64>,
    /// A DEL has announced its release ([`RELEASING_LABEL`]): a sweep may have listed it.
    pub releasing: bool,
    pub resource_version: String,
}

impl Reservation {
    /// True when the reservation was made in the last few seconds: it was won in a race that is
    /// probably still going on, rather than held steadily by a pod of an overlapping range.
    pub fn is_recent(&self) -> bool {
        self.created.is_some_and(|c| now_secs() - c < 10)
    }
}

/// Seconds since the epoch, the unit of [`Reservation::created`].
pub fn now_secs() -> i64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_secs() as i64)
        .unwrap_or(0)
}

#[derive(Debug, Clone, Error)]
pub enum StoreError {
    #[error("{op} {object}: {message}")]
    Api {
        op: &'static str,
        object: String,
        code: u16,
        message: String,
    },
    #[error("{op} {object}: {source}")]
    Transport {
        op: &'static str,
        object: String,
        source: std::sync::Arc<dyn std::error::Error + Send + Sync>,
    },
    #[error("{op} {object}: stored data is malformed: {message}")]
    Malformed {
        op: &'static str,
        object: String,
        message: String,
    },
}

impl StoreError {
    /// True for etcd's refusal of a write over its request limit (a pool grown too big): the
    /// same write will never succeed.
    pub fn is_too_large(&self) -> bool {
        matches!(self, StoreError::Api { message, .. } if message.contains(TOO_LARGE))
    }

    /// The API server refused the credentials (401): no retry with them can succeed.
    pub fn is_unauthenticated(&self) -> bool {
        matches!(self, StoreError::Api { code: 401, .. })
    }

    /// A short stable label for metrics and logs.
    pub fn kind(&self) -> &'static str {
        match self {
            StoreError::Api { code, .. } if *code == 403 || *code == 401 => "forbidden",
            StoreError::Api { .. } => "api",
            StoreError::Transport { .. } => "transport",
            StoreError::Malformed { .. } => "malformed",
        }
    }
}

/// What the API server says when etcd refuses a write over its request limit.
pub const TOO_LARGE: &str = "request is too large";

pub type Result<T, E = StoreError> = std::result::Result<T, E>;

/// Storage operations, each one request. Implemented for Kubernetes and in memory.
pub trait Datastore: Send + Sync {
    fn get_pool(&self, name: &str) -> impl Future<Output = Result<Option<Pool>>> + Send;
    /// The pool as the API server's cache has it: possibly a moment old, for reads whose
    /// staleness a conditional write catches.
    fn get_pool_cached(&self, name: &str) -> impl Future<Output = Result<Option<Pool>>> + Send;
    /// Creates an empty pool with `labels` (what the pool is: network, range, node; see
    /// `ipam::naming::pool_labels`); `Conflict` when it already exists.
    fn create_pool(
        &self,
        name: &str,
        range: &str,
        labels: &BTreeMap<String, String>,
    ) -> impl Future<Output = Result<Write>> + Send;
    /// Records `entries` if the pool is still at `resource_version`; `Conflict` otherwise.
    fn add_allocations(
        &self,
        pool: &str,
        entries: &[(u128, IPAllocation)],
        resource_version: &str,
    ) -> impl Future<Output = Result<PoolWrite>> + Send;
    /// Removes the entries at `offsets` if the pool is still at `resource_version` (the caller
    /// checked their owners in that version); `Conflict` otherwise.
    fn remove_allocations(
        &self,
        pool: &str,
        offsets: &[u128],
        resource_version: &str,
    ) -> impl Future<Output = Result<PoolWrite>> + Send;
    /// Moves the pool to a new resourceVersion without changing its entries (an annotation,
    /// [`TAKEN_AGAIN_ANNOTATION`]), if it is still at `resource_version`; `Conflict` otherwise.
    /// Every other write conditional on an earlier version then fails and reads again.
    fn touch_pool(
        &self,
        pool: &str,
        resource_version: &str,
    ) -> impl Future<Output = Result<PoolWrite>> + Send;
    /// Watches `pool` for versions after `resource_version`.
    fn watch_pool(
        &self,
        pool: &str,
        resource_version: &str,
    ) -> impl Future<Output = Result<Self::Changes>> + Send;
    type Changes: PoolChanges;
    /// Takes the writer turn of `pool` (create-or-conflict). Failures are `Unavailable`, never
    /// errors: the turn is a courtesy.
    fn take_turn(&self, pool: &str, holder: &str) -> impl Future<Output = TurnAttempt> + Send;
    /// Gives the turn back (only if it is still this turn's object).
    fn end_turn(&self, turn: &Turn) -> impl Future<Output = ()> + Send;
    /// The current turn object of `pool`, as (uid, resourceVersion), if any.
    fn turn_holder(&self, pool: &str) -> impl Future<Output = Option<(String, String)>> + Send;
    /// Removes a turn that has not changed for too long (its holder died), only if it is still
    /// exactly the object that was looked at.
    fn break_turn(&self, pool: &str, uid: &str, rv: &str) -> impl Future<Output = ()> + Send;
    /// Replaces the entry at `offset` if it still holds `expected`'s container and pod.
    fn replace_allocation(
        &self,
        pool: &str,
        offset: u128,
        expected: &IPAllocation,
        entry: &IPAllocation,
    ) -> impl Future<Output = Result<Write>> + Send;
    /// Removes the entry at `offset` if it still holds `expected`'s container and pod.
    fn remove_allocation(
        &self,
        pool: &str,
        offset: u128,
        expected: &IPAllocation,
    ) -> impl Future<Output = Result<Write>> + Send;
    /// Creates a reservation of `ip` for `pool`; `Conflict` when one exists. Returns the new
    /// object's UID and version on success.
    fn create_reservation(
        &self,
        name: &str,
        spec: &OverlappingRangeIPReservationSpec,
        pool: &str,
        ip: std::net::IpAddr,
    ) -> impl Future<Output = Result<(Write, Made)>> + Send;
    /// Takes a claim whose entry its pool now holds off the claims lists ([`Datastore::claims_of`]
    /// stops showing it: its [`CLAIMED_LABEL`] goes), if it is still exactly the version its
    /// claimant made. Every claims list of a busy pool returned every recent claim, recorded or
    /// not, and those lists were most of what a storm cost the API server. A reservation
    /// announced or renewed meanwhile changed version and is left as it is.
    fn settle_claim(&self, name: &str, made: &Made) -> impl Future<Output = Result<Write>> + Send;
    /// Recent claims made for `pool` by our plugin (pool and claim-time labels, address
    /// annotation) and not announced as released, as fresh as `listing` asks.
    fn claims_of(
        &self,
        pool: &str,
        listing: Listing,
    ) -> impl Future<Output = Result<Vec<PoolClaim>>> + Send;
    /// Recent releases announced for `pool` (see [`RELEASING_LABEL`]).
    fn releases_of(&self, pool: &str) -> impl Future<Output = Result<Vec<PoolClaim>>> + Send;
    /// Announces the release of a reservation's address, if it is still exactly the version that
    /// was read (`uid` and `resource_version`: one a new container of the pod took over since
    /// is not its release to announce). Returns the reservation's new resourceVersion on success.
    fn mark_releasing(
        &self,
        name: &str,
        uid: &str,
        resource_version: &str,
    ) -> impl Future<Output = Result<(Write, String)>> + Send;
    /// Makes a reservation of this pod's interface the new container's, if it is still exactly
    /// the version that was read (`uid` and `resource_version`), and withdraws any announced
    /// release of it. A DEL of the old container deletes the reservation only at the version it
    /// saw, so it can no longer delete one that a new container has taken over.
    fn take_over_reservation(
        &self,
        name: &str,
        uid: &str,
        resource_version: &str,
        spec: &OverlappingRangeIPReservationSpec,
    ) -> impl Future<Output = Result<Write>> + Send;
    /// Writes a claim afresh, if it is still exactly the version that was read: its claim bucket
    /// moves to now and [`RENEWED_ANNOTATION`] to this second, so that its resourceVersion and
    /// last write change, and any release announced for it is withdrawn (a DEL of the same
    /// container cut off after announcing must not leave the entry to other DELs' sweeps). A writer about to record a claim made earlier (by an earlier attempt)
    /// renews it first: the audit never sweeps a claim written within
    /// [`crate::alloc::CLAIM_LIFETIME`] (plus a margin), and deletes only the version it saw.
    fn renew_claim(
        &self,
        name: &str,
        uid: &str,
        resource_version: &str,
    ) -> impl Future<Output = Result<Write>> + Send;
    fn get_reservation(
        &self,
        name: &str,
    ) -> impl Future<Output = Result<Option<Reservation>>> + Send;
    /// Deletes a reservation if it is still the object with `uid` (and, when given, still at
    /// `resource_version`: unchanged since it was read).
    fn delete_reservation(
        &self,
        name: &str,
        uid: &str,
        resource_version: Option<&str>,
    ) -> impl Future<Output = Result<Write>> + Send;
    /// A NodeSlicePool (the node slices of a range), its resourceVersion in its metadata.
    fn get_node_slice_pool(
        &self,
        name: &str,
    ) -> impl Future<Output = Result<Option<NodeSlicePool>>> + Send;
    /// The NodeSlicePool as this store read it within `max_age`, else read now. A long-lived
    /// store (the node agent's) answers a burst of ADDs from one read: assignments change
    /// rarely, a miss is re-read fresh by the caller, and a fresh read or a write of this store
    /// replaces what it remembers. Without memory, a plain read.
    fn get_node_slice_pool_recent(
        &self,
        name: &str,
        max_age: std::time::Duration,
    ) -> impl Future<Output = Result<Option<NodeSlicePool>>> + Send {
        let _ = max_age;
        self.get_node_slice_pool(name)
    }
    /// Replaces a NodeSlicePool if it is still at the resourceVersion in its metadata (a node
    /// taking a free slice); `Conflict` otherwise, `Missing` when it is gone.
    fn replace_node_slice_pool(
        &self,
        pool: &NodeSlicePool,
    ) -> impl Future<Output = Result<Write>> + Send;
    /// What an ADD needs to know of its pod (only read on networks that keep addresses).
    fn get_pod(
        &self,
        namespace: &str,
        name: &str,
    ) -> impl Future<Output = Result<Option<PodFacts>>> + Send;
    /// An IPAMClaim, its resourceVersion in its metadata.
    fn get_ipam_claim(
        &self,
        namespace: &str,
        name: &str,
    ) -> impl Future<Output = Result<Option<IPAMClaim>>> + Send;
    /// Writes an IPAMClaim's status if the claim is still at the resourceVersion in its metadata;
    /// `Conflict` otherwise, `Missing` when it is gone.
    fn write_ipam_claim_status(
        &self,
        claim: &IPAMClaim,
        status: &IPAMClaimStatus,
    ) -> impl Future<Output = Result<Write>> + Send;
}

/// What an ADD reads of its pod: whose it is, and what its network-selection elements ask for.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct PodFacts {
    pub uid: String,
    /// The `k8s.v1.cni.cncf.io/networks` annotation, as written.
    pub networks: Option<String>,
    /// The StatefulSet controlling the pod, when one does.
    pub statefulset: Option<String>,
}

impl PodFacts {
    /// The facts of a pod's metadata (its UID is [`crate::crd::pod::runtime_uid`]).
    pub fn of(meta: &k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta) -> PodFacts {
        let statefulset = meta
            .owner_references
            .iter()
            .flatten()
            .find(|o| {
                o.controller == Some(true)
                    && o.kind == "StatefulSet"
                    && o.api_version.starts_with("apps/")
            })
            .map(|o| o.name.clone());
        PodFacts {
            uid: crate::crd::pod::runtime_uid(meta),
            networks: meta
                .annotations
                .as_ref()
                .and_then(|a| a.get(NETWORKS_ANNOTATION))
                .cloned(),
            statefulset,
        }
    }
}

/// The pod annotation listing its network-selection elements (Multus).
pub const NETWORKS_ANNOTATION: &str = "k8s.v1.cni.cncf.io/networks";
