//! Metrics and health of the real operator, scraped directly and by a real Prometheus.

use std::collections::BTreeMap;
use std::process::{Command, Stdio};

use serde_json::json;

use crate::harness::{Ns, OperatorProcess, eventually, free_port, http_get, repo};

/// The grace is long enough that the audit never beats the pod-deletion path to a deleted pod's
/// entry, even on a loaded machine, so each release is counted under its own reason.
fn flags(ns: &Ns) -> Vec<String> {
    vec![
        format!("--pool-namespace={}", ns.name),
        "--leader-election=false".into(),
        "--audit-interval=1s".into(),
        "--stale-grace=8s".into(),
    ]
}

/// The value of one series in a Prometheus text exposition.
fn sample(text: &str, series: &str) -> Option<f64> {
    text.lines().find_map(|l| {
        l.strip_prefix(series)?
            .strip_prefix(' ')?
            .trim()
            .parse()
            .ok()
    })
}

fn scraped(op: &OperatorProcess, series: &str) -> Option<f64> {
    sample(&op.get("/metrics")?, series)
}

/// Waits up to `secs` for `series` to read `value`; fails with the whole scrape.
fn wait_for(op: &OperatorProcess, series: &str, value: f64, secs: u64) {
    assert!(
        eventually(secs, || scraped(op, series) == Some(value)),
        "{series} never read {value}: {:?}",
        op.get("/metrics")
    );
}

