//! How big an IPPool is as stored, and how big it may grow.
//!
//! An IPPool keeps every allocation of its range in one object, and etcd refuses a request larger
//! than its `--max-request-bytes` (1.5 MiB by default): the API server then answers every write of
//! the pool with 500 "etcdserver: request is too large". Measured on the local control plane
//! (`bench/pool_limit.py`, docs/reliability.md): a pool took writes up to an object of 1,572,504
//! bytes of compact JSON, and no more. The API server drops an object's managedFields rather than
//! exceed the limit, so only the object itself counts. The estimate here counts the entries'
//! JSON exactly and leaves [`METADATA_ALLOWANCE`] for the rest of the object.

use super::IPAllocation;

/// etcd's default `--max-request-bytes`.
pub const ETCD_REQUEST_LIMIT: usize = 1_572_864;
/// Room for what the estimate does not count: metadata (name, namespace, UID, resourceVersion,
/// timestamps, labels a user may add), the request's key and framing. Measured: a pool of 7,564
/// entries of 204 bytes was refused at one more entry, with metadata of about 300 bytes.
pub const METADATA_ALLOWANCE: usize = 4_096;
/// The largest pool object this project writes: beyond it an ADD is refused for good.
pub const POOL_OBJECT_BUDGET: usize = ETCD_REQUEST_LIMIT - METADATA_ALLOWANCE;
/// The share of the budget at which the operator's alert fires.
pub const ALERT_SHARE: f64 = 0.8;

/// `{"apiVersion":"whereabouts.cni.cncf.io/v1alpha1","kind":"IPPool",...,"spec":{"range":"","allocations":{}}}`
/// without the range and the entries.
const SHELL_BYTES: usize = 120;

/// Bytes one entry adds to the pool's compact JSON: `"<offset>":{"id":"..","podref":".."},`.
pub fn entry_bytes(offset: u128, entry: &IPAllocation) -> usize {
    let field = |name: &str, value: &str| {
        if value.is_empty() {
            0
        } else {
            // "name":"value",  (quotes, colon, comma; values are plain ASCII, never escaped)
            name.len() + value.len() + 6
        }
    };
    // The key's quotes and colon, the braces and the comma after the entry; each field below
    // counts a comma after it, which the last one has not.
    let key = decimal_len(offset) + 3 + 2 + 1 - 1;
    // `id` and `podref` are always written, even empty.
    key + "id".len()
        + entry.id.len()
        + 6
        + "podref".len()
        + entry.podref.len()
        + 6
        + field("ifname", &entry.ifname)
        + field("poduid", &entry.poduid)
        + field("node", &entry.node)
        + field("ipamclaimref", &entry.ipamclaimref)
        + field("statefulset", &entry.statefulset)
}

/// The estimated stored size of a pool with these entries.
pub fn pool_bytes<'a>(
    range: &str,
    entries: impl IntoIterator<Item = (&'a u128, &'a IPAllocation)>,
) -> usize {
    SHELL_BYTES
        + range.len()
        + entries
            .into_iter()
            .map(|(o, e)| entry_bytes(*o, e))
            .sum::<usize>()
}

/// Bytes of a typical entry: a 64-character container id, a 45-character podref, `net1`, a
/// pod UID and a 20-character node name, at a five-digit offset.
pub fn typical_entry_bytes() -> usize {
    let typical = IPAllocation {
        id: "0".repeat(64),
        podref: "x".repeat(45),
        ifname: "net1".into(),
        poduid: "0".repeat(36),
        node: "n".repeat(20),
        ..Default::default()
    };
    entry_bytes(10_000, &typical)
}

/// About how many typical entries one pool object holds.
pub fn typical_capacity() -> usize {
    (POOL_OBJECT_BUDGET - SHELL_BYTES) / typical_entry_bytes()
}

/// Bytes one slice adds to a NodeSlicePool's JSON, `{"nodeName":"..","sliceRange":".."},`, for a
/// 63-character node name (a DNS label, what node names are in practice) and the longest IPv6
/// slice text (43 characters).
pub const NODE_SLICE_ENTRY_BYTES: usize = 12 + 63 + 16 + 43 + 3;

/// The most slices one range may be cut into: a NodeSlicePool lists every slice (free ones with
/// an empty node name) in one object (upstream's #666: a /8 in /27 slices, 524,288 entries).
pub const MAX_NODE_SLICES: u128 = (POOL_OBJECT_BUDGET / NODE_SLICE_ENTRY_BYTES) as u128;

fn decimal_len(n: u128) -> usize {
    n.checked_ilog10().map_or(1, |d| d as usize + 1)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::BTreeMap;

    fn entry(i: u128) -> IPAllocation {
        IPAllocation {
            id: format!("{i:064x}"),
            podref: format!(
                "tenant-namespace-{:02}/app-deployment-7d9f8c6b5-{i:06}",
                i % 50
            ),
            ifname: "net1".into(),
            poduid: format!("5f0c6a2e-1d3b-4c1e-9a4f-{i:012}"),
            ..Default::default()
        }
    }

    /// An entry held by a claim or a StatefulSet, every few offsets.
    fn maybe_held(i: u128) -> IPAllocation {
        IPAllocation {
            ipamclaimref: if i.is_multiple_of(7) {
                format!("vms/vm-{i}.net")
            } else {
                String::new()
            },
            statefulset: if i.is_multiple_of(5) {
                "web".into()
            } else {
                String::new()
            },
            ..entry(i)
        }
    }

    #[test]
    fn the_estimate_is_the_compact_json_of_the_entries() {
        let entries: BTreeMap<u128, IPAllocation> =
            (1..=1000).map(|o| (o, maybe_held(o))).collect();
        let json = serde_json::to_string(
            &entries
                .iter()
                .map(|(o, e)| (o.to_string(), e))
                .collect::<BTreeMap<_, _>>(),
        )
        .unwrap();
        let estimate: usize = entries.iter().map(|(o, e)| entry_bytes(*o, e)).sum();
        // The JSON map has one comma fewer than entries, plus its two braces.
        assert_eq!(estimate, json.len() - 2 + 1);
        let bare = IPAllocation {
            id: "c".into(),
            podref: String::new(),
            ..Default::default()
        };
        let one = serde_json::to_string(&BTreeMap::from([("7", &bare)])).unwrap();
        assert_eq!(entry_bytes(7, &bare), one.len() - 2 + 1, "{one}");
    }

    #[test]
    fn a_typical_pool_holds_about_6700_entries() {
        assert_eq!(typical_entry_bytes(), 233);
        assert_eq!(typical_capacity(), 6_732);
    }

    #[test]
    fn the_budget_matches_the_measured_limit() {
        // bench/pool_limit.py: 7,564 entries of this shape (204 bytes each) were stored, the
        // 7,565th was refused. The budget must refuse before the API server does, and not
        // waste more than the allowance.
        let entries: BTreeMap<u128, IPAllocation> = (1..=7564).map(|o| (o, entry(o))).collect();
        let stored = pool_bytes("10.128.0.0/16", &entries);
        assert!(stored <= ETCD_REQUEST_LIMIT, "{stored}");
        let fits = (POOL_OBJECT_BUDGET - pool_bytes("10.128.0.0/16", [])) / 208;
        assert!((7_540..=7_564).contains(&fits), "{fits}");
    }
}
