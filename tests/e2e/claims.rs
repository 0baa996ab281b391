//! Issue 25: the audit and claims (reservations), with the real operator and API server. An
//! orphan claim is swept by the age of its last write, never while an ADD may still record it;
//! a pool entry whose claim was deleted (upstream's DEL deletes by name) gets it back.

use std::time::{Duration, Instant};

use serde_json::{Value, json};

use crate::harness::{
    Cni, CniCall, Ns, OperatorProcess, eventually, kustomize, repo, token_kubeconfig,
    upstream_spawn,
};

/// A fast audit; claims younger than `age` are spared.
fn operator(ns: &Ns, age: &str) -> OperatorProcess {
    let mut op = OperatorProcess::start(
        ns.dir.path(),
        "op",
        &[
            format!("--pool-namespace={}", ns.name),
            "--leader-election=false".into(),
            "--audit-interval=1s".into(),
            "--stale-grace=1s".into(),
            format!("--orphan-claim-age={age}"),
        ],
    );
    op.wait_ready();
    op
}

fn apply(ns: &Ns, v: serde_json::Value) {
    ns.kubectl_ok_stdin(&["apply", "-f", "-"], &v.to_string());
}

fn orphan_claim(ns: &Ns, name: &str) {
    apply(
        ns,
        json!({"apiVersion": "whereabouts.cni.cncf.io/v1alpha1", "kind": "OverlappingRangeIPReservation",
        "metadata": {"name": name, "namespace": ns.name},
        "spec": {"podref": format!("{}/slow", ns.name), "containerid": "c-slow", "ifname": "net1"}}),
    );
}

#[test]
fn an_orphan_claim_is_swept_only_once_its_last_write_is_old_enough() {
    let ns = Ns::new("claims-age");
    let op = operator(&ns, "8s");
    let created = Instant::now();
    orphan_claim(&ns, "10.78.0.5");
    // Audits every second, each claim seen twice a second apart: only its age holds it back.
    std::thread::sleep(Duration::from_secs(5));
    assert!(
        ns.reservations().contains_key("10.78.0.5"),
        "swept {:?} after it was written\n{}",
        created.elapsed(),
        op.log()
    );
    // Written again (an ADD's retry renewing it, a take-over): as young as that write.
    let renewed = Instant::now();
    ns.kubectl_ok(&[
        "annotate",
        "overlappingrangeipreservation",
        "10.78.0.5",
        "whereabouts.cni.cncf.io/renewed=1",
    ]);
    std::thread::sleep(Duration::from_secs(5));
    let present = ns.reservations().contains_key("10.78.0.5");
    let since = renewed.elapsed();
    assert!(
        present || since >= Duration::from_secs(8),
        "swept {since:?} after it was renewed\n{}",
        op.log()
    );
    assert!(
        eventually(30, || ns.reservations().is_empty()),
        "the old orphan stayed\n{}",
        op.log()
    );
    assert!(renewed.elapsed() >= Duration::from_secs(8), "{}", op.log());
}

/// The pool entry of a plugin ADD on a NAD's network, and its claim.
fn add(ns: &Ns, range: &str, overlapping: bool, pod: &str) -> String {
    let uid = ns.create_pod(pod, &Default::default());
    let ipam = json!({"range": range, "enable_overlapping_ranges": overlapping});
    let out = ns.cni(
        "ADD",
        &ns.netconf("1.0.0", ipam),
        &format!("c-{pod}"),
        "net1",
        pod,
        &uid,
    );
    let addr = out.addresses();
    assert_eq!(addr.len(), 1, "{out:?}");
    addr[0].split('/').next().unwrap().to_owned()
}

fn nad(ns: &Ns, name: &str, range: &str, overlapping: bool) {
    let config = json!({"cniVersion": "1.0.0", "name": name, "type": "macvlan", "master": "eth0",
        "ipam": {"type": "whereabouts", "range": range, "enable_overlapping_ranges": overlapping}});
    apply(
        ns,
        json!({"apiVersion": "k8s.cni.cncf.io/v1", "kind": "NetworkAttachmentDefinition",
        "metadata": {"name": name, "namespace": ns.name}, "spec": {"config": config.to_string()}}),
    );
}

