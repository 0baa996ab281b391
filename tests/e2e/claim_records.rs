//! IPAMClaim records checked by the operator against their owner pods (docs/security.md): a fresh
//! record whose pod does not exist, runs on another node than the record names, or does not refer
//! to the claim gets a Warning Event `ClaimRecordUnverified`; one its pod bears out gets none.
//!
//! Other tests' operators run at the same time and check every claim too, so this test asserts
//! what each claim got, never how many events there are.

use serde_json::{Value, json};

use crate::harness::{Ns, OperatorProcess, eventually};

/// A pod bound to node `node` (no kubelet runs it) whose element for net1 refers to `claim`.
fn pod_on(ns: &Ns, name: &str, node: &str, claim: &str) {
    let networks = json!([{"name": "e2e-net", "interface": "net1", "ipam-claim-reference": claim}]);
    let pod = json!({"apiVersion": "v1", "kind": "Pod",
        "metadata": {"name": name, "namespace": ns.name,
            "annotations": {"k8s.v1.cni.cncf.io/networks": networks.to_string()}},
        "spec": {"nodeName": node, "automountServiceAccountToken": false,
            "containers": [{"name": "c", "image": "registry.invalid/pause"}]}});
    let out = ns.kubectl(&["create", "-f", "-"], Some(&pod.to_string()));
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
}

/// Writes on claim `name` what a node's ADD records: the address, the owner pod, and `node` in
/// RecordedBy. The condition's time is the writer's to set: backdated here, as a forger would, past
/// the age the operator checks; the record is still checked (its age is the API server's).
fn record(ns: &Ns, name: &str, ip: &str, pod: &str, node: &str) {
    let mut recorded = whereabouts::crd::claim::recorded_by(node);
    recorded.last_transition_time = "2001-01-01T00:00:00Z".into();
    let patch =
        json!({"status": {"ips": [ip], "ownerPod": {"name": pod}, "conditions": [recorded]}});
    ns.kubectl_ok(&[
        "patch",
        "ipamclaim",
        name,
        "--subresource=status",
        "--type=merge",
        "-p",
        &patch.to_string(),
    ]);
}

/// The notes of the ClaimRecordUnverified events about claim `name`.
fn unverified(ns: &Ns, name: &str) -> Vec<String> {
    let list = ns
        .get_json(&["events.v1.events.k8s.io"])
        .unwrap_or(Value::Null);
    (list["items"].as_array().into_iter().flatten())
        .filter(|e| e["reason"] == "ClaimRecordUnverified" && e["regarding"]["name"] == name)
        .map(|e| e["note"].as_str().unwrap_or_default().to_owned())
        .collect()
}

#[test]
fn the_operator_reports_a_claim_record_that_its_owner_pod_does_not_bear_out() {
    let ns = Ns::new("records");
    let op = OperatorProcess::for_namespace(&ns);
    let (a, b) = (format!("{}-a", ns.name), format!("{}-b", ns.name));
    // Borne out: its pod runs on a, the node the record names, and refers to the claim.
    ns.create_ipam_claim("good.e2e-net", "e2e-net");
    pod_on(&ns, "launcher-good", &a, "good.e2e-net");
    record(&ns, "good.e2e-net", "10.171.0.1/24", "launcher-good", &a);
    // Not: a pod that does not exist; a pod on a while the record names b; b's own pod of
    // another claim, named by b as the owner of this one.
    ns.create_ipam_claim("ghost.e2e-net", "e2e-net");
    record(&ns, "ghost.e2e-net", "10.171.0.2/24", "launcher-ghost", &b);
    ns.create_ipam_claim("moved.e2e-net", "e2e-net");
    pod_on(&ns, "launcher-moved", &a, "moved.e2e-net");
    record(&ns, "moved.e2e-net", "10.171.0.3/24", "launcher-moved", &b);
    ns.create_ipam_claim("stolen.e2e-net", "e2e-net");
    pod_on(&ns, "launcher-other", &b, "other.e2e-net");
    record(&ns, "stolen.e2e-net", "10.171.0.4/24", "launcher-other", &b);
    let want = [
        (
            "ghost.e2e-net",
            format!("its owner pod {}/launcher-ghost does not exist", ns.name),
        ),
        (
            "moved.e2e-net",
            format!("its owner pod {}/launcher-moved runs on {a}", ns.name),
        ),
        (
            "stolen.e2e-net",
            format!(
                "its owner pod {}/launcher-other does not refer to it for interface net1",
                ns.name
            ),
        ),
    ];
    let reported = || {
        want.iter().all(|(claim, why)| {
            unverified(&ns, claim)
                .iter()
                .any(|n| n.contains(why) && n.contains(&format!("names node {b}")))
        })
    };
    assert!(
        eventually(30, reported),
        "{:?}\n{}",
        want.iter()
            .map(|(c, _)| unverified(&ns, c))
            .collect::<Vec<_>>(),
        op.log()
    );
    // Every record was checked in the pass that reported these (or an earlier one): the one its
    // pod bears out was not reported, by this operator or any other.
    assert_eq!(unverified(&ns, "good.e2e-net"), Vec::<String>::new());
    // This operator's own count: the events above may be another operator's, seen before this
    // one's pass over the same claims has ended.
    let counted = || {
        let metrics = op.get("/metrics").unwrap_or_default();
        (metrics.lines()).any(|l| {
            l.starts_with("whereabouts_claim_records_unverified_total ")
                && l.split(' ').nth(1).and_then(|n| n.parse::<u64>().ok()) >= Some(3)
        })
    };
    assert!(
        eventually(30, counted),
        "{}",
        op.get("/metrics").unwrap_or_default()
    );
}
