//! A pod deleted while the operator's pod watch is down. An API server restart makes every
//! client's watch list again (the new server's watch cache starts at the current revision, so the
//! old resourceVersion is "too old"), and a pod deleted in that gap never comes as a Delete
//! event. The operator talks to a replica API server of its own (`e2e/cluster.sh replica`), which
//! this test restarts without disturbing the other tests.

use std::process::Command;

use crate::harness::{Ns, OperatorProcess, admin_kubeconfig, eventually, repo, signal};
use crate::operator::{attached_pod, dual, entries};

fn cluster(args: &[&str]) -> String {
    admin_kubeconfig();
    let out = Command::new(repo().join("e2e/cluster.sh"))
        .args(args)
        .output()
        .expect("run e2e/cluster.sh");
    assert!(
        out.status.success(),
        "cluster.sh {args:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout)
        .trim()
        .lines()
        .last()
        .unwrap_or_default()
        .to_owned()
}

/// Stopped while its API server restarts (so its watches find a new server and must list again)
/// and the pod is deleted meanwhile, the operator releases that pod when its pod watch relists,
/// not an hour later at the audit.
#[test]
fn a_pod_deleted_while_the_operators_watch_was_down_is_released_at_the_relist() {
    let replica = cluster(&["replica"]);
    let ns = Ns::new("op-relist");
    let conf = dual(&ns);
    attached_pod(&ns, "gone", &conf, true);
    attached_pod(&ns, "stays", &conf, true);
    let flags = [
        format!("--pool-namespace={}", ns.name),
        "--leader-election=false".into(),
        "--audit-interval=1h".into(),
    ];
    let env = [("KUBECONFIG", replica.as_str())];
    let mut op = OperatorProcess::start_with_env(ns.dir.path(), "op", &flags, &env);
    op.wait_ready();
    assert_eq!(entries(&ns), 4);
    let pid = op.child.id();
    signal(pid, "-STOP");
    // A write after the operator's last resourceVersion, so that the restarted server's watch
    // cache starts past it (with nothing written, the watch could resume where it was).
    ns.kubectl_ok(&["annotate", "pod", "stays", "relist=1"]);
    cluster(&["restart", "kube-apiserver-replica"]);
    ns.kubectl_ok(&["delete", "pod", "gone"]);
    signal(pid, "-CONT");
    assert!(
        eventually(60, || entries(&ns) == 2),
        "{:?}\n{}",
        ns.allocations("10.70.0.0-24"),
        op.log()
    );
    assert!(
        op.log()
            .contains("pods deleted while the pod watch was down"),
        "{}",
        op.log()
    );
    assert!(
        eventually(5, || ns.reservations().len() == 2),
        "{:?}",
        ns.reservations()
    );
}
