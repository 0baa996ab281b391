//! The install pieces against the real control plane: `config/default` renders and the API server
//! accepts every object (server-side dry run); the node installer writes a working kubeconfig
//! into a temporary host root and follows token rotation.

use std::os::unix::fs::PermissionsExt as _;
use std::path::Path;
use std::process::{Command, Stdio};

use serde_json::json;

use crate::harness::{
    Ns, admin_kubeconfig, cluster_env, eventually, kubectl_raw, kustomize, repo, whereabouts_bin,
};

fn find<'a>(objects: &'a [serde_json::Value], kind: &str, name: &str) -> &'a serde_json::Value {
    objects
        .iter()
        .find(|o| o["kind"] == kind && o["metadata"]["name"] == name)
        .unwrap_or_else(|| panic!("{kind}/{name} not rendered"))
}

#[test]
fn config_default_renders_and_the_server_accepts_every_object() {
    let objects = kustomize("config/default");
    assert!(objects.len() >= 20, "{} objects", objects.len());

    // Least privilege: no wildcard anywhere in a role.
    for role in objects
        .iter()
        .filter(|o| o["kind"] == "Role" || o["kind"] == "ClusterRole")
    {
        for rule in role["rules"].as_array().unwrap() {
            for key in ["verbs", "resources", "apiGroups"] {
                let values = rule[key].as_array().unwrap();
                assert!(
                    !values.iter().any(|v| v == "*"),
                    "{:?}: wildcard in {key}",
                    role["metadata"]["name"]
                );
            }
        }
    }
    // The operator: two replicas, leader election, hardened, probes on the admin port.
    let op = find(&objects, "Deployment", "whereabouts-operator");
    assert_eq!(op["spec"]["replicas"], 2);
    let pod = &op["spec"]["template"]["spec"];
    assert_eq!(pod["securityContext"]["runAsNonRoot"], true);
    let c = &pod["containers"][0];
    assert!(
        c["args"]
            .as_array()
            .unwrap()
            .contains(&"--leader-election=true".into())
    );
    assert_eq!(c["securityContext"]["readOnlyRootFilesystem"], true);
    assert_eq!(c["securityContext"]["allowPrivilegeEscalation"], false);
    assert_eq!(c["readinessProbe"]["httpGet"]["path"], "/readyz");
    assert_eq!(c["livenessProbe"]["httpGet"]["path"], "/livez");
    // The webhook Service is next to the pods it selects, and the webhook configuration points at it.
    let svc = find(&objects, "Service", "whereabouts-webhook");
    assert_eq!(svc["metadata"]["namespace"], "whereabouts-operator");
    let vwc = find(
        &objects,
        "ValidatingWebhookConfiguration",
        "whereabouts-nad-validation",
    );
    assert_eq!(
        vwc["webhooks"][0]["clientConfig"]["service"]["namespace"],
        "whereabouts-operator"
    );
    let ds = find(&objects, "DaemonSet", "whereabouts-node");
    assert_eq!(
        ds["spec"]["template"]["spec"]["serviceAccountName"],
        "whereabouts-node"
    );
    // The node agent binds its socket where the plugin looks by default.
    let pod = &ds["spec"]["template"]["spec"];
    let agent = pod["containers"]
        .as_array()
        .unwrap()
        .iter()
        .find(|c| c["name"] == "agent")
        .expect("an agent container");
    assert_eq!(agent["args"][0], "agent");
    assert!(
        agent["args"]
            .as_array()
            .unwrap()
            .iter()
            .any(|a| a.as_str() == Some("--socket=/run/whereabouts/agent.sock"))
    );
    assert!(
        pod["volumes"]
            .as_array()
            .unwrap()
            .iter()
            .any(|v| v["hostPath"]["path"] == "/run/whereabouts")
    );

    // The server-side dry run. Namespaced objects need their namespace to exist (a dry run does
    // not create it), so config/namespace is applied for real; nothing else is persisted.
    apply_namespaces();
    let out = kubectl_raw(
        admin_kubeconfig(),
        &[
            "apply",
            "--dry-run=server",
            "-k",
            repo().join("config/default").to_str().unwrap(),
        ],
        None,
    );
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "server dry run rejected objects:\n{}\n{stdout}",
        String::from_utf8_lossy(&out.stderr)
    );
    let accepted = stdout
        .lines()
        .filter(|l| l.ends_with("(server dry run)"))
        .count();
    assert_eq!(accepted, objects.len(), "{stdout}");
    // Nothing was created.
    let get = kubectl_raw(
        admin_kubeconfig(),
        &[
            "get",
            "deployment",
            "-n",
            "whereabouts-operator",
            "-o",
            "name",
        ],
        None,
    );
    assert_eq!(String::from_utf8_lossy(&get.stdout).trim(), "");
}

