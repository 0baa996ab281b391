//! The node, the install (the README's "Install on a cluster" steps, run once), and workloads.

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::process::{Command, Output, Stdio};
use std::sync::OnceLock;
use std::time::{Duration, Instant};

use serde_json::Value;

use crate::harness::{kubectl_raw, repo};

pub const POOL_NAMESPACE: &str = "kube-system";
/// The pools of the node's pod networks (e2e/node.sh): eth0 (dual-stack) and net1.
pub const POD_POOL: &str = "10.85.0.0-22";
pub const POD_POOL6: &str = "fd00-85---116";
pub const NET2_POOL: &str = "10.86.0.0-22";
pub const SYSTEM_NS: &str = "whereabouts-system";
/// The operator's namespace (Pod Security `restricted`; the node DaemonSet's is `privileged`).
pub const OPERATOR_NS: &str = "whereabouts-operator";

pub struct Node {
    pub kubeconfig: PathBuf,
    /// `e2e/node.sh env`: NODE_DIR, NODE_NAME, WHEREABOUTS_IMAGE, CONTAINERD_SOCKET, ...
    pub env: BTreeMap<String, String>,
}

impl Node {
    pub fn get(&self, key: &str) -> &str {
        self.env
            .get(key)
            .unwrap_or_else(|| panic!("node.sh env has no {key}"))
    }

    /// `e2e/node.sh VERB [ARG]` (restart containerd, stop kubelet, ...).
    pub fn script(&self, verb: &str, arg: &str) {
        let out = Command::new(repo().join("e2e/node.sh"))
            .args([verb, arg])
            .stderr(Stdio::inherit())
            .output()
            .expect("run e2e/node.sh");
        assert!(out.status.success(), "e2e/node.sh {verb} {arg} failed");
    }

    /// `crictl` (built from sigs.k8s.io/cri-tools) against the node's runtime: the kubelet's view.
    pub fn crictl(&self, args: &[&str]) -> Output {
        let endpoint = format!("unix://{}", self.get("CONTAINERD_SOCKET"));
        Command::new(repo().join("e2e/bin/crictl"))
            .args([
                "--runtime-endpoint",
                &endpoint,
                "--image-endpoint",
                &endpoint,
            ])
            .args(args)
            .output()
            .expect("run crictl")
    }

    /// `ctr` against the node's containerd, in the Kubernetes namespace.
    pub fn ctr(&self, args: &[&str]) -> Output {
        Command::new("ctr")
            .args(["--address", self.get("CONTAINERD_SOCKET"), "-n", "k8s.io"])
            .args(args)
            .output()
            .expect("run ctr")
    }
}

/// The node, started (or reused) once per test process, with whereabouts installed on it.
pub fn node() -> &'static Node {
    static NODE: OnceLock<Node> = OnceLock::new();
    NODE.get_or_init(|| {
        let out = Command::new(repo().join("e2e/node.sh"))
            .arg("up")
            .stderr(Stdio::inherit())
            .output()
            .expect("run e2e/node.sh up");
        assert!(out.status.success(), "e2e/node.sh up failed");
        let stdout = String::from_utf8(out.stdout).unwrap();
        let kubeconfig = PathBuf::from(stdout.lines().last().expect("a kubeconfig path").trim());
        let env = Command::new(repo().join("e2e/node.sh"))
            .arg("env")
            .output()
            .expect("run e2e/node.sh env");
        let env = String::from_utf8(env.stdout)
            .unwrap()
            .lines()
            .filter_map(|l| l.split_once('='))
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect();
        let node = Node { kubeconfig, env };
        install(&node);
        node
    })
}

pub fn kubectl(args: &[&str], stdin: Option<&str>) -> Output {
    kubectl_raw(&node().kubeconfig, args, stdin)
}

fn kubectl_checked(kubeconfig: &std::path::Path, args: &[&str], stdin: Option<&str>) -> String {
    let out = kubectl_raw(kubeconfig, args, stdin);
    assert!(
        out.status.success(),
        "kubectl {args:?}: {}{}",
        String::from_utf8_lossy(&out.stderr),
        String::from_utf8_lossy(&out.stdout)
    );
    String::from_utf8(out.stdout).unwrap()
}

