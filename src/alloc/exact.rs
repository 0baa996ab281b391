//! A requested address (`runtimeConfig.ips`, `args.cni.ips`, an IPAMClaim's `status.ips`): that
//! one address, claimed and recorded as any other so that no dynamic ADD can hand it out, or an
//! error naming why not. Nothing is taken when it fails.

use std::net::IpAddr;

use super::add::Attempt;
use super::claim::{Claim, PendingClaim};
use super::pool::ObjectRoom;
use super::{AllocError, Allocated, Engine, Owned, Owner};
use crate::crd::IPAllocation;
use crate::retry::{LOST_RACE, MAX_CONFLICTS};
use crate::store::{Datastore, Listing};

/// Who holds an address, in the words of an error.
fn holder_words(pool: &str, e: &IPAllocation) -> String {
    let mut words = format!("is held by pod {}", e.podref);
    if !e.ifname.is_empty() {
        words.push_str(&format!(" interface {}", e.ifname));
    }
    if !e.ipamclaimref.is_empty() {
        words.push_str(&format!(" for IPAMClaim {}", e.ipamclaimref));
    }
    words + &format!(" (pool {pool})")
}

impl<S: Datastore> Engine<'_, S> {
    /// Allocates exactly `ip` to `who`: returns it again when `who` already holds it, fails with
    /// [`AllocError::Unavailable`] when it lies outside the target's window or another
    /// attachment holds it.
    pub async fn allocate_exact(self, ip: IpAddr, who: &Owner) -> Result<Allocated, AllocError> {
        let unavailable = |why: String| AllocError::Unavailable { ip, why };
        if let Some(why) = self.target.range.refusal(ip) {
            return Err(unavailable(why));
        }
        let offset = self.target.range.offset_of(ip).expect("inside the range");
        let mut conflicts = 0;
        while conflicts < MAX_CONFLICTS {
            let pool = self.ensure_pool(false).await?;
            // The request is the truth: an entry this attachment (or its claim) holds at another
            // address is let go (the request changed, or an ADD that lost the race to record a
            // claim's first addresses left it), then the requested one is taken.
            let mut strays: Vec<(u128, IPAllocation)> = who
                .claim_entries(&pool)
                .chain(who.held_entry(&pool))
                .filter(|(o, _)| *o != offset)
                .map(|(o, e)| (o, e.clone()))
                .collect();
            if !strays.is_empty() {
                strays.sort_by_key(|(o, _)| *o);
                strays.dedup_by_key(|(o, _)| *o);
                self.release_entries(&strays).await?;
                conflicts += 1;
                continue;
            }
            if let Some((_, entry)) = who.held_entry(&pool) {
                match self.reuse(&pool, offset, entry, who).await? {
                    Some(ip) => return Ok(Allocated { ip, conflicts }),
                    None => {
                        conflicts += 1;
                        continue;
                    }
                }
            }
            if let Some(entry) = pool.allocations.get(&offset) {
                return Err(unavailable(holder_words(&pool.name, entry)));
            }
            let pending = if self.target.overlapping {
                self.pending_claims(&pool, None, Listing::Cached).await?
            } else {
                Vec::new()
            };
            let claimed = match pending.iter().find(|p| p.offset == offset) {
                Some(p) if p.is_of(who) => Some(p.uid.clone()),
                // Another pod of the same claim is recording it right now (a live migration's
                // two pods at once): once recorded, it is reused above.
                Some(p) if p.entry.same_claim(who) => {
                    conflicts += 1;
                    LOST_RACE.pause(conflicts).await;
                    continue;
                }
                Some(p) => return Err(unavailable(holder_words(&pool.name, &p.entry))),
                None => None,
            };
            if let Some(full) =
                ObjectRoom::of(self.target, &pool).full(&who.entry(), pending.len() + 1)
            {
                return Err(full);
            }
            let contenders = others(&pending, who);
            let attempt = Attempt {
                offset,
                claimed,
                verify: true,
            };
            match self
                .claim_and_record(&pool, attempt, who, contenders)
                .await?
            {
                Ok(ip) => return Ok(Allocated { ip, conflicts }),
                Err(Claim::Occupied) => return Err(self.held_elsewhere(ip, who).await?),
                Err(_) => {
                    conflicts += 1;
                    LOST_RACE.pause(conflicts).await;
                }
            }
        }
        Err(AllocError::TooManyConflicts {
            pool: self.target.pool.clone(),
            attempts: conflicts,
        })
    }

    /// The error for `ip` steadily reserved by another attachment (an overlapping range's pod).
    async fn held_elsewhere(&self, ip: IpAddr, who: &Owner) -> Result<AllocError, AllocError> {
        let name = self.target.reservation(ip);
        let why = match self.store.get_reservation(&name).await? {
            Some(r) if !who.may_take_over(&r.spec) => format!(
                "is reserved by pod {} interface {} (overlappingrangeipreservation {name})",
                r.spec.podref, r.spec.ifname
            ),
            _ => {
                format!("is reserved by another attachment (overlappingrangeipreservation {name})")
            }
        };
        Ok(AllocError::Unavailable { ip, why })
    }
}

fn others(pending: &[PendingClaim], who: &Owner) -> usize {
    pending.iter().filter(|p| !p.is_of(who)).count()
}
