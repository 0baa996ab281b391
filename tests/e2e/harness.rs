//! The e2e harness: the local control plane, namespaces, kubectl, and our binaries run as a
//! runtime would run them.

use std::collections::BTreeMap;
use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};
use std::sync::OnceLock;

use serde_json::Value;

pub fn repo() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

pub fn kubectl_bin() -> PathBuf {
    repo().join("e2e/bin/kubectl")
}

/// The admin kubeconfig of the local control plane, started (or reused) once per test process,
/// with our CRDs applied.
pub fn admin_kubeconfig() -> &'static Path {
    static KUBECONFIG: OnceLock<PathBuf> = OnceLock::new();
    KUBECONFIG.get_or_init(|| {
        let out = Command::new(repo().join("e2e/cluster.sh"))
            .arg("up")
            .stderr(Stdio::inherit())
            .output()
            .expect("run e2e/cluster.sh up");
        assert!(out.status.success(), "e2e/cluster.sh up failed");
        let stdout = String::from_utf8(out.stdout).unwrap();
        let path = PathBuf::from(
            stdout
                .lines()
                .last()
                .expect("cluster.sh up prints the kubeconfig path")
                .trim(),
        );
        let apply = kubectl_raw(
            &path,
            &["apply", "-f", repo().join("crds").to_str().unwrap()],
            None,
        );
        assert!(
            apply.status.success(),
            "applying crds/: {}",
            String::from_utf8_lossy(&apply.stderr)
        );
        for crd in [
            "ippools.whereabouts.cni.cncf.io",
            "overlappingrangeipreservations.whereabouts.cni.cncf.io",
            "network-attachment-definitions.k8s.cni.cncf.io",
            "ipamclaims.k8s.cni.cncf.io",
        ] {
            let wait = kubectl_raw(
                &path,
                &[
                    "wait",
                    "--for=condition=Established",
                    "--timeout=30s",
                    &format!("crd/{crd}"),
                ],
                None,
            );
            assert!(wait.status.success(), "CRD {crd} not established");
        }
        path
    })
}

pub fn kubectl_raw(kubeconfig: &Path, args: &[&str], stdin: Option<&str>) -> Output {
    let mut cmd = Command::new(kubectl_bin());
    cmd.arg("--kubeconfig")
        .arg(kubeconfig)
        .args(args)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    let mut child = cmd.spawn().expect("spawn kubectl");
    child
        .stdin
        .take()
        .unwrap()
        .write_all(stdin.unwrap_or_default().as_bytes())
        .unwrap();
    child.wait_with_output().unwrap()
}

/// A fresh namespace for one test. Pools live in it too: the test's kubeconfig (the one the CNI
/// plugin gets through its flat file) has it as the context namespace, as a node's would.
pub struct Ns {
    pub name: String,
    pub kubeconfig: PathBuf,
    pub dir: tempfile::TempDir,
}

impl Ns {
    pub fn new(prefix: &str) -> Ns {
        let admin = admin_kubeconfig();
        let name = format!(
            "e2e-{prefix}-{}",
            fastrand::u32(..).to_string().get(..6).unwrap_or("0")
        );
        let dir = tempfile::tempdir().unwrap();
        let kubeconfig = dir.path().join("kubeconfig");
        std::fs::copy(admin, &kubeconfig).unwrap();
        let ns = Ns {
            name: name.clone(),
            kubeconfig,
            dir,
        };
        ns.kubectl_ok(&["create", "namespace", &name]);
        ns.kubectl_ok(&["config", "set-context", "--current", "--namespace", &name]);
        // Pods need the `default` ServiceAccount; do not wait for the controller manager to make it.
        let _ = ns.kubectl(&["create", "serviceaccount", "default"], None);
        std::fs::write(
            ns.flat_file(),
            // Each test namespace is a node of its own, with its own bound on plugin processes.
            serde_json::json!({
                "kubernetes": {"kubeconfig": ns.kubeconfig},
                "plugin_slots_dir": ns.dir.path().join("plugin-slots"),
            })
            .to_string(),
        )
        .unwrap();
        // ... named after the namespace, as the installer names the node next to its flat file.
        std::fs::write(ns.dir.path().join("nodename"), format!("{name}\n")).unwrap();
        ns
    }

    /// The node's flat file for this namespace: points the plugin at the test kubeconfig.
    pub fn flat_file(&self) -> PathBuf {
        self.dir.path().join("whereabouts.conf")
    }

    pub fn kubectl(&self, args: &[&str], stdin: Option<&str>) -> Output {
        kubectl_raw(&self.kubeconfig, args, stdin)
    }

