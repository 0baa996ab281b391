//! Node slices ("fast IPAM", upstream's `node_slice_size`): a range cut into equal, contiguous
//! CIDRs in ascending order from its network address, one or more per node, each allocated from
//! an IPPool of its own so that nodes never contend on one object.
//!
//! A slice allocates the addresses of its whole range's window that fall inside it (so
//! `range_start`, `range_end` and `exclude` hold inside slices, which upstream ignores), less the
//! slice's own first and last address, which upstream never hands out either: both plugins then
//! agree on what a slice may give, and a mixed fleet cannot hand an address out twice.

use std::net::IpAddr;

use ipnet::IpNet;

use super::addr::{from_u128, to_u128};
use super::{AddrRange, RangeError};

/// The prefix length of a `node_slice_size` value: `"/22"` or `"22"`, as upstream reads it.
pub fn parse_slice_size(text: &str) -> Option<u8> {
    let digits = text.trim().strip_prefix('/').unwrap_or(text.trim());
    if digits.is_empty() || !digits.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    digits.parse().ok()
}

/// Why slices of `prefix` cannot be cut from `range`, if they cannot.
pub fn slice_size_problem(range: IpNet, prefix: u8) -> Option<String> {
    if prefix <= range.prefix_len() {
        return Some(format!(
            "does not fit range {range}: a slice must be smaller than the range (a prefix longer than /{})",
            range.prefix_len()
        ));
    }
    if prefix > range.max_prefix_len().saturating_sub(2) {
        return Some(format!(
            "does not fit range {range}: a slice needs at least two host bits (a prefix of at most /{})",
            range.max_prefix_len() - 2
        ));
    }
    None
}

/// How many slices of `prefix` the range holds (saturating for absurd IPv6 cuts).
pub fn slice_count(range: IpNet, prefix: u8) -> u128 {
    let bits = u32::from(prefix.saturating_sub(range.prefix_len()));
    1u128.checked_shl(bits).unwrap_or(u128::MAX)
}

/// The `index`th slice of the range, if there is one.
pub fn nth_slice(range: IpNet, prefix: u8, index: u128) -> Option<IpNet> {
    if index >= slice_count(range, prefix) {
        return None;
    }
    let range = range.trunc();
    let host_bits = u32::from(range.max_prefix_len() - prefix);
    let base = to_u128(range.network()) + (index << host_bits);
    let family = super::Family::of(range.addr());
    IpNet::new(from_u128(family, base)?, prefix).ok()
}

/// Every slice of the range, in ascending order (callers bound the count first: the validator
/// refuses more than a NodeSlicePool can list, see `crd::size::MAX_NODE_SLICES`).
pub fn slices(range: IpNet, prefix: u8) -> impl Iterator<Item = IpNet> {
    let count = slice_count(range, prefix);
    (0..count).filter_map(move |i| nth_slice(range, prefix, i))
}

/// The part of `whole`'s window inside `slice`, with `whole`'s excludes: what the slice's pool may
/// hand out, its offsets counted from the slice's network address (as upstream's slice pools).
/// An error when the slice has no such address (outside the window, or all excluded).
pub fn slice_range(whole: &AddrRange, slice: IpNet) -> Result<AddrRange, RangeError> {
    let slice = slice.trunc();
    let (first, last) = whole.window();
    let clamp = |ip: IpAddr| slice.contains(&ip).then_some(ip);
    let start = clamp(first)
        .or_else(|| (to_u128(first) < to_u128(slice.network())).then_some(slice.network()));
    let end = clamp(last)
        .or_else(|| (to_u128(last) > to_u128(slice.broadcast())).then_some(slice.broadcast()));
    let (Some(start), Some(end)) = (start, end) else {
        return Err(RangeError::AllExcluded {
            cidr: slice,
            first,
            last,
        });
    };
    let excludes: Vec<IpNet> = whole
        .excludes()
        .iter()
        .filter(|e| e.contains(&slice.network()) || slice.contains(&e.network()))
        .copied()
        .collect();
    AddrRange::new(slice, Some(start), Some(end), &excludes)
}

/// True when `slice` is one of the range's slices of its own prefix length: inside the range and
/// aligned (what a NodeSlicePool written by anyone must list to be used).
pub fn is_slice_of(range: IpNet, slice: IpNet) -> bool {
    slice.prefix_len() > range.prefix_len()
        && range.trunc().contains(&slice.network())
        && slice.trunc() == slice
}

