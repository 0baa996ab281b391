//! Requested addresses: the CNI `ips` capability (`runtimeConfig.ips`, which Multus fills from the
//! network-selection element's `ips`) and `args.cni.ips`, each given to the range it falls in
//! instead of a dynamic address, and reserved like one. Every problem is found here, before
//! anything is allocated, except an address another pod holds (the engine finds that).

use std::net::IpAddr;

use serde_json::Value;

use super::protocol::{CniError, Code};
use crate::config::RangeConfig;

/// Where requested addresses are read from, in order.
const SOURCES: [(&str, &str); 2] = [
    ("/runtimeConfig/ips", "runtimeConfig.ips"),
    ("/args/cni/ips", "args.cni.ips"),
];

/// An address as requested, with the field it came from (`runtimeConfig.ips[0]`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Requested {
    pub field: String,
    pub ip: IpAddr,
}

/// The addresses the network config requests, in order, each once.
pub fn read(conf: &Value) -> Result<Vec<Requested>, CniError> {
    let mut out: Vec<Requested> = Vec::new();
    for (pointer, field) in SOURCES {
        let items = match conf.pointer(pointer) {
            None | Some(Value::Null) => continue,
            Some(Value::Array(items)) => items,
            Some(other) => {
                return Err(invalid(format!(
                    "{field}: {other} must be a list of IP addresses"
                )));
            }
        };
        for (i, item) in items.iter().enumerate() {
            let field = format!("{field}[{i}]");
            let ip = item.as_str().and_then(parse).ok_or_else(|| {
                invalid(format!(
                    "{field}: {item} is not an IP address (with or without a prefix length, for example 10.0.0.5/24)"
                ))
            })?;
            if !out.iter().any(|r| r.ip == ip) {
                out.push(Requested { field, ip });
            }
        }
    }
    Ok(out)
}

/// An address with or without a prefix length (the prefix of the result is the range's).
pub fn parse(text: &str) -> Option<IpAddr> {
    let text = text.trim();
    text.parse::<ipnet::IpNet>()
        .map(|n| n.addr())
        .or_else(|_| text.parse::<IpAddr>())
        .ok()
}

/// Gives each requested address to the first range whose CIDR holds it: one per range, none
/// outside every range, none a range may not hand out, none in a sliced range. The result has
/// one slot per range; a range without a request allocates dynamically.
pub fn assign(
    ranges: &[RangeConfig],
    requested: &[Requested],
) -> Result<Vec<Option<IpAddr>>, CniError> {
    let mut slots = vec![None; ranges.len()];
    for r in requested {
        let unavailable = |why: String| {
            CniError::new(
                Code::AddressUnavailable,
                format!("{}: requested address {} {why}", r.field, r.ip),
            )
        };
        let Some(i) = ranges.iter().position(|c| c.range.cidr().contains(&r.ip)) else {
            let cidrs: Vec<String> = ranges.iter().map(|c| c.range.cidr().to_string()).collect();
            return Err(unavailable(format!(
                "is outside every range of this network ({})",
                cidrs.join(", ")
            )));
        };
        let range = &ranges[i];
        if range.node_slice.is_some() {
            return Err(unavailable(format!(
                "is in {} ({}), which is cut into node slices (node_slice_size): requested addresses are not supported there",
                range.path,
                range.range.cidr()
            )));
        }
        if let Some(why) = range.range.refusal(r.ip) {
            return Err(unavailable(why));
        }
        if let Some(earlier) = slots[i] {
            return Err(unavailable(format!(
                "is the second address requested in {} ({}), after {earlier}: one address per range",
                range.path,
                range.range.cidr()
            )));
        }
        slots[i] = Some(r.ip);
    }
    Ok(slots)
}

