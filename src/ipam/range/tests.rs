use super::*;

fn net(s: &str) -> IpNet {
    s.parse().unwrap()
}
fn ip(s: &str) -> IpAddr {
    s.parse().unwrap()
}
fn range(cidr: &str) -> AddrRange {
    AddrRange::new(net(cidr), None, None, &[]).unwrap()
}

#[test]
fn window_skips_network_and_broadcast() {
    let r = range("192.168.2.230/24");
    assert_eq!(r.cidr(), net("192.168.2.0/24"));
    assert_eq!(r.window(), (ip("192.168.2.1"), ip("192.168.2.254")));
    assert_eq!(r.size(), 254);
    let r6 = range("fd00:0:0:10::/64");
    assert_eq!(
        r6.window(),
        (ip("fd00:0:0:10::1"), ip("fd00:0:0:10:ffff:ffff:ffff:fffe"))
    );
    assert_eq!(r6.size(), (1u128 << 64) - 2);
}

#[test]
fn tiny_prefixes_have_no_usable_address() {
    for cidr in ["10.0.0.0/31", "10.0.0.1/32", "2001::/127", "2001::1/128"] {
        assert!(
            matches!(
                AddrRange::new(net(cidr), None, None, &[]),
                Err(RangeError::NoUsableAddress { .. })
            ),
            "{cidr}"
        );
    }
    assert_eq!(range("10.0.0.0/30").size(), 2);
}

#[test]
fn whole_v6_space_works() {
    let r = range("::/0");
    assert_eq!(r.size(), u128::MAX - 1);
    assert_eq!(r.free(&BTreeSet::new()).next(), Some(1));
}

#[test]
fn start_and_end_narrow_the_window() {
    let r = AddrRange::new(
        net("10.10.10.10/24"),
        Some(ip("10.10.10.20")),
        Some(ip("10.10.10.200")),
        &[],
    )
    .unwrap();
    assert_eq!(r.window(), (ip("10.10.10.20"), ip("10.10.10.200")));
    assert_eq!(r.size(), 181);
    // A start at the network address is clamped, as upstream does.
    let r = AddrRange::new(net("10.0.0.0/24"), Some(ip("10.0.0.0")), None, &[]).unwrap();
    assert_eq!(r.window().0, ip("10.0.0.1"));
}

#[test]
fn bad_bounds_are_errors_naming_the_value() {
    let e = AddrRange::new(net("10.0.0.0/24"), Some(ip("10.0.1.5")), None, &[]).unwrap_err();
    assert_eq!(
        e.to_string(),
        "range_start 10.0.1.5 is outside range 10.0.0.0/24"
    );
    let e = AddrRange::new(
        net("10.0.0.0/24"),
        Some(ip("10.0.0.50")),
        Some(ip("10.0.0.10")),
        &[],
    )
    .unwrap_err();
    assert_eq!(
        e.to_string(),
        "range_start 10.0.0.50 is after range_end 10.0.0.10"
    );
    let e = AddrRange::new(net("10.0.0.0/24"), None, Some(ip("2001::1")), &[]).unwrap_err();
    assert!(matches!(
        e,
        RangeError::FamilyMismatch {
            bound: Bound::End,
            ..
        }
    ));
    let e = AddrRange::new(net("10.0.0.0/24"), None, None, &[net("2001::/64")]).unwrap_err();
    assert!(matches!(
        e,
        RangeError::FamilyMismatch {
            bound: Bound::Exclude(0),
            ..
        }
    ));
}

#[test]
fn excludes_are_jumped_and_counted() {
    let r = AddrRange::new(
        net("10.0.0.0/24"),
        None,
        None,
        &[
            net("10.0.0.0/28"),
            net("10.0.0.16/32"),
            net("10.0.0.200/29"),
            net("192.168.0.0/16"),
        ],
    )
    .unwrap();
    assert_eq!(r.free(&BTreeSet::new()).next(), Some(17));
    // 254 usable, minus .1-.15 (15), .16 (1), .200-.207 (8).
    assert_eq!(r.size(), 254 - 15 - 1 - 8);
    assert!(!r.is_allocatable(203));
    assert!(r.is_allocatable(199));
}

#[test]
fn everything_excluded_is_an_error() {
    let e = AddrRange::new(net("10.0.0.0/24"), None, None, &[net("10.0.0.0/24")]).unwrap_err();
    assert_eq!(
        e.to_string(),
        "exclude leaves no usable address in range 10.0.0.0/24 (window 10.0.0.1 to 10.0.0.254)"
    );
}

#[test]
fn full_window_of_a_huge_range_is_found_at_once() {
    // A /64 whose window is excluded except for two addresses, both taken: the walk must end
    // after a handful of steps, not 2^64.
    let all = AddrRange::new(
        net("2001:db8::/64"),
        None,
        None,
        &[net("2001:db8::/65"), net("2001:db8:0:0:8000::2/65")],
    );
    assert!(matches!(all, Err(RangeError::AllExcluded { .. })));
    let r = AddrRange::new(
        net("2001:db8::/64"),
        Some(ip("2001:db8::ffff:ffff:ffff:fff0")),
        None,
        &[
            net("2001:db8::ffff:ffff:ffff:fff0/126"),
            net("2001:db8::ffff:ffff:ffff:fff4/126"),
            net("2001:db8::ffff:ffff:ffff:fff8/126"),
        ],
    )
    .unwrap();
    assert_eq!(r.size(), 3);
    let taken: BTreeSet<u128> = r.free(&BTreeSet::new()).collect();
    assert_eq!(taken.len(), 3);
    assert_eq!(r.free(&taken).next(), None);
    assert_eq!(r.free_count(&taken), 0);
}

#[test]
fn zero_ending_addresses_inside_larger_prefixes_are_allocatable() {
    let r = AddrRange::new(net("10.0.0.0/16"), Some(ip("10.0.0.255")), None, &[]).unwrap();
    let taken = BTreeSet::from([255]);
    assert_eq!(
        r.addr_at(r.free(&taken).next().unwrap()),
        Some(ip("10.0.1.0"))
    );
}

#[test]
fn pick_spreads_after_a_lost_race() {
    let r = range("10.0.0.0/24");
    let taken = BTreeSet::new();
    assert_eq!(r.pick(&taken, 0, |_| unreachable!()), Some(1));
    assert_eq!(r.pick(&taken, 1, |n| n - 1), Some(8));
    assert_eq!(r.pick(&taken, 3, |n| n - 1), Some(32));
}

#[test]
fn offsets_round_trip() {
    let r = range("192.168.2.0/24");
    assert_eq!(r.offset_of(ip("192.168.2.5")), Some(5));
    assert_eq!(r.addr_at(5), Some(ip("192.168.2.5")));
    assert_eq!(r.addr_at(256), None);
    assert_eq!(r.offset_of(ip("192.168.3.5")), None);
}

#[test]
fn overlap_and_touch() {
    let a = range("10.0.0.0/24");
    let b = AddrRange::new(net("10.0.0.0/16"), Some(ip("10.0.1.1")), None, &[]).unwrap();
    assert!(!a.windows_overlap(&b));
    assert!(a.windows_overlap(&range("10.0.0.128/25")));
    assert!(!a.window_touches(&net("10.0.1.0/24")));
    assert!(a.window_touches(&net("10.0.0.5/32")));
}
