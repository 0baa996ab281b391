//! The cross-NAD check: ranges of NADs in one network whose windows overlap share addresses
//! through reservations, which is allowed but rarely meant, so it is a warning.

use std::collections::HashMap;
use std::sync::Arc;

use super::NadRange;
use crate::config::Problem;

/// How many of the overlapping NADs a warning names; the others are counted. One warning per
/// range, whatever the number of NADs: a thousand NADs sharing one range (one per namespace, the
/// common multi-tenant pattern) give each NAD one line, not a thousand.
pub const OVERLAP_EXAMPLES: usize = 3;

/// What one range overlaps in other NADs of its network: how many ranges, and the first few.
#[derive(Debug, Default)]
pub(super) struct Overlaps {
    pub(super) count: usize,
    /// `(namespace/name, range)` of the first [`OVERLAP_EXAMPLES`] found.
    pub(super) examples: Vec<(String, ipnet::IpNet)>,
}

/// One warning for every range of `mine` (the NAD `me`, `namespace/name`) whose window overlaps
/// ranges of other NADs in the same network. Ranges of `me` in the index (its stored version) do
/// not count.
pub fn overlap_warnings(mine: &[NadRange], me: &str, index: &RangeIndex) -> Vec<Problem> {
    mine.iter()
        .filter_map(|r| {
            let found = index.overlaps(r, me);
            (found.count > 0).then(|| overlap_problem(r, &found))
        })
        .collect()
}

/// How far back from a range, in window-start order, a query looks for example NADs; the count
/// is exact whatever this is.
const EXAMPLE_LOOKBACK: usize = 64;

/// The ranges of many NADs, for overlap questions: grouped by network name and family (only
/// ranges that share both can overlap) and sorted by window start and by window end, so that how
/// many ranges a window overlaps is two binary searches, and naming a few is a short walk. Built
/// in O(n log n); a query costs O(log n + examples).
#[derive(Debug, Default)]
pub struct RangeIndex {
    groups: HashMap<(Option<String>, bool), Group>,
}

#[derive(Debug, Default)]
struct Group {
    /// `(namespace/name, range)`, by window start.
    entries: Vec<(Arc<str>, NadRange)>,
    /// Window ends, sorted on their own.
    ends: Vec<u128>,
    /// Positions in `entries` of each NAD's ranges.
    by_nad: HashMap<Arc<str>, Vec<usize>>,
}

fn group_key(r: &NadRange) -> (Option<String>, bool) {
    (r.network_name.clone(), r.range.cidr().addr().is_ipv6())
}

impl RangeIndex {
    /// Indexes `(namespace/name, ranges)` of every NAD.
    pub fn build<'a>(nads: impl IntoIterator<Item = (&'a str, &'a [NadRange])>) -> RangeIndex {
        let mut groups: HashMap<(Option<String>, bool), Group> = HashMap::new();
        for (key, ranges) in nads {
            let key: Arc<str> = Arc::from(key);
            for r in ranges {
                let g = groups.entry(group_key(r)).or_default();
                g.entries.push((key.clone(), r.clone()));
            }
        }
        for g in groups.values_mut() {
            g.entries.sort_by_key(|(_, r)| r.range.window_bounds());
            g.ends = g
                .entries
                .iter()
                .map(|(_, r)| r.range.window_bounds().1)
                .collect();
            g.ends.sort_unstable();
            for (p, (key, _)) in g.entries.iter().enumerate() {
                g.by_nad.entry(key.clone()).or_default().push(p);
            }
        }
        RangeIndex { groups }
    }

    /// What `r` overlaps among the ranges of NADs other than `me`.
    pub(super) fn overlaps(&self, r: &NadRange, me: &str) -> Overlaps {
        let Some(g) = self.groups.get(&group_key(r)) else {
            return Overlaps::default();
        };
        let (lo, hi) = r.range.window_bounds();
        // Ranges starting at or before `hi`, less those that ended before `lo`...
        let started = g
            .entries
            .partition_point(|(_, o)| o.range.window_bounds().0 <= hi);
        let all = started - g.ends.partition_point(|&e| e < lo);
        // ... less `me`'s own.
        let own = g.by_nad.get(me).map_or(0, |ps| {
            ps.iter()
                .filter(|&&p| g.entries[p].1.range.windows_overlap(&r.range))
                .count()
        });
        let mut found = Overlaps {
            count: all - own,
            examples: Vec::new(),
        };
        // Examples: those starting inside the window all overlap; before it, look back a little.
        let first = g
            .entries
            .partition_point(|(_, o)| o.range.window_bounds().0 < lo);
        let inside = g.entries[first..]
            .iter()
            .take_while(|(_, o)| o.range.window_bounds().0 <= hi);
        let before = g.entries[..first].iter().rev().take(EXAMPLE_LOOKBACK);
        for (key, o) in inside.chain(before) {
            if found.examples.len() == OVERLAP_EXAMPLES || found.examples.len() == found.count {
                break;
            }
            if &**key != me && o.range.windows_overlap(&r.range) {
                found.examples.push((key.to_string(), o.range.cidr()));
            }
        }
        found
    }
}

