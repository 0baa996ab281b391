//! What the node identity may do beyond its RBAC rules (config/rbac/node-limits.yaml), against the
//! real API server with a token of the real `whereabouts-system/whereabouts-node` account: Lease
//! writes only for pools' writer turns (the ValidatingAdmissionPolicy), and its requests in their
//! own API Priority and Fairness level.

use std::path::PathBuf;

use serde_json::{Value, json};

use crate::harness::{Ns, admin_kubeconfig, cluster_env, eventually, kubectl_raw, kustomize};

const SYSTEM: &str = "whereabouts-system";
const NODE: &str = "whereabouts-node";

/// Applies the policy and flow objects as config/default renders them, the real node account, and
/// the node Role's Lease rule in `ns` (the pool namespace of this test). Returns a kubeconfig
/// with the account's token.
fn node_account(ns: &Ns) -> PathBuf {
    let limits: Vec<Value> = kustomize("config/default")
        .into_iter()
        .filter(|o| {
            let kind = o["kind"].as_str().unwrap_or_default();
            kind.starts_with("ValidatingAdmissionPolicy")
                || kind == "FlowSchema"
                || kind == "PriorityLevelConfiguration"
        })
        .collect();
    assert_eq!(limits.len(), 4, "{limits:?}");
    let admin = |args: &[&str], stdin: Option<&str>| {
        let out = kubectl_raw(admin_kubeconfig(), args, stdin);
        assert!(
            out.status.success(),
            "kubectl {args:?}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        String::from_utf8_lossy(&out.stdout).into_owned()
    };
    let list = json!({"apiVersion": "v1", "kind": "List", "items": limits});
    admin(&["apply", "-f", "-"], Some(&list.to_string()));
    let _ = kubectl_raw(admin_kubeconfig(), &["create", "namespace", SYSTEM], None);
    let _ = kubectl_raw(
        admin_kubeconfig(),
        &["-n", SYSTEM, "create", "serviceaccount", NODE],
        None,
    );
    let subject = format!("{SYSTEM}:{NODE}");
    ns.kubectl_ok(&[
        "create",
        "role",
        "leases",
        "--verb=get,create,delete,update",
        "--resource=leases.coordination.k8s.io",
    ]);
    ns.kubectl_ok(&[
        "create",
        "rolebinding",
        "leases",
        "--role=leases",
        &format!("--serviceaccount={subject}"),
    ]);
    let token = admin(
        &["-n", SYSTEM, "create", "token", NODE, "--duration=10m"],
        None,
    );
    let kubeconfig = ns.dir.path().join("node.kubeconfig");
    let text = json!({
        "apiVersion": "v1", "kind": "Config",
        "clusters": [{"name": "c", "cluster": {
            "server": cluster_env("APISERVER_URL"),
            "certificate-authority": cluster_env("CA_CERT")}}],
        "users": [{"name": "node", "user": {"token": token.trim()}}],
        "contexts": [{"name": "c", "context": {"cluster": "c", "user": "node", "namespace": ns.name}}],
        "current-context": "c",
    });
    std::fs::write(&kubeconfig, text.to_string()).unwrap();
    kubeconfig
}

fn lease(name: &str, turn: bool) -> String {
    let labels = if turn {
        json!({"whereabouts.cni.cncf.io/writer-turn": "true"})
    } else {
        json!({})
    };
    json!({"apiVersion": "coordination.k8s.io/v1", "kind": "Lease",
           "metadata": {"name": name, "labels": labels}, "spec": {"holderIdentity": "x"}})
    .to_string()
}

#[test]
fn the_node_identity_writes_only_writer_turn_leases_in_its_own_priority_level() {
    let ns = Ns::new("nodelimits");
    let node = node_account(&ns);
    let as_node = |args: &[&str], stdin: Option<&str>| kubectl_raw(&node, args, stdin);
    let denied = |out: &std::process::Output| {
        !out.status.success()
            && String::from_utf8_lossy(&out.stderr)
                .contains("the whereabouts node identity may only write pools' writer turns")
    };
    // The policy is enforced once the API server has loaded it: a leader Lease of the control
    // plane is refused to the node, with the reason.
    assert!(
        eventually(30, || denied(&as_node(
            &["create", "-f", "-"],
            Some(&lease("kube-scheduler", false))
        ))),
        "the node identity could create Lease kube-scheduler"
    );
    // A writer turn is its to create and delete.
    let out = as_node(
        &["create", "-f", "-"],
        Some(&lease("whereabouts-pool-a", true)),
    );
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let out = as_node(&["delete", "lease", "whereabouts-pool-a"], None);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    // Its name without the label, or the operator's leader Lease, are not.
    for (name, turn) in [
        ("whereabouts-pool-b", false),
        ("whereabouts-operator", true),
    ] {
        let out = as_node(&["create", "-f", "-"], Some(&lease(name, turn)));
        assert!(
            denied(&out),
            "{name}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
    }
    // A Lease someone else made (a control-plane leader's) cannot be deleted or taken over.
    ns.kubectl_ok_stdin(
        &["create", "-f", "-"],
        &lease("kube-controller-manager", false),
    );
    let out = as_node(&["delete", "lease", "kube-controller-manager"], None);
    assert!(denied(&out), "{}", String::from_utf8_lossy(&out.stderr));
    let taken = lease("kube-controller-manager", true);
    let out = as_node(&["replace", "-f", "-"], Some(&taken));
    assert!(denied(&out), "{}", String::from_utf8_lossy(&out.stderr));
    assert!(ns.get_json(&["lease", "kube-controller-manager"]).is_some());

    // Its requests are classified into the whereabouts-node level (the API server names the
    // FlowSchema and priority level of every answer in its headers).
    let uid = |kind: &str| {
        let out = kubectl_raw(
            admin_kubeconfig(),
            &["get", kind, NODE, "-o", "jsonpath={.metadata.uid}"],
            None,
        );
        String::from_utf8_lossy(&out.stdout).trim().to_owned()
    };
    let (schema, level) = (uid("flowschema"), uid("prioritylevelconfiguration"));
    assert!(!schema.is_empty() && !level.is_empty());
    let out = as_node(&["get", "leases", "-v=8"], None);
    let log = String::from_utf8_lossy(&out.stderr).to_lowercase();
    assert!(
        log.contains(&format!("x-kubernetes-pf-flowschema-uid: {schema}"))
            && log.contains(&format!("x-kubernetes-pf-prioritylevel-uid: {level}")),
        "{log}"
    );
}