pub fn kubectl_ok(args: &[&str]) -> String {
    kubectl_checked(&node().kubeconfig, args, None)
}

/// `kubectl apply` of `yaml` (YAML or JSON; a namespaced object names its namespace).
pub fn apply_ok(yaml: &str) -> String {
    kubectl_checked(&node().kubeconfig, &["apply", "-f", "-"], Some(yaml))
}

pub fn get_json(args: &[&str]) -> Option<Value> {
    let mut all = args.to_vec();
    all.extend(["-o", "json"]);
    let out = kubectl(&all, None);
    out.status
        .success()
        .then(|| serde_json::from_slice(&out.stdout).unwrap())
}

/// The README's "Install on a cluster", command for command (e2e/install.sh), with the image
/// built here.
fn install(node: &Node) {
    // A node kept from an earlier run (a developer re-running one test) is installed already.
    if kubectl_raw(
        &node.kubeconfig,
        &["-n", SYSTEM_NS, "get", "daemonset", "whereabouts-node"],
        None,
    )
    .status
    .success()
    {
        eprintln!("whereabouts is installed on this node already: not installing again");
        return;
    }
    install_with_kustomize(node);
}

/// e2e/install.sh (the README's steps), then the operator's pace for tests.
pub fn install_with_kustomize(node: &Node) {
    let out = Command::new(repo().join("e2e/install.sh"))
        .arg(node.get("WHEREABOUTS_IMAGE"))
        .env("KUBECONFIG", &node.kubeconfig)
        .stderr(Stdio::inherit())
        .output()
        .expect("run e2e/install.sh");
    assert!(out.status.success(), "e2e/install.sh failed");
    pace_operator(node);
}

/// The installed operator's audit at a pace the tests can wait for.
pub fn pace_operator(node: &Node) {
    // The installed operator audits every 5 minutes and spares orphan claims for 3: the tests
    // wait a minute or two for the audit's work, so it runs at a pace they can see. The claim
    // age stays above the longest an ADD holds a claim on this node (seconds).
    pace_operator_at(node, "10s", "10s", "40s");
}

/// The operator's audit every `interval`, with `--stale-grace` `grace` and `--orphan-claim-age`
/// `age`, once its rollout is done.
pub fn pace_operator_at(node: &Node, interval: &str, grace: &str, age: &str) {
    let kubectl_ok = |args: &[&str]| kubectl_checked(&node.kubeconfig, args, None);
    kubectl_ok(&[
        "-n",
        OPERATOR_NS,
        "set",
        "env",
        "deployment/whereabouts-operator",
        &format!("WHEREABOUTS_AUDIT_INTERVAL={interval}"),
        &format!("WHEREABOUTS_STALE_GRACE={grace}"),
        &format!("WHEREABOUTS_ORPHAN_CLAIM_AGE={age}"),
    ]);
    kubectl_ok(&[
        "-n",
        OPERATOR_NS,
        "rollout",
        "status",
        "deployment/whereabouts-operator",
        "--timeout=180s",
    ]);
}

/// The node agent's log, every line since its container started.
pub fn agent_log() -> String {
    kubectl_ok(&[
        "-n",
        SYSTEM_NS,
        "logs",
        "daemonset/whereabouts-node",
        "-c",
        "agent",
        "--tail=-1",
    ])
}

/// Polls `check` every 500 ms for up to `secs`; panics with `what` and the last state if it never
/// holds.
pub fn wait_until(secs: u64, what: &str, mut check: impl FnMut() -> Result<(), String>) {
    let deadline = Instant::now() + Duration::from_secs(secs);
    loop {
        match check() {
            Ok(()) => return,
            Err(state) if Instant::now() >= deadline => {
                panic!("{what}: not within {secs} s; last state: {state}")
            }
            Err(_) => std::thread::sleep(Duration::from_millis(500)),
        }
    }
}

/// A pool's allocations (offset -> entry), empty if the pool does not exist.
pub fn pool_entries(pool: &str) -> BTreeMap<String, Value> {
    get_json(&["-n", POOL_NAMESPACE, "get", "ippool", pool])
        .and_then(|p| p["spec"]["allocations"].as_object().cloned())
        .map(|m| m.into_iter().collect())
        .unwrap_or_default()
}

