//! Reservations as claims: an address is claimed by creating its reservation object (atomic
//! create-or-409) before the pool records it, and the claims a pool does not record yet are the
//! pending work of whoever writes the pool next.

use std::net::IpAddr;
use std::time::Duration;

use super::{Engine, Owned, Owner};
use crate::crd::IPAllocation;
use crate::store::{Datastore, Listing, Made, Pool, Reservation, StoreError, Write};

/// How long a claim may wait for its pool entry while its writer is still at work. An ADD records
/// its claim, or rolls it back, within its deadline and rollback budget of writing it
/// (`cni::ADD_DEADLINE` + `cni::ROLLBACK_BUDGET`, checked there at compile time); a writer that
/// finishes a claim written earlier (by an earlier attempt of its container) renews it first
/// ([`Datastore::renew_claim`]), and an agent's group that runs longer than a third of this hands
/// its claims to that path. So the audit, which sweeps no claim written within this long (plus a
/// margin for clocks), never deletes a claim that a writer may still record.
pub const CLAIM_LIFETIME: Duration = Duration::from_secs(120);

/// The outcome of trying to claim an address.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Claim {
    /// Ours, with the reservation's UID (new, or left by an earlier attempt of this attachment)
    /// and, when this claimant made it, its version.
    Ours(Made),
    /// Lost to a claimant that is probably still racing us: spread the next pick.
    Race,
    /// Held steadily by another pod (an overlapping range): just try the next address.
    Occupied,
    /// Lost, not read back: the next claims list tells `Race` from `Occupied`.
    Lost,
}

/// A claim of the pool whose entry the pool does not hold yet.
pub struct PendingClaim {
    pub offset: u128,
    pub uid: String,
    pub entry: IPAllocation,
}

impl PendingClaim {
    /// Made by this very container for this interface (an earlier attempt of the same ADD):
    /// [`Owned::same_attachment`].
    pub fn is_of(&self, who: &Owner) -> bool {
        self.entry.same_attachment(who)
    }
}

