//! The install manifests in config/ stay in step with the generated CRDs in crds/ and with the
//! binaries they run.

#[test]
fn config_crd_is_a_copy_of_crds() {
    let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR"));
    for file in [
        "ippools.yaml",
        "overlappingrangeipreservations.yaml",
        "nodeslicepools.yaml",
    ] {
        let generated = std::fs::read_to_string(root.join("crds").join(file)).unwrap();
        let copy = std::fs::read_to_string(root.join("config/crd").join(file)).unwrap();
        assert!(
            generated == copy,
            "config/crd/{file} differs from crds/{file}: run `make crds`"
        );
    }
}

/// The node agent container has a liveness and a readiness probe on its admin port, and that
/// port is the one its `--admin-addr` (parsed by the real CLI) listens on.
#[test]
fn the_agent_container_is_probed_on_its_admin_port() {
    use clap::Parser as _;
    use serde_json::Value;

    #[derive(clap::Parser)]
    struct Cli {
        #[command(flatten)]
        agent: whereabouts::cli::agent::AgentArgs,
    }

    let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR"));
    let text = std::fs::read_to_string(root.join("config/cni/daemonset.yaml")).unwrap();
    let ds: Value = serde_saphyr::from_str(&text).unwrap();
    let containers = ds["spec"]["template"]["spec"]["containers"]
        .as_array()
        .unwrap();
    let agent = containers
        .iter()
        .find(|c| c["name"] == "agent")
        .expect("an agent container");
    let args: Vec<&str> = agent["args"]
        .as_array()
        .unwrap()
        .iter()
        .map(|a| a.as_str().unwrap())
        .collect();
    assert_eq!(args[0], "agent");
    // `$(NODE_IP)` is the downward API's status.hostIP, which the kubelet substitutes: the args
    // parse with a node address of either family, and bind that address, not a wildcard.
    let node_ip = agent["env"]
        .as_array()
        .unwrap()
        .iter()
        .find(|e| e["name"] == "NODE_IP")
        .expect("NODE_IP in the agent's env");
    assert_eq!(
        node_ip["valueFrom"]["fieldRef"]["fieldPath"],
        "status.hostIP"
    );
    let mut listens = 0;
    for ip in ["192.0.2.10", "2001:db8::10"] {
        let expanded: Vec<String> = args[1..]
            .iter()
            .map(|a| a.replace("$(NODE_IP)", ip))
            .collect();
        let cli = Cli::try_parse_from(std::iter::once("agent".to_owned()).chain(expanded))
            .unwrap_or_else(|e| panic!("the agent's args do not parse: {e}"));
        assert_eq!(cli.agent.admin_addr.ip().to_string(), ip);
        listens = cli.agent.admin_addr.port();
    }

    let ports = agent["ports"].as_array().expect("the agent declares ports");
    let port_of = |name: &Value| -> u64 {
        if let Some(n) = name.as_u64() {
            return n;
        }
        ports
            .iter()
            .find(|p| &p["name"] == name)
            .and_then(|p| p["containerPort"].as_u64())
            .unwrap_or_else(|| panic!("no container port named {name:?}"))
    };
    for (probe, path) in [("livenessProbe", "/livez"), ("readinessProbe", "/readyz")] {
        let get = &agent[probe]["httpGet"];
        assert_eq!(get["path"].as_str(), Some(path), "agent {probe} path");
        assert_eq!(
            port_of(&get["port"]),
            u64::from(listens),
            "agent {probe} port is not --admin-addr's"
        );
    }
    assert!(
        ports.iter().any(|p| p["name"] == "metrics"),
        "the metrics port is named for the PodMonitor"
    );
}

/// Issue 24: the node's token, which the installer copies to the host for the plugin, is a
/// projected one with an expiry of its own (an hour), not the automounted token the API server
/// extends to a year; both containers read it where in-cluster clients look for it.
#[test]
fn the_node_token_on_the_host_expires_within_an_hour() {
    use serde_json::Value;
    let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR"));
    let text = std::fs::read_to_string(root.join("config/cni/daemonset.yaml")).unwrap();
    let ds: Value = serde_saphyr::from_str(&text).unwrap();
    let pod = &ds["spec"]["template"]["spec"];
    assert_eq!(pod["automountServiceAccountToken"], false);
    let volume = pod["volumes"]
        .as_array()
        .unwrap()
        .iter()
        .find(|v| v["name"] == "node-token")
        .expect("a node-token volume");
    let sources = volume["projected"]["sources"].as_array().unwrap();
    let token = sources
        .iter()
        .find_map(|s| s.get("serviceAccountToken"))
        .expect("a projected ServiceAccount token");
    assert_eq!(token["path"], "token");
    let expiry = token["expirationSeconds"].as_u64().unwrap();
    // 3607 is the one value the API server extends to a year; the minimum is 600.
    assert!((600..=3600).contains(&expiry), "{expiry}");
    assert!(
        sources
            .iter()
            .any(|s| s["configMap"]["name"] == "kube-root-ca.crt")
    );
    for c in pod["containers"].as_array().unwrap() {
        let mounted = c["volumeMounts"].as_array().unwrap().iter().any(|m| {
            m["name"] == "node-token"
                && m["mountPath"] == "/var/run/secrets/kubernetes.io/serviceaccount"
        });
        assert!(mounted, "{} does not mount the node token", c["name"]);
    }
}

