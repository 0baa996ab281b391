//! What `kubectl apply -k` put on the node: the plugin and its files on the host, the agent
//! serving the kubelet's pods, the operator's two replicas and one leader, the in-cluster webhook;
//! and the plugin itself, static, answering in an empty root.

use std::os::unix::fs::PermissionsExt as _;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};

use serde_json::json;

use crate::addresses::check_pods_against_pools;
use crate::cluster::{
    POOL_NAMESPACE, Workload, agent_log, get_json, is_ready, kubectl, node, operator_pods,
    wait_until,
};
use crate::harness::repo;

/// The release binary `name` the node's image was built from (e2e/images.sh builds the image
/// from these).
pub fn release_binary(name: &str) -> PathBuf {
    repo()
        .join("target/x86_64-unknown-linux-musl/release")
        .join(name)
}

/// `readelf` of `path`: (has an interpreter, its NEEDED libraries).
fn linkage(path: &Path) -> (bool, Vec<String>) {
    let run = |flag: &str| {
        let out = Command::new("readelf")
            .args([flag, "-W"])
            .arg(path)
            .output()
            .expect("readelf (binutils)");
        assert!(out.status.success(), "readelf {flag} {}", path.display());
        String::from_utf8(out.stdout).unwrap()
    };
    let interp = run("-l").contains("Requesting program interpreter");
    let needed = run("-d")
        .lines()
        .filter(|l| l.contains("(NEEDED)"))
        .map(|l| l.trim().to_string())
        .collect();
    (interp, needed)
}

#[test]
fn the_daemonset_installs_a_static_plugin_and_its_files_on_the_host() {
    node();
    let plugin = Path::new("/opt/cni/bin/whereabouts");
    let conf = Path::new("/etc/cni/net.d/whereabouts.d/whereabouts.conf");
    let kubeconfig = Path::new("/etc/cni/net.d/whereabouts.d/whereabouts.kubeconfig");
    for f in [plugin, conf, kubeconfig] {
        assert!(f.exists(), "{} not installed", f.display());
    }
    assert_eq!(
        std::fs::metadata(kubeconfig).unwrap().permissions().mode() & 0o777,
        0o600
    );
    // The node's name, from the DaemonSet's spec.nodeName, where node slices look for it.
    let nodename = std::fs::read_to_string("/etc/cni/net.d/whereabouts.d/nodename").unwrap();
    assert_eq!(nodename.trim(), node().get("NODE_NAME"));
    let flat: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(conf).unwrap()).unwrap();
    assert_eq!(
        flat["kubernetes"]["kubeconfig"],
        kubeconfig.to_str().unwrap()
    );
    // Static: no loader to ask for, no shared library; so it runs on any node's libc.
    let (interp, needed) = linkage(plugin);
    assert!(
        !interp,
        "the installed plugin asks for a program interpreter"
    );
    assert!(needed.is_empty(), "the installed plugin needs {needed:?}");
    // The image's binaries, as built by the release path, are the same kind.
    for bin in ["whereabouts", "whereabouts-operator"] {
        let path = release_binary(bin);
        assert_eq!(linkage(&path), (false, vec![]), "{}", path.display());
    }
    // What the DaemonSet installed is byte for byte the image's plugin.
    assert_eq!(
        std::fs::read(plugin).unwrap(),
        std::fs::read(release_binary("whereabouts")).unwrap()
    );
}

#[test]
fn the_operator_runs_two_ready_replicas_and_one_leader() {
    node();
    // Right after an install the pace's rollout may still be ending an old replica.
    let mut pods = vec![];
    wait_until(120, "two Ready operator replicas", || {
        pods = operator_pods();
        (pods.len() == 2 && pods.iter().all(is_ready))
            .then_some(())
            .ok_or_else(|| format!("{} pods: {}", pods.len(), crate::cluster::summary(&pods)))
    });
    // Each operator pod's address came from our plugin on the node's pod network.
    for p in &pods {
        assert!(
            p["status"]["podIP"]
                .as_str()
                .is_some_and(|ip| ip.starts_with("10.85.")),
            "{}",
            p["status"]["podIP"]
        );
    }
    let names: Vec<&str> = pods
        .iter()
        .map(|p| p["metadata"]["name"].as_str().unwrap())
        .collect();
    let mut holder = String::new();
    wait_until(60, "a leader among the operator pods", || {
        holder = get_json(&["-n", POOL_NAMESPACE, "get", "lease", "whereabouts-operator"])
            .and_then(|l| l["spec"]["holderIdentity"].as_str().map(str::to_string))
            .unwrap_or_default();
        if names.contains(&holder.as_str()) {
            Ok(())
        } else {
            Err(format!("holder {holder:?}, pods {names:?}"))
        }
    });
}