#[cfg(test)]
mod tests {
    use super::*;

    fn net(s: &str) -> IpNet {
        s.parse().unwrap()
    }

    #[test]
    fn sizes_parse_as_upstream_reads_them() {
        assert_eq!(parse_slice_size("/22"), Some(22));
        assert_eq!(parse_slice_size("22"), Some(22));
        assert_eq!(parse_slice_size(" /120 "), Some(120));
        for bad in ["", "/", "/x", "22a", "-3", "/+4", "//22", "300"] {
            assert_eq!(parse_slice_size(bad), None, "{bad:?}");
        }
    }

    #[test]
    fn slices_are_contiguous_and_ascending() {
        let all: Vec<String> = slices(net("10.0.0.0/22"), 24)
            .map(|s| s.to_string())
            .collect();
        assert_eq!(
            all,
            ["10.0.0.0/24", "10.0.1.0/24", "10.0.2.0/24", "10.0.3.0/24"]
        );
        let v6: Vec<String> = slices(net("fd00::/120"), 122)
            .map(|s| s.to_string())
            .collect();
        assert_eq!(
            v6,
            ["fd00::/122", "fd00::40/122", "fd00::80/122", "fd00::c0/122"]
        );
        assert_eq!(
            nth_slice(net("10.0.0.5/22"), 24, 3),
            Some(net("10.0.3.0/24"))
        );
        assert_eq!(nth_slice(net("10.0.0.0/22"), 24, 4), None);
    }

    #[test]
    fn sizes_that_do_not_fit_are_named() {
        let r = net("10.0.0.0/16");
        assert!(
            slice_size_problem(r, 16)
                .unwrap()
                .contains("smaller than the range")
        );
        assert!(slice_size_problem(r, 31).unwrap().contains("at most /30"));
        assert_eq!(slice_size_problem(r, 24), None);
        assert_eq!(slice_count(net("10.0.0.0/8"), 27), 524_288);
        assert_eq!(slice_size_problem(net("fd00::/48"), 64), None);
        assert!(slice_count(net("::/0"), 128) == u128::MAX);
    }

    #[test]
    fn a_slice_keeps_the_range_window_and_excludes() {
        let whole = AddrRange::new(
            net("10.0.0.0/24"),
            Some("10.0.0.10".parse().unwrap()),
            Some("10.0.0.200".parse().unwrap()),
            &[net("10.0.0.64/30"), net("10.0.0.128/25")],
        )
        .unwrap();
        // Below the start: only from .10.
        let s0 = slice_range(&whole, net("10.0.0.0/26")).unwrap();
        assert_eq!(s0.window().0, "10.0.0.10".parse::<IpAddr>().unwrap());
        assert_eq!(s0.window().1, "10.0.0.62".parse::<IpAddr>().unwrap());
        assert_eq!(s0.offset_of("10.0.0.10".parse().unwrap()), Some(10));
        // The exclude inside is kept.
        let s1 = slice_range(&whole, net("10.0.0.64/26")).unwrap();
        assert!(!s1.is_allocatable(s1.offset_of("10.0.0.65".parse().unwrap()).unwrap()));
        assert!(s1.is_allocatable(s1.offset_of("10.0.0.68".parse().unwrap()).unwrap()));
        assert_eq!(s1.window().0, "10.0.0.65".parse::<IpAddr>().unwrap());
        // Wholly excluded, or beyond the end: no address.
        assert!(slice_range(&whole, net("10.0.0.128/26")).is_err());
        assert!(slice_range(&whole, net("10.0.0.192/26")).is_err());
        let wide = AddrRange::new(net("10.0.0.0/16"), None, None, &[]).unwrap();
        let s = slice_range(&wide, net("10.0.4.0/24")).unwrap();
        assert_eq!(
            s.size(),
            254,
            "the slice's first and last are not handed out"
        );
    }

    #[test]
    fn slices_are_aligned_and_inside() {
        let r = net("10.0.0.0/16");
        assert!(is_slice_of(r, net("10.0.4.0/24")));
        assert!(!is_slice_of(r, net("10.1.4.0/24")));
        assert!(!is_slice_of(r, net("10.0.4.1/24")));
        assert!(!is_slice_of(r, net("10.0.0.0/16")));
    }
}