fn apply_namespaces() {
    let dir = repo().join("config/namespace");
    let out = kubectl_raw(
        admin_kubeconfig(),
        &["apply", "-k", dir.to_str().unwrap()],
        None,
    );
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
}

/// A pod of `workload`'s template in `namespace`, created as a server-side dry run: what the API
/// server's Pod Security admission says of it (Err: its message).
fn pod_of(workload: &serde_json::Value, namespace: &str) -> Result<(), String> {
    // Only Pod Security is asked: the account and the priority class (whose quota lives in the
    // node namespace) have admission checks of their own that a bare namespace would fail.
    let mut spec = workload["spec"]["template"]["spec"].clone();
    let fields = spec.as_object_mut().unwrap();
    fields.remove("serviceAccountName");
    fields.remove("priorityClassName");
    let pod = json!({
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": "psa-check", "namespace": namespace},
        "spec": spec,
    });
    let out = kubectl_raw(
        admin_kubeconfig(),
        &["create", "--dry-run=server", "-f", "-"],
        Some(&pod.to_string()),
    );
    match out.status.success() {
        true => Ok(()),
        false => Err(String::from_utf8_lossy(&out.stderr).into_owned()),
    }
}

/// Each half in the namespace whose Pod Security level fits it: the operator passes
/// `restricted`, so its namespace enforces that and would refuse the node pods (host network,
/// host paths, root), which run in the `privileged` one.
#[test]
fn the_operator_runs_under_restricted_pod_security_and_the_node_pods_under_privileged() {
    let objects = kustomize("config/default");
    apply_namespaces();
    let operator = find(&objects, "Deployment", "whereabouts-operator");
    let node = find(&objects, "DaemonSet", "whereabouts-node");
    assert_eq!(operator["metadata"]["namespace"], "whereabouts-operator");
    assert_eq!(node["metadata"]["namespace"], "whereabouts-system");

    pod_of(operator, "whereabouts-operator").expect("the operator's pod under restricted");
    pod_of(node, "whereabouts-system").expect("the node pod under privileged");
    let refused = pod_of(node, "whereabouts-operator").expect_err("a node pod under restricted");
    assert!(
        refused.contains(r#"violates PodSecurity "restricted"#) && refused.contains("hostNetwork"),
        "{refused}"
    );
}

#[test]
fn the_sample_nads_are_accepted() {
    let objects = kustomize("config/samples");
    assert_eq!(objects.len(), 5);
    let ns = Ns::new("samples");
    let out = ns.kubectl(
        &[
            "apply",
            "--dry-run=server",
            "-k",
            repo().join("config/samples").to_str().unwrap(),
        ],
        None,
    );
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
}

fn mode(p: &Path) -> u32 {
    std::fs::metadata(p).unwrap().permissions().mode() & 0o7777
}

/// A ServiceAccount with exactly the node plugin's Role from config/rbac (in the test namespace)
/// and a fresh token for it.
fn node_identity(ns: &Ns) -> impl Fn() -> String + '_ {
    let rbac = std::fs::read_to_string(repo().join("config/rbac/node.yaml")).unwrap();
    let role: serde_json::Value = serde_saphyr::from_multiple::<serde_json::Value>(&rbac)
        .unwrap()
        .into_iter()
        .find(|v| v["kind"] == "Role")
        .unwrap();
    let rules: serde_json::Value = serde_json::to_value(&role["rules"]).unwrap();
    ns.kubectl_ok(&["create", "serviceaccount", "node"]);
    let objects = json!({"apiVersion": "v1", "kind": "List", "items": [
        {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "Role",
         "metadata": {"name": "node", "namespace": ns.name}, "rules": rules},
        {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "RoleBinding",
         "metadata": {"name": "node", "namespace": ns.name},
         "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": "node"},
         "subjects": [{"kind": "ServiceAccount", "name": "node", "namespace": ns.name}]}]});
    let out = ns.apply(&objects.to_string());
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    move || {
        ns.kubectl_ok(&["create", "token", "node", "--duration=10m"])
            .trim()
            .to_owned()
    }
}

