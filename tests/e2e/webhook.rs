//! The admission webhook on the real control plane, served by the real operator binary.
//!
//! The operator runs on the host with a certificate for 127.0.0.1 minted by webhook-certs/mint.sh;
//! the ValidatingWebhookConfiguration points at it by URL and is scoped with a namespaceSelector to
//! this test's namespace, so tests running in parallel elsewhere never reach it.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

use crate::harness::{Ns, OperatorProcess, admin_kubeconfig, free_port, kubectl_raw, repo};

const LABEL: &str = "whereabouts-e2e-webhook";

/// Mints a CA and a certificate for 127.0.0.1 into `dir`; returns the base64 caBundle.
fn mint(dir: &Path) -> String {
    let out = Command::new(repo().join("webhook-certs/mint.sh"))
        .args(["--ip", "127.0.0.1", "--out"])
        .arg(dir)
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "mint.sh: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8(out.stdout).unwrap().trim().to_owned()
}

/// The cluster-scoped webhook registration; deleted when the test ends, even on panic.
struct Registration {
    name: String,
}

impl Registration {
    fn create(ns: &str, port: u16, ca_bundle: &str) -> Registration {
        let name = format!("whereabouts-e2e-{ns}");
        let vwc = serde_json::json!({
            "apiVersion": "admissionregistration.k8s.io/v1", "kind": "ValidatingWebhookConfiguration",
            "metadata": {"name": name},
            "webhooks": [{
                "name": "nad.whereabouts.cni.cncf.io",
                "clientConfig": {"url": format!("https://127.0.0.1:{port}/validate"), "caBundle": ca_bundle},
                "rules": [{"apiGroups": ["k8s.cni.cncf.io"], "apiVersions": ["v1"], "operations": ["CREATE", "UPDATE"],
                           "resources": ["network-attachment-definitions"], "scope": "Namespaced"}],
                "namespaceSelector": {"matchLabels": {LABEL: ns}},
                "failurePolicy": "Fail", "sideEffects": "None", "timeoutSeconds": 5, "admissionReviewVersions": ["v1"]
            }]
        });
        let out = kubectl_raw(
            admin_kubeconfig(),
            &["apply", "-f", "-"],
            Some(&vwc.to_string()),
        );
        assert!(
            out.status.success(),
            "register webhook: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        Registration { name }
    }
}

impl Drop for Registration {
    fn drop(&mut self) {
        let _ = kubectl_raw(
            admin_kubeconfig(),
            &[
                "delete",
                "validatingwebhookconfiguration",
                &self.name,
                "--ignore-not-found",
            ],
            None,
        );
    }
}

fn yaml_files(dir: &str, prefix: &str) -> Vec<PathBuf> {
    let mut out: Vec<PathBuf> = std::fs::read_dir(repo().join(dir))
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| {
            p.extension().is_some_and(|e| e == "yaml")
                && p.file_name().unwrap().to_string_lossy().starts_with(prefix)
        })
        .collect();
    out.sort();
    out
}

fn expected(text: &str) -> &str {
    text.lines()
        .next()
        .and_then(|l| l.strip_prefix("# expect: "))
        .expect("`# expect:` line")
}

fn nad_yaml(name: &str, config: &serde_json::Value) -> String {
    serde_json::json!({"apiVersion": "k8s.cni.cncf.io/v1", "kind": "NetworkAttachmentDefinition", "metadata": {"name": name},
        "spec": {"config": config.to_string()}}).to_string()
}