#[test]
fn an_invalid_nad_is_rejected_by_the_in_cluster_webhook_through_its_service() {
    let w = Workload::new("webhook");
    // The install made no certificate: the operator did, kept it in its Secret, injected its CA
    // and, serving, turned the installed failure policy (Ignore) to Fail.
    wait_until(
        60,
        "the webhook configuration carries the operator's CA and Fail",
        || {
            let secret = crate::cluster::get_json(&[
                "-n",
                crate::cluster::OPERATOR_NS,
                "get",
                "secret",
                "whereabouts-webhook-tls",
            ])
            .ok_or("no Secret whereabouts-webhook-tls")?;
            let config = crate::cluster::get_json(&[
                "get",
                "validatingwebhookconfiguration",
                "whereabouts-nad-validation",
            ])
            .ok_or("no webhook configuration")?;
            let hook = &config["webhooks"][0];
            match (
                hook["clientConfig"]["caBundle"] == secret["data"]["ca.crt"],
                hook["failurePolicy"].as_str(),
            ) {
                (true, Some("Fail")) => Ok(()),
                (same, policy) => Err(format!("CA injected: {same}, failurePolicy {policy:?}")),
            }
        },
    );
    let nad = |name: &str, ipam: serde_json::Value| {
        json!({"apiVersion": "k8s.cni.cncf.io/v1", "kind": "NetworkAttachmentDefinition",
               "metadata": {"name": name, "namespace": w.ns},
               "spec": {"config": json!({"cniVersion": "0.3.1", "name": name, "type": "macvlan",
                                         "master": "wab1", "ipam": ipam}).to_string()}})
        .to_string()
    };
    let out = kubectl(
        &["apply", "-f", "-"],
        Some(&nad(
            "bad",
            json!({"type": "whereabouts", "range": "10.90.0.0/24", "range_start": "10.91.0.5"}),
        )),
    );
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "invalid NAD accepted");
    assert!(
        stderr.contains("nad.whereabouts.cni.cncf.io") && stderr.contains("denied"),
        "not refused by our webhook: {stderr}"
    );
    assert!(
        stderr.contains("range_start") && stderr.contains("10.91.0.5"),
        "the message must name the field and the value: {stderr}"
    );
    let ok = kubectl(
        &["apply", "-f", "-"],
        Some(&nad(
            "good",
            json!({"type": "whereabouts", "range": "10.90.0.0/24"}),
        )),
    );
    assert!(
        ok.status.success(),
        "valid NAD refused: {}",
        String::from_utf8_lossy(&ok.stderr)
    );
}

#[test]
fn the_agent_serves_the_kubelets_pods() {
    let w = Workload::new("agent");
    let before = agent_served();
    w.deployment("web", 3);
    let pods = w.wait_running("app=web", 3, 180);
    // Each pod: eth0 from the pod pool, net1 from the second, as its log shows; the pools and
    // reservations hold exactly these three.
    check_pods_against_pools(&w, &pods);
    // Three pods, two networks: six ADDs, all through the agent.
    wait_until(30, "the agent's log counts the pods' ADDs", || {
        let after = agent_served();
        if after >= before + 6 {
            Ok(())
        } else {
            Err(format!("served ADDs {before} -> {after}"))
        }
    });
}