fn install_cni(host: &Path, sa: &Path, extra: &[&str]) -> Command {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_whereabouts-operator"));
    cmd.arg("install-cni")
        .arg(format!("--host-root={}", host.display()))
        .arg(format!("--source-binary={}", whereabouts_bin().display()))
        .arg(format!("--token-file={}", sa.join("token").display()))
        .arg(format!("--ca-file={}", sa.join("ca.crt").display()))
        .arg(format!(
            "--namespace-file={}",
            sa.join("namespace").display()
        ))
        .arg(format!("--api-server={}", cluster_env("APISERVER_URL")))
        .args(extra)
        .env_remove("KUBERNETES_SERVICE_HOST")
        .env("RUST_LOG", "info");
    cmd
}

#[test]
fn install_cni_into_a_temporary_host_root() {
    let ns = Ns::new("install");
    let token = node_identity(&ns);
    let dir = ns.dir.path();
    let host = dir.join("host");
    let sa = dir.join("sa");
    std::fs::create_dir_all(&sa).unwrap();
    let first = token();
    std::fs::write(sa.join("token"), &first).unwrap();
    std::fs::copy(cluster_env("CA_CERT"), sa.join("ca.crt")).unwrap();
    std::fs::write(sa.join("namespace"), &ns.name).unwrap();

    let out = install_cni(&host, &sa, &["--once"]).output().unwrap();
    assert!(
        out.status.success(),
        "install-cni --once: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let bin = host.join("opt/cni/bin/whereabouts");
    let conf_dir = host.join("etc/cni/net.d/whereabouts.d");
    let flat = conf_dir.join("whereabouts.conf");
    let kubeconfig = conf_dir.join("whereabouts.kubeconfig");
    assert_eq!(
        std::fs::read(&bin).unwrap(),
        std::fs::read(whereabouts_bin()).unwrap()
    );
    assert_eq!(mode(&bin), 0o755);
    assert_eq!(mode(&flat), 0o644);
    assert_eq!(mode(&kubeconfig), 0o600);
    let flat_json: serde_json::Value =
        serde_json::from_slice(&std::fs::read(&flat).unwrap()).unwrap();
    assert_eq!(
        flat_json,
        json!({"kubernetes": {"kubeconfig": "/etc/cni/net.d/whereabouts.d/whereabouts.kubeconfig"}})
    );
    let kc: serde_json::Value =
        serde_saphyr::from_str(&std::fs::read_to_string(&kubeconfig).unwrap()).unwrap();
    assert_eq!(kc["users"][0]["user"]["token"], first.as_str(), "{kc}");
    assert_eq!(kc["contexts"][0]["context"]["namespace"], ns.name.as_str());
    for d in [bin.parent().unwrap(), conf_dir.as_path()] {
        let temps: Vec<_> = std::fs::read_dir(d)
            .unwrap()
            .flatten()
            .filter(|e| e.file_name().to_string_lossy().starts_with('.'))
            .collect();
        assert!(temps.is_empty(), "{temps:?}");
    }

    // The installed plugin works with the installed kubeconfig and only the node's rights. The
    // flat file names the kubeconfig by its host path; here the host is a directory, so a flat
    // file pointing into it stands in.
    let test_flat = dir.join("flat.conf");
    std::fs::write(
        &test_flat,
        json!({"kubernetes": {"kubeconfig": kubeconfig}}).to_string(),
    )
    .unwrap();
    let conf = json!({"cniVersion": "1.0.0", "name": "install", "type": "bridge",
        "ipam": {"type": "whereabouts", "range": "10.77.0.0/24", "configuration_path": test_flat}});
    let uid = ns.create_pod("p", &Default::default());
    let add = crate::harness::CniCall {
        command: "ADD",
        conf: &conf,
        container: "c-install",
        ifname: "net1",
        netns: "/var/run/netns/none",
        args: &format!(
            "IgnoreUnknown=1;K8S_POD_NAMESPACE={};K8S_POD_NAME=p;K8S_POD_UID={uid}",
            ns.name
        ),
        path: None,
    };
    let result = crate::harness::Cni::from(add.spawn(bin.clone()).wait_with_output().unwrap());
    assert_eq!(result.addresses(), vec!["10.77.0.1/24".to_owned()]);
    assert_eq!(ns.allocations("10.77.0.0-24").len(), 1);
    // DEL, with the same rights, frees it (it announces the release on the reservation first).
    let del = crate::harness::CniCall {
        command: "DEL",
        ..add
    };
    let out = del.spawn(bin.clone()).wait_with_output().unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stdout)
    );
    assert!(ns.allocations("10.77.0.0-24").is_empty());
    assert!(ns.reservations().is_empty());

    // The node agent, with the same kubeconfig and rights, serving the same ADD and DEL.
    let kubeconfig_path = kubeconfig.to_str().unwrap();
    let agent = crate::agent::Agent::start_with(&kubeconfig, dir, kubeconfig_path);
    std::fs::write(
        &test_flat,
        json!({"kubernetes": {"kubeconfig": kubeconfig}, "agent_socket": agent.socket}).to_string(),
    )
    .unwrap();
    let result = crate::harness::Cni::from(add.spawn(bin.clone()).wait_with_output().unwrap());
    assert_eq!(result.addresses(), vec!["10.77.0.1/24".to_owned()]);
    assert_eq!(ns.allocations("10.77.0.0-24").len(), 1);
    let out = del.spawn(bin.clone()).wait_with_output().unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stdout)
    );
    assert!(ns.allocations("10.77.0.0-24").is_empty());
    assert!(ns.reservations().is_empty());
    assert_eq!(agent.served(), 2, "the agent ran both");
    drop(agent);

    // Token rotation, followed by the long-running installer.
    let mut child = install_cni(&host, &sa, &["--interval=1s"])
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let second = token();
    assert_ne!(first, second);
    std::fs::write(sa.join("token"), &second).unwrap();
    let rotated = eventually(10, || {
        let text = std::fs::read_to_string(&kubeconfig).unwrap();
        let kc: serde_json::Value = serde_saphyr::from_str(&text).unwrap_or_default();
        kc["users"][0]["user"]["token"] == second.as_str()
    });
    let _ = Command::new("kill")
        .arg("-TERM")
        .arg(child.id().to_string())
        .status();
    let status = child.wait().unwrap();
    let mut log = String::new();
    std::io::Read::read_to_string(child.stderr.as_mut().unwrap(), &mut log).unwrap();
    assert!(
        rotated,
        "kubeconfig not updated after token rotation:\n{log}"
    );
    assert!(
        status.success(),
        "installer exit on SIGTERM: {status}\n{log}"
    );
    assert_eq!(mode(&kubeconfig), 0o600);
}

