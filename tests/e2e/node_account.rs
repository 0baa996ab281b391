//! A node's credentials as the installer gives them to the host: a token of the node account
//! bound to a pod on a Node object (the API server adds the node's name to its identity), and
//! what becomes of it when that pod goes. Shared by the tests of what those credentials may do.

use std::path::{Path, PathBuf};

use serde_json::json;

use crate::harness::{Ns, admin_kubeconfig, eventually, kubectl_raw, token_kubeconfig};

pub(crate) const SYSTEM: &str = "whereabouts-system";
pub(crate) const NODE: &str = "whereabouts-node";

/// kubectl as the cluster admin; its stdout, trimmed (a failure fails the test).
pub(crate) fn admin(args: &[&str], stdin: Option<&str>) -> String {
    let out = kubectl_raw(admin_kubeconfig(), args, stdin);
    assert!(
        out.status.success(),
        "kubectl {args:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).trim().to_owned()
}

/// `kubectl apply` of `text` as the cluster admin. Tests running at once apply the same
/// cluster-wide objects (the node policies and flow schemas), and a client-side apply that lost
/// to the other's write of the same object fails ("the object has been modified"): it is retried.
pub(crate) fn admin_apply(text: &str) {
    let mut failures = Vec::new();
    for _ in 0..10 {
        let out = kubectl_raw(admin_kubeconfig(), &["apply", "-f", "-"], Some(text));
        if out.status.success() {
            return;
        }
        failures.push(String::from_utf8_lossy(&out.stderr).into_owned());
        std::thread::sleep(std::time::Duration::from_millis(300));
    }
    panic!("kubectl apply failed 10 times: {failures:?}");
}

/// Runs `args` with `kubeconfig` and asserts that the API server refuses it with `why`. An
/// admission policy takes effect a while after it is created, so this first waits until a
/// server-side dry run of the same request is refused (policies judge dry runs too, and nothing
/// is written): the real request can then only fail, and must.
pub(crate) fn refused_once_loaded(
    kubeconfig: &Path,
    args: &[&str],
    stdin: Option<&str>,
    why: &str,
) {
    let refused = |out: &std::process::Output| {
        !out.status.success() && String::from_utf8_lossy(&out.stderr).contains(why)
    };
    let dry_run = [args, &["--dry-run=server"]].concat();
    assert!(
        eventually(60, || refused(&kubectl_raw(kubeconfig, &dry_run, stdin))),
        "never refused with {why:?}: {}",
        String::from_utf8_lossy(&kubectl_raw(kubeconfig, &dry_run, stdin).stderr)
    );
    let out = kubectl_raw(kubeconfig, args, stdin);
    assert!(refused(&out), "not refused with {why:?}: {out:?}");
}

/// A kubeconfig with a token of the node account bound to a pod on `node`, as the DaemonSet's
/// projected token is (the API server adds the node's name to the identity). The pod never runs:
/// this tier has no kubelet.
pub(crate) fn node_token(ns: &Ns, node: &str) -> PathBuf {
    node_token_in(ns, node, &format!("{node}.kubeconfig"))
}

/// [`node_token`], written to `file` of the namespace's folder.
pub(crate) fn node_token_in(ns: &Ns, node: &str, file: &str) -> PathBuf {
    let pod = json!({"apiVersion": "v1", "kind": "Pod",
        "metadata": {"name": format!("agent-{node}"), "namespace": SYSTEM},
        "spec": {"nodeName": node, "serviceAccountName": NODE, "automountServiceAccountToken": false,
                 "containers": [{"name": "agent", "image": "whereabouts:never-pulled"}]}});
    admin(&["create", "-f", "-"], Some(&pod.to_string()));
    let name = format!("agent-{node}");
    let uid = admin(
        &[
            "-n",
            SYSTEM,
            "get",
            "pod",
            &name,
            "-o",
            "jsonpath={.metadata.uid}",
        ],
        None,
    );
    let token = admin(
        &[
            "-n",
            SYSTEM,
            "create",
            "token",
            NODE,
            "--duration=10m",
            "--bound-object-kind=Pod",
            &format!("--bound-object-name={name}"),
            &format!("--bound-object-uid={uid}"),
        ],
        None,
    );
    token_kubeconfig(ns, file, &token)
}

/// Deletes the pod node `node`'s token is bound to (as a rolling update of the DaemonSet or an
/// uninstall does), and waits until the API server refuses the token at `kubeconfig` (it may
/// accept it for a few seconds after its pod went: its cache).
pub(crate) fn kill_token(node: &str, kubeconfig: &Path) {
    let pod = format!("agent-{node}");
    let args = [
        "-n",
        SYSTEM,
        "delete",
        "pod",
        &pod,
        "--grace-period=0",
        "--force",
    ];
    let out = kubectl_raw(admin_kubeconfig(), &args, None);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(
        eventually(30, || {
            let out = kubectl_raw(kubeconfig, &["get", "ippools"], None);
            String::from_utf8_lossy(&out.stderr).contains("Unauthorized")
        }),
        "the dead token still works"
    );
}
