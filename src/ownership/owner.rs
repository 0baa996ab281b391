//! The one model of who holds an address: an [`Owner`] (container, pod, interface, pod UID,
//! holder), recorded alike by a CNI request, a pool entry and a reservation (claim), and a few
//! named comparisons between any two of them ([`Owned`]). Every writer and every releaser decides
//! through these comparisons; none compares fields itself.
//!
//! A field an older writer did not record is empty and means "unknown": upstream writes no pod UID,
//! very old upstream versions no interface, old upstream reservations no container. Each
//! comparison says how it treats an unknown field.
//!
//! | comparison | asks | used by |
//! |---|---|---|
//! | [`Owned::same_attachment`] | one container's interface (CNI's key) | DEL (`alloc::release`, the agent's group release), the withdrawal of a cut-off ADD's claims, CHECK, CNI GC's valid attachments |
//! | [`Owned::same_container`] | the container of the pod | every conditional entry write: group commit (`alloc::turn`), the agent's groups, removals (`alloc::release`) |
//! | [`Owned::same_claimant`] | the pod, the container where known | which reservation a release deletes (`alloc::claim`, `controller::cleanup`), the audit's foreign-claim check |
//! | [`Owned::same_pod_interface`] | the pod's interface, any container | ADD's idempotency (`Owner::held_entry`), taking over a claim |
//! | [`Owned::same_claim`] | the IPAMClaim | ADD of a claim's next pod, claimed entries |
//! | [`Owned::may_rewrite`] | the writer's node, or the same holder | ADD's idempotency and take-over (never another node's attachment), a turn holder's removal of announced releases; the node-limits admission policy says the same to a node's credentials |
//! | [`Owned::incarnation`] | the pod's UID | pod cleanup (`belongs_to`), CNI GC and the audit (`is_stale`), held addresses (`is_pod_gone`) |
//!
//! `tests.rs` holds each writer's owner (our plugin, the agent, upstream's versions, a retried
//! sandbox, a StatefulSet replacement, a DEL without a pod) against each comparison.

use crate::crd::{IPAllocation, OverlappingRangeIPReservationSpec};

/// Who an address is for: one container interface of one pod, and what keeps the address past
/// that pod, if anything.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Owner {
    /// `CNI_CONTAINERID`: the sandbox. A runtime's retry of a failed ADD comes with a new one.
    pub container_id: String,
    /// The pod interface (`CNI_IFNAME`, `net1`).
    pub ifname: String,
    /// `<namespace>/<name>`; empty when the runtime did not pass the pod (DEL may omit it).
    pub podref: String,
    /// `K8S_POD_UID`: tells two pods of one name apart (a StatefulSet's replacement).
    pub pod_uid: String,
    /// The node the attachment is on (empty where unknown: the operator, an old record).
    pub node: String,
    /// What keeps the address past this pod, if anything.
    pub holder: Holder,
}

/// What holds an address beyond the pod it was given to. A held entry is not released by DEL,
/// CNI GC or the operator's pod cleanup; the operator frees it when its holder goes away.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub enum Holder {
    /// Nothing: the address lives and dies with the attachment.
    #[default]
    Pod,
    /// The StatefulSet (its name) whose pod this is, on a `sticky_statefulset` network: the
    /// ordinal keeps the address while the StatefulSet has it.
    StatefulSet(String),
    /// An IPAMClaim, `<namespace>/<name>`: every pod that refers to it gets its address.
    Claim(String),
}

/// Whether two owners are the same incarnation of a pod (see [`Owned::incarnation`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Incarnation {
    /// The same pod name and the same recorded UID.
    Same,
    /// Another pod: another name, or the same name with another UID (a replacement).
    Other,
    /// The same name, and one side recorded no UID: only other evidence (the pod's Multus
    /// network-status) can tell.
    Unknown,
}

impl Holder {
    fn of(claim: &str, statefulset: &str) -> Holder {
        if !claim.is_empty() {
            Holder::Claim(claim.to_owned())
        } else if !statefulset.is_empty() {
            Holder::StatefulSet(statefulset.to_owned())
        } else {
            Holder::Pod
        }
    }

    /// The holder an entry records.
    pub fn of_entry(entry: &IPAllocation) -> Holder {
        Holder::of(&entry.ipamclaimref, &entry.statefulset)
    }