    pub fn kubectl_ok(&self, args: &[&str]) -> String {
        self.kubectl_ok_with(args, None)
    }

    /// [`Ns::kubectl_ok`] with `stdin` (`-f -`).
    pub fn kubectl_ok_stdin(&self, args: &[&str], stdin: &str) -> String {
        self.kubectl_ok_with(args, Some(stdin))
    }

    fn kubectl_ok_with(&self, args: &[&str], stdin: Option<&str>) -> String {
        let out = self.kubectl(args, stdin);
        assert!(
            out.status.success(),
            "kubectl {args:?}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        String::from_utf8(out.stdout).unwrap()
    }

    pub fn apply(&self, yaml: &str) -> Output {
        self.kubectl(&["apply", "-f", "-"], Some(yaml))
    }

    /// Creates IPAMClaim `name` in this namespace for network `network`, interface net1.
    pub fn create_ipam_claim(&self, name: &str, network: &str) {
        let claim = serde_json::json!({"apiVersion": "k8s.cni.cncf.io/v1alpha1", "kind": "IPAMClaim",
            "metadata": {"name": name, "namespace": self.name},
            "spec": {"network": network, "interface": "net1"}});
        self.kubectl_ok_stdin(&["create", "-f", "-"], &claim.to_string());
    }

    pub fn get_json(&self, args: &[&str]) -> Option<Value> {
        let mut all = vec!["get"];
        all.extend_from_slice(args);
        all.extend_from_slice(&["-o", "json"]);
        let out = self.kubectl(&all, None);
        out.status
            .success()
            .then(|| serde_json::from_slice(&out.stdout).unwrap())
    }

    /// A pool's allocations, offset -> entry (empty when the pool does not exist).
    pub fn allocations(&self, pool: &str) -> BTreeMap<String, Value> {
        self.get_json(&["ippool", pool])
            .and_then(|p| p["spec"]["allocations"].as_object().cloned())
            .map(|m| m.into_iter().collect())
            .unwrap_or_default()
    }

    pub fn reservations(&self) -> BTreeMap<String, Value> {
        let list = self.get_json(&["overlappingrangeipreservations"]).unwrap();
        list["items"]
            .as_array()
            .unwrap()
            .iter()
            .map(|r| {
                (
                    r["metadata"]["name"].as_str().unwrap().to_owned(),
                    r["spec"].clone(),
                )
            })
            .collect()
    }

    /// Creates a Pod (it stays Pending: there is no scheduler) and returns its UID.
    pub fn create_pod(&self, name: &str, annotations: &BTreeMap<String, String>) -> String {
        let pod = serde_json::json!({"apiVersion": "v1", "kind": "Pod", "metadata": {"name": name, "namespace": self.name, "annotations": annotations},
            "spec": {"automountServiceAccountToken": false, "containers": [{"name": "c", "image": "registry.invalid/pause"}]}});
        let out = self.kubectl(
            &["create", "-f", "-", "-o", "jsonpath={.metadata.uid}"],
            Some(&pod.to_string()),
        );
        assert!(
            out.status.success(),
            "create pod {name}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        String::from_utf8(out.stdout).unwrap()
    }

    /// A network config for our plugin whose flat file points at this namespace's kubeconfig.
    pub fn netconf(&self, cni_version: &str, mut ipam: Value) -> Value {
        ipam["type"] = "whereabouts".into();
        ipam["configuration_path"] = self.flat_file().to_str().unwrap().into();
        serde_json::json!({"cniVersion": cni_version, "name": "e2e-net", "type": "bridge", "ipam": ipam})
    }

    /// Runs the CNI binary as a runtime would for pod `pod` of this namespace.
    pub fn cni(
        &self,
        command: &str,
        conf: &Value,
        container: &str,
        ifname: &str,
        pod: &str,
        uid: &str,
    ) -> Cni {
        Cni::run(&CniCall {
            command,
            conf,
            container,
            ifname,
            netns: "/var/run/netns/none",
            args: &format!(
                "IgnoreUnknown=1;K8S_POD_NAMESPACE={};K8S_POD_NAME={pod};K8S_POD_UID={uid}",
                self.name
            ),
            path: None,
        })
    }

    pub fn cni_spawn(
        &self,
        command: &str,
        conf: &Value,
        container: &str,
        pod: &str,
    ) -> std::process::Child {
        self.spawn_plugin(whereabouts_bin(), command, conf, container, pod)
    }

    /// Plugin binary `bin` as a runtime runs it for pod `pod` of this namespace (UID
    /// `uid-<pod>`), container `container`, interface net1: started now.
    pub fn spawn_plugin(
        &self,
        bin: PathBuf,
        command: &str,
        conf: &Value,
        container: &str,
        pod: &str,
    ) -> std::process::Child {
        CniCall {
            command,
            conf,
            container,
            ifname: "net1",
            netns: "/var/run/netns/none",
            args: &format!(
                "IgnoreUnknown=1;K8S_POD_NAMESPACE={};K8S_POD_NAME={pod};K8S_POD_UID=uid-{pod}",
                self.name
            ),
            path: None,
        }
        .spawn(bin)
    }

    /// `command` processes for pods pod<i> (containers c<i>) of `pods`, all started at once.
    pub fn cni_spawn_pods(
        &self,
        command: &str,
        conf: &Value,
        pods: std::ops::Range<usize>,
    ) -> Vec<std::process::Child> {
        pods.map(|i| self.cni_spawn(command, conf, &format!("c{i}"), &format!("pod{i}")))
            .collect()
    }

    /// [`Ns::cni_spawn_pods`], then each one's outcome, in pod order.
    pub fn cni_pods(&self, command: &str, conf: &Value, pods: std::ops::Range<usize>) -> Vec<Cni> {
        self.cni_spawn_pods(command, conf, pods)
            .into_iter()
            .map(|c| Cni::from(c.wait_with_output().unwrap()))
            .collect()
    }

    /// `command` for pod<i> alone, named as [`Ns::cni_spawn_pods`] names it (UID uid-pod<i>).
    pub fn cni_pod(&self, command: &str, conf: &Value, i: usize) -> Cni {
        let (container, pod) = (format!("c{i}"), format!("pod{i}"));
        self.cni(
            command,
            conf,
            &container,
            "net1",
            &pod,
            &format!("uid-{pod}"),
        )
    }
}

impl Drop for Ns {
    fn drop(&mut self) {
        let _ = kubectl_raw(
            admin_kubeconfig(),
            &["delete", "namespace", &self.name, "--wait=false"],
            None,
        );
    }
}

pub fn whereabouts_bin() -> PathBuf {
    PathBuf::from(env!("CARGO_BIN_EXE_whereabouts"))
}

/// The operator binary the tests run: this build's, or `WHEREABOUTS_E2E_OPERATOR`, so that a new
/// regression test can be run against a build of the code before its fix (it must fail there).
pub fn operator_bin() -> PathBuf {
    std::env::var_os("WHEREABOUTS_E2E_OPERATOR")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from(env!("CARGO_BIN_EXE_whereabouts-operator")))
}

pub struct CniCall<'a> {
    pub command: &'a str,
    pub conf: &'a Value,
    pub container: &'a str,
    pub ifname: &'a str,
    pub netns: &'a str,
    pub args: &'a str,
    /// CNI_PATH, for plugins that call us as their IPAM.
    pub path: Option<&'a Path>,
}

