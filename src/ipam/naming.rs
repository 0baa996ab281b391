//! Names of stored objects, byte-compatible with upstream whereabouts.
//!
//! IPPool: the normalised CIDR with `:` and `/` replaced by `-`, prefixed by `<network_name>-`.
//! OverlappingRangeIPReservation: the canonical IP text with `:` replaced by `-`, a `0` appended
//! when it would end in `-`, prefixed by `<network_name>-`. Rust and Go both print IPv6 in the RFC
//! 5952 form, so the names agree.

use std::net::IpAddr;

use ipnet::IpNet;

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
}
