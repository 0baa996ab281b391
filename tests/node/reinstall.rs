//! Uninstall and reinstall on the real node (issue 26), with the README's "Uninstall" commands:
//! a kustomize install taken down while pods still hold addresses (the host's files stay, and a
//! pod deleted meanwhile is not left Terminating), Helm installed over the kept CRDs (no address
//! handed out twice, the workloads pass as with `config/default`), then a Helm uninstall of an
//! idle node (the host's files go), and the standard install back for the tests after this one.

use std::collections::BTreeSet;
use std::path::Path;
use std::process::{Command, Stdio};

use crate::addresses::check_pods_against_pools;
use crate::addresses::pooled;
use crate::cluster::{
    NET2_POOL, OPERATOR_NS, POD_POOL, SYSTEM_NS, Workload, get_json, install_with_kustomize,
    kubectl_ok, node, pace_operator, pool_entries, wait_until,
};
use crate::harness::repo;

pub const PLUGIN: &str = "/opt/cni/bin/whereabouts";
const KUBECONFIG: &str = "/etc/cni/net.d/whereabouts.d/whereabouts.kubeconfig";
const CONF_DIR: &str = "/etc/cni/net.d/whereabouts.d";

/// The README's "Uninstall", steps 2 to 4; `helm`: `helm uninstall` instead of config/uninstall.
pub fn uninstall(helm: bool) {
    kubectl_ok(&[
        "delete",
        "validatingwebhookconfiguration",
        "whereabouts-nad-validation",
    ]);
    for (namespace, object) in [
        (OPERATOR_NS, "deployment/whereabouts-operator"),
        (SYSTEM_NS, "daemonset/whereabouts-node"),
    ] {
        kubectl_ok(&[
            "-n",
            namespace,
            "delete",
            object,
            "--cascade=foreground",
            "--timeout=180s",
        ]);
    }
    if helm {
        run_helm(&[
            "uninstall",
            "whereabouts",
            "-n",
            SYSTEM_NS,
            "--wait",
            "--timeout=180s",
        ]);
    } else {
        let dir = repo().join("config/uninstall");
        kubectl_ok(&[
            "delete",
            "-k",
            dir.to_str().unwrap(),
            "--ignore-not-found",
            "--timeout=180s",
        ]);
    }
    // config/uninstall deletes both namespaces; Helm deletes the operator's, which the chart
    // made, and leaves the one --create-namespace made.
    let gone: &[&str] = if helm {
        &[OPERATOR_NS]
    } else {
        &[SYSTEM_NS, OPERATOR_NS]
    };
    for namespace in gone {
        wait_until(120, &format!("namespace {namespace} gone"), || {
            get_json(&["get", "namespace", namespace])
                .map_or(Ok(()), |n| Err(format!("{}", n["status"])))
        });
    }
}

/// The README's "With Helm", with the image built here.
pub fn helm_install() {
    let image = node().get("WHEREABOUTS_IMAGE");
    let (repository, tag) = image.rsplit_once(':').unwrap();
    run_helm(&[
        "install",
        "whereabouts",
        "charts/whereabouts",
        "-n",
        SYSTEM_NS,
        "--create-namespace",
        "--set",
        &format!("image.repository={repository}"),
        "--set",
        &format!("image.tag={tag}"),
        "--wait",
        "--timeout=300s",
    ]);
    pace_operator(node());
}

pub fn run_helm(args: &[&str]) {
    let out = Command::new(repo().join("e2e/bin/helm"))
        .args(args)
        .current_dir(repo())
        .env("KUBECONFIG", &node().kubeconfig)
        .stderr(Stdio::inherit())
        .output()
        .expect("run helm");
    assert!(
        out.status.success(),
        "helm {args:?}: {}",
        String::from_utf8_lossy(&out.stdout)
    );
}

/// Every address `podref` holds, whichever interface.
pub fn held(podref: &str) -> BTreeSet<String> {
    pooled(podref).into_values().flatten().collect()
}

fn crds_kept() {
    for crd in [
        "ippools",
        "overlappingrangeipreservations",
        "nodeslicepools",
    ] {
        let name = format!("{crd}.whereabouts.cni.cncf.io");
        assert!(get_json(&["get", "crd", &name]).is_some(), "{name} deleted");
    }
}

