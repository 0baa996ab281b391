//! Multus's thick mode on the real node (issue 26): its daemon as a DaemonSet, shaped like
//! Multus's own `deployments/multus-daemonset-thick.yml` (privileged, host network, the host's
//! root for a chroot, the daemon config in a ConfigMap), from an image built here (e2e/images.sh);
//! its shim becomes the node's only CNI config, with the thin plugin's cluster network (eth0),
//! default network (net1) and cache. A pod on two NADs gets its addresses from our plugin, run by
//! the daemon chrooted to the host; Multus's network-status, the pools and the pod agree; the
//! pod's DEL through the shim frees them. Then the node goes back to the thin plugin.

use std::path::{Path, PathBuf};

use serde_json::json;

use crate::addresses::pooled;
use crate::cluster::{Workload, indented, kubectl, kubectl_ok, node, wait_until};
use crate::multus::two_nads_agree;

const NS: &str = "kube-system";
const SHIM: &str = "/opt/cni/bin/multus-shim";
const SOCKET_DIR: &str = "/run/multus";

/// The daemon's config (Multus's thick-plugin.md and configuration.md keys): its own paths under
/// the host's root, the delegates run chrooted there. It writes the shim's config (the runtime's
/// only one, `00-multus.conf`) from the thin plugin's cluster network (`multusConfigFile: auto`:
/// v4.3.0's daemon exits at once with a config file of the user's), and serves the thin plugin's
/// networks and cache folder (e2e/node.sh), so pods started in one mode are deleted in the other.
fn daemon_config(node_dir: &str) -> String {
    json!({
        "chrootDir": "/hostroot",
        "cniVersion": "1.0.0",
        "logLevel": "verbose",
        "logToStderr": true,
        "socketDir": "/host/run/multus/",
        "daemonSocketDir": SOCKET_DIR,
        "multusConfigFile": "auto",
        "multusAutoconfigDir": format!("/hostroot{node_dir}/cni-networks"),
        "multusMasterCNI": "10-wab-pods.conflist",
        "cniConfigDir": format!("/hostroot{node_dir}/net.d"),
        "confDir": format!("/hostroot{node_dir}/cni-networks"),
        "cniDir": format!("/hostroot{node_dir}/multus-cache"),
        "binDir": "/opt/cni/bin",
        "clusterNetwork": "wab-pods",
        "defaultNetworks": ["wab-net2"],
        "systemNamespaces": []
    })
    .to_string()
}

/// The ServiceAccount (with the rights e2e/node.sh gives Multus), ConfigMap and DaemonSet.
fn manifests(node_dir: &str, image: &str) -> String {
    let daemon = daemon_config(node_dir);
    format!(
        r#"apiVersion: v1
kind: ServiceAccount
metadata: {{name: multus, namespace: {NS}}}
---
apiVersion: rbac.authorization.k8s.io/v1
kind: ClusterRoleBinding
metadata: {{name: e2e-node-multus-thick}}
roleRef: {{apiGroup: rbac.authorization.k8s.io, kind: ClusterRole, name: e2e-node-multus}}
subjects: [{{kind: ServiceAccount, name: multus, namespace: {NS}}}]
---
apiVersion: v1
kind: ConfigMap
metadata: {{name: multus-daemon-config, namespace: {NS}}}
data:
  daemon-config.json: '{daemon}'
---
apiVersion: apps/v1
kind: DaemonSet
metadata: {{name: kube-multus-ds, namespace: {NS}}}
spec:
  selector: {{matchLabels: {{name: multus}}}}
  template:
    metadata: {{labels: {{name: multus}}}}
    spec:
      hostNetwork: true
      hostPID: true
      serviceAccountName: multus
      tolerations: [{{operator: Exists}}]
      terminationGracePeriodSeconds: 10
      initContainers:
        - name: install-multus-shim
          image: {image}
          imagePullPolicy: Never
          command: ["/bin/sh", "-c", "cp /usr/src/multus-cni/bin/multus-shim /host/opt/cni/bin/.multus-shim.tmp && mv -f /host/opt/cni/bin/.multus-shim.tmp /host/opt/cni/bin/multus-shim"]
          securityContext: {{privileged: true}}
          volumeMounts: [{{name: cnibin, mountPath: /host/opt/cni/bin}}]
      containers:
        - name: kube-multus
          image: {image}
          imagePullPolicy: Never
          command: ["/usr/src/multus-cni/bin/multus-daemon"]
          env:
            - name: MULTUS_NODE_NAME
              valueFrom: {{fieldRef: {{fieldPath: spec.nodeName}}}}
          securityContext: {{privileged: true}}
          volumeMounts:
            - {{name: cnibin, mountPath: /opt/cni/bin}}
            - {{name: host-run, mountPath: /host/run}}
            - {{name: hostroot, mountPath: /hostroot, mountPropagation: HostToContainer}}
            - {{name: host-run-netns, mountPath: /run/netns, mountPropagation: HostToContainer}}
            - {{name: daemon-config, mountPath: /etc/cni/net.d/multus.d, readOnly: true}}
            # The node's plugins in /opt/cni/bin are links into Debian's /usr/lib/cni: the daemon
            # looks them up in its own filesystem before it runs them in the host's.
            - {{name: host-cni-lib, mountPath: /usr/lib/cni, readOnly: true}}
      volumes:
        - {{name: cnibin, hostPath: {{path: /opt/cni/bin}}}}
        - {{name: host-run, hostPath: {{path: /run}}}}
        - {{name: hostroot, hostPath: {{path: /}}}}
        - {{name: host-run-netns, hostPath: {{path: /run/netns/}}}}
        - {{name: daemon-config, configMap: {{name: multus-daemon-config}}}}
        - {{name: host-cni-lib, hostPath: {{path: /usr/lib/cni}}}}
"#
    )
}

