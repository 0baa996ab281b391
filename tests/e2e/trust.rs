//! Issue 24's exploit, through the real plugin against the real API server: a NAD author who
//! names a kubeconfig, a flat file or a log file of their choosing (in their pod's emptyDir, whose
//! host path is predictable) gets nothing run, nothing created and no address; the node's own
//! files keep working. The webhook's and `validate`'s refusal of the same NADs is in
//! `webhook.rs` and `tests/webhook_validate_cli.rs` (fixtures `invalid-kubeconfig-outside`,
//! `invalid-configuration-path`).

use std::os::unix::fs::PermissionsExt as _;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};

use serde_json::{Value, json};

use crate::harness::{Cni, Ns, whereabouts_bin};

/// The node: its whereabouts directory (root's, 0755) holding the flat file and kubeconfig.
/// The attacker: an emptyDir-like directory anyone may write (0777), holding a kubeconfig whose
/// user runs `/bin/sh`, which would leave `pwned` behind, and a flat file naming it.
struct Setup {
    ns: Ns,
    node: tempfile::TempDir,
    attacker: tempfile::TempDir,
}

impl Setup {
    fn new() -> Setup {
        let ns = Ns::new("trust");
        let node = tempfile::tempdir().unwrap();
        chmod(node.path(), 0o755);
        let node_kubeconfig = node.path().join("whereabouts.kubeconfig");
        std::fs::copy(&ns.kubeconfig, &node_kubeconfig).unwrap();
        write_flat(node.path(), &node_kubeconfig);
        let attacker = tempfile::tempdir().unwrap();
        chmod(attacker.path(), 0o777);
        let s = Setup { ns, node, attacker };
        let evil = s.evil_kubeconfig(&s.attacker.path().join("evil.kubeconfig"));
        std::fs::write(
            s.attacker.path().join("evil.conf"),
            json!({"kubernetes": {"kubeconfig": evil}}).to_string(),
        )
        .unwrap();
        s
    }

    fn pwned(&self) -> PathBuf {
        self.attacker.path().join("pwned")
    }

    /// Writes at `path` the namespace's kubeconfig with its user replaced by an `exec` command
    /// that records who ran it and then prints a valid ExecCredential.
    fn evil_kubeconfig(&self, path: &Path) -> PathBuf {
        let text = std::fs::read_to_string(&self.ns.kubeconfig).unwrap();
        let mut kc: Value = serde_saphyr::from_str(&text).unwrap();
        let cred = r#"{"apiVersion":"client.authentication.k8s.io/v1","kind":"ExecCredential","status":{"token":"x"}}"#;
        let script = format!("id > {}; echo '{cred}'", self.pwned().display());
        for user in kc["users"].as_array_mut().unwrap() {
            user["user"] = json!({"exec": {"apiVersion": "client.authentication.k8s.io/v1",
                "command": "/bin/sh", "args": ["-c", script], "interactiveMode": "Never"}});
        }
        std::fs::write(path, serde_json::to_string(&kc).unwrap()).unwrap();
        path.to_path_buf()
    }

    fn conf(&self, extra: Value) -> Value {
        let mut ipam = json!({"type": "whereabouts", "range": "10.93.0.0/24"});
        for (k, v) in extra.as_object().unwrap() {
            ipam[k] = v.clone();
        }
        json!({"cniVersion": "1.0.0", "name": "trust", "type": "macvlan", "ipam": ipam})
    }

    /// Runs the plugin as the runtime does on this node, with ambient credentials about
    /// (`KUBECONFIG`, `HOME`) that it must never use.
    fn cni(&self, command: &str, conf: &Value, pod: &str) -> Cni {
        use std::io::Write as _;
        let mut child = Command::new(whereabouts_bin())
            .env_clear()
            .env("PATH", std::env::var("PATH").unwrap_or_default())
            .env("HOME", "/root")
            .env("KUBECONFIG", crate::harness::admin_kubeconfig())
            .env("WHEREABOUTS_CONF_DIR", self.node.path())
            .env("CNI_COMMAND", command)
            .env("CNI_CONTAINERID", format!("c-{pod}"))
            .env("CNI_NETNS", "/var/run/netns/none")
            .env("CNI_IFNAME", "net1")
            .env(
                "CNI_ARGS",
                format!(
                    "IgnoreUnknown=1;K8S_POD_NAMESPACE={};K8S_POD_NAME={pod};K8S_POD_UID=u-{pod}",
                    self.ns.name
                ),
            )
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap();
        let stdin = conf.to_string();
        child
            .stdin
            .take()
            .unwrap()
            .write_all(stdin.as_bytes())
            .unwrap();
        Cni::from(child.wait_with_output().unwrap())
    }

    /// An ADD that must fail with code 7 and `words` in its message, having run nothing and
    /// allocated nothing.
    fn refused(&self, extra: Value, words: &str) {
        let before = self.entries();
        let r = self.cni("ADD", &self.conf(extra.clone()), "victim");
        assert!(!r.ok, "{extra} was accepted: {}", r.stdout);
        assert_eq!(r.stdout["code"], 7, "{extra}: {}", r.stdout);
        let msg = r.stdout["msg"].as_str().unwrap();
        assert!(msg.contains(words), "{extra}: {msg:?} should say {words:?}");
        assert!(!self.pwned().exists(), "{extra}: the exec command ran");
        assert_eq!(self.entries(), before, "{extra}: an address was allocated");
    }