fn overlap_problem(r: &NadRange, found: &Overlaps) -> Problem {
    let network = match &r.network_name {
        Some(n) => format!("network_name {n:?}"),
        None => "the default network (no network_name)".to_owned(),
    };
    let reason = match found.examples.as_slice() {
        [(other, theirs)] if found.count == 1 => format!(
            "overlaps range {theirs} of NetworkAttachmentDefinition {other} in {network}: the two share addresses through reservations"
        ),
        examples => {
            let named: Vec<String> = examples.iter().map(|(o, t)| format!("{o} ({t})")).collect();
            let more = found.count - examples.len();
            format!(
                "overlaps {} ranges of other NetworkAttachmentDefinitions in {network}: {}{}; they share addresses through reservations",
                found.count,
                named.join(", "),
                if more > 0 {
                    format!(" and {more} more")
                } else {
                    String::new()
                }
            )
        }
    };
    Problem::with_value(r.path.clone(), r.range.cidr(), reason)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::nad_check::tests::nad;
    use crate::nad_check::{CheckedNad, check_object};

    #[test]
    fn overlap_sweep_respects_network_names() {
        let mk = |name: &str, range: &str, net: Option<&str>| {
            let mut ipam = serde_json::json!({"type": "whereabouts", "range": range});
            if let Some(n) = net {
                ipam["network_name"] = n.into();
            }
            check_object(
                "f",
                1,
                &serde_json::from_str(&nad(name, &serde_json::json!({"ipam": ipam}).to_string()))
                    .unwrap(),
            )
            .unwrap()
        };
        let nads = vec![
            mk("a", "10.0.0.0/16", None),
            mk("b", "10.0.5.0/24", Some("blue")),
            mk("c", "10.1.0.0/24", None),
            mk("d", "10.0.200.0/24", None),
        ];
        let seen: Vec<(usize, usize, String)> = overlaps_of(&nads)
            .into_iter()
            .map(|(i, _, f)| (i, f.count, f.examples[0].0.clone()))
            .collect();
        assert_eq!(seen, [(0, 1, "ns/d".to_owned()), (3, 1, "ns/a".to_owned())]);
    }

    /// Each NAD's ranges queried against the index of all, as `findings` does: (NAD, range path,
    /// what it overlaps).
    fn overlaps_of(nads: &[CheckedNad]) -> Vec<(usize, String, Overlaps)> {
        let keys: Vec<String> = nads.iter().map(CheckedNad::key).collect();
        let index = RangeIndex::build(
            nads.iter()
                .zip(&keys)
                .map(|(n, k)| (k.as_str(), n.check.ranges.as_slice())),
        );
        let mut out = Vec::new();
        for (i, (n, k)) in nads.iter().zip(&keys).enumerate() {
            for r in &n.check.ranges {
                let f = index.overlaps(r, k);
                if f.count > 0 {
                    out.push((i, r.path.clone(), f));
                }
            }
        }
        out
    }

    /// The binary-search counts equal a brute-force count, over random layouts of ranges in two
    /// networks, with NADs of one and two ranges.
    #[test]
    fn overlap_counts_match_brute_force() {
        let mut rng = fastrand::Rng::with_seed(7);
        for _ in 0..200 {
            let nads: Vec<CheckedNad> = (0..rng.usize(1..40))
                .map(|k| {
                    let range = |rng: &mut fastrand::Rng| {
                        let prefix = rng.u8(26..31);
                        let base =
                            u32::from(std::net::Ipv4Addr::new(10, 0, 0, 0)) + rng.u32(0..64) * 8;
                        format!("{}/{prefix}", std::net::Ipv4Addr::from(base))
                    };
                    let mut ipam =
                        serde_json::json!({"type": "whereabouts", "range": range(&mut rng)});
                    if rng.bool() {
                        ipam["ipRanges"] = serde_json::json!([{"range": range(&mut rng)}]);
                    }
                    if rng.bool() {
                        ipam["network_name"] = "blue".into();
                    }
                    let text = nad(
                        &format!("n{k}"),
                        &serde_json::json!({"ipam": ipam}).to_string(),
                    );
                    check_object("f", k + 1, &serde_json::from_str(&text).unwrap()).unwrap()
                })
                .collect();
            let mut want = Vec::new();
            for (i, n) in nads.iter().enumerate() {
                for r in &n.check.ranges {
                    let count = nads
                        .iter()
                        .enumerate()
                        .filter(|(j, _)| *j != i)
                        .flat_map(|(_, o)| &o.check.ranges)
                        .filter(|o| {
                            o.network_name == r.network_name && o.range.windows_overlap(&r.range)
                        })
                        .count();
                    if count > 0 {
                        want.push((i, r.path.clone(), count));
                    }
                }
            }
            let mut got: Vec<(usize, String, usize)> = overlaps_of(&nads)
                .into_iter()
                .map(|(i, path, f)| {
                    assert_eq!(f.examples.len(), f.count.min(OVERLAP_EXAMPLES), "{f:?}");
                    (i, path, f.count)
                })
                .collect();
            want.sort();
            got.sort();
            assert_eq!(got, want);
        }
    }
}