/// Writes `bytes` to `path` through a temporary file and a rename (containerd watches the folder).
fn replace(path: &Path, bytes: &[u8]) {
    let temp = path.with_extension("e2e-tmp");
    std::fs::write(&temp, bytes).unwrap();
    std::fs::rename(&temp, path).unwrap();
}

/// Back to the thin plugin: the daemon gone, the thin config back, the shim and socket removed.
struct ThinAgain {
    conf: PathBuf,
    thin: Vec<u8>,
    manifests: String,
}

impl Drop for ThinAgain {
    fn drop(&mut self) {
        let _ = kubectl(
            &["delete", "-f", "-", "--ignore-not-found", "--wait=true"],
            Some(&self.manifests),
        );
        // The daemon removes the config it wrote when it stops: only then is the thin one back
        // for good.
        wait_until(60, "the Multus daemon's pod gone", || {
            let out = kubectl(
                &["-n", NS, "get", "pods", "-l", "name=multus", "-o", "name"],
                None,
            );
            let left = String::from_utf8_lossy(&out.stdout).trim().to_string();
            left.is_empty().then_some(()).ok_or(left)
        });
        replace(&self.conf, &self.thin);
        let _ = std::fs::remove_file(SHIM);
        let _ = std::fs::remove_dir_all(SOCKET_DIR);
    }
}

#[test]
fn multus_thick_mode_runs_our_ipam_as_the_thin_plugin_does() {
    let node_dir = node().get("NODE_DIR").to_string();
    let image = node().get("MULTUS_THICK_IMAGE").to_string();
    assert!(!image.is_empty(), "no MULTUS_THICK_IMAGE (e2e/images.sh)");
    let conf = PathBuf::from(&node_dir).join("net.d/00-multus.conf");
    let manifests = manifests(&node_dir, &image);
    let _thin = ThinAgain {
        thin: std::fs::read(&conf).unwrap(),
        conf: conf.clone(),
        manifests: manifests.clone(),
    };
    let out = kubectl(&["apply", "-f", "-"], Some(&manifests));
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    kubectl_ok(&[
        "-n",
        NS,
        "rollout",
        "status",
        "daemonset/kube-multus-ds",
        "--timeout=180s",
    ]);
    wait_until(60, "the daemon's shim config in place", || {
        let text = std::fs::read_to_string(&conf).unwrap_or_default();
        text.contains("multus-shim").then_some(()).ok_or(text)
    });
    assert!(Path::new(SHIM).exists());

    let w = Workload::new("multus-thick");
    two_nads_agree(&w);
    // The DEL through the shim and the daemon frees every address, before the pod object goes.
    let podref = format!("{}/two-nads", w.ns);
    kubectl_ok(&[
        "-n",
        &w.ns,
        "delete",
        "pod",
        "two-nads",
        "--wait=true",
        "--timeout=120s",
    ]);
    let left = pooled(&podref);
    assert!(left.is_empty(), "left after the DEL: {left:?}");
    // The daemon, not the thin plugin (whose log file is its config's), served the pod.
    let log = kubectl_ok(&[
        "-n",
        NS,
        "logs",
        "daemonset/kube-multus-ds",
        "-c",
        "kube-multus",
    ]);
    assert!(
        log.contains(&w.ns),
        "the daemon's log:\n{}",
        indented(&log, 2)
    );
    let thin_log = std::fs::read_to_string(format!("{node_dir}/multus.log")).unwrap_or_default();
    assert!(
        !thin_log.contains(&w.ns),
        "the thin plugin ran for {podref}"
    );
}
