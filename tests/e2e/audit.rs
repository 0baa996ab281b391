//! `whereabouts-operator audit` and `repair` against a namespace seeded with every kind of
//! inconsistency, some written by hand and some by upstream's v0.9.2 plugin: the report names
//! each exactly, repair fixes what it may, a pod created between audit and repair keeps its
//! address, and a second audit finds only what needs a person.

use std::collections::BTreeMap;
use std::process::{Command, Output};

use serde_json::{Value, json};

use crate::harness::{Cni, CniCall, Ns, repo};

fn operator(ns: &Ns, args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_whereabouts-operator"))
        .args(args)
        .env("KUBECONFIG", &ns.kubeconfig)
        .output()
        .expect("run whereabouts-operator")
}

/// The JSON report, and its findings of this namespace as `kind: subject` lines.
fn audit(ns: &Ns) -> (Value, Vec<String>) {
    let out = operator(
        ns,
        &[
            "audit",
            "--pool-namespace",
            &ns.name,
            "-o",
            "json",
            "--min-age",
            "0s",
        ],
    );
    assert!(
        out.status.code().is_some_and(|c| c <= 1),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let report: Value = serde_json::from_slice(&out.stdout).unwrap();
    let mine = report["findings"]
        .as_array()
        .unwrap()
        .iter()
        .filter_map(|f| {
            let kind = f["kind"].as_str().unwrap();
            let subject = match kind {
                "stale-entry" | "missing-reservation" => {
                    format!(
                        "{} {}",
                        f["at"]["pool"].as_str()?,
                        f["at"]["address"].as_str()?
                    )
                }
                "orphan-reservation" => f["name"].as_str()?.to_owned(),
                "duplicate-address" => f["address"].as_str()?.to_owned(),
                "outside-range" => format!("{} {}", f["pool"].as_str()?, f["key"].as_str()?),
                "invalid-nad" => f["nad"].as_str()?.to_owned(),
                other => other.to_owned(),
            };
            let ours = f.to_string().contains(&ns.name);
            ours.then(|| format!("{kind}: {subject}"))
        })
        .collect();
    (report, mine)
}

fn apply(ns: &Ns, object: Value) {
    let out = ns.apply(&object.to_string());
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
}

fn pool(ns: &Ns, name: &str, range: &str, allocations: Value) -> Value {
    json!({"apiVersion": "whereabouts.cni.cncf.io/v1alpha1", "kind": "IPPool",
        "metadata": {"name": name, "namespace": ns.name}, "spec": {"range": range, "allocations": allocations}})
}

#[test]
fn audit_reports_each_inconsistency_and_repair_fixes_what_it_may() {
    let ns = Ns::new("audit");
    let conf = ns.netconf("1.0.0", json!({"range": "10.170.0.0/24"}));
    // Consistent: a live pod's address, allocated by our plugin.
    let alive = ns.create_pod("alive", &BTreeMap::new());
    assert_eq!(
        ns.cni("ADD", &conf, "c-alive", "net1", "alive", &alive)
            .addresses(),
        ["10.170.0.1/24"]
    );
    // Upstream's plugin for a pod that does not exist: an entry and a reservation, both stale.
    let up = CniCall {
        command: "ADD",
        conf: &conf,
        container: "c-ghost",
        ifname: "net1",
        netns: "/var/run/netns/none",
        args: &format!(
            "IgnoreUnknown=1;K8S_POD_NAMESPACE={};K8S_POD_NAME=ghost;K8S_POD_UID=u",
            ns.name
        ),
        path: None,
    }
    .spawn(repo().join("bench/bin/whereabouts-upstream"));
    assert_eq!(
        Cni::from(up.wait_with_output().unwrap()).addresses(),
        ["10.170.0.2/24"]
    );
    // By hand: entries of live pods without reservations, held twice across overlapping pools;
    // an entry outside its range; the entry of a pod about to be created; a killed ADD's claim.
    let a = ns.create_pod("dup-a", &BTreeMap::new());
    let b = ns.create_pod("dup-b", &BTreeMap::new());
    let mut allocations =
        ns.get_json(&["ippool", "10.170.0.0-24"]).unwrap()["spec"]["allocations"].clone();
    let podref = |p: &str| format!("{}/{p}", ns.name);
    allocations["5"] =
        json!({"id": "c-dup-a", "podref": podref("dup-a"), "ifname": "net1", "poduid": a});
    allocations["300"] = json!({"id": "c-far", "podref": podref("far"), "ifname": "net1"});
    allocations["9"] = json!({"id": "c-late", "podref": podref("late"), "ifname": "net1"});
    apply(
        &ns,
        pool(&ns, "10.170.0.0-24", "10.170.0.0/24", allocations),
    );
    apply(
        &ns,
        pool(
            &ns,
            "10.170.0.0-25",
            "10.170.0.0/25",
            json!({"5": {"id": "c-dup-b", "podref": podref("dup-b"), "ifname": "net1", "poduid": b}}),
        ),
    );
    let reservation = |ip: &str, pod: &str| {
        json!({"apiVersion": "whereabouts.cni.cncf.io/v1alpha1",
        "kind": "OverlappingRangeIPReservation", "metadata": {"name": ip, "namespace": ns.name},
        "spec": {"podref": podref(pod), "containerid": format!("c-{pod}"), "ifname": "net1"}})
    };
    apply(&ns, reservation("10.170.0.77", "killed"));
    apply(&ns, reservation("10.170.0.9", "late"));
    apply(
        &ns,
        json!({"apiVersion": "k8s.cni.cncf.io/v1", "kind": "NetworkAttachmentDefinition",
        "metadata": {"name": "broken", "namespace": ns.name},
        "spec": {"config": r#"{"cniVersion":"1.0.0","name":"b","type":"macvlan","ipam":{"type":"whereabouts","range":"10.170.0.0/24","range_start":"10.9.9.9"}}"#}}),
    );

    let (report, mut found) = audit(&ns);
    found.sort();
    assert_eq!(
        found,
        [
            "duplicate-address: 10.170.0.5".to_owned(),
            format!("invalid-nad: {}/broken", ns.name),
            "missing-reservation: 10.170.0.0-24 10.170.0.5".to_owned(),
            "missing-reservation: 10.170.0.0-25 10.170.0.5".to_owned(),
            "orphan-reservation: 10.170.0.77".to_owned(),
            "outside-range: 10.170.0.0-24 300".to_owned(),
            "stale-entry: 10.170.0.0-24 10.170.0.2".to_owned(),
            "stale-entry: 10.170.0.0-24 10.170.0.9".to_owned(),
        ],
        "{report:#}"
    );
    let text = operator(
        &ns,
        &["audit", "--pool-namespace", &ns.name, "--min-age", "0s"],
    );
    assert_eq!(text.status.code(), Some(1));
    let text = String::from_utf8_lossy(&text.stdout);
    assert!(
        text.contains(&format!("[repairable] stale-entry: pool 10.170.0.0-24 10.170.0.2 (offset 2) of pod {}/ghost container c-ghost", ns.name)),
        "{text}"
    );

    // Saved; then the pod of one stale entry is created before the repair runs.
    let file = ns.dir.path().join("report.json");
    std::fs::write(&file, report.to_string()).unwrap();
    ns.create_pod("late", &BTreeMap::new());
    let dry = operator(
        &ns,
        &[
            "repair",
            "--from-report",
            file.to_str().unwrap(),
            "--dry-run",
        ],
    );
    assert!(
        dry.status.success(),
        "{}",
        String::from_utf8_lossy(&dry.stderr)
    );
    assert!(String::from_utf8_lossy(&dry.stdout).contains("would remove 10.170.0.2"));
    assert_eq!(
        ns.allocations("10.170.0.0-24").len(),
        5,
        "a dry run writes nothing"
    );
    let out = operator(&ns, &["repair", "--from-report", file.to_str().unwrap()]);
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{stdout}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(
        stdout.contains(&format!(
            "skipped stale-entry: pod {}/late exists now",
            ns.name
        )),
        "{stdout}"
    );
    assert!(
        stdout.contains(&format!("removed 10.170.0.2 of pod {}/ghost", ns.name)),
        "{stdout}"
    );
    assert!(
        stdout.contains("deleted overlappingrangeipreservation 10.170.0.77"),
        "{stdout}"
    );
    assert!(
        stdout.contains("created overlappingrangeipreservation 10.170.0.5"),
        "{stdout}"
    );
    assert!(
        stdout.contains(
            "skipped missing-reservation: overlappingrangeipreservation 10.170.0.5 exists now"
        ),
        "{stdout}"
    );
    let pool = ns.allocations("10.170.0.0-24");
    assert!(pool.contains_key("9"), "the late pod keeps its address");
    assert!(!pool.contains_key("2"));
    assert!(!ns.reservations().contains_key("10.170.0.2"));

    // What is left needs a person: the duplicate (one reservation names one of its two pods),
    // the entry outside its range, the broken NAD.
    let (_, mut again) = audit(&ns);
    again.sort();
    assert_eq!(
        again,
        [
            "duplicate-address: 10.170.0.5".to_owned(),
            format!("invalid-nad: {}/broken", ns.name),
            "outside-range: 10.170.0.0-24 300".to_owned(),
        ]
    );
}