/// The pool entries of pods in `ns`: podref -> (offset, container id), one per pod.
pub fn entries_of(pool: &str, ns: &str) -> Vec<(String, String, String)> {
    let prefix = format!("{ns}/");
    pool_entries(pool)
        .into_iter()
        .filter(|(_, e)| e["podref"].as_str().is_some_and(|p| p.starts_with(&prefix)))
        .map(|(offset, e)| {
            (
                e["podref"].as_str().unwrap().to_string(),
                offset,
                e["id"].as_str().unwrap_or_default().to_string(),
            )
        })
        .collect()
}

/// The overlapping-range reservations held by pods of `ns`.
pub fn reservations_of(ns: &str) -> usize {
    let prefix = format!("{ns}/");
    get_json(&[
        "-n",
        POOL_NAMESPACE,
        "get",
        "overlappingrangeipreservations",
    ])
    .map(|l| {
        l["items"]
            .as_array()
            .unwrap()
            .iter()
            .filter(|r| {
                r["spec"]["podref"]
                    .as_str()
                    .is_some_and(|p| p.starts_with(&prefix))
            })
            .count()
    })
    .unwrap_or(0)
}

/// `text` with each line indented by `indent` spaces (to place YAML inside YAML).
pub fn indented(text: &str, indent: usize) -> String {
    let pad = " ".repeat(indent);
    text.lines()
        .map(|l| format!("{pad}{l}"))
        .collect::<Vec<_>>()
        .join("\n")
}

/// A test namespace with a busybox workload template; deleted when dropped.
pub struct Workload {
    pub ns: String,
}

/// What each test pod runs: prints its interfaces (the log shows the address on eth0 and net1),
/// then idles until told to stop.
pub const POD_COMMAND: &str = "ip -o addr show; trap 'exit 0' TERM; while true; do sleep 1; done";

impl Workload {
    pub fn new(prefix: &str) -> Workload {
        node();
        let ns = format!(
            "node-{prefix}-{}",
            fastrand::u32(..).to_string().get(..5).unwrap_or("0")
        );
        kubectl_ok(&["create", "namespace", &ns]);
        // The controller manager makes the `default` ServiceAccount; pods need it.
        wait_until(60, "default ServiceAccount", || {
            get_json(&["-n", &ns, "get", "serviceaccount", "default"])
                .map(|_| ())
                .ok_or_else(|| "missing".into())
        });
        Workload { ns }
    }

    pub fn apply(&self, yaml: &str) {
        kubectl_checked(
            &node().kubeconfig,
            &["-n", &self.ns, "apply", "-f", "-"],
            Some(yaml),
        );
    }

    /// The test pods' spec, each line indented by `indent` spaces.
    pub fn pod_spec(&self, indent: usize) -> String {
        self.pod_spec_running(indent, POD_COMMAND)
    }

    /// The test pods' spec with `command` run by `/bin/sh -c`, indented by `indent` spaces.
    pub fn pod_spec_running(&self, indent: usize, command: &str) -> String {
        let spec = format!(
            r#"terminationGracePeriodSeconds: 2
automountServiceAccountToken: false
enableServiceLinks: false
containers:
  - name: main
    image: {}
    imagePullPolicy: Never
    command: ["/bin/sh", "-c", "{command}"]"#,
            node().get("BUSYBOX_IMAGE")
        );
        indented(&spec, indent)
    }

    /// A Deployment `name` of `replicas` test pods.
    pub fn deployment(&self, name: &str, replicas: u32) {
        self.deployment_of(name, replicas, &self.pod_spec(6));
    }

    /// A Deployment `name` of `replicas` pods of `spec` (indented by 6 spaces).
    pub fn deployment_of(&self, name: &str, replicas: u32, spec: &str) {
        self.apply(&format!(
            r#"apiVersion: apps/v1
kind: Deployment
metadata: {{name: {name}}}
spec:
  replicas: {replicas}
  selector: {{matchLabels: {{app: {name}}}}}
  template:
    metadata: {{labels: {{app: {name}}}}}
    spec:
{}
"#,
            spec
        ));
    }