/// The agent's admin port (plain HTTP on the host network) is the node's own address, which the
/// kubelet probes (the DaemonSet is Ready through it), and not every address of the host.
#[test]
fn the_agents_admin_port_listens_on_the_node_address_only() {
    let _ = node();
    let out = Command::new("ss")
        .args(["-Hltn", "sport = :9437"])
        .output()
        .expect("ss");
    let text = String::from_utf8_lossy(&out.stdout);
    let locals: Vec<&str> = text
        .lines()
        .filter_map(|l| l.split_whitespace().nth(3))
        .collect();
    assert!(!locals.is_empty(), "nothing listens on 9437: {text}");
    for local in &locals {
        assert!(
            !(local.starts_with("0.0.0.0:")
                || local.starts_with("*:")
                || local.starts_with("[::]:")),
            "the agent's admin port listens on every address: {locals:?}"
        );
    }
}

/// ADDs the node agent logged as served, over every agent container's log.
fn agent_served() -> usize {
    agent_log()
        .lines()
        .filter(|l| l.contains("served") && l.contains("command=Add"))
        .count()
}

/// The static plugin answers VERSION and a real ADD and DEL with nothing around it: an empty root
/// holding only the binary, its kubeconfig and its flat file.
#[test]
fn the_plugin_runs_in_an_empty_root() {
    let node = node();
    let root = tempfile::tempdir().unwrap();
    let bin = root.path().join("whereabouts");
    std::fs::copy(release_binary("whereabouts"), &bin).unwrap();
    std::fs::copy(&node.kubeconfig, root.path().join("kubeconfig")).unwrap();
    std::fs::write(
        root.path().join("whereabouts.conf"),
        json!({"kubernetes": {"kubeconfig": "/kubeconfig"}}).to_string(),
    )
    .unwrap();
    let entries: Vec<_> = std::fs::read_dir(root.path())
        .unwrap()
        .map(|e| e.unwrap().file_name().into_string().unwrap())
        .collect();
    assert_eq!(entries.len(), 3, "{entries:?}");

    let conf = json!({"cniVersion": "1.0.0", "name": "chroot-net", "type": "bridge",
        "ipam": {"type": "whereabouts", "range": "10.87.0.0/24", "agent_socket": ""}})
    .to_string();
    let run = |command: &str| {
        let mut child = Command::new("/usr/sbin/chroot")
            .arg(root.path())
            .arg("/whereabouts")
            .env_clear()
            .envs([
                ("CNI_COMMAND", command),
                ("CNI_CONTAINERID", "chroot-1"),
                ("CNI_NETNS", "/var/run/netns/none"),
                ("CNI_IFNAME", "net1"),
                ("CNI_PATH", "/"),
                // The node's whereabouts directory is the root: its flat file is /whereabouts.conf.
                ("WHEREABOUTS_CONF_DIR", "/"),
                (
                    "CNI_ARGS",
                    "IgnoreUnknown=1;K8S_POD_NAMESPACE=chroot;K8S_POD_NAME=p;K8S_POD_UID=u1",
                ),
            ])
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .expect("chroot");
        use std::io::Write as _;
        // VERSION reads no stdin: the plugin may exit before the config is written (EPIPE).
        let written = child.stdin.take().unwrap().write_all(conf.as_bytes());
        assert!(
            written.is_ok() || command == "VERSION",
            "writing the config for {command}: {written:?}"
        );
        let out = child.wait_with_output().unwrap();
        assert!(
            out.status.success(),
            "{command} in the empty root: {}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
        serde_json::from_slice::<serde_json::Value>(&out.stdout).unwrap_or_default()
    };
    let version = run("VERSION");
    assert!(
        version["supportedVersions"]
            .as_array()
            .is_some_and(|v| v.contains(&"1.0.0".into())),
        "{version}"
    );
    let add = run("ADD");
    assert_eq!(add["ips"][0]["address"], "10.87.0.1/24", "{add}");
    let entries = crate::cluster::entries_of("10.87.0.0-24", "chroot");
    assert_eq!(entries.len(), 1, "{entries:?}");
    assert_eq!(entries[0].2, "chroot-1");
    run("DEL");
    assert!(crate::cluster::entries_of("10.87.0.0-24", "chroot").is_empty());
}