#[test]
fn a_pool_entry_whose_claim_was_deleted_gets_it_back() {
    let ns = Ns::new("claims-restore");
    nad(&ns, "guarded", "10.79.0.0/24", true);
    nad(&ns, "unguarded", "10.79.1.0/24", false);
    let guarded = add(&ns, "10.79.0.0/24", true, "a");
    let unguarded = add(&ns, "10.79.1.0/24", false, "b");
    let claims = ns.reservations();
    assert!(claims.contains_key(&guarded), "{claims:?}");
    assert!(!claims.contains_key(&unguarded), "{claims:?}");
    // What upstream's DEL of another sandbox does: delete the reservation by name.
    ns.kubectl_ok(&["delete", "overlappingrangeipreservation", &guarded]);
    let op = operator(&ns, "3m");
    assert!(
        eventually(30, || ns.reservations().contains_key(&guarded)),
        "the claim was not re-created\n{}",
        op.log()
    );
    let claim = &ns.reservations()[&guarded];
    assert_eq!(claim["podref"], format!("{}/a", ns.name), "{claim}");
    assert_eq!(claim["containerid"], "c-a", "{claim}");
    let metrics = op.get("/metrics").unwrap_or_default();
    assert!(
        metrics.contains("whereabouts_claims_restored_total 1"),
        "{metrics}"
    );
    // A network without reservations gets none: its entries are not claims' business.
    std::thread::sleep(Duration::from_secs(4));
    assert!(!ns.reservations().contains_key(&unguarded), "{}", op.log());
    assert_eq!(ns.allocations("10.79.1.0-24").len(), 1);
}

/// Upstream's v0.9.2 ADD over two ranges that finds a claim of its own pod on the first one (left
/// by a DEL of an earlier sandbox killed between its pool write and its claim's delete) reuses it,
/// and then creates no claim for the second range either (its "skip" flag is set once for the
/// whole ADD). The entry stands unguarded until the audit re-creates its claim.
#[test]
fn upstreams_second_range_left_unclaimed_after_it_reused_its_pods_claim_gets_one() {
    let ns = Ns::new("claims-upstream");
    let podref = format!("{}/p", ns.name);
    apply(
        &ns,
        json!({"apiVersion": "whereabouts.cni.cncf.io/v1alpha1", "kind": "OverlappingRangeIPReservation",
        "metadata": {"name": "10.81.0.1", "namespace": ns.name},
        "spec": {"podref": podref, "containerid": "c-killed-del", "ifname": "net1"}}),
    );
    let conf = ns.netconf(
        "0.4.0",
        json!({"ipRanges": [{"range": "10.81.0.0/24"}, {"range": "fd81::/64"}]}),
    );
    let up = CniCall {
        command: "ADD",
        conf: &conf,
        container: "c-second-sandbox",
        ifname: "net1",
        netns: "/var/run/netns/none",
        args: &format!(
            "IgnoreUnknown=1;K8S_POD_NAMESPACE={};K8S_POD_NAME=p;K8S_POD_UID=u",
            ns.name
        ),
        path: None,
    }
    .spawn(repo().join("bench/bin/whereabouts-upstream"));
    let out = Cni::from(up.wait_with_output().unwrap());
    assert_eq!(out.addresses(), ["10.81.0.1/24", "fd81::1/64"], "{out:?}");
    // Upstream's defect, as it is: no claim for the second range's address.
    assert!(
        !ns.reservations().contains_key("fd81--1"),
        "{:?}",
        ns.reservations()
    );
    ns.create_pod("p", &Default::default());
    let op = operator(&ns, "3m");
    assert!(
        eventually(30, || ns.reservations().contains_key("fd81--1")),
        "the second range's entry stayed unclaimed\n{}",
        op.log()
    );
    let claims = ns.reservations();
    assert_eq!(claims["fd81--1"]["podref"], podref, "{claims:?}");
    assert_eq!(
        claims["fd81--1"]["containerid"], "c-second-sandbox",
        "{claims:?}"
    );
    assert_eq!(claims["10.81.0.1"]["podref"], podref, "{claims:?}");
}

