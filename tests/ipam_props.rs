//! Property tests of the pure allocation core.

use std::collections::BTreeSet;
use std::net::IpAddr;

use ipnet::IpNet;
use proptest::prelude::*;
use whereabouts::ipam::AddrRange;

/// A small IPv4 or IPv6 range (so that brute force can check it) with a start, an end and excludes.
fn small_range() -> impl Strategy<Value = AddrRange> {
    (
        any::<bool>(),
        22u8..=30,
        any::<u32>(),
        any::<u64>(),
        any::<u64>(),
        proptest::collection::vec((any::<u64>(), 0u8..6), 0..4),
    )
        .prop_filter_map("valid range", |(v6, host_bits_v4, seed, s, e, ex)| {
            let (cidr, host_bits): (IpNet, u8) = if v6 {
                (
                    format!("2001:db8:{:x}::/{}", seed as u16, 128 - (32 - host_bits_v4))
                        .parse()
                        .unwrap(),
                    32 - host_bits_v4,
                )
            } else {
                (
                    format!("10.{}.0.0/{}", seed % 250, host_bits_v4)
                        .parse()
                        .unwrap(),
                    32 - host_bits_v4,
                )
            };
            let size = 1u128 << host_bits;
            let at = |x: u64| -> IpAddr { offset_ip(cidr, x as u128 % size) };
            let (start, end) = (at(s), at(e));
            let excludes: Vec<IpNet> = ex
                .iter()
                .map(|(o, bits)| {
                    IpNet::new(at(*o), cidr.max_prefix_len() - bits)
                        .unwrap()
                        .trunc()
                })
                .collect();
            AddrRange::new(cidr, Some(start), Some(end), &excludes).ok()
        })
}

fn offset_ip(cidr: IpNet, offset: u128) -> IpAddr {
    match cidr.network() {
        IpAddr::V4(a) => IpAddr::V4((u32::from(a) + offset as u32).into()),
        IpAddr::V6(a) => IpAddr::V6((u128::from(a) + offset).into()),
    }
}

/// Brute force: every allocatable offset not taken, in order.
fn oracle(r: &AddrRange, taken: &BTreeSet<u128>) -> Vec<u128> {
    let host_bits = r.cidr().max_prefix_len() - r.cidr().prefix_len();
    (0..(1u128 << host_bits))
        .filter(|o| r.is_allocatable(*o) && !taken.contains(o))
        .collect()
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(300))]

    #[test]
    fn free_walk_matches_brute_force(r in small_range(), taken_raw in proptest::collection::vec(any::<u16>(), 0..64)) {
        let taken: BTreeSet<u128> = taken_raw.iter().map(|t| u128::from(*t) % 1024).collect();
        let expected = oracle(&r, &taken);
        let got: Vec<u128> = r.free(&taken).collect();
        prop_assert_eq!(&got, &expected);
        prop_assert_eq!(r.free_count(&taken), expected.len() as u128);
    }

    #[test]
    fn allocating_until_full_never_duplicates_or_leaves_the_window(r in small_range(), seed in any::<u64>()) {
        let mut rng = fastrand::Rng::with_seed(seed);
        let mut taken = BTreeSet::new();
        let mut attempt = 0u32;
        while let Some(o) = r.pick(&taken, attempt % 4, |n| rng.usize(..n)) {
            prop_assert!(r.is_allocatable(o), "picked {} outside the window", o);
            prop_assert!(taken.insert(o), "picked {} twice", o);
            attempt += 1;
            prop_assert!(taken.len() as u128 <= r.size());
        }
        prop_assert_eq!(taken.len() as u128, r.size());
        prop_assert_eq!(r.free(&taken).next(), None);
    }

    #[test]
    fn release_restores_the_previous_state(r in small_range(), n in 1usize..40, victim in any::<usize>()) {
        let mut taken = BTreeSet::new();
        for _ in 0..n {
            match r.pick(&taken, 0, |_| 0) { Some(o) => { taken.insert(o); } None => break }
        }
        let before: Vec<u128> = r.free(&taken).take(5).collect();
        let Some(&v) = taken.iter().nth(victim % taken.len().max(1)) else { return Ok(()) };
        taken.remove(&v);
        // The released address is the lowest free one again (everything below it is taken).
        prop_assert_eq!(r.pick(&taken, 0, |_| 0), Some(v));
        taken.insert(v);
        prop_assert_eq!(r.free(&taken).take(5).collect::<Vec<_>>(), before);
    }

    #[test]
    fn huge_ranges_stay_cheap(prefix in 0u8..=64, taken_n in 0usize..200) {
        let r = AddrRange::new(format!("2001:db8::/{prefix}").parse::<IpNet>().unwrap().trunc(), None, None, &[]).unwrap();
        let taken: BTreeSet<u128> = (1..=taken_n as u128).collect();
        prop_assert_eq!(r.free(&taken).next(), Some(taken_n as u128 + 1));
        prop_assert_eq!(r.free_count(&taken), r.size() - taken_n as u128);
    }
}
