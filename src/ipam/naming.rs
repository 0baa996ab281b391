//! Names of stored objects, byte-compatible with upstream whereabouts.
//!
//! IPPool: the normalised CIDR with `:` and `/` replaced by `-`, prefixed by `<network_name>-`.
//! OverlappingRangeIPReservation: the canonical IP text with `:` replaced by `-`, a `0` appended
//! when it would end in `-`, prefixed by `<network_name>-`. Rust and Go both print IPv6 in the RFC
//! 5952 form, so the names agree.

use std::collections::BTreeMap;
use std::net::IpAddr;

use ipnet::IpNet;

/// The network (`network_name`, empty for the unnamed network) of a pool ours created.
pub const NETWORK_LABEL: &str = "whereabouts.cni.cncf.io/network";
/// The pool's own range, normalised as in its name (`10.0.4.0-24`).
pub const RANGE_LABEL: &str = "whereabouts.cni.cncf.io/range";
/// The node whose slice a pool is (node slices only).
pub const NODE_LABEL: &str = "whereabouts.cni.cncf.io/node";

/// The IPPool name for a range in a network (`None` or empty: the unnamed network).
pub fn pool_name(network_name: Option<&str>, cidr: IpNet) -> String {
    let normalised = cidr.trunc().to_string().replace([':', '/'], "-");
    prefixed(network_name, normalised)
}

/// The OverlappingRangeIPReservation name for an address in a network.
pub fn reservation_name(network_name: Option<&str>, ip: IpAddr) -> String {
    let mut normalised = ip.to_string().replace(':', "-");
    if normalised.ends_with('-') {
        normalised.push('0');
    }
    prefixed(network_name, normalised)
}

/// The IPPool of a node's slice, as upstream names it: `[<network_name>-]<node>-<slice>`.
pub fn slice_pool_name(network_name: Option<&str>, node: &str, slice: IpNet) -> String {
    let normalised = slice.trunc().to_string().replace([':', '/'], "-");
    prefixed(network_name, format!("{node}-{normalised}"))
}

/// The NodeSlicePool of a network's range. Upstream slices only the first range and names its
/// NodeSlicePool after the network (`network_name`, else the config's `name`); every further range
/// sliced here (ours: dual-stack) gets `<that>-<normalised range>`, which stays the same when
/// ranges are added or reordered behind it.
pub fn node_slice_pool_name(network: &str, index: usize, range: IpNet) -> String {
    if index == 0 {
        network.to_owned()
    } else {
        pool_name(Some(network), range)
    }
}

/// The labels of the pool of `range` in a network (and of `node`'s slice): what the pool is, so
/// that nobody has to parse its name. A network or node whose name is no valid label value (over
/// 63 characters) gets no labels at all: such a pool reads as an unlabelled one, by its name.
pub fn pool_labels(
    network: Option<&str>,
    range: IpNet,
    node: Option<&str>,
) -> BTreeMap<String, String> {
    let network = network.unwrap_or_default();
    let mut labels = BTreeMap::new();
    if !is_label_value(network) || !node.is_none_or(is_label_value) {
        return labels;
    }
    labels.insert(NETWORK_LABEL.to_owned(), network.to_owned());
    if let Some(node) = node {
        labels.insert(NODE_LABEL.to_owned(), node.to_owned());
    }
    let normalised = pool_name(None, range);
    if is_label_value(&normalised) {
        labels.insert(RANGE_LABEL.to_owned(), normalised);
    }
    labels
}

/// The network a pool's labels name (`Some(None)`: the unnamed network), when the labels
/// compose the pool's very name; `None` when it has no such labels, or labels that do not fit
/// its name (edited by hand): then the name is all there is.
pub fn labelled_network(
    name: &str,
    labels: &BTreeMap<String, String>,
    range: IpNet,
) -> Option<Option<String>> {
    let network = labels.get(NETWORK_LABEL)?;
    let network = (!network.is_empty()).then(|| network.clone());
    let expected = match labels.get(NODE_LABEL) {
        Some(node) => slice_pool_name(network.as_deref(), node, range),
        None => pool_name(network.as_deref(), range),
    };
    (expected == name).then_some(network)
}

/// A Kubernetes label value: at most 63 characters, alphanumeric at both ends, `-`, `_` and `.`
/// inside; empty is allowed.
pub fn is_label_value(value: &str) -> bool {
    let inner = |b: u8| b.is_ascii_alphanumeric() || matches!(b, b'-' | b'_' | b'.');
    let bytes = value.as_bytes();
    value.is_empty()
        || (bytes.len() <= 63
            && bytes.iter().all(|b| inner(*b))
            && bytes[0].is_ascii_alphanumeric()
            && bytes[bytes.len() - 1].is_ascii_alphanumeric())
}