/// Where the API server's ResourceQuota admission limits the critical priority classes (GKE's
/// default; e2e/cluster.sh configures it the same way), a pod of `system-node-critical` outside
/// kube-system is refused unless a quota covers its class. The node DaemonSet's quota
/// (`config/cni/critical-quota.yaml`, in the chart too) is that quota.
#[test]
fn the_node_pods_quota_admits_system_node_critical_where_the_class_is_limited() {
    let ns = Ns::new("quota");
    let pod = format!(
        "apiVersion: v1\nkind: Pod\nmetadata: {{name: critical, namespace: {}}}\nspec:\n  priorityClassName: system-node-critical\n  containers: [{{name: c, image: whereabouts:0.1.0}}]\n",
        ns.name
    );
    let refused = ns.apply(&pod);
    let err = String::from_utf8_lossy(&refused.stderr);
    assert!(!refused.status.success(), "admitted with no quota");
    assert!(
        err.contains("insufficient quota to match these scopes"),
        "{err}"
    );

    let quota = std::fs::read_to_string(repo().join("config/cni/critical-quota.yaml"))
        .unwrap()
        .replace(
            "namespace: whereabouts-system",
            &format!("namespace: {}", ns.name),
        );
    let out = ns.apply(&quota);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    // The quota admits pods once the quota controller has filled in its status.
    let mut last = String::new();
    let admitted = eventually(30, || {
        let out = ns.apply(&pod);
        last = String::from_utf8_lossy(&out.stderr).into_owned();
        out.status.success()
    });
    assert!(admitted, "still refused: {last}");
    let used = ns.kubectl_ok(&[
        "get",
        "resourcequota",
        "whereabouts-critical-pods",
        "-o",
        "jsonpath={.spec.scopeSelector.matchExpressions[0].values[0]}",
    ]);
    assert_eq!(used, "system-node-critical");
}
