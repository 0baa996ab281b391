//! The monitoring pieces name only metrics the operator or the node agent defines, and scrape
//! what they mean to.

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

/// The name of every metric the operator (its own families and the usage collector's) or the
/// node agent can export; series appear once they have a value.
fn defined_names() -> BTreeSet<String> {
    let mut names = whereabouts::metrics::Metrics::new().names();
    names.extend(whereabouts::controller::usage::family_names());
    names.extend(whereabouts::metrics::agent::AgentMetrics::new().names());
    names.into_iter().collect()
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
    let defined: BTreeSet<String> = defined_names();
    let used = names_in(&text);
    assert!(!used.is_empty(), "{file} names no metric");
    for name in used
        .iter()
        .filter(|n| !n.ends_with('_') && *n != "whereabouts_ipam")
    {
        assert!(
            defined.contains(base(name)),
            "{file} uses {name}, which neither the operator nor the agent exports; defined: {defined:?}"
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
    let defined: BTreeSet<String> = defined_names();
    for name in [
        "whereabouts_pool_size_addresses",
        "whereabouts_pool_allocated_addresses",
        "whereabouts_pool_free_addresses",
        "whereabouts_network_size_addresses",
        "whereabouts_network_allocated_addresses",
        "whereabouts_stale_reservations",
        "whereabouts_orphan_reservations",
        "whereabouts_addresses_held_twice",
        "whereabouts_releases_total",
        "whereabouts_release_errors_total",
        "whereabouts_reconcile_total",
        "whereabouts_reconcile_duration_seconds",
        "whereabouts_webhook_requests_total",
        "whereabouts_webhook_duration_seconds",
        "whereabouts_leader",
        "whereabouts_build_info",
        "whereabouts_agent_queue_depth",
        "whereabouts_agent_group_size",
        "whereabouts_agent_handbacks_total",
        "whereabouts_agent_held_back_total",
        "whereabouts_agent_requests_total",
        "whereabouts_agent_request_duration_seconds",
    ] {
        assert!(defined.contains(name), "{name} is not defined");
    }
}

/// The PodMonitor scrapes the node agent: it selects the DaemonSet's pods and names the agent
/// container's metrics port.
#[test]
fn the_pod_monitor_selects_the_agent_and_its_port() {
    use serde_json::Value;
    let read = |path: &str| -> Value {
        let text =
            std::fs::read_to_string(format!("{}/{path}", env!("CARGO_MANIFEST_DIR"))).unwrap();
        serde_saphyr::from_str(&text).unwrap()
    };
    let monitor = read("config/monitoring/podmonitor.yaml");
    let ds = read("config/cni/daemonset.yaml");
    let kustomization = read("config/monitoring/kustomization.yaml");
    assert!(
        kustomization["resources"]
            .as_array()
            .unwrap()
            .contains(&Value::from("podmonitor.yaml")),
        "podmonitor.yaml is not in the kustomization"
    );
    let template = &ds["spec"]["template"];
    let wanted = monitor["spec"]["selector"]["matchLabels"]
        .as_object()
        .unwrap();
    assert!(!wanted.is_empty());
    for (k, v) in wanted {
        assert_eq!(&template["metadata"]["labels"][k], v, "label {k:?}");
    }
    assert_eq!(
        monitor["metadata"]["namespace"],
        ds["metadata"]["namespace"]
    );
    let agent = template["spec"]["containers"]
        .as_array()
        .unwrap()
        .iter()
        .find(|c| c["name"] == "agent")
        .unwrap();
    for endpoint in monitor["spec"]["podMetricsEndpoints"].as_array().unwrap() {
        let port = &endpoint["port"];
        assert!(
            agent["ports"]
                .as_array()
                .unwrap()
                .iter()
                .any(|p| &p["name"] == port),
            "the agent has no port named {port:?}"
        );
    }
}
