//! Claim time and release announcements on reservations: what a claims list shows, and how
//! fresh it must be.

#[cfg(doc)]
use super::Datastore;
use super::now_secs;

/// When a reservation was made, in [`CLAIM_BUCKET_SECONDS`] buckets since the epoch. Claims still
/// waiting for their pool entry are seconds old, so listing only the last few buckets returns
/// them and not the pool's thousands of settled reservations: the cost of a claims list stays
/// proportional to the claims in flight, not to the size of the pool. A node whose clock is off
/// by more than a bucket only has its claims recorded by itself instead of by a turn holder.
pub const CLAIMED_LABEL: &str = "whereabouts.cni.cncf.io/claimed";
pub const CLAIM_BUCKET_SECONDS: i64 = 30;
/// When a claim was last renewed (seconds since the epoch; see [`Datastore::renew_claim`]).
pub const RENEWED_ANNOTATION: &str = "whereabouts.cni.cncf.io/renewed";
/// Set on a reservation (to the claim bucket of the moment) by a DEL about to remove its entry:
/// a turn holder then removes it together with every other announced release in one write, and
/// no claims list mistakes it for a claim still waiting to be recorded.
pub const RELEASING_LABEL: &str = "whereabouts.cni.cncf.io/releasing";
/// The claim bucket of a moment, in seconds since the epoch.
pub fn claim_bucket(secs: i64) -> i64 {
    secs.div_euclid(CLAIM_BUCKET_SECONDS)
}

/// The buckets a claims list asks for: the current one and its neighbours (clock skew, and claims
/// made just before the bucket turned).
pub fn recent_buckets(now_secs: i64) -> [i64; 3] {
    let b = claim_bucket(now_secs);
    [b - 1, b, b + 1]
}

/// Whether some claims list may still show a reservation claimed in `bucket`: one of the recent
/// buckets of a lister whose clock runs up to two buckets behind ours. A releaser announces such
/// a reservation ([`Datastore::mark_releasing`]) before it removes the entry, or a writer turn
/// that lists it between the removal and the reservation's deletion records it again as a claim
/// still waiting for its entry. Older ones (most releases) need no announcement.
pub fn listable_claim(bucket: Option<i64>) -> bool {
    bucket.is_some_and(|b| b >= claim_bucket(now_secs()) - 3)
}

/// How fresh a claims list must be.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Listing {
    /// From the API server's watch cache, which may lag the last writes: enough to pick an
    /// address (a claim missed there only loses a create) or to count contenders.
    Cached,
    /// At least as new as every write that completed before it was asked (a LIST without a
    /// resourceVersion): for a writer that records the claims it lists. Listed after the pool
    /// read its write is conditional on, it shows every release announced before that version.
    Consistent,
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every bucket that a lister whose clock runs up to two buckets behind (or any amount ahead)
    /// still asks for is announced by a releaser; an older one, that nobody lists, is not.
    #[test]
    fn a_claim_is_announced_while_any_lister_may_still_list_it() {
        let now = now_secs();
        for behind in 0..=2 {
            for bucket in recent_buckets(now - behind * CLAIM_BUCKET_SECONDS) {
                assert!(
                    listable_claim(Some(bucket)),
                    "{behind} bucket(s) behind: {bucket}"
                );
            }
        }
        assert!(
            listable_claim(Some(claim_bucket(now) + 5)),
            "a lister ahead of us"
        );
        assert!(!listable_claim(Some(claim_bucket(now) - 5)), "an old claim");
        assert!(
            !listable_claim(None),
            "upstream's reservations are never listed"
        );
    }
}
