//! Addresses as 128-bit integers.
//!
//! Every address, IPv4 or IPv6, is handled as a `u128` so that one piece of arithmetic serves both
//! families and whole IPv6 ranges work (upstream read offsets back as signed 64-bit integers).

use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};

/// The address family of a range; one range never mixes the two.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Family {
    V4,
    V6,
}

impl Family {
    pub fn of(ip: IpAddr) -> Family {
        match ip {
            IpAddr::V4(_) => Family::V4,
            IpAddr::V6(_) => Family::V6,
        }
    }

    /// Number of address bits.
    pub fn bits(self) -> u8 {
        match self {
            Family::V4 => 32,
            Family::V6 => 128,
        }
    }

    /// For messages: `IPv4`, `IPv6`.
    pub fn name(self) -> &'static str {
        match self {
            Family::V4 => "IPv4",
            Family::V6 => "IPv6",
        }
    }

    /// The CNI 0.3/0.4 result's `version` field.
    pub fn version_str(self) -> &'static str {
        match self {
            Family::V4 => "4",
            Family::V6 => "6",
        }
    }
}

pub fn to_u128(ip: IpAddr) -> u128 {
    match ip {
        IpAddr::V4(v4) => u128::from(u32::from(v4)),
        IpAddr::V6(v6) => u128::from(v6),
    }
}

/// Converts back; `None` when the value does not fit the family (an IPv4 value above 2^32).
pub fn from_u128(family: Family, value: u128) -> Option<IpAddr> {
    match family {
        Family::V4 => u32::try_from(value)
            .ok()
            .map(|v| IpAddr::V4(Ipv4Addr::from(v))),
        Family::V6 => Some(IpAddr::V6(Ipv6Addr::from(value))),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn round_trips_both_families() {
        for text in [
            "10.0.0.1",
            "255.255.255.255",
            "::",
            "2001:db8::1",
            "ffff:ffff:ffff:ffff:ffff:ffff:ffff:ffff",
        ] {
            let ip: IpAddr = text.parse().unwrap();
            assert_eq!(from_u128(Family::of(ip), to_u128(ip)), Some(ip));
        }
    }

    #[test]
    fn v4_overflow_is_none() {
        assert_eq!(from_u128(Family::V4, 1u128 << 32), None);
    }
}