#[test]
fn metrics_equal_what_the_pools_hold() {
    let ns = Ns::new("metrics");
    let ipam = json!({"range": "10.80.0.0/24", "range_start": "10.80.0.10", "exclude": ["10.80.0.100/30"]});
    let mut nad_config = json!({"cniVersion": "1.0.0", "name": "net", "type": "macvlan", "master": "eth0", "ipam": ipam.clone()});
    nad_config["ipam"]["type"] = "whereabouts".into();
    let nad = format!(
        "apiVersion: k8s.cni.cncf.io/v1\nkind: NetworkAttachmentDefinition\nmetadata:\n  name: net\n  namespace: {}\nspec:\n  config: '{}'\n",
        ns.name, nad_config
    );
    assert!(ns.apply(&nad).status.success());
    let mut op = OperatorProcess::start(ns.dir.path(), "op", &flags(&ns));
    op.wait_ready();
    let conf = ns.netconf("1.0.0", ipam);
    for i in 0..5 {
        let uid = ns.create_pod(&format!("p{i}"), &BTreeMap::new());
        ns.cni(
            "ADD",
            &conf,
            &format!("c{i}"),
            "net1",
            &format!("p{i}"),
            &uid,
        )
        .addresses();
    }
    let pool = r#"{pool="10.80.0.0-24",range="10.80.0.0/24"}"#;
    let network = format!(r#"{{network="{}/net",range="10.80.0.0/24"}}"#, ns.name);
    wait_for(
        &op,
        &format!("whereabouts_pool_allocated_addresses{pool}"),
        5.0,
        10,
    );
    assert_eq!(
        scraped(&op, &format!("whereabouts_pool_size_addresses{pool}")),
        Some(254.0)
    );
    assert_eq!(
        scraped(&op, &format!("whereabouts_pool_free_addresses{pool}")),
        Some(249.0)
    );
    // Window .10-.254 is 245 addresses, less the 4 excluded ones.
    assert_eq!(
        scraped(&op, &format!("whereabouts_network_size_addresses{network}")),
        Some(241.0)
    );
    assert_eq!(
        scraped(
            &op,
            &format!("whereabouts_network_allocated_addresses{network}")
        ),
        Some(5.0)
    );

    ns.kubectl_ok(&["delete", "pod", "p0"]);
    wait_for(
        &op,
        &format!("whereabouts_pool_allocated_addresses{pool}"),
        4.0,
        10,
    );
    // The pool watch can show the entry gone before the release (its reservation delete
    // included) has finished and been counted.
    wait_for(
        &op,
        r#"whereabouts_releases_total{reason="pod_deleted"}"#,
        1.0,
        10,
    );

    // A leaked entry: its pod never existed. The audit reports it, then releases it.
    ns.cni("ADD", &conf, "c-ghost", "net1", "ghost", "")
        .addresses();
    let stale = r#"whereabouts_stale_reservations{pool="10.80.0.0-24"}"#;
    wait_for(&op, stale, 1.0, 20);
    assert!(eventually(30, || scraped(&op, stale).unwrap_or(0.0) == 0.0
        && scraped(
            &op,
            &format!("whereabouts_pool_allocated_addresses{pool}")
        ) == Some(4.0)));
    wait_for(
        &op,
        r#"whereabouts_releases_total{reason="audit"}"#,
        1.0,
        10,
    );
    assert_eq!(
        ns.allocations("10.80.0.0-24").len(),
        4,
        "the exported count equals what the pool holds"
    );

    prometheus_scrapes(&ns, &op, 4.0);
}

/// A real Prometheus scrapes the operator; PromQL returns the pool's allocated count.
fn prometheus_scrapes(ns: &Ns, op: &OperatorProcess, expected: f64) {
    let port = free_port();
    let dir = ns.dir.path().join("prometheus");
    std::fs::create_dir_all(&dir).unwrap();
    let config = format!(
        "global:\n  scrape_interval: 1s\nscrape_configs:\n  - job_name: whereabouts\n    static_configs:\n      - targets: ['127.0.0.1:{}']\n",
        op.admin_port
    );
    std::fs::write(dir.join("prometheus.yml"), config).unwrap();
    let mut prom = Command::new("prometheus")
        .arg(format!(
            "--config.file={}",
            dir.join("prometheus.yml").display()
        ))
        .arg(format!(
            "--storage.tsdb.path={}",
            dir.join("data").display()
        ))
        .arg(format!("--web.listen-address=127.0.0.1:{port}"))
        .stdout(Stdio::null())
        .stderr(std::fs::File::create(dir.join("log")).unwrap())
        .spawn()
        .expect("Debian's prometheus package (e2e/install-deps.sh)");
    let query =
        "/api/v1/query?query=whereabouts_pool_allocated_addresses%7Bpool%3D%2210.80.0.0-24%22%7D";
    let value = || -> Option<f64> {
        let response = http_get(port, query)?;
        let body: serde_json::Value =
            serde_json::from_str(response.split("\r\n\r\n").nth(1)?).ok()?;
        body["data"]["result"][0]["value"][1].as_str()?.parse().ok()
    };
    let ok = eventually(30, || value() == Some(expected));
    let _ = prom.kill();
    let _ = prom.wait();
    assert!(
        ok,
        "PromQL gave {:?}; log: {}",
        value(),
        std::fs::read_to_string(dir.join("log")).unwrap_or_default()
    );
}

#[test]
fn readyz_names_what_is_not_ready() {
    let ns = Ns::new("readyz");
    // An API server nobody answers at: the caches can never sync.
    let dead = ns.dir.path().join("dead-kubeconfig");
    std::fs::copy(&ns.kubeconfig, &dead).unwrap();
    let out = Command::new(crate::harness::kubectl_bin())
        .args([
            "--kubeconfig",
            dead.to_str().unwrap(),
            "config",
            "set-cluster",
            "--server=https://127.0.0.1:1",
        ])
        .arg(ns.kubectl_ok(&["config", "view", "-o", "jsonpath={.clusters[0].name}"]))
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let admin_port = free_port();
    let mut child = Command::new(env!("CARGO_BIN_EXE_whereabouts-operator"))
        .args(["run", "--leader-election=false", "--pool-namespace=x"])
        .arg(format!("--admin-addr=127.0.0.1:{admin_port}"))
        .env("KUBECONFIG", &dead)
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let saw = eventually(10, || {
        http_get(admin_port, "/readyz")
            .is_some_and(|r| r.starts_with("HTTP/1.1 503") && r.contains("caches: not synced"))
    });
    let livez = http_get(admin_port, "/livez");
    let _ = child.kill();
    let _ = child.wait();
    assert!(saw, "{:?}", http_get(admin_port, "/readyz"));
    assert!(livez.is_some_and(|r| r.starts_with("HTTP/1.1 200")));
    // And with a working API server it becomes ready (OperatorProcess::wait_ready waits for 200).
    let mut op = OperatorProcess::start(ns.dir.path(), "op", &flags(&ns));
    op.wait_ready();
}

#[test]
fn promtool_accepts_the_alert_rules() {
    let rule: serde_json::Value = serde_saphyr::from_str(
        &std::fs::read_to_string(repo().join("config/monitoring/prometheusrule.yaml")).unwrap(),
    )
    .unwrap();
    let dir = tempfile::tempdir().unwrap();
    let rules = dir.path().join("rules.yaml");
    std::fs::write(&rules, serde_saphyr::to_string(&rule["spec"]).unwrap()).unwrap();
    let out = Command::new("promtool")
        .args(["check", "rules"])
        .arg(&rules)
        .output()
        .expect("promtool (Debian's prometheus package)");
    assert!(
        out.status.success(),
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
}