#[test]
fn webhook_rejects_invalid_nads_at_apply_time() {
    let ns = Ns::new("webhook");
    ns.kubectl_ok(&[
        "label",
        "namespace",
        &ns.name,
        &format!("{LABEL}={}", ns.name),
    ]);
    let certs = tempfile::tempdir().unwrap();
    let ca_bundle = mint(certs.path());
    let webhook_port = free_port();
    let flags = [
        "--leader-election=false".to_owned(),
        format!("--pool-namespace={}", ns.name),
        format!("--webhook-addr=127.0.0.1:{webhook_port}"),
        format!("--tls-cert-file={}", certs.path().join("tls.crt").display()),
        format!("--tls-key-file={}", certs.path().join("tls.key").display()),
    ];
    let mut operator = OperatorProcess::start(certs.path(), "operator", &flags);
    operator.wait_ready();
    let _registration = Registration::create(&ns.name, webhook_port, &ca_bundle);

    // The API server picks the registration up asynchronously: wait until a bad NAD is denied.
    let probe =
        std::fs::read_to_string(repo().join("tests/fixtures/nads/invalid-cidr.yaml")).unwrap();
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        let out = ns.apply(&probe);
        if !out.status.success() {
            break;
        }
        let _ = ns.kubectl(&["delete", "net-attach-def", "invalid-cidr"], None);
        assert!(
            Instant::now() < deadline,
            "webhook registration never took effect\n{}",
            operator.log()
        );
        std::thread::sleep(Duration::from_millis(300));
    }

    // Every valid sample is admitted.
    for sample in yaml_files("config/samples", "whereabouts-") {
        let out = ns.apply(&std::fs::read_to_string(&sample).unwrap());
        assert!(
            out.status.success(),
            "{}: {}\n{}",
            sample.display(),
            String::from_utf8_lossy(&out.stderr),
            operator.log()
        );
    }

    // Every invalid NAD is denied, and kubectl shows our message.
    for file in yaml_files("tests/fixtures/nads", "invalid-") {
        let text = std::fs::read_to_string(&file).unwrap();
        let out = ns.apply(&text);
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(!out.status.success(), "{} was admitted", file.display());
        assert!(
            stderr.contains("denied the request"),
            "{}: {stderr}",
            file.display()
        );
        assert!(
            stderr.contains(expected(&text)),
            "{}: {stderr:?} should contain {:?}",
            file.display(),
            expected(&text)
        );
    }

    // Updating a valid NAD to an invalid one is denied and leaves the stored object as it was.
    let good = serde_json::json!({"cniVersion": "0.3.1", "type": "macvlan", "ipam": {"type": "whereabouts", "range": "10.60.0.0/24"}});
    let out = ns.apply(&nad_yaml("update-me", &good));
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let bad = serde_json::json!({"cniVersion": "0.3.1", "type": "macvlan", "ipam": {"type": "whereabouts", "range": "10.60.0.0/24", "range_start": "10.60.1.5"}});
    let out = ns.apply(&nad_yaml("update-me", &bad));
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        !out.status.success(),
        "update to an invalid config was admitted"
    );
    assert!(
        stderr
            .contains(r#"spec.config: ipam.range_start "10.60.1.5" is outside range 10.60.0.0/24"#),
        "{stderr}"
    );
    let stored = ns.get_json(&["net-attach-def", "update-me"]).unwrap();
    assert_eq!(stored["spec"]["config"], good.to_string());

    // Risky but valid: admitted, and kubectl prints our warning.
    let risky = serde_json::json!({"type": "macvlan", "ipam": {"type": "whereabouts", "range": "10.61.0.0/24", "gateway": "10.99.0.1"}});
    let out = ns.apply(&nad_yaml("risky", &risky));
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(
        String::from_utf8_lossy(&out.stderr)
            .contains(r#"Warning: spec.config: ipam.gateway "10.99.0.1" is outside every range"#),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );

    // Two NADs on one range of one network: once the operator's NAD watch has seen the first
    // (its index is rebuilt when the watch moves), the second is admitted with a warning naming it.
    let net = format!("e2e-{}", ns.name);
    let shared = serde_json::json!({"cniVersion": "1.0.0", "type": "macvlan", "ipam": {"type": "whereabouts", "range": "10.62.0.0/24", "network_name": net}});
    let out = ns.apply(&nad_yaml("first", &shared));
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let want = format!(
        r#"overlaps range 10.62.0.0/24 of NetworkAttachmentDefinition {}/first in network_name "{net}""#,
        ns.name
    );
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        let out = ns.apply(&nad_yaml("second", &shared));
        let stderr = String::from_utf8_lossy(&out.stderr).to_string();
        assert!(out.status.success(), "{stderr}");
        if stderr.contains(&want) {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "no overlap warning for {want}: {stderr}"
        );
        std::thread::sleep(Duration::from_millis(300));
    }

    // A NAD of another IPAM is not ours: admitted untouched, even with a config we would reject.
    let host_local = serde_json::json!({"cniVersion": "0.3.1", "type": "bridge", "ipam": {"type": "host-local", "subnet": "abc.0.0.0/99"}});
    let out = ns.apply(&nad_yaml("host-local", &host_local));
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(
        !String::from_utf8_lossy(&out.stderr).contains("Warning"),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let stored = ns.get_json(&["net-attach-def", "host-local"]).unwrap();
    assert_eq!(stored["spec"]["config"], host_local.to_string());
}