impl<S: Datastore> Engine<'_, S> {
    /// Claims `ip` for `who`. With `verify`, a lost create is read back to tell a racing claimant
    /// from a steady holder, and a reservation of the same pod interface under an earlier
    /// container is taken over.
    pub async fn claim(&self, ip: IpAddr, who: &Owner, verify: bool) -> Result<Claim, StoreError> {
        let name = self.target.reservation(ip);
        for _ in 0..3 {
            if let (Write::Done, made) = self
                .store
                .create_reservation(&name, &who.claim(), &self.target.pool, ip)
                .await?
            {
                return Ok(Claim::Ours(made));
            }
            if !verify {
                return Ok(Claim::Lost);
            }
            match self.store.get_reservation(&name).await? {
                Some(r) if who.may_take_over(&r.spec) => {
                    return self.take_over(&name, &r, who).await;
                }
                Some(r) if r.is_recent() => return Ok(Claim::Race),
                Some(_) => return Ok(Claim::Occupied),
                None => continue, // released between our create and get: try again
            }
        }
        Ok(Claim::Race)
    }

    /// Claims `ip` again for an attachment whose entry the pool shows: `None` when it is not
    /// ours to take, else whether taking it withdrew a release that a cut-off DEL of the
    /// attachment had announced, which a sweep may have listed (see [`Engine::reuse`]).
    pub(super) async fn claim_again(
        &self,
        ip: IpAddr,
        who: &Owner,
    ) -> Result<Option<bool>, StoreError> {
        let name = self.target.reservation(ip);
        // Read first: the attachment's own reservation nearly always exists, and its labels at
        // the version the renewal is conditional on tell whether a release is being withdrawn.
        if let Some(r) = self.store.get_reservation(&name).await?
            && who.may_take_over(&r.spec)
        {
            let ours = matches!(self.take_over(&name, &r, who).await?, Claim::Ours(_));
            return Ok(ours.then_some(r.releasing));
        }
        // Gone, or another pod's: claim as any writer does. What this replaced is not known
        // here, so count it as a withdrawn release.
        let ours = matches!(self.claim(ip, who, true).await?, Claim::Ours(_));
        Ok(ours.then_some(true))
    }

    /// This pod's interface holds the reservation: ours if under this container; under an
    /// earlier container (a StatefulSet replacement, a sandbox re-created) it is made ours at the
    /// version read, so that the earlier container's DEL, which deletes only the version it saw,
    /// leaves it alone.
    async fn take_over(
        &self,
        name: &str,
        r: &Reservation,
        who: &Owner,
    ) -> Result<Claim, StoreError> {
        if r.spec.containerid == who.container_id {
            // An earlier attempt's claim: renewed before it is recorded (see CLAIM_LIFETIME).
            return Ok(
                match self
                    .store
                    .renew_claim(name, &r.uid, &r.resource_version)
                    .await?
                {
                    Write::Done => Claim::Ours(Made {
                        uid: r.uid.clone(),
                        ..Made::default()
                    }),
                    _ => Claim::Race,
                },
            );
        }
        let spec = who.claim();
        Ok(
            match self
                .store
                .take_over_reservation(name, &r.uid, &r.resource_version, &spec)
                .await?
            {
                Write::Done => Claim::Ours(Made {
                    uid: r.uid.clone(),
                    ..Made::default()
                }),
                _ => Claim::Race,
            },
        )
    }

    /// Deletes this claim of `ip` (only the reservation object with `uid`).
    pub async fn unclaim(&self, ip: IpAddr, uid: &str) -> Result<(), StoreError> {
        self.store
            .delete_reservation(&self.target.reservation(ip), uid, None)
            .await
            .map(|_| ())
    }

    /// The reservation `name` when it is `entry`'s claim (see
    /// [`Owned::same_claimant`]): the one a release of that entry may
    /// delete, never another pod's claim on the same address (of an overlapping range), nor one a
    /// new container of the pod has taken over.
    pub async fn reservation_of(
        &self,
        name: &str,
        entry: &IPAllocation,
    ) -> Result<Option<Reservation>, StoreError> {
        Ok(self
            .store
            .get_reservation(name)
            .await?
            .filter(|r| r.spec.same_claimant(entry)))
    }

    /// Deletes the claims of `who`'s container and interface that the pool does not record: an
    /// ADD of it claimed and was cut off before it recorded (its plugin or the agent killed, its
    /// deadline passed). A DEL is the container's last word (its retry is a new sandbox, with a
    /// new container id), so nothing of it is left for the audit's sweep; and no writer turn
    /// writes the entry back ([`super::announce::withdraw`]). Only recent claims are listed (see
    /// [`crate::store::CLAIMED_LABEL`]): an older one is the sweep's.
    pub async fn withdraw_claims(&self, pool: &Pool, who: &Owner) -> Result<(), StoreError> {
        if !self.target.overlapping {
            return Ok(());
        }
        let pending = self.pending_claims(pool, None, Listing::Consistent).await?;
        let mine: Vec<PendingClaim> = pending.into_iter().filter(|p| p.is_of(who)).collect();
        super::announce::withdraw(self.store, self.target, &mine, &[who]).await
    }

    /// This pool's claims that the pool does not hold yet (other than `own`), listed as fresh as
    /// `listing` asks.
    pub async fn pending_claims(
        &self,
        pool: &Pool,
        own: Option<u128>,
        listing: Listing,
    ) -> Result<Vec<PendingClaim>, StoreError> {
        let claims = match self.store.claims_of(&self.target.pool, listing).await {
            Ok(claims) => claims,
            // Rights from before claims were listed: each claimant then records only itself.
            Err(e) if e.kind() == "forbidden" => {
                tracing::warn!(error = %e, "cannot list claims (RBAC: list overlappingrangeipreservations); recording only our own");
                Vec::new()
            }
            Err(e) => return Err(e),
        };
        Ok(claims
            .into_iter()
            .filter_map(|c| {
                let offset = self.target.range.offset_of(c.ip)?;
                let entry = Owner::of_claim(&c.spec).entry();
                let pending = Some(offset) != own && !pool.allocations.contains_key(&offset);
                pending.then_some(PendingClaim {
                    offset,
                    uid: c.uid,
                    entry,
                })
            })
            .collect())
    }
}