/// Upstream v0.9.2's ADD reports success with an address that no pool entry records when its pool
/// write fails: after its retries (100 failed JSON-patch `test`s on a busy pool) or at once on any
/// other error (a crashed or paused API server, a refusal), it still creates the address's
/// reservation, and that call's result replaces the pool write's error
/// (`IPManagementKubernetesUpdate`). Its pod runs with the address; the reservation is all that
/// keeps every pool of the range from handing it out again. The chaos tier saw this twice (seed 3
/// at b972ac0, seed 7 at 04682b4): the audit swept the claim as an orphan, and upstream gave the
/// address to a second pod. Reproduced here with upstream's account refused its pool patches. The
/// claim is not swept while its pod reports the address (Multus's network-status); it is once the
/// pod is gone. A claim its pod does not report is swept.
#[test]
fn a_claim_whose_pod_reports_its_address_is_not_swept_while_the_pod_lives() {
    let ns = Ns::new("claims-held");
    let account = upstream_account(&ns, false);
    let conf = ns.netconf("0.4.0", json!({"range": "10.78.0.0/24"}));
    ns.create_pod("held", &Default::default());
    let add = Cni::from(
        upstream(&ns, &account, &conf, json!({}), "held", "c-held", "ADD")
            .wait_with_output()
            .unwrap(),
    );
    assert_eq!(add.addresses(), ["10.78.0.1/24"], "{add:?}");
    assert!(
        ns.allocations("10.78.0.0-24").is_empty(),
        "upstream's pool write was refused, yet it recorded an entry"
    );
    assert_eq!(
        ns.reservations()["10.78.0.1"]["podref"],
        format!("{}/held", ns.name)
    );
    // Multus reports the address the ADD returned.
    let status = json!([{"name": format!("{}/lan", ns.name), "interface": "net1",
        "ips": ["10.78.0.1"], "default": false}]);
    ns.kubectl_ok(&[
        "annotate",
        "pod",
        "held",
        &format!("k8s.v1.cni.cncf.io/network-status={status}"),
    ]);
    // Another claim of the same pod (upstream's: no container id or pod UID) that it does not report.
    apply(
        &ns,
        json!({"apiVersion": "whereabouts.cni.cncf.io/v1alpha1", "kind": "OverlappingRangeIPReservation",
        "metadata": {"name": "10.78.0.7", "namespace": ns.name},
        "spec": {"podref": format!("{}/held", ns.name), "ifname": "net1"}}),
    );
    let op = operator(&ns, "2s");
    assert!(
        eventually(30, || !ns.reservations().contains_key("10.78.0.7")),
        "the claim its pod does not report stayed\n{}",
        op.log()
    );
    // Audits every second, the claim old enough for seconds already: only the pod keeps it.
    std::thread::sleep(Duration::from_secs(6));
    assert!(
        ns.reservations().contains_key("10.78.0.1"),
        "swept while its pod reports it\n{}",
        op.log()
    );
    // So the next pod, ours or upstream's, gets another address.
    let next = ns.cni("ADD", &conf, "c-next", "net1", "next", "uid-next");
    assert_eq!(next.addresses(), ["10.78.0.2/24"], "{next:?}");
    ns.kubectl_ok(&[
        "delete",
        "pod",
        "held",
        "--wait=false",
        "--grace-period=0",
        "--force",
    ]);
    assert!(
        eventually(30, || !ns.reservations().contains_key("10.78.0.1")),
        "the claim stayed after its pod went\n{}",
        op.log()
    );
}

/// A service account of upstream's own, with the rules of upstream's ClusterRole (its
/// daemonset-install.yaml) in `ns`, the pool namespace: a kubeconfig with its token. Without
/// `patch_pools`, its pool writes (JSON patches) are refused with 403.
fn upstream_account(ns: &Ns, patch_pools: bool) -> std::path::PathBuf {
    ns.kubectl_ok(&["create", "serviceaccount", "whereabouts-upstream"]);
    let all = json!([
        "get", "list", "watch", "create", "update", "patch", "delete"
    ]);
    let pool_verbs = if patch_pools {
        all.clone()
    } else {
        json!(["get", "list", "watch", "create", "update", "delete"])
    };
    let group = "whereabouts.cni.cncf.io";
    apply(
        ns,
        json!({"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "Role",
        "metadata": {"name": "whereabouts-upstream", "namespace": ns.name},
        "rules": [
            {"apiGroups": [group], "resources": ["ippools"], "verbs": pool_verbs},
            {"apiGroups": [group], "resources": ["overlappingrangeipreservations"], "verbs": all},
            {"apiGroups": ["coordination.k8s.io"], "resources": ["leases"], "verbs": all},
            {"apiGroups": [""], "resources": ["pods"], "verbs": all},
        ]}),
    );
    ns.kubectl_ok(&[
        "create",
        "rolebinding",
        "whereabouts-upstream",
        "--role=whereabouts-upstream",
        &format!("--serviceaccount={}:whereabouts-upstream", ns.name),
    ]);
    let token = ns.kubectl_ok(&["create", "token", "whereabouts-upstream", "--duration=10m"]);
    token_kubeconfig(ns, "upstream.kubeconfig", token.trim())
}