/// Issue 27: the node pod (installer and agent) runs as `spc_t`, so that on SELinux-enforcing
/// nodes it may write the host's CNI folders and create the agent's socket; the no-selinux
/// component takes it out again (its rendering is compared with the chart's by e2e/helm-test.sh).
#[test]
fn the_node_pod_runs_as_spc_t_unless_the_component_removes_it() {
    use serde_json::Value;
    let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR"));
    let text = std::fs::read_to_string(root.join("config/cni/daemonset.yaml")).unwrap();
    let ds: Value = serde_saphyr::from_str(&text).unwrap();
    let context = &ds["spec"]["template"]["spec"]["securityContext"];
    assert_eq!(
        context["seLinuxOptions"],
        serde_json::json!({"type": "spc_t"})
    );
    let component =
        std::fs::read_to_string(root.join("config/components/no-selinux/kustomization.yaml"))
            .unwrap();
    let component: Value = serde_saphyr::from_str(&component).unwrap();
    assert_eq!(component["kind"], "Component");
    let patch = component["patches"][0]["patch"].as_str().unwrap();
    assert!(patch.contains("/spec/template/spec/securityContext/seLinuxOptions"));
}

/// The operator's RBAC names exactly the objects its migration checks read, each by name: our
/// CRDs that upstream installs too, and upstream's components in kube-system. The chart carries
/// the same names (e2e/helm-test.sh compares the rest).
#[test]
fn the_migration_checks_read_only_what_rbac_names() {
    use serde_json::Value;
    use std::collections::BTreeSet;
    use whereabouts::controller::migration::{schema, upstream};

    let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR"));
    let text = std::fs::read_to_string(root.join("config/rbac/operator.yaml")).unwrap();
    let docs: Vec<Value> = serde_saphyr::from_multiple(&text).unwrap();
    let rules = |kind: &str, name: &str| -> Vec<Value> {
        let doc = docs
            .iter()
            .find(|d| d["kind"] == kind && d["metadata"]["name"] == name)
            .unwrap_or_else(|| panic!("config/rbac/operator.yaml has no {kind} {name}"));
        doc["rules"].as_array().unwrap().clone()
    };
    let names = |rule: &Value| -> BTreeSet<String> {
        assert_eq!(rule["verbs"], serde_json::json!(["get"]), "{rule}");
        let list = rule["resourceNames"].as_array().unwrap();
        list.iter()
            .map(|n| n.as_str().unwrap().to_owned())
            .collect()
    };

    let crd_rule = rules("ClusterRole", "whereabouts-operator")
        .into_iter()
        .find(|r| r["resources"] == serde_json::json!(["customresourcedefinitions"]))
        .expect("a rule for customresourcedefinitions");
    let ours: BTreeSet<String> = schema::ours().iter().map(schema::name_of).collect();
    assert_eq!(names(&crd_rule), ours);

    let role = rules("Role", "whereabouts-operator-upstream");
    for kind in [
        upstream::Kind::DaemonSet,
        upstream::Kind::Deployment,
        upstream::Kind::CronJob,
    ] {
        let resource = format!("{}s", kind.resource());
        let rule = role
            .iter()
            .find(|r| r["resources"] == serde_json::json!([resource]))
            .unwrap_or_else(|| panic!("no rule for {resource}"));
        let known: BTreeSet<String> = upstream::KNOWN
            .iter()
            .filter(|k| k.kind == kind)
            .map(|k| k.name.to_owned())
            .collect();
        assert_eq!(names(rule), known, "{resource}");
    }
    assert_eq!(role.len(), 3, "nothing but the three kinds, by name");
    let namespace = docs
        .iter()
        .find(|d| d["kind"] == "Role" && d["metadata"]["name"] == "whereabouts-operator-upstream")
        .unwrap()["metadata"]["namespace"]
        .clone();
    assert_eq!(namespace, upstream::NAMESPACE);

    let chart =
        std::fs::read_to_string(root.join("charts/whereabouts/templates/rbac-operator.yaml"))
            .unwrap();
    for name in ours
        .iter()
        .map(String::as_str)
        .chain(upstream::KNOWN.iter().map(|k| k.name))
    {
        assert!(
            chart.contains(name),
            "the chart's operator RBAC lacks {name}"
        );
    }
}