fn invalid(msg: String) -> CniError {
    CniError::new(Code::InvalidConfig, msg)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::{Source, validate_ipam};
    use serde_json::json;

    fn ranges(ipam: Value) -> Vec<RangeConfig> {
        validate_ipam(&ipam, "ipam", Source::Runtime)
            .config
            .expect("valid")
            .ranges
    }

    fn dual() -> Vec<RangeConfig> {
        ranges(json!({"type": "whereabouts", "ipRanges": [
            {"range": "10.0.0.0/24", "exclude": ["10.0.0.128/25"]},
            {"range": "fd00::/64"}
        ]}))
    }

    #[test]
    fn reads_both_sources_once_each() {
        let conf = json!({
            "runtimeConfig": {"ips": ["10.0.0.5/24", "fd00::5"]},
            "args": {"cni": {"ips": ["10.0.0.5"]}}
        });
        let got = read(&conf).unwrap();
        assert_eq!(got.len(), 2);
        assert_eq!(got[0].field, "runtimeConfig.ips[0]");
        assert_eq!(got[1].ip, "fd00::5".parse::<IpAddr>().unwrap());
        assert!(read(&json!({})).unwrap().is_empty());
    }

    #[test]
    fn bad_input_names_the_field_and_value() {
        let e = read(&json!({"runtimeConfig": {"ips": ["10.0.0.300"]}})).unwrap_err();
        assert_eq!(e.code, Code::InvalidConfig);
        assert!(
            e.msg
                .starts_with("runtimeConfig.ips[0]: \"10.0.0.300\" is not an IP address"),
            "{}",
            e.msg
        );
        let e = read(&json!({"args": {"cni": {"ips": "10.0.0.5"}}})).unwrap_err();
        assert!(
            e.msg.contains("args.cni.ips: \"10.0.0.5\" must be a list"),
            "{}",
            e.msg
        );
        let e = read(&json!({"args": {"cni": {"ips": [5]}}})).unwrap_err();
        assert!(e.msg.starts_with("args.cni.ips[0]: 5 is not"), "{}", e.msg);
    }

    fn req(field: &str, ip: &str) -> Requested {
        Requested {
            field: field.into(),
            ip: ip.parse().unwrap(),
        }
    }

    #[test]
    fn each_address_goes_to_its_range() {
        let got = assign(&dual(), &[req("a", "fd00::9"), req("b", "10.0.0.7")]).unwrap();
        assert_eq!(
            got,
            vec![
                Some("10.0.0.7".parse().unwrap()),
                Some("fd00::9".parse().unwrap())
            ]
        );
        let got = assign(&dual(), &[req("a", "10.0.0.7")]).unwrap();
        assert_eq!(got[1], None, "the IPv6 range stays dynamic");
    }

    #[test]
    fn refusals_name_the_address_and_why() {
        let cases = [
            (
                "10.9.9.9",
                "is outside every range of this network (10.0.0.0/24, fd00::/64)",
            ),
            (
                "10.0.0.200",
                "is excluded from range 10.0.0.0/24 (exclude 10.0.0.128/25)",
            ),
            (
                "10.0.0.0",
                "is outside the usable window 10.0.0.1 to 10.0.0.254 of range 10.0.0.0/24",
            ),
        ];
        for (ip, why) in cases {
            let e = assign(&dual(), &[req("runtimeConfig.ips[0]", ip)]).unwrap_err();
            assert_eq!(e.code, Code::AddressUnavailable);
            assert_eq!(
                e.msg,
                format!("runtimeConfig.ips[0]: requested address {ip} {why}")
            );
        }
        let e = assign(&dual(), &[req("a", "10.0.0.7"), req("b", "10.0.0.8")]).unwrap_err();
        assert!(
            e.msg
                .contains("second address requested in ipam.ipRanges[0]"),
            "{}",
            e.msg
        );
        let sliced = ranges(
            json!({"type": "whereabouts", "range": "10.0.0.0/16", "node_slice_size": "/24"}),
        );
        let e = assign(&sliced, &[req("a", "10.0.0.7")]).unwrap_err();
        assert!(e.msg.contains("node slices"), "{}", e.msg);
    }
}