    fn statefulset(&self) -> &str {
        match self {
            Holder::StatefulSet(name) => name,
            _ => "",
        }
    }
}

/// Equal, or unknown on either side.
fn agree(a: &str, b: &str) -> bool {
    a.is_empty() || b.is_empty() || a == b
}

impl Owner {
    /// The owner a reservation (a claim) records.
    pub fn of_claim(spec: &OverlappingRangeIPReservationSpec) -> Owner {
        Owner {
            container_id: spec.containerid.clone(),
            ifname: spec.ifname.clone(),
            podref: spec.podref.clone(),
            pod_uid: spec.poduid.clone(),
            node: spec.node.clone(),
            holder: Holder::of(&spec.ipamclaimref, &spec.statefulset),
        }
    }

    /// The pool entry recording this owner.
    pub fn entry(&self) -> IPAllocation {
        IPAllocation {
            id: self.container_id.clone(),
            podref: self.podref.clone(),
            ifname: self.ifname.clone(),
            poduid: self.pod_uid.clone(),
            node: self.node.clone(),
            ipamclaimref: Owned::claim_ref(self).to_owned(),
            statefulset: self.holder.statefulset().to_owned(),
        }
    }

    /// The reservation (claim) recording this owner.
    pub fn claim(&self) -> OverlappingRangeIPReservationSpec {
        OverlappingRangeIPReservationSpec::from(&self.entry())
    }
}

/// A live pod as the API server has it: its name and runtime UID (see
/// [`crate::crd::pod::runtime_uid`]), to compare an entry's pod with.
#[derive(Debug, Clone, Copy)]
pub struct LivePod<'a> {
    pub podref: &'a str,
    pub uid: &'a str,
}

/// Anything that records an owner: a request's [`Owner`], a pool entry, a reservation, a live
/// pod. The comparisons are written once, here, for any two of them, and copy no field (a DEL of
/// an agent's group compares every entry of a pool of thousands).
pub trait Owned {
    fn container_id(&self) -> &str;
    fn ifname(&self) -> &str;
    fn podref(&self) -> &str;
    fn pod_uid(&self) -> &str;
    /// The IPAMClaim holding the address (`<namespace>/<name>`), empty when none does.
    fn claim_ref(&self) -> &str;
    /// The StatefulSet whose ordinal holds the address, empty when none does.
    fn statefulset(&self) -> &str;
    /// The node of the attachment, empty where unknown.
    fn node(&self) -> &str;

    /// The same attachment in CNI's sense: one container's interface (`CNI_CONTAINERID` and
    /// `CNI_IFNAME`; the pod is not part of the key, and a DEL may omit it). An entry without an
    /// interface (very old upstream versions) counts as its container's only one. What a DEL
    /// releases, which unrecorded claim an ADD's earlier attempt left, what CHECK and CNI GC find.
    fn same_attachment(&self, other: &(impl Owned + ?Sized)) -> bool {
        !self.container_id().is_empty()
            && self.container_id() == other.container_id()
            && agree(self.ifname(), other.ifname())
    }

    /// The same container of the same pod, whatever interface each recorded: what a conditional
    /// removal or replacement of an entry holds on (the JSON Patch `test` of `id` and `podref`),
    /// so that an address re-bound to a newer container is never released by the older one.
    fn same_container(&self, other: &(impl Owned + ?Sized)) -> bool {
        self.container_id() == other.container_id() && self.podref() == other.podref()
    }

    /// The same pod, and the same container where both recorded one (old upstream reservations
    /// name the pod alone): which reservation is the claim of an entry, the one its release may
    /// delete. One that a newer container of the pod took over is the newer attachment's.
    fn same_claimant(&self, other: &(impl Owned + ?Sized)) -> bool {
        self.podref() == other.podref() && agree(self.container_id(), other.container_id())
    }

    /// The same interface of the same pod, in any of its containers (a sandbox re-created, a
    /// StatefulSet replacement): the address an ADD returns again, and whose reservation a new
    /// container takes over.
    fn same_pod_interface(&self, other: &(impl Owned + ?Sized)) -> bool {
        self.podref() == other.podref() && self.ifname() == other.ifname()
    }

