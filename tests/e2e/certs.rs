//! The webhook's self-managed certificate against the real API server: the shipped webhook
//! configuration refuses nothing while there is no certificate (failurePolicy Ignore); the
//! operator makes its CA and serving certificate, keeps them in a Secret, injects the CA, serves
//! with it, turns the policy to Fail, and keeps the same certificate across a restart.

use std::process::Command;

use serde_json::{Value, json};

use crate::harness::{
    Ns, OperatorProcess, admin_kubeconfig, eventually, free_port, kubectl_raw, repo,
};

const LABEL: &str = "whereabouts-e2e-certs";

/// The shipped ValidatingWebhookConfiguration, renamed and scoped to `ns` (it is cluster-wide),
/// its Service in `ns`; deleted when dropped.
struct Shipped {
    name: String,
}

impl Shipped {
    fn apply(ns: &Ns) -> Shipped {
        let file = repo().join("config/webhook/base/validatingwebhookconfiguration.yaml");
        let out = kubectl_raw(
            admin_kubeconfig(),
            &[
                "create",
                "--dry-run=client",
                "-o",
                "json",
                "-f",
                file.to_str().unwrap(),
            ],
            None,
        );
        let mut vwc: Value = serde_json::from_slice(&out.stdout).unwrap();
        assert_eq!(vwc["webhooks"][0]["failurePolicy"], "Ignore", "as shipped");
        let name = format!("whereabouts-e2e-{}", ns.name);
        vwc["metadata"]["name"] = name.clone().into();
        vwc["webhooks"][0]["clientConfig"]["service"]["namespace"] = ns.name.clone().into();
        vwc["webhooks"][0]["namespaceSelector"] = json!({"matchLabels": {LABEL: ns.name}});
        let out = kubectl_raw(
            admin_kubeconfig(),
            &["apply", "-f", "-"],
            Some(&vwc.to_string()),
        );
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
        Shipped { name }
    }

    fn get(&self) -> Value {
        let out = kubectl_raw(
            admin_kubeconfig(),
            &[
                "get",
                "validatingwebhookconfiguration",
                &self.name,
                "-o",
                "json",
            ],
            None,
        );
        serde_json::from_slice(&out.stdout).unwrap()
    }
}

impl Drop for Shipped {
    fn drop(&mut self) {
        let _ = kubectl_raw(
            admin_kubeconfig(),
            &["delete", "validatingwebhookconfiguration", &self.name],
            None,
        );
    }
}

fn invalid_nad(ns: &Ns, name: &str) -> std::process::Output {
    let config = json!({"cniVersion": "1.0.0", "name": name, "type": "macvlan",
        "ipam": {"type": "whereabouts", "range": "10.0.0.0/24", "range_start": "10.9.9.9"}});
    ns.apply(&nad_object(ns, name, &config.to_string()))
}

fn nad_object(ns: &Ns, name: &str, config: &str) -> String {
    json!({"apiVersion": "k8s.cni.cncf.io/v1", "kind": "NetworkAttachmentDefinition",
        "metadata": {"name": name, "namespace": ns.name}, "spec": {"config": config}})
    .to_string()
}

fn start(ns: &Ns, shipped: &Shipped, port: u16, name: &str) -> OperatorProcess {
    let dir = ns.dir.path().join("webhook-certs");
    let mut op = OperatorProcess::start_with_env(
        ns.dir.path(),
        name,
        &[
            format!("--pool-namespace={}", ns.name),
            "--leader-election=false".into(),
            format!("--webhook-addr=127.0.0.1:{port}"),
            "--webhook-certificate-secret=whereabouts-webhook-tls".into(),
            format!("--webhook-configuration={}", shipped.name),
            format!("--webhook-cert-dir={}", dir.display()),
        ],
        &[("POD_NAMESPACE", ns.name.as_str())],
    );
    op.wait_ready();
    op
}

