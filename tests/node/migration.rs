//! Replacing upstream whereabouts v0.9.2 in place on the real node (issue 26), with the README's
//! "Migration from upstream" commands. Upstream is installed as its users install it (its own
//! manifests and an image built from its module: e2e/upstream-install.sh), pods start on its
//! addresses through Multus, then: the switch with `kubectl apply -k`, a rollback to upstream, and
//! the switch again with Helm. Through all of it running pods keep their addresses, every running
//! pod's address is recorded for it and no other, and pods are freed by whichever plugin is on the
//! host when they go, whoever allocated them. A StatefulSet's pod started under upstream is
//! force-deleted under ours: its replacement keeps addresses of its own.

use std::collections::{BTreeMap, BTreeSet};
use std::net::Ipv4Addr;
use std::path::{Path, PathBuf};
use std::process::Command;

use serde_json::{Value, json};

use crate::addresses::check_pods_against_pools;
use crate::cluster::{
    OPERATOR_NS, POD_POOL, Workload, apply_ok, events_in, get_json, install_with_kustomize,
    is_ready, kubectl, kubectl_ok, node, operator_pods, pool_entries, wait_until,
};
use crate::harness::{operator_bin, repo};
use crate::install::release_binary;
use crate::multus::{macvlan, nad, nad_pod, running};
use crate::reinstall::{PLUGIN, held, helm_install, uninstall};

/// Where upstream's manifests put its objects.
const UPSTREAM_NS: &str = "kube-system";
const CRD_IPPOOLS: &str = "ippools.whereabouts.cni.cncf.io";
const CRD_IPAMCLAIMS: &str = "ipamclaims.k8s.cni.cncf.io";

/// The ipamclaims CRD as some of its releases declare it, `status.ownerPod` a string, applied
/// over ours: the API server would refuse every claim our plugin records.
fn apply_ipamclaims_crd_with_owner_pod_a_string() {
    use kube::CustomResourceExt as _;
    let mut crd = serde_json::to_value(whereabouts::crd::IPAMClaim::crd()).unwrap();
    let schema = &mut crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"];
    schema["properties"]["status"]["properties"]["ownerPod"] = json!({"type": "string"});
    apply_ok(&crd.to_string());
}

/// e2e/upstream-install.sh: upstream's CRDs, DaemonSet and node-slice controller from its module.
fn install_upstream() {
    let status = Command::new(repo().join("e2e/upstream-install.sh"))
        .arg(node().get("UPSTREAM_IMAGE"))
        .env("KUBECONFIG", &node().kubeconfig)
        .status()
        .expect("run e2e/upstream-install.sh");
    assert!(status.success(), "e2e/upstream-install.sh failed");
    wait_until(60, "upstream's plugin on the host", || {
        host_plugin_is(&upstream_plugin())
    });
}

/// The README's migration step 4: upstream's objects, by the names in its manifests; its node
/// pods first, waited for, so that no installer of upstream's writes the host's files afterwards.
fn remove_upstream() {
    let ns = ["-n", UPSTREAM_NS];
    let gone = ["--ignore-not-found", "--timeout=180s"];
    kubectl_ok(
        &[
            &ns[..],
            &["delete", "daemonset", "whereabouts"],
            &gone,
            &["--cascade=foreground"],
        ]
        .concat(),
    );
    kubectl_ok(
        &[
            &ns[..],
            &["delete", "deployment", "whereabouts-controller"],
            &gone,
        ]
        .concat(),
    );
    kubectl_ok(&[&ns[..], &["delete", "cronjob", "ip-reconciler"], &gone].concat());
    kubectl_ok(
        &[
            &ns[..],
            &[
                "delete",
                "serviceaccount/whereabouts",
                "configmap/whereabouts-config",
            ],
            &gone,
        ]
        .concat(),
    );
    kubectl_ok(
        &[
            &[
                "delete",
                "clusterrolebinding/whereabouts",
                "clusterrole/whereabouts-cni",
            ][..],
            &gone,
        ]
        .concat(),
    );
}