/// Upstream's plugin under `kubeconfig` for pod `pod` (container `container`), on `conf` with
/// `extra` merged into its ipam section.
fn upstream(
    ns: &Ns,
    kubeconfig: &std::path::Path,
    conf: &Value,
    extra: Value,
    pod: &str,
    container: &str,
    command: &str,
) -> std::process::Child {
    let flat = ns.dir.path().join("upstream.conf");
    std::fs::write(
        &flat,
        json!({"kubernetes": {"kubeconfig": kubeconfig}}).to_string(),
    )
    .unwrap();
    let mut conf = conf.clone();
    conf["ipam"]["configuration_path"] = flat.to_str().unwrap().into();
    for (k, v) in extra.as_object().unwrap() {
        conf["ipam"][k] = v.clone();
    }
    upstream_spawn(ns, &conf, command, container, pod)
}

/// Upstream's DEL, run under a service account of its own, deletes the reservation of the address
/// its pool entry had by name, with no precondition. When its ADD lost the race for that address
/// to ours (it writes its pool before its reservation), that reservation is our running pod's
/// claim, and its retry took the address again: two pods on one address (the chaos tier, with
/// overlapping pools). config/rbac/claims-kept.yaml refuses a service account's delete of our
/// claim by name alone (ours name the UID they read); upstream's DEL still succeeds, its entry is
/// gone, and its retry gets another address.
#[test]
fn upstreams_del_does_not_delete_our_claim_of_the_address_it_lost() {
    let ns = Ns::new("claims-kept");
    let kept: Vec<Value> = kustomize("config/default")
        .into_iter()
        .filter(|o| o["metadata"]["name"] == "whereabouts-claims-kept")
        .collect();
    assert_eq!(kept.len(), 2, "{kept:?}");
    let list = json!({"apiVersion": "v1", "kind": "List", "items": kept});
    ns.kubectl_ok_stdin(&["apply", "-f", "-"], &list.to_string());
    let account = upstream_account(&ns, true);
    // Ours on 10.82.0.0/23, upstream's on the /22 that holds it: the same reservation names.
    let ours = ns.netconf("0.4.0", json!({"range": "10.82.0.0/23"}));
    let theirs = ns.netconf("0.4.0", json!({"range": "10.82.0.0/22"}));
    // Upstream's ADD checks that 10.82.0.1 is unreserved, then waits before its pool write...
    let lost = upstream(
        &ns,
        &account,
        &theirs,
        json!({"sleep_for_race": 4}),
        "theirs",
        "c-up-0",
        "ADD",
    );
    std::thread::sleep(Duration::from_millis(1500));
    // ... while ours takes the address and reserves it for its pod.
    let mine = ns.cni("ADD", &ours, "c-mine", "net1", "mine", "uid-mine");
    assert_eq!(mine.addresses(), ["10.82.0.1/23"], "{mine:?}");
    let lost = Cni::from(lost.wait_with_output().unwrap());
    assert!(!lost.ok, "upstream's ADD did not lose the race: {lost:?}");
    assert_eq!(
        ns.allocations("10.82.0.0-22").len(),
        1,
        "upstream's entry of its lost ADD"
    );
    // The runtime's DEL of that sandbox: its entry goes, our claim stays; it reports no error.
    let del = Cni::from(
        upstream(&ns, &account, &theirs, json!({}), "theirs", "c-up-0", "DEL")
            .wait_with_output()
            .unwrap(),
    );
    assert!(del.ok, "{del:?}");
    assert!(
        ns.allocations("10.82.0.0-22").is_empty(),
        "upstream's entry stayed"
    );
    let claims = ns.reservations();
    assert_eq!(
        claims["10.82.0.1"]["podref"],
        format!("{}/mine", ns.name),
        "{claims:?}"
    );
    // The runtime's retry: another address.
    let retry = Cni::from(
        upstream(&ns, &account, &theirs, json!({}), "theirs", "c-up-1", "ADD")
            .wait_with_output()
            .unwrap(),
    );
    assert_eq!(retry.addresses(), ["10.82.0.2/22"], "{retry:?}");
    // Ours may still release its claim; and upstream its own (no container id).
    let freed = ns.cni("DEL", &ours, "c-mine", "net1", "mine", "uid-mine");
    assert!(
        freed.ok && !ns.reservations().contains_key("10.82.0.1"),
        "{freed:?}"
    );
    let del = Cni::from(
        upstream(&ns, &account, &theirs, json!({}), "theirs", "c-up-1", "DEL")
            .wait_with_output()
            .unwrap(),
    );
    assert!(
        del.ok && ns.reservations().is_empty(),
        "{del:?} {:?}",
        ns.reservations()
    );
    // The namespace controller may delete our claims: a namespace with one goes.
    let again = ns.cni("ADD", &ours, "c-again", "net1", "again", "uid-again");
    assert!(again.ok, "{again:?}");
    ns.kubectl_ok(&["delete", "namespace", &ns.name, "--wait=false"]);
    assert!(
        eventually(60, || ns
            .kubectl(&["get", "namespace", &ns.name], None)
            .status
            .code()
            == Some(1)),
        "namespace {} with our claim stayed",
        ns.name
    );
}

