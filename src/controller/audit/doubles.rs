//! Addresses two pods may hold, which the audit reports: it cannot tell which pod should give
//! its address up, and a silent duplicate is the worst thing an IPAM can do.
//!
//! Two ways one address of one network ends up with two holders: entries of different pods in
//! two pools of overlapping ranges (their claims went missing), or an entry whose claim names
//! another pod (the claim was deleted by name and the address claimed again: upstream's DEL, seen
//! in the chaos tier). Both are reported once they last the grace period, which a writer mid-way
//! (a claim taken over before its entry is rewritten) never does.

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::time::Instant;

use super::{Auditor, Unguarded};
use crate::controller::Context;
use crate::controller::pools::PoolView;
use crate::crd::{IPAllocation, OverlappingRangeIPReservationSpec};
use crate::ipam::naming::reservation_name;
use crate::ownership::Owned;

/// An address (its claim's name) and the pods that hold it: `namespace/pod (interface)`, in
/// pools or in the claim.
pub type HeldTwice = (String, Vec<String>);

fn holder(podref: &str, ifname: &str) -> String {
    format!("{podref} ({ifname})")
}

/// The addresses of `pools` that two pods hold: by entries, or by an entry and its claim (among
/// `claims`, by name; not for pools of ranges that take none). The operator's audit and the
/// offline `audit` both decide with it.
pub fn held_twice(
    pools: &[PoolView],
    claims: &HashMap<&str, &OverlappingRangeIPReservationSpec>,
    unguarded: &Unguarded,
) -> Vec<HeldTwice> {
    let mut entries: BTreeMap<String, Vec<(&IPAllocation, bool)>> = BTreeMap::new();
    for p in pools {
        let guarded = !unguarded.covers(p);
        for (offset, e) in &p.entries {
            if let Some(ip) = p.ip(*offset) {
                let name = reservation_name(p.network_name.as_deref(), ip);
                entries.entry(name).or_default().push((e, guarded));
            }
        }
    }
    entries
        .into_iter()
        .filter_map(|(name, held)| {
            let mut holders: BTreeSet<String> = held
                .iter()
                .map(|(e, _)| holder(&e.podref, &e.ifname))
                .collect();
            let claim = claims.get(name.as_str());
            // A claim names another pod when it names none of the entries' pods; one of the
            // same IPAMClaim is its holder's, whichever pod it names this moment.
            let foreign = |c: &&&OverlappingRangeIPReservationSpec| {
                held.iter().all(|(e, _)| e.podref != c.podref)
                    && held
                        .iter()
                        .any(|(e, guarded)| *guarded && !c.same_claim(*e))
            };
            if let Some(c) = claim.filter(foreign) {
                holders.insert(holder(&c.podref, &c.ifname));
            }
            (holders.len() > 1).then(|| (name, holders.into_iter().collect()))
        })
        .collect()
}

/// Addresses held twice named in the log at each audit; the rest are counted in one line.
const LOGGED_PER_AUDIT: usize = 20;

impl Auditor {
    /// Logs every address that two pods have held for the grace period, at every audit while
    /// they do; how many there are.
    pub(super) fn report_held_twice(
        &mut self,
        ctx: &Context,
        pools: &[PoolView],
        unguarded: &Unguarded,
        now: Instant,
    ) -> usize {
        let cached = ctx.caches.reservations.state();
        let claims = cached
            .iter()
            .filter_map(|r| Some((r.metadata.name.as_deref()?, &r.spec)))
            .collect();
        let found = held_twice(pools, &claims, unguarded);
        let due = self.doubles.observe(now, found, ctx.opts.stale_grace);
        // Each is a real duplicate, but thousands of lines every audit would bury the first ones:
        // the gauge has the count, the log names the first few.
        for (address, holders) in due.iter().take(LOGGED_PER_AUDIT) {
            tracing::error!(
                reservation = %address,
                ?holders,
                "two pods hold one address: delete one of them (its replacement gets another address)"
            );
        }
        if due.len() > LOGGED_PER_AUDIT {
            tracing::error!(
                more = due.len() - LOGGED_PER_AUDIT,
                "more addresses are held by two pods than are named above (see whereabouts_addresses_held_twice)"
            );
        }
        due.len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::crd::{IPPool, IPPoolSpec};

    fn pool(name: &str, range: &str, entries: &[(u128, &str)]) -> PoolView {
        let allocations = entries
            .iter()
            .map(|(o, pod)| {
                let e = IPAllocation {
                    id: format!("c-{pod}"),
                    podref: format!("ns/{pod}"),
                    ifname: "net1".into(),
                    ..Default::default()
                };
                (o.to_string(), e)
            })
            .collect();
        let spec = IPPoolSpec {
            range: range.into(),
            allocations,
        };
        PoolView::from_pool(&IPPool::new(name, spec)).unwrap()
    }

    fn claim(pod: &str) -> OverlappingRangeIPReservationSpec {
        OverlappingRangeIPReservationSpec {
            podref: format!("ns/{pod}"),
            ifname: "net1".into(),
            ..Default::default()
        }
    }

    /// Entries of two pods in overlapping pools, and an entry whose claim names another pod, are
    /// reported with their holders; an entry with its own claim, or with none, is not.
    #[test]
    fn an_address_of_two_pods_is_reported_with_both() {
        let a = pool(
            "10.0.0.0-23",
            "10.0.0.0/23",
            &[(1, "a"), (2, "b"), (3, "c")],
        );
        let b = pool("10.0.0.0-22", "10.0.0.0/22", &[(1, "x")]);
        let (a1, y2) = (claim("a"), claim("y"));
        let claims = HashMap::from([("10.0.0.1", &a1), ("10.0.0.2", &y2)]);
        let found = held_twice(&[a, b], &claims, &Unguarded::default());
        assert_eq!(
            found,
            vec![
                (
                    "10.0.0.1".into(),
                    vec!["ns/a (net1)".into(), "ns/x (net1)".into()]
                ),
                (
                    "10.0.0.2".into(),
                    vec!["ns/b (net1)".into(), "ns/y (net1)".into()]
                ),
            ]
        );
    }
}
