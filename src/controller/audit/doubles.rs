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

use kube::ResourceExt;

use super::{Auditor, Unguarded};
use crate::controller::Context;
use crate::controller::pools::PoolView;
use crate::crd::{IPAllocation, OverlappingRangeIPReservation};
use crate::ipam::naming::reservation_name;
use crate::ownership::Owned;

/// An address (its claim's name) and the pods that hold it: `namespace/pod (interface)`, in
/// pools or in the claim.
pub type HeldTwice = (String, Vec<String>);

fn holder(podref: &str, ifname: &str) -> String {
    format!("{podref} ({ifname})")
}

/// The addresses of `pools` that two pods hold: by entries, or by an entry and its claim (among
/// `claims`; not for pools of ranges that take none).
pub fn held_twice(
    pools: &[PoolView],
    claims: &[std::sync::Arc<OverlappingRangeIPReservation>],
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
    let claims: HashMap<String, &OverlappingRangeIPReservation> =
        claims.iter().map(|r| (r.name_any(), r.as_ref())).collect();
    entries
        .into_iter()
        .filter_map(|(name, held)| {
            let mut holders: BTreeSet<String> = held
                .iter()
                .map(|(e, _)| holder(&e.podref, &e.ifname))
                .collect();
            let claim = claims.get(&name).map(|r| &r.spec);
            // A claim of the same IPAMClaim is its holder's, whichever pod it names this moment.
            if let Some(c) = claim.filter(|c| held.iter().any(|(e, g)| *g && !c.same_claim(*e))) {
                holders.insert(holder(&c.podref, &c.ifname));
            }
            (holders.len() > 1).then(|| (name, holders.into_iter().collect()))
        })
        .collect()
}

impl Auditor {
    /// Logs every address that two pods have held for the grace period, at every audit while
    /// they do; how many there are.
    pub(super) fn held_twice(&mut self, ctx: &Context, pools: &[PoolView], now: Instant) -> usize {
        let nads = ctx.caches.nads.state();
        let unguarded = Unguarded::of(nads.iter().map(|n| n.as_ref()));
        let found = held_twice(pools, &ctx.caches.reservations.state(), &unguarded);
        let due = self.doubles.observe(now, found, ctx.opts.stale_grace);
        for (address, holders) in &due {
            tracing::error!(
                reservation = %address,
                ?holders,
                "two pods hold one address: delete one of them (its replacement gets another address)"
            );
        }
        due.len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::crd::{IPPool, IPPoolSpec, OverlappingRangeIPReservationSpec};
    use std::sync::Arc;

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

    fn claim(name: &str, pod: &str) -> Arc<OverlappingRangeIPReservation> {
        let spec = OverlappingRangeIPReservationSpec {
            podref: format!("ns/{pod}"),
            ifname: "net1".into(),
            ..Default::default()
        };
        Arc::new(OverlappingRangeIPReservation::new(name, spec))
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
        let claims = [claim("10.0.0.1", "a"), claim("10.0.0.2", "y")];
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