fn secret(ns: &Ns) -> Option<Value> {
    ns.get_json(&["secret", "whereabouts-webhook-tls"])
}

#[test]
fn the_operator_makes_its_webhook_certificate_and_injects_its_ca() {
    let ns = Ns::new("certs");
    ns.kubectl_ok(&[
        "label",
        "namespace",
        &ns.name,
        &format!("{LABEL}={}", ns.name),
    ]);
    let shipped = Shipped::apply(&ns);
    // Installed, no certificate yet, the webhook unreachable: nothing is refused for it.
    let out = invalid_nad(&ns, "before");
    assert!(
        out.status.success(),
        "refused before any certificate: {}",
        String::from_utf8_lossy(&out.stderr)
    );

    let port = free_port();
    let op = start(&ns, &shipped, port, "op-a");
    let s = secret(&ns).expect("the operator made its Secret");
    assert_eq!(s["type"], "kubernetes.io/tls");
    for key in ["tls.crt", "tls.key", "ca.crt", "ca.key"] {
        assert!(
            s["data"][key].as_str().is_some_and(|v| !v.is_empty()),
            "{key}"
        );
    }
    let service = format!("whereabouts-webhook.{}.svc", ns.name);
    assert!(
        s["metadata"]["annotations"]["whereabouts.cni.cncf.io/dns-names"]
            .as_str()
            .unwrap()
            .contains(&service)
    );
    assert!(
        eventually(20, || {
            let hook = &shipped.get()["webhooks"][0];
            hook["clientConfig"]["caBundle"] == s["data"]["ca.crt"]
                && hook["failurePolicy"] == "Fail"
        }),
        "{:#}\n{}",
        shipped.get(),
        op.log()
    );
    // The webhook serves that certificate, which a client trusting the CA accepts for the
    // Service's name.
    let ca = ns.dir.path().join("ca.crt");
    let pem = base64_decode(s["data"]["ca.crt"].as_str().unwrap());
    std::fs::write(&ca, pem).unwrap();
    let curl = Command::new("curl")
        .args(["-sS", "-o", "/dev/null", "-w", "%{http_code}", "--cacert"])
        .arg(&ca)
        .args(["--resolve", &format!("{service}:{port}:127.0.0.1")])
        .arg(format!("https://{service}:{port}/validate"))
        .output()
        .unwrap();
    assert!(
        curl.status.success(),
        "TLS: {}",
        String::from_utf8_lossy(&curl.stderr)
    );
    // Fail from now on: the API server cannot reach this Service here, so a NAD change is refused.
    let out = invalid_nad(&ns, "after");
    assert!(!out.status.success(), "the policy is Fail now");
    // ... but only for whereabouts NADs (the shipped matchConditions): with the webhook
    // unreachable, a NAD of another IPAM still gets in, and one that spells the type with a JSON
    // escape is still sent to the webhook (and so refused here).
    let other = json!({"cniVersion": "1.0.0", "name": "sriov", "type": "sriov",
        "ipam": {"type": "host-local", "subnet": "10.8.0.0/24"}});
    let out = ns.apply(&nad_object(&ns, "other-ipam", &other.to_string()));
    assert!(
        out.status.success(),
        "a host-local NAD was sent to the webhook: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let escaped = r#"{"cniVersion": "1.0.0", "name": "e", "type": "macvlan", "ipam": {"type": "whereabouts", "range": "10.0.0.0/24"}}"#;
    let out = ns.apply(&nad_object(&ns, "escaped", escaped));
    assert!(
        !out.status.success(),
        "an escaped whereabouts NAD skipped the webhook"
    );
    // A restart (or another replica) keeps the same certificate.
    drop(op);
    let _op = start(&ns, &shipped, port, "op-b");
    assert_eq!(secret(&ns).unwrap()["data"], s["data"]);
}

fn base64_decode(text: &str) -> Vec<u8> {
    use base64::Engine as _;
    base64::engine::general_purpose::STANDARD
        .decode(text)
        .unwrap()
}