fn prefixed(network_name: Option<&str>, name: String) -> String {
    match network_name {
        Some(n) if !n.is_empty() => format!("{n}-{name}"),
        _ => name,
    }
}

/// Why a string is not a valid Kubernetes object name (a DNS-1123 subdomain), or `None` if it is.
pub fn object_name_problem(name: &str) -> Option<String> {
    if name.is_empty() {
        return Some("must not be empty".into());
    }
    if name.len() > 253 {
        return Some(format!(
            "is {} characters long, the limit is 253",
            name.len()
        ));
    }
    for label in name.split('.') {
        let valid_chars = label
            .bytes()
            .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-');
        let alnum_ends = label
            .bytes()
            .next()
            .is_some_and(|b| b.is_ascii_alphanumeric())
            && label
                .bytes()
                .last()
                .is_some_and(|b| b.is_ascii_alphanumeric());
        if !valid_chars || !alnum_ends {
            return Some("must consist of lower case alphanumeric characters, '-' or '.', and must start and end with an alphanumeric character".into());
        }
    }
    None
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pool_names_match_upstream() {
        assert_eq!(
            pool_name(None, "192.168.2.230/24".parse().unwrap()),
            "192.168.2.0-24"
        );
        assert_eq!(
            pool_name(None, "fd00:0:0:10::/64".parse().unwrap()),
            "fd00-0-0-10---64"
        );
        assert_eq!(
            pool_name(Some("blue"), "10.0.0.0/8".parse().unwrap()),
            "blue-10.0.0.0-8"
        );
        assert_eq!(
            pool_name(Some(""), "10.0.0.0/8".parse().unwrap()),
            "10.0.0.0-8"
        );
    }

    #[test]
    fn reservation_names_match_upstream() {
        assert_eq!(
            reservation_name(None, "2001::1".parse().unwrap()),
            "2001--1"
        );
        assert_eq!(
            reservation_name(None, "fdef:b041:5422:5::".parse().unwrap()),
            "fdef-b041-5422-5--0"
        );
        assert_eq!(
            reservation_name(None, "10.0.0.5".parse().unwrap()),
            "10.0.0.5"
        );
        assert_eq!(
            reservation_name(Some("red"), "10.0.0.5".parse().unwrap()),
            "red-10.0.0.5"
        );
    }

    #[test]
    fn object_names() {
        assert_eq!(object_name_problem("fd00-0-0-10---64"), None);
        assert_eq!(object_name_problem("blue-10.0.0.0-8"), None);
        assert!(object_name_problem("Blue_net-10.0.0.0-8").is_some());
        assert!(object_name_problem("-a").is_some());
        assert!(object_name_problem(&"a".repeat(254)).is_some());
    }

    #[test]
    fn labels_say_what_a_pool_is_and_compose_its_name() {
        let cidr: IpNet = "10.0.4.0/24".parse().unwrap();
        let plain = pool_labels(Some("blue"), cidr, None);
        assert_eq!(plain[NETWORK_LABEL], "blue");
        assert_eq!(plain[RANGE_LABEL], "10.0.4.0-24");
        assert!(!plain.contains_key(NODE_LABEL));
        assert_eq!(
            labelled_network("blue-10.0.4.0-24", &plain, cidr),
            Some(Some("blue".into()))
        );
        // The same labels on another name were not written for it.
        assert_eq!(labelled_network("red-10.0.4.0-24", &plain, cidr), None);
        let slice = pool_labels(None, cidr, Some("node-1"));
        assert_eq!(slice[NETWORK_LABEL], "");
        assert_eq!(
            labelled_network("node-1-10.0.4.0-24", &slice, cidr),
            Some(None)
        );
        let named_slice = pool_labels(Some("blue"), cidr, Some("blue-x"));
        assert_eq!(
            labelled_network("blue-blue-x-10.0.4.0-24", &named_slice, cidr),
            Some(Some("blue".into()))
        );
        // No labels at all for what cannot be a label value: read by name, as upstream's pools.
        assert!(pool_labels(Some(&"n".repeat(64)), cidr, None).is_empty());
        assert!(
            pool_labels(
                Some("blue"),
                cidr,
                Some(&format!("{}.example", "a".repeat(60)))
            )
            .is_empty()
        );
        assert_eq!(
            labelled_network("blue-10.0.4.0-24", &BTreeMap::new(), cidr),
            None
        );
        let v6 = pool_labels(None, "fd00::/64".parse().unwrap(), None);
        assert_eq!(v6[RANGE_LABEL], "fd00---64");
        let everything = pool_labels(None, "::/0".parse().unwrap(), None);
        assert!(
            !everything.contains_key(RANGE_LABEL),
            "'---0' is no label value"
        );
        assert!(
            is_label_value("")
                && is_label_value("a.b_c-1")
                && !is_label_value("-a")
                && !is_label_value("a/b")
        );
    }
}
