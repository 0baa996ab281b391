//! The monitoring pieces name only metrics the operator defines.

use std::collections::BTreeSet;

fn names_in(text: &str) -> BTreeSet<String> {
    let mut found = BTreeSet::new();
    let bytes = text.as_bytes();
    let mut i = 0;
    while let Some(pos) = text[i..].find("whereabouts_") {
        let start = i + pos;
        let end = start
            + bytes[start..]
                .iter()
                .take_while(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || **b == b'_')
                .count();
        found.insert(text[start..end].to_owned());
        i = end;
    }
    found
}

fn base(name: &str) -> &str {
    ["_bucket", "_sum", "_count"]
        .iter()
        .find_map(|s| name.strip_suffix(s))
        .unwrap_or(name)
}

fn check(file: &str) {
    let text = std::fs::read_to_string(format!(
        "{}/config/monitoring/{file}",
        env!("CARGO_MANIFEST_DIR")
    ))
    .unwrap();
    let defined: BTreeSet<String> = whereabouts::metrics::defined_names().into_iter().collect();
    let used = names_in(&text);
    assert!(!used.is_empty(), "{file} names no metric");
    for name in used
        .iter()
        .filter(|n| !n.ends_with('_') && *n != "whereabouts_ipam")
    {
        assert!(
            defined.contains(base(name)),
            "{file} uses {name}, which the operator does not export; defined: {defined:?}"
        );
    }
}

#[test]
fn dashboard_queries_name_exported_metrics() {
    let dash: serde_json::Value = serde_json::from_str(
        &std::fs::read_to_string(format!(
            "{}/config/monitoring/dashboard.json",
            env!("CARGO_MANIFEST_DIR")
        ))
        .unwrap(),
    )
    .unwrap();
    let panels = dash["panels"].as_array().unwrap();
    assert!(panels.len() >= 6);
    for p in panels {
        assert!(
            !p["targets"].as_array().unwrap().is_empty(),
            "panel {} has no query",
            p["title"]
        );
    }
    check("dashboard.json");
}

#[test]
fn alert_rules_name_exported_metrics() {
    check("prometheusrule.yaml");
}

#[test]
fn the_issue_metric_names_are_all_defined() {
    let defined: BTreeSet<String> = whereabouts::metrics::defined_names().into_iter().collect();
    for name in [
        "whereabouts_pool_size_addresses",
        "whereabouts_pool_allocated_addresses",
        "whereabouts_pool_free_addresses",
        "whereabouts_network_size_addresses",
        "whereabouts_network_allocated_addresses",
        "whereabouts_stale_reservations",
        "whereabouts_orphan_reservations",
        "whereabouts_releases_total",
        "whereabouts_release_errors_total",
        "whereabouts_reconcile_total",
        "whereabouts_reconcile_duration_seconds",
        "whereabouts_webhook_requests_total",
        "whereabouts_webhook_duration_seconds",
        "whereabouts_leader",
        "whereabouts_build_info",
    ] {
        assert!(defined.contains(name), "{name} is not defined");
    }
}