    fn entries(&self) -> usize {
        let out = self.ns.kubectl(&["get", "ippools", "-o", "json"], None);
        let pools: Value = serde_json::from_slice(&out.stdout).unwrap();
        let items = pools["items"].as_array().cloned().unwrap_or_default();
        items
            .iter()
            .filter_map(|p| p["spec"]["allocations"].as_object().map(|a| a.len()))
            .sum()
    }
}

fn chmod(p: &Path, mode: u32) {
    std::fs::set_permissions(p, std::fs::Permissions::from_mode(mode)).unwrap();
}

fn write_flat(dir: &Path, kubeconfig: &Path) {
    let flat = json!({"kubernetes": {"kubeconfig": kubeconfig}, "agent_socket": ""});
    std::fs::write(dir.join("whereabouts.conf"), flat.to_string()).unwrap();
}

#[test]
fn a_nad_cannot_make_the_plugin_run_or_read_its_authors_files() {
    let s = Setup::new();
    let evil = s.attacker.path().join("evil.kubeconfig");
    let evil_flat = s.attacker.path().join("evil.conf");
    // The exploit as reported: the NAD names the kubeconfig in the author's emptyDir.
    s.refused(
        json!({"kubernetes": {"kubeconfig": evil}}),
        &format!(
            "ipam.kubernetes.kubeconfig {:?} names the plugin's credentials, which are node configuration",
            evil.display().to_string()
        ),
    );
    // The same through a flat file of the author's choosing, directly or with `..`.
    s.refused(
        json!({"configuration_path": evil_flat}),
        "ipam.configuration_path",
    );
    let dotted = format!(
        "{}/../{}/evil.conf",
        s.node.path().display(),
        s.attacker.path().file_name().unwrap().to_str().unwrap()
    );
    s.refused(
        json!({"configuration_path": dotted}),
        "names the node's flat file",
    );
    // Symlinks in the node's directory that lead out of it: followed by nothing.
    std::os::unix::fs::symlink(&evil, s.node.path().join("link.kubeconfig")).unwrap();
    std::os::unix::fs::symlink(&evil_flat, s.node.path().join("link.conf")).unwrap();
    s.refused(
        json!({"kubernetes": {"kubeconfig": s.node.path().join("link.kubeconfig")}}),
        "resolves to ",
    );
    s.refused(
        json!({"configuration_path": s.node.path().join("link.conf")}),
        "resolves to ",
    );
    // A file in the node's directory that others may write is not root's word either.
    let writable = s.node.path().join("writable.kubeconfig");
    std::fs::copy(&s.ns.kubeconfig, &writable).unwrap();
    chmod(&writable, 0o666);
    s.refused(
        json!({"kubernetes": {"kubeconfig": writable}}),
        "is writable by group or others",
    );
    // A kubeconfig that runs a command is refused wherever it is, even root's own.
    let root_exec = s.evil_kubeconfig(&s.node.path().join("exec.kubeconfig"));
    chmod(&root_exec, 0o600);
    s.refused(
        json!({"kubernetes": {"kubeconfig": root_exec}}),
        "gets its credentials by running a command (exec)",
    );
}

#[test]
fn the_nodes_own_files_keep_working_and_nothing_else_is_borrowed() {
    let s = Setup::new();
    // Upstream's documented form: the NAD names the node's kubeconfig in the node's directory.
    let own = s.node.path().join("whereabouts.kubeconfig");
    let r = s.cni(
        "ADD",
        &s.conf(json!({"kubernetes": {"kubeconfig": own}})),
        "p1",
    );
    assert_eq!(r.addresses(), ["10.93.0.1/24"], "{}", r.stderr);
    // A NAD's log_file is not followed (the node's flat file decides where the plugin logs).
    let log = s.attacker.path().join("plugin.log");
    let r = s.cni(
        "ADD",
        &s.conf(json!({"log_file": log, "log_level": "debug"})),
        "p2",
    );
    assert_eq!(r.addresses(), ["10.93.0.2/24"], "{}", r.stderr);
    assert!(!log.exists(), "the NAD's log_file was created");
    assert!(
        r.stderr.contains("ipam.log_file is node configuration"),
        "{}",
        r.stderr
    );
    // A DEL of a NAD admitted before the rule goes on with the node's own kubeconfig, so the
    // runtime can still delete its sandboxes; the author's command never runs.
    let evil = s.attacker.path().join("evil.kubeconfig");
    let r = s.cni(
        "DEL",
        &s.conf(json!({"kubernetes": {"kubeconfig": evil}})),
        "p1",
    );
    assert!(r.ok, "{} {}", r.stdout, r.stderr);
    assert!(!s.pwned().exists());
    assert_eq!(s.entries(), 1);
    // The same for a flat file that is in the node's directory only by a symlink out of it.
    let link = s.node.path().join("link.conf");
    std::os::unix::fs::symlink(s.attacker.path().join("evil.conf"), &link).unwrap();
    let r = s.cni("DEL", &s.conf(json!({"configuration_path": link})), "p2");
    assert!(r.ok, "{} {}", r.stdout, r.stderr);
    assert!(!s.pwned().exists());
    assert_eq!(s.entries(), 0);
    // The node's own flat file with an exec kubeconfig: refused too.
    let root_exec = s.evil_kubeconfig(&s.node.path().join("exec.kubeconfig"));
    write_flat(s.node.path(), &root_exec);
    s.refused(
        json!({}),
        "gets its credentials by running a command (exec)",
    );
    // No kubeconfig at all: a clear error, never KUBECONFIG or ~/.kube/config.
    std::fs::write(
        s.node.path().join("whereabouts.conf"),
        json!({"agent_socket": ""}).to_string(),
    )
    .unwrap();
    s.refused(json!({}), "no kubeconfig");
}
