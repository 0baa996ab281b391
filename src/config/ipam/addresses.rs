//! Routes and static addresses: copied into the CNI result as given, once they parse.

use ipnet::IpNet;
use serde_json::Value;

use super::reader::{Reader, parse_ip};
use super::{RangeConfig, StaticAddress};
use crate::config::problem::Problem;

pub(super) fn read_routes(r: &mut Reader<'_>) -> Vec<Value> {
    let mut routes = Vec::new();
    for (i, v) in r.array("routes").iter().enumerate() {
        let path = format!("{}.routes[{i}]", r.prefix);
        let dst = v.get("dst").and_then(Value::as_str);
        if dst.and_then(|d| d.trim().parse::<IpNet>().ok()).is_none() {
            let shown = v
                .get("dst")
                .map(|d| {
                    d.as_str()
                        .map(str::to_owned)
                        .unwrap_or_else(|| d.to_string())
                })
                .unwrap_or_default();
            r.errors.push(Problem::with_value(
                format!("{path}.dst"),
                shown,
                "is not a CIDR",
            ));
            continue;
        }
        if let Some(gw) = v.get("gw").filter(|g| !g.is_null())
            && gw.as_str().and_then(parse_ip).is_none()
        {
            r.errors.push(Problem::with_value(
                format!("{path}.gw"),
                gw,
                "is not an IP address",
            ));
            continue;
        }
        routes.push(v.clone());
    }
    routes
}

pub(super) fn read_addresses(r: &mut Reader<'_>) -> Vec<StaticAddress> {
    let mut addresses = Vec::new();
    for (i, v) in r.array("addresses").iter().enumerate() {
        let path = format!("{}.addresses[{i}]", r.prefix);
        let text = v.get("address").and_then(Value::as_str).unwrap_or_default();
        let Ok(address) = text.trim().parse::<IpNet>() else {
            r.errors.push(Problem::with_value(
                format!("{path}.address"),
                text,
                "is not an address with a prefix length (for example 10.0.0.5/24)",
            ));
            continue;
        };
        let gateway = match v
            .get("gateway")
            .and_then(Value::as_str)
            .filter(|s| !s.is_empty())
        {
            None => None,
            Some(g) => match parse_ip(g) {
                Some(ip) => Some(ip),
                None => {
                    r.errors.push(Problem::with_value(
                        format!("{path}.gateway"),
                        g,
                        "is not an IP address",
                    ));
                    continue;
                }
            },
        };
        addresses.push(StaticAddress { address, gateway });
    }
    addresses
}

/// Static `addresses` are appended to every result without being reserved (as upstream does): one
/// inside the network's own dynamic window is a duplicate waiting to happen.
pub(super) fn inside_ranges(
    prefix: &str,
    addresses: &[StaticAddress],
    ranges: &[RangeConfig],
) -> Vec<Problem> {
    addresses
        .iter()
        .enumerate()
        .filter_map(|(i, a)| {
            let ip = a.address.addr();
            let range = ranges
                .iter()
                .find(|r| r.range.offset_of(ip).is_some_and(|o| r.range.is_allocatable(o)))?;
            Some(Problem::with_value(
                format!("{prefix}.addresses[{i}].address"),
                a.address,
                format!(
                    "is inside the allocatable window of {} ({}): static addresses are not reserved, so a pod may be given it too; exclude it from the range, or request it per pod (runtimeConfig.ips) so that it is reserved",
                    range.path.trim_end_matches(".range"),
                    range.range.cidr()
                ),
            ))
        })
        .collect()
}