/// The plugin upstream's image installs (e2e/upstream-image.sh keeps its build context).
fn upstream_plugin() -> PathBuf {
    PathBuf::from(node().get("IMAGES_DIR")).join("ctx-upstream/rootfs/whereabouts")
}

fn host_plugin_is(want: &Path) -> Result<(), String> {
    let host = std::fs::read(PLUGIN).map_err(|e| format!("{PLUGIN}: {e}"))?;
    let want_bytes = std::fs::read(want).unwrap_or_else(|e| panic!("{}: {e}", want.display()));
    (host == want_bytes)
        .then_some(())
        .ok_or_else(|| format!("{PLUGIN} ({} bytes) is not {}", host.len(), want.display()))
}

/// Our release binaries are those of the node's image (its tag is the digest of them, their SBOM
/// and the Dockerfile, e2e/images.sh): otherwise "the host's plugin is ours" could not be told
/// from the bytes.
fn our_plugin_is_the_images() {
    let bins = ["whereabouts", "whereabouts-operator"].map(release_binary);
    let inputs = [
        repo().join("target/image/amd64/sbom.cdx.json"),
        repo().join("Dockerfile"),
    ];
    let mut bytes = vec![];
    for f in bins.iter().chain(&inputs) {
        bytes.extend(std::fs::read(f).unwrap_or_else(|e| panic!("{}: {e}", f.display())));
    }
    let digest = sha256_hex(&bytes);
    let image = node().get("WHEREABOUTS_IMAGE");
    assert!(
        image.ends_with(&format!("dev-{}", &digest[..12])),
        "{image} was not built from the release binaries in target/: run e2e/images.sh and reimport"
    );
}

fn sha256_hex(bytes: &[u8]) -> String {
    use std::io::Write;
    let mut child = Command::new("sha256sum")
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .spawn()
        .expect("run sha256sum");
    child.stdin.take().unwrap().write_all(bytes).unwrap();
    let out = child.wait_with_output().unwrap();
    String::from_utf8(out.stdout).unwrap()[..64].to_string()
}

/// `whereabouts-operator audit` as an admin runs it (step 1): the kinds of its findings.
fn audit_kinds() -> BTreeSet<String> {
    let out = Command::new(operator_bin())
        .arg("audit")
        .env("KUBECONFIG", &node().kubeconfig)
        .output()
        .expect("run whereabouts-operator audit");
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        matches!(out.status.code(), Some(0 | 1)),
        "audit could not read the cluster: {}{text}",
        String::from_utf8_lossy(&out.stderr)
    );
    let kinds = ["crd-missing-fields", "upstream-component"];
    text.lines()
        // "[mark] kind: what, where and the fix"
        .filter_map(|l| l.split_once("] ")?.1.split_once(':').map(|(k, _)| k))
        .filter(|k| kinds.contains(k))
        .map(str::to_string)
        .collect()
}