    /// Held by the same IPAMClaim: every pod of a claim gets the claim's address.
    fn same_claim(&self, other: &(impl Owned + ?Sized)) -> bool {
        !self.claim_ref().is_empty() && self.claim_ref() == other.claim_ref()
    }

    /// Held by the same holder, which moves with its pod to whichever node runs it: the same
    /// IPAMClaim, or the same StatefulSet ordinal (the same StatefulSet and pod name).
    fn same_holder(&self, other: &(impl Owned + ?Sized)) -> bool {
        self.same_claim(other)
            || (!self.statefulset().is_empty()
                && self.statefulset() == other.statefulset()
                && self.podref() == other.podref())
    }

    /// Whether this owner's node may remove or rewrite what `other` recorded: a record of its own
    /// node or of no known node (upstream's entries, ours from before nodes were recorded), or
    /// one held by the same holder ([`Owned::same_holder`]). The same rule as the node-limits
    /// admission policy puts on a node's credentials (`config/rbac/node-limits.yaml`): a node
    /// never takes over an attachment of another node, which may still be running there (a
    /// partitioned node's pod, force-deleted and re-created under its name elsewhere). A writer
    /// that knows no node (the operator) may rewrite anything.
    fn may_rewrite(&self, other: &(impl Owned + ?Sized)) -> bool {
        agree(self.node(), other.node()) || self.same_holder(other)
    }

    /// Whether a reservation of `other` is this owner's to take over: the same claim, or the same
    /// pod interface on a node this owner may rewrite ([`Owned::may_rewrite`]).
    fn may_take_over(&self, other: &(impl Owned + ?Sized)) -> bool {
        self.same_claim(other) || (self.same_pod_interface(other) && self.may_rewrite(other))
    }

    /// Whether `other` is the same incarnation of this owner's pod: the UID decides where both
    /// recorded one.
    fn incarnation(&self, other: &(impl Owned + ?Sized)) -> Incarnation {
        if self.podref() != other.podref() {
            Incarnation::Other
        } else if self.pod_uid().is_empty() || other.pod_uid().is_empty() {
            Incarnation::Unknown
        } else if self.pod_uid() == other.pod_uid() {
            Incarnation::Same
        } else {
            Incarnation::Other
        }
    }
}

impl Owned for Owner {
    fn container_id(&self) -> &str {
        &self.container_id
    }
    fn ifname(&self) -> &str {
        &self.ifname
    }
    fn podref(&self) -> &str {
        &self.podref
    }
    fn pod_uid(&self) -> &str {
        &self.pod_uid
    }
    fn claim_ref(&self) -> &str {
        match &self.holder {
            Holder::Claim(claim) => claim,
            _ => "",
        }
    }
    fn statefulset(&self) -> &str {
        self.holder.statefulset()
    }
    fn node(&self) -> &str {
        &self.node
    }
}

impl Owned for IPAllocation {
    fn container_id(&self) -> &str {
        &self.id
    }
    fn ifname(&self) -> &str {
        &self.ifname
    }
    fn podref(&self) -> &str {
        &self.podref
    }
    fn pod_uid(&self) -> &str {
        &self.poduid
    }
    fn claim_ref(&self) -> &str {
        &self.ipamclaimref
    }
    fn statefulset(&self) -> &str {
        &self.statefulset
    }
    fn node(&self) -> &str {
        &self.node
    }
}

impl Owned for OverlappingRangeIPReservationSpec {
    fn container_id(&self) -> &str {
        &self.containerid
    }
    fn ifname(&self) -> &str {
        &self.ifname
    }
    fn podref(&self) -> &str {
        &self.podref
    }
    fn pod_uid(&self) -> &str {
        &self.poduid
    }
    fn claim_ref(&self) -> &str {
        &self.ipamclaimref
    }
    fn statefulset(&self) -> &str {
        &self.statefulset
    }
    fn node(&self) -> &str {
        &self.node
    }
}

impl Owned for LivePod<'_> {
    fn container_id(&self) -> &str {
        ""
    }
    fn ifname(&self) -> &str {
        ""
    }
    fn podref(&self) -> &str {
        self.podref
    }
    fn pod_uid(&self) -> &str {
        self.uid
    }
    fn claim_ref(&self) -> &str {
        ""
    }
    fn statefulset(&self) -> &str {
        ""
    }
    fn node(&self) -> &str {
        ""
    }
}