#[test]
fn uninstall_keeps_the_data_and_no_pod_stuck_then_helm_reinstalls_over_it() {
    let w = Workload::new("reinstall");
    w.deployment("survivor", 1);
    w.deployment("orphan", 1);
    let survivor = w.wait_running("app=survivor", 1, 120).remove(0);
    let orphan = w.wait_running("app=orphan", 1, 120).remove(0);
    let name =
        |p: &serde_json::Value| format!("{}/{}", w.ns, p["metadata"]["name"].as_str().unwrap());
    let (survivor_ref, orphan_ref) = (name(&survivor), name(&orphan));
    let survivor_held = held(&survivor_ref);
    let orphan_held = held(&orphan_ref);
    assert_eq!(
        survivor_held.len(),
        3,
        "eth0 (IPv4 and IPv6) and net1: {survivor_held:?}"
    );

    // Uninstalled while pods hold addresses: the host's files stay for their DELs.
    uninstall(false);
    crds_kept();
    assert!(Path::new(PLUGIN).exists() && Path::new(KUBECONFIG).exists());
    // A pod deleted now: its DEL's token is dead, it succeeds, the address stays recorded.
    w.scale("deployment/orphan", 0);
    w.wait_gone("app=orphan", 90);
    assert_eq!(
        held(&orphan_ref),
        orphan_held,
        "recorded until an operator frees it"
    );

    // Helm over the kept CRDs: the survivor keeps its addresses, nobody else gets them, and the
    // new operator frees the orphan's once it sees the pod gone.
    helm_install();
    w.deployment("fresh", 3);
    let fresh = w.wait_running("app=fresh", 3, 180);
    for p in &fresh {
        let got = held(&name(p));
        assert!(
            got.is_disjoint(&survivor_held),
            "{got:?} vs the survivor's {survivor_held:?}"
        );
    }
    wait_until(120, "the orphan's entries freed", || {
        let left = held(&orphan_ref);
        left.is_empty()
            .then_some(())
            .ok_or_else(|| format!("{left:?}"))
    });
    assert_eq!(held(&survivor_ref), survivor_held);
    let mut all = fresh.clone();
    all.extend(w.wait_running("app=survivor", 1, 10));
    check_pods_against_pools(&w, &all);
    // The survivor's DEL, with the new install's token, frees its addresses.
    w.scale("deployment/survivor", 0);
    w.scale("deployment/fresh", 0);
    w.wait_gone("app", 120);
    wait_until(60, "the workload's entries freed", || {
        let left = held(&survivor_ref);
        left.is_empty()
            .then_some(())
            .ok_or_else(|| format!("{left:?}"))
    });

    // A Helm uninstall of a node that holds no address but the operator's: the host's files go.
    let node_name = node().get("NODE_NAME").to_string();
    wait_until(180, "no address held on the node", || {
        let held: Vec<String> = [POD_POOL, NET2_POOL]
            .iter()
            .flat_map(|p| pool_entries(p).into_values())
            // The operator's own pods go in step 2 of the uninstall.
            .filter(|e| e["node"] == node_name.as_str())
            .filter(|e| {
                !e["podref"]
                    .as_str()
                    .unwrap_or_default()
                    .starts_with(OPERATOR_NS)
            })
            .map(|e| e["podref"].to_string())
            .collect();
        held.is_empty()
            .then_some(())
            .ok_or_else(|| format!("{held:?}"))
    });
    uninstall(true);
    crds_kept();
    assert!(!Path::new(PLUGIN).exists(), "{PLUGIN} left");
    // What the installer wrote is gone. A flat file stays only for keys that are not the
    // installer's (after tests/node/migration.rs: upstream's `datastore` and
    // `reconciler_cron_expression`), and the folder with it.
    assert!(!Path::new(KUBECONFIG).exists(), "{KUBECONFIG} left");
    let flat = std::fs::read_to_string(format!("{CONF_DIR}/whereabouts.conf")).unwrap_or_default();
    assert!(
        !flat.contains("kubeconfig"),
        "the installer's keys left: {flat}"
    );
    if flat.is_empty() {
        assert!(!Path::new(CONF_DIR).exists(), "{CONF_DIR} left");
    }

    // The standard install back, over the same CRDs, for the tests after this one.
    install_with_kustomize(node());
    w.deployment("after", 2);
    let after = w.wait_running("app=after", 2, 180);
    check_pods_against_pools(&w, &after);
}