impl CniCall<'_> {
    /// Runs `bin` on a node whose whereabouts directory (`WHEREABOUTS_CONF_DIR`) is the one that
    /// holds the flat file the config names, as the node's own directory holds its flat file.
    pub fn spawn(&self, bin: PathBuf) -> std::process::Child {
        let flat_dir = flat_file_dir(self.conf);
        self.spawn_on(bin, flat_dir.as_deref())
    }

    /// Runs `bin` on a node whose whereabouts directory is `node_dir` (none: only the well-known
    /// ones).
    pub fn spawn_on(&self, bin: PathBuf, node_dir: Option<&Path>) -> std::process::Child {
        let mut cmd = Command::new(bin);
        cmd.env_clear()
            .env("PATH", std::env::var("PATH").unwrap_or_default())
            .env("CNI_COMMAND", self.command)
            .env("CNI_CONTAINERID", self.container)
            .env("CNI_NETNS", self.netns)
            .env("CNI_IFNAME", self.ifname)
            .env("CNI_ARGS", self.args)
            .env(
                "CNI_PATH",
                self.path
                    .map(|p| p.to_path_buf())
                    .unwrap_or_else(|| whereabouts_bin().parent().unwrap().to_path_buf()),
            )
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped());
        if let Some(dir) = node_dir {
            cmd.env(whereabouts::config::trust::CONF_DIR_ENV, dir);
        }
        let mut child = cmd.spawn().expect("spawn CNI plugin");
        // A command that needs no config (VERSION) may exit before reading stdin: a broken pipe
        // here is not a failure, as for a runtime.
        let _ = child
            .stdin
            .take()
            .unwrap()
            .write_all(self.conf.to_string().as_bytes());
        child
    }
}

