//! What a config may say but probably does not mean: keys whereabouts ignores, an unknown log
//! level, excludes outside the window, windows too large for one pool object, a gateway that is
//! outside every range or may be handed to a pod. Warnings never refuse a config.

use std::collections::BTreeSet;
use std::net::IpAddr;

use serde_json::{Map, Value};

use super::RangeConfig;
use crate::config::problem::Problem;

/// Keys upstream understands. Legacy keys of the lease and etcd backends are accepted and unused.
const KNOWN_KEYS: &[&str] = &[
    "type",
    "name",
    "range",
    "range_start",
    "range_end",
    "exclude",
    "ipRanges",
    "gateway",
    "routes",
    "dns",
    "addresses",
    "enable_overlapping_ranges",
    "network_name",
    "node_slice_size",
    "kubernetes",
    "configuration_path",
    "log_file",
    "log_level",
    "agent_socket",
    "plugin_slots",
    "plugin_slots_dir",
    "sticky_statefulset",
    "allowPersistentIPs",
    "leader_lease_duration",
    "leader_renew_deadline",
    "leader_retry_period",
    "sleep_for_race",
    "reconciler_cron_expression",
    "datastore",
    "etcd_host",
    "etcd_username",
    "etcd_password",
    "etcd_key_file",
    "etcd_cert_file",
    "etcd_ca_cert_file",
];
const RANGE_KEYS: &[&str] = &[
    "range",
    "range_start",
    "range_end",
    "exclude",
    "node_slice_size",
];
const LOG_LEVELS: &[&str] = &["debug", "verbose", "error", "panic"];

pub(super) fn warnings(
    obj: &Map<String, Value>,
    prefix: &str,
    ranges: &[RangeConfig],
    gateway: Option<IpAddr>,
    log_level: Option<&str>,
) -> Vec<Problem> {
    let mut w = Vec::new();
    let known: BTreeSet<&str> = KNOWN_KEYS.iter().copied().collect();
    for key in obj.keys().filter(|k| !known.contains(k.as_str())) {
        w.push(Problem::at(
            format!("{prefix}.{key}"),
            "is not a whereabouts setting and is ignored",
        ));
    }
    if let Some(Value::Array(entries)) = obj.get("ipRanges") {
        for (i, e) in entries.iter().enumerate() {
            for key in e
                .as_object()
                .into_iter()
                .flat_map(|o| o.keys())
                .filter(|k| !RANGE_KEYS.contains(&k.as_str()))
            {
                w.push(Problem::at(
                    format!("{prefix}.ipRanges[{i}].{key}"),
                    "is not a range setting and is ignored",
                ));
            }
        }
    }
    if let Some(level) = log_level.filter(|l| !LOG_LEVELS.contains(l)) {
        w.push(Problem::with_value(
            format!("{prefix}.log_level"),
            level,
            format!("is not one of {}; using error", LOG_LEVELS.join(", ")),
        ));
    }
    for range in ranges {
        for net in range
            .range
            .excludes()
            .iter()
            .filter(|n| !range.range.window_touches(n))
        {
            w.push(Problem::with_value(
                format!("{}.exclude", range.path.trim_end_matches(".range")),
                net,
                format!("does not touch the window of range {}", range.range.cidr()),
            ));
        }
    }
    w.extend(ranges.iter().filter_map(pool_object_warning));
    if let Some(gw) = gateway {
        w.extend(gateway_warnings(prefix, gw, ranges));
    }
    w
}

/// A window with more addresses than one IPPool object can record: the pool stops taking ADDs
/// long before the range is used up. Windows beyond 2^32 addresses (IPv6 /64s and the like) are
/// sized by convention, not to be filled, and get no warning.
fn pool_object_warning(range: &RangeConfig) -> Option<Problem> {
    let addresses = range.range.free_count(&BTreeSet::new());
    let capacity = crate::crd::size::typical_capacity();
    (addresses > capacity as u128 && addresses <= 1 << 32).then(|| {
        Problem::with_value(
            range.path.clone(),
            range.range.cidr(),
            format!(
                "has {addresses} allocatable addresses, but one IPPool object records about {capacity} (at ~{} bytes an entry under etcd's 1.5 MiB request limit): once that full, ADDs fail with \"cannot hold another entry\"; use smaller ranges (several NADs, or range_start/range_end windows) or node slices",
                crate::crd::size::typical_entry_bytes()
            ),
        )
    })
}

fn gateway_warnings(prefix: &str, gw: IpAddr, ranges: &[RangeConfig]) -> Option<Problem> {
    let path = format!("{prefix}.gateway");
    if !ranges.is_empty() && !ranges.iter().any(|r| r.range.cidr().contains(&gw)) {
        return Some(Problem::with_value(path, gw, "is outside every range"));
    }
    let inside = ranges.iter().find(|r| {
        r.range
            .offset_of(gw)
            .is_some_and(|o| r.range.is_allocatable(o))
    })?;
    Some(Problem::with_value(
        path,
        gw,
        format!(
            "is inside the allocatable window of {} and may be handed to a pod: add it to exclude or narrow range_start/range_end",
            inside.range.cidr()
        ),
    ))
}