    pub fn scale(&self, kind_name: &str, replicas: u32) {
        kubectl_ok(&[
            "-n",
            &self.ns,
            "scale",
            kind_name,
            &format!("--replicas={replicas}"),
        ]);
    }

    /// The namespace's pods (optionally of one label selector).
    pub fn pods(&self, selector: Option<&str>) -> Vec<Value> {
        let mut args = vec!["-n", &self.ns, "get", "pods"];
        if let Some(s) = selector {
            args.extend(["-l", s]);
        }
        get_json(&args)
            .map(|l| l["items"].as_array().unwrap().clone())
            .unwrap_or_default()
    }

    /// How many pods of `selector` are Ready.
    pub fn ready(&self, selector: &str) -> usize {
        self.pods(Some(selector))
            .iter()
            .filter(|p| is_ready(p))
            .count()
    }

    /// Waits until exactly `n` pods of `selector` exist, all Running and Ready, none terminating.
    pub fn wait_running(&self, selector: &str, n: usize, secs: u64) -> Vec<Value> {
        let mut pods = vec![];
        wait_until(secs, &format!("{n} pods {selector} Running"), || {
            pods = self.pods(Some(selector));
            let ready = pods.iter().filter(|p| is_ready(p)).count();
            let terminating = pods
                .iter()
                .filter(|p| !p["metadata"]["deletionTimestamp"].is_null())
                .count();
            if pods.len() == n && ready == n && terminating == 0 {
                Ok(())
            } else {
                Err(format!(
                    "{} pods, {ready} ready, {terminating} terminating: {}",
                    pods.len(),
                    summary(&pods)
                ))
            }
        });
        pods
    }

    /// Waits until no pod of `selector` is left.
    pub fn wait_gone(&self, selector: &str, secs: u64) {
        wait_until(secs, &format!("pods {selector} gone"), || {
            let pods = self.pods(Some(selector));
            if pods.is_empty() {
                Ok(())
            } else {
                Err(summary(&pods))
            }
        });
    }

    pub fn logs(&self, pod: &str) -> String {
        kubectl_ok(&["-n", &self.ns, "logs", pod, "-c", "main"])
    }

    /// Events of the namespace with `reason`.
    pub fn events(&self, reason: &str) -> Vec<String> {
        events_in(&self.ns, reason)
    }
}

/// The operator's pods (none when it is not installed).
pub fn operator_pods() -> Vec<Value> {
    let selector = "app.kubernetes.io/name=whereabouts-operator";
    get_json(&["-n", OPERATOR_NS, "get", "pods", "-l", selector])
        .and_then(|l| l["items"].as_array().cloned())
        .unwrap_or_default()
}

/// Events of namespace `ns` with `reason`, each as "OBJECT: MESSAGE".
pub fn events_in(ns: &str, reason: &str) -> Vec<String> {
    get_json(&["-n", ns, "get", "events"])
        .map(|l| {
            l["items"]
                .as_array()
                .unwrap()
                .iter()
                .filter(|e| e["reason"] == reason)
                .map(|e| {
                    let object = e["involvedObject"]["name"].as_str().unwrap_or_default();
                    let message = e["message"].as_str().unwrap_or_default();
                    format!("{object}: {message}")
                })
                .collect()
        })
        .unwrap_or_default()
}

impl Drop for Workload {
    fn drop(&mut self) {
        let _ = kubectl(&["delete", "namespace", &self.ns, "--wait=false"], None);
    }
}

pub fn is_ready(pod: &Value) -> bool {
    pod["status"]["phase"] == "Running"
        && pod["status"]["conditions"].as_array().is_some_and(|c| {
            c.iter()
                .any(|c| c["type"] == "Ready" && c["status"] == "True")
        })
}

pub fn summary(pods: &[Value]) -> String {
    pods.iter()
        .map(|p| {
            format!(
                "{}={}{}",
                p["metadata"]["name"].as_str().unwrap_or("?"),
                p["status"]["phase"].as_str().unwrap_or("?"),
                if p["metadata"]["deletionTimestamp"].is_null() {
                    ""
                } else {
                    "(terminating)"
                }
            )
        })
        .collect::<Vec<_>>()
        .join(" ")
}