/// `whereabouts-operator validate --cluster` (step 1): every NAD valid.
fn validate_cluster() {
    let out = Command::new(operator_bin())
        .args(["validate", "--cluster"])
        .env("KUBECONFIG", &node().kubeconfig)
        .output()
        .expect("run whereabouts-operator validate");
    assert!(
        out.status.success(),
        "validate --cluster: {}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
}

/// The operator's samples of `metric` (labels -> value), from a ready replica's /metrics through
/// the API server's pod proxy (every replica keeps these gauges).
fn operator_samples(metric: &str) -> BTreeMap<String, f64> {
    let Some(pod) = operator_pods().into_iter().find(is_ready) else {
        return BTreeMap::new();
    };
    let name = pod["metadata"]["name"].as_str().unwrap();
    let path = format!("/api/v1/namespaces/{OPERATOR_NS}/pods/{name}:8080/proxy/metrics");
    let out = kubectl(&["get", "--raw", &path], None);
    String::from_utf8_lossy(&out.stdout)
        .lines()
        .filter_map(|l| l.strip_prefix(metric))
        .filter(|rest| rest.starts_with('{') || rest.starts_with(' '))
        .filter_map(|rest| rest.rsplit_once(' '))
        .filter_map(|(labels, v)| Some((labels.to_string(), v.parse().ok()?)))
        .collect()
}

/// Waits until the gauge `metric` has one series whose labels contain `label`, and its value
/// passes `ok`.
fn wait_gauge(metric: &str, label: &str, ok: impl Fn(f64) -> bool) {
    wait_until(120, &format!("{metric}{{..{label}..}}"), || {
        let samples = operator_samples(metric);
        let got: Vec<f64> = samples
            .iter()
            .filter(|(l, _)| l.contains(label))
            .map(|(_, v)| *v)
            .collect();
        (got.len() == 1 && ok(got[0]))
            .then_some(())
            .ok_or_else(|| format!("{samples:?}"))
    });
}

/// Waits until Events `reason` in `ns` name every one of `objects`.
fn wait_events(ns: &str, reason: &str, objects: &[&str]) {
    wait_until(120, &format!("{reason} Events on {objects:?}"), || {
        let events = events_in(ns, reason);
        let missing: Vec<&&str> = objects
            .iter()
            .filter(|o| !events.iter().any(|e| e.starts_with(&format!("{o}: "))))
            .collect();
        missing
            .is_empty()
            .then_some(())
            .ok_or_else(|| format!("{missing:?} in {events:?}"))
    });
}

/// Every running pod of the cluster on the node's pod network has its address recorded in the
/// pool for it and no other pod: no address is handed out twice, whoever allocated it.
fn every_pod_address_recorded() {
    let pods = get_json(&["get", "pods", "-A"]).unwrap();
    let entries = pool_entries(POD_POOL);
    let base: Ipv4Addr = POD_POOL.split('-').next().unwrap().parse().unwrap();
    let mut seen = BTreeSet::new();
    for p in pods["items"].as_array().unwrap() {
        if p["spec"]["hostNetwork"] == true
            || !p["metadata"]["deletionTimestamp"].is_null()
            || !is_ready(p)
        {
            continue;
        }
        let podref = format!(
            "{}/{}",
            p["metadata"]["namespace"].as_str().unwrap(),
            p["metadata"]["name"].as_str().unwrap()
        );
        let ip: Ipv4Addr = p["status"]["podIP"].as_str().unwrap().parse().unwrap();
        assert!(seen.insert(ip), "{ip} on two running pods ({podref})");
        let offset = (u32::from(ip) - u32::from(base)).to_string();
        let holder = entries.get(&offset).map(|e| e["podref"].clone());
        assert_eq!(
            holder,
            Some(json!(podref)),
            "{ip} of {podref} in {POD_POOL}"
        );
    }
}

/// The addresses each of `pods` holds now, by podref.
fn holdings(pods: &[Value]) -> BTreeMap<String, BTreeSet<String>> {
    pods.iter()
        .map(|p| {
            let podref = format!(
                "{}/{}",
                p["metadata"]["namespace"].as_str().unwrap(),
                p["metadata"]["name"].as_str().unwrap()
            );
            let got = held(&podref);
            assert!(!got.is_empty(), "{podref} holds nothing");
            (podref, got)
        })
        .collect()
}

/// Each of `before`'s pods still holds exactly what it held.
fn kept(before: &BTreeMap<String, BTreeSet<String>>) {
    for (podref, addresses) in before {
        assert_eq!(
            &held(podref),
            addresses,
            "{podref} lost or changed its addresses"
        );
    }
}

/// Waits until none of `before`'s pods holds an address any more.
fn freed(before: &BTreeMap<String, BTreeSet<String>>) {
    wait_until(120, "the deleted pods' addresses freed", || {
        let left: Vec<String> = before
            .keys()
            .filter(|p| !held(p).is_empty())
            .cloned()
            .collect();
        left.is_empty()
            .then_some(())
            .ok_or_else(|| format!("{left:?}"))
    });
}

/// `n` pods of Deployment `name` in `w` (eth0 and net1 through Multus) and a pod `name` on the
/// NAD `lan` in `lan`, running: what each holds.
fn start(w: &Workload, lan: &Workload, name: &str, n: u32) -> BTreeMap<String, BTreeSet<String>> {
    w.deployment(name, n);
    nad_pod(lan, name, "lan");
    let mut pods = w.wait_running(&format!("app={name}"), n as usize, 180);
    pods.push(running(lan, name));
    holdings(&pods)
}

/// Deletes what `start` started.
fn stop(w: &Workload, lan: &Workload, name: &str) {
    w.scale(&format!("deployment/{name}"), 0);
    kubectl_ok(&["-n", &lan.ns, "delete", "pod", name, "--wait=false"]);
}

/// Every pod of `w` is recorded as it runs (eth0, net1; reservations), and so is every other
/// running pod of the cluster.
fn consistent(w: &Workload) {
    let pods: Vec<Value> = w.pods(None).into_iter().filter(is_ready).collect();
    check_pods_against_pools(w, &pods);
    every_pod_address_recorded();
}

/// StatefulSet `name` of one pod in `w`, started under whichever plugin is on the host: what its
/// pod holds.
fn statefulset(w: &Workload, name: &str) -> BTreeMap<String, BTreeSet<String>> {
    w.apply(&format!(
        r#"apiVersion: apps/v1
kind: StatefulSet
metadata: {{name: {name}}}
spec:
  replicas: 1
  serviceName: {name}
  selector: {{matchLabels: {{app: {name}}}}}
  template:
    metadata: {{labels: {{app: {name}}}}}
    spec:
{}
"#,
        w.pod_spec(6)
    ));
    holdings(&w.wait_running(&format!("app={name}"), 1, 180))
}

/// Force-deletes StatefulSet `name`'s pod, as an admin does on a partitioned node: its replacement
/// of the same name starts at once on the same node while the old sandbox is torn down, and the
/// operator's cleanup of the old pod runs beside both (issue 25). The old entries are upstream's:
/// they record no pod UID or node, so only the living pod of that name keeps the cleanup from
/// them, leaving them to the old sandbox's DEL. The replacement ends with as many addresses as
/// its predecessor had, recorded for it, and the old ones are freed.
fn replace_forcibly(w: &Workload, name: &str, before: &BTreeMap<String, BTreeSet<String>>) {
    let pod = format!("{name}-0");
    let podref = format!("{}/{pod}", w.ns);
    let uid_of = || {
        get_json(&["-n", &w.ns, "get", "pod", &pod])
            .and_then(|p| p["metadata"]["uid"].as_str().map(str::to_string))
    };
    let old_uid = uid_of().expect("the StatefulSet's pod");
    let force = ["--grace-period=0", "--force", "--wait=false"];
    kubectl_ok(&[&["-n", &w.ns, "delete", "pod", &pod][..], &force].concat());
    wait_until(
        180,
        "the replacement running, the old addresses freed",
        || {
            let pods = w.pods(Some(&format!("app={name}")));
            let replaced = pods
                .iter()
                .any(|p| is_ready(p) && p["metadata"]["uid"].as_str() != Some(&old_uid));
            let holds = held(&podref);
            if replaced && holds.len() == before[&podref].len() {
                Ok(())
            } else {
                Err(format!("replaced: {replaced}, holds {holds:?}"))
            }
        },
    );
}

/// Waits until the operator reports upstream's DaemonSet and controller at `want` (1: they
/// exist, 0: they are gone).
fn upstream_reported(want: f64) {
    for name in ["whereabouts", "whereabouts-controller"] {
        wait_gauge(
            "whereabouts_upstream_components",
            &format!("name=\"{name}\""),
            |v| v == want,
        );
    }
}

/// After step 4: nothing of upstream's is reported, and the host's plugin is ours.
fn upstream_gone() {
    upstream_reported(0.0);
    assert_eq!(audit_kinds(), BTreeSet::new(), "audit after the switch");
    // The installer rewrites the host's files every 30 s.
    wait_until(60, "our plugin on the host", || {
        host_plugin_is(&release_binary("whereabouts"))
    });
}

#[test]
fn upstream_is_replaced_in_place_rolled_back_and_replaced_again_with_helm() {
    our_plugin_is_the_images();
    // The cluster as upstream's users have it: ours uninstalled (the README's "Uninstall"; no
    // workload holds an address), upstream installed from its own manifests.
    uninstall(false);
    install_upstream();
    let w = Workload::new("migrate");
    let lan = Workload::new("migrate-lan");
    nad(
        &lan,
        "lan",
        macvlan(json!({"type": "whereabouts", "range": "10.94.0.0/24"})),
    );
    let upstreams = start(&w, &lan, "upstreams", 2);
    let db = statefulset(&w, "db");
    consistent(&w);
    let both = BTreeSet::from([
        "crd-missing-fields".to_string(),
        "upstream-component".to_string(),
    ]);

    // The README's migration with kubectl. Step 1: the checks say what the next steps fix.
    validate_cluster();
    assert_eq!(audit_kinds(), both, "audit before the switch");
    // Steps 2 and 3: our CRDs, then our install next to upstream's.
    kubectl_ok(&["apply", "-k", repo().join("config/crd").to_str().unwrap()]);
    install_with_kustomize(node());
    upstream_reported(1.0);
    wait_events(
        UPSTREAM_NS,
        "UpstreamComponentRunning",
        &["whereabouts", "whereabouts-controller"],
    );
    // Pods started while both are installed.
    let during = start(&w, &lan, "during", 2);
    // A pod upstream started, replaced under ours.
    replace_forcibly(&w, "db", &db);
    consistent(&w);
    // Step 4: upstream's objects go.
    remove_upstream();
    upstream_gone();
    kept(&upstreams);
    consistent(&w);
    // Pods started under upstream are freed by ours.
    stop(&w, &lan, "upstreams");
    freed(&upstreams);

    // Rollback: our uninstall (CRDs kept), then upstream's install as it was.
    uninstall(false);
    install_upstream();
    let rolled = start(&w, &lan, "rolled", 2);
    kept(&during);
    consistent(&w);
    // Pods started under ours are freed by upstream's plugin.
    stop(&w, &lan, "during");
    freed(&during);

    // The migration again, with Helm. Upstream's install put its CRDs back.
    assert_eq!(audit_kinds(), both, "audit before the second switch");
    // Step 3 before step 2, which Helm users forget (Helm never upgrades a CRD that exists): the
    // operator says so, and the fix it names works. An ipamclaims CRD that another component
    // installed in an older form too.
    apply_ipamclaims_crd_with_owner_pod_a_string();
    helm_install();
    wait_events(
        "default",
        "CrdMissingFields",
        &[CRD_IPPOOLS, CRD_IPAMCLAIMS],
    );
    wait_gauge("whereabouts_crd_fields_missing", CRD_IPPOOLS, |v| v > 0.0);
    wait_gauge("whereabouts_crd_fields_missing", CRD_IPAMCLAIMS, |v| {
        v == 1.0
    });
    let crds = repo().join("charts/whereabouts/crds");
    kubectl_ok(&["apply", "-f", crds.to_str().unwrap()]);
    wait_gauge("whereabouts_crd_fields_missing", CRD_IPPOOLS, |v| v == 0.0);
    wait_gauge("whereabouts_crd_fields_missing", CRD_IPAMCLAIMS, |v| {
        v == 0.0
    });
    upstream_reported(1.0);
    remove_upstream();
    upstream_gone();
    kept(&rolled);
    consistent(&w);
    stop(&w, &lan, "rolled");
    freed(&rolled);

    // The standard install back, for the tests after this one.
    uninstall(true);
    install_with_kustomize(node());
    every_pod_address_recorded();
}