/// Two pods on one address, which the audit cannot repair (which of them should move?), are
/// reported: entries of two pods in overlapping pools, and an entry whose claim names another
/// pod. The gauge counts them, the log names the pods, and both clear once repaired.
#[test]
fn an_address_two_pods_hold_is_reported_until_it_is_not() {
    let ns = Ns::new("claims-twice");
    for pod in ["a", "b", "x", "y"] {
        ns.create_pod(pod, &Default::default());
    }
    let entry = |pod: &str| json!({"id": format!("c-{pod}"), "podref": format!("{}/{pod}", ns.name), "ifname": "net1"});
    let pool = |range: &str, allocations: Value| {
        let name = range.replace('/', "-");
        json!({"apiVersion": "whereabouts.cni.cncf.io/v1alpha1", "kind": "IPPool",
            "metadata": {"name": name, "namespace": ns.name},
            "spec": {"range": range, "allocations": allocations}})
    };
    apply(
        &ns,
        pool("10.83.0.0/23", json!({"1": entry("a"), "2": entry("b")})),
    );
    apply(&ns, pool("10.83.0.0/22", json!({"1": entry("x")})));
    for (address, pod) in [("10.83.0.1", "a"), ("10.83.0.2", "y")] {
        apply(
            &ns,
            json!({"apiVersion": "whereabouts.cni.cncf.io/v1alpha1", "kind": "OverlappingRangeIPReservation",
            "metadata": {"name": address, "namespace": ns.name},
            "spec": {"podref": format!("{}/{pod}", ns.name), "containerid": format!("c-{pod}"), "ifname": "net1"}}),
        );
    }
    let op = operator(&ns, "3m");
    let op = &op;
    let gauge = |n: usize| {
        let line = format!("whereabouts_addresses_held_twice {n}\n");
        move || op.get("/metrics").is_some_and(|m| m.contains(&line))
    };
    assert!(eventually(30, gauge(2)), "{}", op.log());
    let log = op.log();
    for pod in ["a", "b", "x", "y"] {
        let holder = format!("{}/{pod} (net1)", ns.name);
        assert!(log.contains(&holder), "{holder} not named\n{log}");
    }
    assert!(log.contains("two pods hold one address"), "{log}");
    // Repaired: x's entry goes (its pod given another address), b's claim is b's.
    ns.kubectl_ok(&[
        "patch",
        "ippool",
        "10.83.0.0-22",
        "--type=json",
        "-p",
        r#"[{"op": "remove", "path": "/spec/allocations/1"}]"#,
    ]);
    ns.kubectl_ok(&[
        "patch",
        "overlappingrangeipreservation",
        "10.83.0.2",
        "--type=merge",
        "-p",
        &json!({"spec": {"podref": format!("{}/b", ns.name), "containerid": "c-b"}}).to_string(),
    ]);
    assert!(eventually(30, gauge(0)), "{}", op.log());
}