/// The directory of the flat file that a network config names (`configuration_path` of its
/// ipam, or of its first plugin's in a conflist).
fn flat_file_dir(conf: &Value) -> Option<PathBuf> {
    let ipam = conf
        .get("ipam")
        .or_else(|| conf.get("plugins")?.get(0)?.get("ipam"))?;
    let path = Path::new(ipam.get("configuration_path")?.as_str()?);
    Some(path.parent()?.to_path_buf())
}

/// The outcome of one plugin run.
#[derive(Debug)]
pub struct Cni {
    pub ok: bool,
    pub stdout: Value,
    pub stderr: String,
}

impl Cni {
    pub fn run(call: &CniCall<'_>) -> Cni {
        Cni::from(call.spawn(whereabouts_bin()).wait_with_output().unwrap())
    }

    pub fn addresses(&self) -> Vec<String> {
        assert!(
            self.ok,
            "CNI call failed: {} / {}",
            self.stdout, self.stderr
        );
        self.stdout["ips"]
            .as_array()
            .unwrap()
            .iter()
            .map(|ip| ip["address"].as_str().unwrap().to_owned())
            .collect()
    }
}

impl From<Output> for Cni {
    fn from(out: Output) -> Cni {
        let text = String::from_utf8_lossy(&out.stdout);
        let stdout = if text.trim().is_empty() {
            Value::Null
        } else {
            serde_json::from_str(&text)
                .unwrap_or_else(|e| panic!("stdout is not JSON ({e}): {text}"))
        };
        Cni {
            ok: out.status.success(),
            stdout,
            stderr: String::from_utf8_lossy(&out.stderr).into_owned(),
        }
    }
}

pub fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

/// A plain HTTP/1.1 GET on loopback; the whole response (status line, headers, body).
pub fn http_get(port: u16, path: &str) -> Option<String> {
    http_get_at("127.0.0.1", port, path)
}

/// [`http_get`] at another address (`::1`...).
pub fn http_get_at(ip: &str, port: u16, path: &str) -> Option<String> {
    use std::io::Read;
    let ip: std::net::IpAddr = ip.parse().ok()?;
    let mut s = std::net::TcpStream::connect((ip, port)).ok()?;
    s.set_read_timeout(Some(std::time::Duration::from_secs(5)))
        .ok()?;
    write!(
        s,
        "GET {path} HTTP/1.1\r\nHost: localhost\r\nConnection: close\r\n\r\n"
    )
    .ok()?;
    let mut out = String::new();
    s.read_to_string(&mut out).ok()?;
    Some(out)
}

/// A `whereabouts-operator run` process with its log in a file; killed when dropped.
pub struct OperatorProcess {
    pub child: std::process::Child,
    pub log: PathBuf,
    pub admin_port: u16,
}

impl OperatorProcess {
    /// Starts `run` with the admin port on loopback and `extra` flags, as the admin user.
    pub fn start(dir: &Path, name: &str, extra: &[String]) -> OperatorProcess {
        Self::start_with_env(dir, name, extra, &[])
    }

    /// [`OperatorProcess::start`] with more environment variables.
    pub fn start_with_env(
        dir: &Path,
        name: &str,
        extra: &[String],
        env: &[(&str, &str)],
    ) -> OperatorProcess {
        let admin_port = free_port();
        Self::start_at(&format!("127.0.0.1:{admin_port}"), dir, name, extra, env)
    }

    /// [`OperatorProcess::start_with_env`] with the admin port at `admin` (`[::]:PORT`...).
    pub fn start_at(
        admin: &str,
        dir: &Path,
        name: &str,
        extra: &[String],
        env: &[(&str, &str)],
    ) -> OperatorProcess {
        let admin_port = admin.rsplit(':').next().unwrap().parse().unwrap();
        let log = dir.join(format!("{name}.log"));
        let child = Command::new(operator_bin())
            .arg("run")
            .arg(format!("--admin-addr={admin}"))
            .args(extra)
            .env("KUBECONFIG", admin_kubeconfig())
            .env("RUST_LOG", "info,whereabouts=debug")
            .env("POD_NAME", name)
            .envs(env.iter().copied())
            .stdout(Stdio::null())
            .stderr(std::fs::File::create(&log).unwrap())
            .spawn()
            .expect("start whereabouts-operator");
        OperatorProcess {
            child,
            log,
            admin_port,
        }
    }

    /// A ready operator for `ns` alone: its pools in the namespace, no election, no periodic
    /// audit to interfere.
    pub fn for_namespace(ns: &Ns) -> OperatorProcess {
        let mut op = OperatorProcess::start(
            ns.dir.path(),
            "op",
            &[
                format!("--pool-namespace={}", ns.name),
                "--leader-election=false".into(),
                "--audit-interval=1h".into(),
            ],
        );
        op.wait_ready();
        op
    }

    pub fn log(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }

    pub fn get(&self, path: &str) -> Option<String> {
        http_get(self.admin_port, path)
    }

    /// Waits until /readyz answers 200 (caches synced, election running).
    pub fn wait_ready(&mut self) {
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(30);
        loop {
            if let Some(status) = self.child.try_wait().unwrap() {
                panic!("operator exited with {status}: {}", self.log());
            }
            if self
                .get("/readyz")
                .is_some_and(|r| r.starts_with("HTTP/1.1 200"))
            {
                return;
            }
            assert!(
                std::time::Instant::now() < deadline,
                "operator not ready in 30 s: {:?}\n{}",
                self.get("/readyz"),
                self.log()
            );
            std::thread::sleep(std::time::Duration::from_millis(200));
        }
    }

    pub fn kill(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl Drop for OperatorProcess {
    fn drop(&mut self) {
        self.kill();
    }
}

/// Polls `check` every 100 ms until it holds or `secs` pass; returns whether it held.
pub fn eventually(secs: u64, mut check: impl FnMut() -> bool) -> bool {
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(secs);
    while std::time::Instant::now() < deadline {
        if check() {
            return true;
        }
        std::thread::sleep(std::time::Duration::from_millis(100));
    }
    check()
}

/// The objects `kubectl kustomize` renders from `dir` (relative to the repository).
pub fn kustomize(dir: &str) -> Vec<serde_json::Value> {
    let out = kubectl_raw(
        admin_kubeconfig(),
        &["kustomize", repo().join(dir).to_str().unwrap()],
        None,
    );
    assert!(
        out.status.success(),
        "kubectl kustomize {dir}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let text = String::from_utf8(out.stdout).unwrap();
    // Empty documents are skipped.
    serde_saphyr::from_multiple(&text).unwrap()
}

/// Sends `sig` (`-STOP`, `-CONT`...) to process `pid`, as `kill` does.
pub fn signal(pid: u32, sig: &str) {
    let ok = Command::new("kill")
        .args([sig, &pid.to_string()])
        .status()
        .is_ok_and(|s| s.success());
    assert!(ok, "kill {sig} {pid}");
}

/// A value of the running cluster's `cluster.env` (e2e/cluster.sh): APISERVER_URL, CA_CERT...
pub fn cluster_env(key: &str) -> String {
    let state = std::env::var("WHEREABOUTS_E2E_STATE")
        .map(PathBuf::from)
        .unwrap_or_else(|_| repo().join("e2e/.state"));
    let env = std::fs::read_to_string(state.join("cluster.env")).unwrap();
    env.lines()
        .find_map(|l| l.strip_prefix(&format!("{key}=")))
        .unwrap_or_else(|| panic!("{key} not in cluster.env"))
        .to_owned()
}

/// A kubeconfig `file` in the test's directory: a service account's `token`, context namespace
/// `ns` (the pool namespace).
pub fn token_kubeconfig(ns: &Ns, file: &str, token: &str) -> PathBuf {
    let kubeconfig = ns.dir.path().join(file);
    let text = serde_json::json!({
        "apiVersion": "v1", "kind": "Config",
        "clusters": [{"name": "c", "cluster": {
            "server": cluster_env("APISERVER_URL"),
            "certificate-authority": cluster_env("CA_CERT")}}],
        "users": [{"name": "node", "user": {"token": token}}],
        "contexts": [{"name": "c", "context": {"cluster": "c", "user": "node", "namespace": ns.name}}],
        "current-context": "c",
    });
    std::fs::write(&kubeconfig, text.to_string()).unwrap();
    kubeconfig
}

/// Upstream's plugin (v0.9.2, `bench/bin`) for pod `pod` of `ns`: [`Ns::spawn_plugin`].
pub fn upstream_spawn(
    ns: &Ns,
    conf: &Value,
    command: &str,
    container: &str,
    pod: &str,
) -> std::process::Child {
    ns.spawn_plugin(
        repo().join("bench/bin/whereabouts-upstream"),
        command,
        conf,
        container,
        pod,
    )
}
