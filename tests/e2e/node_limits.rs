//! What the node identity may do beyond its RBAC rules (config/rbac/node-limits.yaml), against the
//! real API server with a token of the real `whereabouts-system/whereabouts-node` account: Lease
//! writes only for pools' writer turns (the ValidatingAdmissionPolicy), and its requests in their
//! own API Priority and Fairness level.

use std::path::{Path, PathBuf};

use serde_json::{Value, json};

use std::collections::BTreeSet;

use crate::harness::{
    Cni, CniCall, Ns, admin_kubeconfig, eventually, kubectl_raw, kustomize, token_kubeconfig,
};
use crate::slices::{SimNode, upstream_bin};

use crate::node_account::{
    NODE, SYSTEM, admin, admin_apply, kill_token, node_token, refused_once_loaded,
};

/// The objects of config/rbac/node-limits.yaml as config/default renders them: the policies,
/// their bindings, the FlowSchema and its priority level.
fn is_node_limit(o: &Value) -> bool {
    let kind = o["kind"].as_str().unwrap_or_default();
    (kind.starts_with("ValidatingAdmissionPolicy")
        && o["metadata"]["name"]
            .as_str()
            .unwrap_or_default()
            .starts_with("whereabouts-node-"))
        || kind == "FlowSchema"
        || kind == "PriorityLevelConfiguration"
}

/// Applies the policy and flow objects as config/default renders them, the real node account, and
/// the node Role's Lease rule in `ns` (the pool namespace of this test). Returns a kubeconfig
/// with the account's token.
fn node_account(ns: &Ns) -> PathBuf {
    let limits: Vec<Value> = kustomize("config/default")
        .into_iter()
        .filter(is_node_limit)
        .collect();
    assert_eq!(limits.len(), 8, "{limits:?}");
    let list = json!({"apiVersion": "v1", "kind": "List", "items": limits});
    admin_apply(&list.to_string());
    let _ = kubectl_raw(admin_kubeconfig(), &["create", "namespace", SYSTEM], None);
    let _ = kubectl_raw(
        admin_kubeconfig(),
        &["-n", SYSTEM, "create", "serviceaccount", NODE],
        None,
    );
    let subject = format!("{SYSTEM}:{NODE}");
    ns.kubectl_ok(&[
        "create",
        "role",
        "leases",
        "--verb=get,create,delete,update",
        "--resource=leases.coordination.k8s.io",
    ]);
    ns.kubectl_ok(&[
        "create",
        "rolebinding",
        "leases",
        "--role=leases",
        &format!("--serviceaccount={subject}"),
    ]);
    let token = admin(
        &["-n", SYSTEM, "create", "token", NODE, "--duration=10m"],
        None,
    );
    token_kubeconfig(ns, "node.kubeconfig", &token)
}

fn lease(name: &str, turn: bool) -> String {
    let labels = if turn {
        json!({"whereabouts.cni.cncf.io/writer-turn": "true"})
    } else {
        json!({})
    };
    json!({"apiVersion": "coordination.k8s.io/v1", "kind": "Lease",
           "metadata": {"name": name, "labels": labels}, "spec": {"holderIdentity": "x"}})
    .to_string()
}

#[test]
fn the_node_identity_writes_only_writer_turn_leases_in_its_own_priority_level() {
    let ns = Ns::new("nodelimits");
    let node = node_account(&ns);
    let as_node = |args: &[&str], stdin: Option<&str>| kubectl_raw(&node, args, stdin);
    let denied = |out: &std::process::Output| {
        !out.status.success()
            && String::from_utf8_lossy(&out.stderr)
                .contains("the whereabouts node identity may only write pools' writer turns")
    };
    // A leader Lease of the control plane is refused to the node, with the reason.
    refused_once_loaded(
        &node,
        &["create", "-f", "-"],
        Some(&lease("kube-scheduler", false)),
        "the whereabouts node identity may only write pools' writer turns",
    );
    // A writer turn is its to create and delete.
    let out = as_node(
        &["create", "-f", "-"],
        Some(&lease("whereabouts-pool-a", true)),
    );
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let out = as_node(&["delete", "lease", "whereabouts-pool-a"], None);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    // Its name without the label, or the operator's leader Lease, are not.
    for (name, turn) in [
        ("whereabouts-pool-b", false),
        ("whereabouts-operator", true),
    ] {
        let out = as_node(&["create", "-f", "-"], Some(&lease(name, turn)));
        assert!(
            denied(&out),
            "{name}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
    }
    // A Lease someone else made (a control-plane leader's) cannot be deleted or taken over.
    ns.kubectl_ok_stdin(
        &["create", "-f", "-"],
        &lease("kube-controller-manager", false),
    );
    let out = as_node(&["delete", "lease", "kube-controller-manager"], None);
    assert!(denied(&out), "{}", String::from_utf8_lossy(&out.stderr));
    let taken = lease("kube-controller-manager", true);
    let out = as_node(&["replace", "-f", "-"], Some(&taken));
    assert!(denied(&out), "{}", String::from_utf8_lossy(&out.stderr));
    assert!(ns.get_json(&["lease", "kube-controller-manager"]).is_some());

    // Its requests are classified into the whereabouts-node level (the API server names the
    // FlowSchema and priority level of every answer in its headers).
    let uid = |kind: &str| {
        let out = kubectl_raw(
            admin_kubeconfig(),
            &["get", kind, NODE, "-o", "jsonpath={.metadata.uid}"],
            None,
        );
        String::from_utf8_lossy(&out.stdout).trim().to_owned()
    };
    let (schema, level) = (uid("flowschema"), uid("prioritylevelconfiguration"));
    assert!(!schema.is_empty() && !level.is_empty());
    let out = as_node(&["get", "leases", "-v=8"], None);
    let log = String::from_utf8_lossy(&out.stderr).to_lowercase();
    assert!(
        log.contains(&format!("x-kubernetes-pf-flowschema-uid: {schema}"))
            && log.contains(&format!("x-kubernetes-pf-prioritylevel-uid: {level}")),
        "{log}"
    );
}

/// Applies the node's RBAC of config/default with its Role in `ns` (the pool namespace of this
/// test) instead of kube-system, and the node-limits objects.
pub(crate) fn node_rights(ns: &Ns) {
    let objects: Vec<Value> = kustomize("config/default")
        .into_iter()
        .filter(|o| {
            let kind = o["kind"].as_str().unwrap_or_default();
            let name = o["metadata"]["name"].as_str().unwrap_or_default();
            is_node_limit(o)
                // (not its Role in whereabouts-system: the installer's, for an uninstall)
                || (name == NODE && kind.contains("Role") && o["metadata"]["namespace"] != SYSTEM)
                || (name == SYSTEM && kind == "Namespace")
                || (name == NODE && kind == "ServiceAccount")
        })
        .map(|mut o| {
            if o["kind"] == "Role" || o["kind"] == "RoleBinding" {
                o["metadata"]["namespace"] = ns.name.clone().into();
            }
            o
        })
        .collect();
    assert_eq!(objects.len(), 14, "{objects:?}");
    let list = json!({"apiVersion": "v1", "kind": "List", "items": objects});
    admin_apply(&list.to_string());
}

/// Deletes reservation `name` with `kubeconfig` as our plugin does, on the condition of the UID it
/// read (the claims-kept policy refuses a service account's delete of ours by name alone); a
/// server-side dry run when `dry`.
fn delete_claim(ns: &Ns, kubeconfig: &Path, name: &str, dry: bool) -> std::process::Output {
    let jsonpath = "jsonpath={.metadata.uid}";
    let uid = ns.kubectl_ok(&["get", "overlappingrangeipreservation", name, "-o", jsonpath]);
    let mut options =
        json!({"apiVersion": "v1", "kind": "DeleteOptions", "preconditions": {"uid": uid.trim()}});
    if dry {
        // In the body: a body's options replace the query's.
        options["dryRun"] = json!(["All"]);
    }
    let body = ns.dir.path().join("delete-options.json");
    std::fs::write(&body, options.to_string()).unwrap();
    let path = format!(
        "/apis/whereabouts.cni.cncf.io/v1alpha1/namespaces/{}/overlappingrangeipreservations/{name}",
        ns.name
    );
    let body = body.to_str().unwrap();
    kubectl_raw(kubeconfig, &["delete", "--raw", &path, "-f", body], None)
}

/// Writes IPAMClaim `ns/name`'s `status.ips` as the plugin does (`KubeStore`, whose kubeconfig is
/// `kubeconfig`), naming `recorder` in its RecordedBy condition (none: left as it was); the API
/// server's refusal as text.
fn claim_status(
    kubeconfig: &Path,
    ns: &str,
    name: &str,
    ips: &[&str],
    recorder: Option<&str>,
) -> Result<(), String> {
    use whereabouts::store::Datastore as _;
    let runtime = tokio::runtime::Runtime::new().unwrap();
    runtime.block_on(async {
        let (config, _) = whereabouts::kubeconfig::load(Some(kubeconfig.to_str().unwrap()))
            .await
            .unwrap();
        let client = kube::Client::try_from(config).unwrap();
        let store = whereabouts::store::kubernetes::KubeStore::new(client, ns);
        let claim = store.get_ipam_claim(ns, name).await.unwrap().unwrap();
        let mut status = claim.status.clone().unwrap_or_default();
        status.ips = ips.iter().map(|ip| ip.to_string()).collect();
        if let Some(node) = recorder {
            (status.conditions).retain(|c| c.type_ != whereabouts::crd::claim::RECORDED_BY);
            (status.conditions).push(whereabouts::crd::claim::recorded_by(node));
        }
        match store.write_ipam_claim_status(&claim, &status).await {
            Ok(whereabouts::store::Write::Done) => Ok(()),
            Ok(other) => Err(format!("{other:?}")),
            Err(e) => Err(format!("{e:#}")),
        }
    })
}

/// One node's credentials (a token bound to it, the shipped RBAC and policies) change only that
/// node's work: its own ADD, CHECK, DEL and CNI GC work; another node's entries, reservations and
/// slices, a pool delete and a pod list are refused, each naming why. Upstream's plugin (its own,
/// unbound identity) shares the pool.
#[test]
fn a_nodes_credentials_change_only_that_nodes_work() {
    let ns = Ns::new("nodewrites");
    node_rights(&ns);
    let (a, b) = (SimNode::new(&ns, "a", false), SimNode::new(&ns, "b", false));
    let (a_creds, b_creds) = (node_token(&ns, &a.name), node_token(&ns, &b.name));
    a.use_credentials(&a_creds);
    b.use_credentials(&b_creds);
    let ipam = json!({"range": "10.94.0.0/24"});
    let pool = "10.94.0.0-24";
    let denied = |out: &std::process::Output, what: &str| {
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(!out.status.success() && err.contains(what), "{err}");
    };
    let first = a.run(&ns, "ADD", &ipam, &["a1".into()]);
    assert!(first[0].ok, "{:?}", first[0]);
    for (node, pod) in [(&a, "a2"), (&b, "b1")] {
        let r = node.run(&ns, "ADD", &ipam, &[pod.into()]);
        assert!(r[0].ok, "{pod}: {:?}", r[0]);
    }
    // The runtime repeats an ADD of a1's container: the entry is taken again, and with no
    // release of it announced the pool is left as it was (see `Engine::reuse`).
    let before = ns.get_json(&["ippool", pool]).unwrap();
    let again = a.run(&ns, "ADD", &ipam, &["a1".into()]);
    assert!(again[0].ok, "{:?}", again[0]);
    let after = ns.get_json(&["ippool", pool]).unwrap();
    assert_eq!(
        after["metadata"]["resourceVersion"], before["metadata"]["resourceVersion"],
        "{after}"
    );
    // A DEL of a1's container announced its release and was cut off: the repeated ADD withdraws
    // the announcement and moves the pool on (an annotation), which the policy lets the node
    // write.
    let a1 = format!("{}/a1", ns.name);
    let (claim, _) = (ns.reservations().into_iter())
        .find(|(_, spec)| spec["podref"] == a1.as_str())
        .unwrap();
    let bucket = whereabouts::store::claim_bucket(whereabouts::store::now_secs());
    let label = format!("{}={bucket}", whereabouts::store::RELEASING_LABEL);
    ns.kubectl_ok(&["label", "overlappingrangeipreservation", &claim, &label]);
    let again = a.run(&ns, "ADD", &ipam, &["a1".into()]);
    assert!(again[0].ok, "{:?}", again[0]);
    let touched = ns.get_json(&["ippool", pool]).unwrap();
    assert!(
        touched["metadata"]["annotations"][whereabouts::store::TAKEN_AGAIN_ANNOTATION].is_string(),
        "{touched}"
    );
    let withdrawn = ns
        .get_json(&["overlappingrangeipreservation", &claim])
        .unwrap();
    assert!(
        withdrawn["metadata"]["labels"][whereabouts::store::RELEASING_LABEL].is_null(),
        "{withdrawn}"
    );
    let entries = ns.allocations(pool);
    let node_of = |pod: &str| {
        let podref = format!("{}/{pod}", ns.name);
        let (offset, e) = entries
            .iter()
            .find(|(_, e)| e["podref"] == podref.as_str())
            .unwrap();
        (
            offset.clone(),
            e["node"].as_str().unwrap_or_default().to_owned(),
        )
    };
    assert_eq!(node_of("a1").1, a.name);
    assert_eq!(node_of("b1").1, b.name);

    // With a's token: b's entry cannot be removed or taken, b's claim not deleted, no claim made
    // in b's name, no pods listed.
    let b1 = node_of("b1").0;
    let remove = json!([{"op": "remove", "path": format!("/spec/allocations/{b1}")}]).to_string();
    // (Each policy's refusal is first awaited: see `refused_once_loaded`.)
    let why = format!(
        "node {} may remove or rewrite only its own node's entries of IPPool {pool}",
        a.name
    );
    let patch = ["patch", "ippool", pool, "--type=json", "-p", &remove];
    refused_once_loaded(&a_creds, &patch, None, &why);
    // No pool can be deleted (RBAC, and the policy too).
    let out = kubectl_raw(&a_creds, &["delete", "ippool", pool], None);
    denied(&out, "forbidden");
    let b1_claim = format!("10.94.0.{b1}");
    let why = format!("not {b1_claim} (node {})", b.name);
    let refused = |out: &std::process::Output| {
        !out.status.success() && String::from_utf8_lossy(&out.stderr).contains(&why)
    };
    assert!(
        eventually(60, || refused(&delete_claim(
            &ns, &a_creds, &b1_claim, true
        ))),
        "never refused with {why:?}"
    );
    denied(&delete_claim(&ns, &a_creds, &b1_claim, false), &why);
    let claim = json!({"apiVersion": "whereabouts.cni.cncf.io/v1alpha1", "kind": "OverlappingRangeIPReservation",
        "metadata": {"name": "10.94.0.99"}, "spec": {"podref": "x/y", "containerid": "c", "node": b.name}});
    let why = "may write only its own node's reservations";
    refused_once_loaded(
        &a_creds,
        &["create", "-f", "-"],
        Some(&claim.to_string()),
        why,
    );
    let out = kubectl_raw(&a_creds, &["get", "pods", "-A"], None);
    denied(&out, "cannot list resource \"pods\"");
    assert!(ns.allocations(pool).contains_key(&b1));

    // NodeSlicePools: a free slice can be taken for a, b's cannot.
    let slices = json!({"apiVersion": "whereabouts.cni.cncf.io/v1alpha1", "kind": "NodeSlicePool",
        "metadata": {"name": "sliced"}, "spec": {"range": "10.95.0.0/24", "sliceSize": "/26"},
        "status": {"allocations": [{"nodeName": b.name, "sliceRange": "10.95.0.0/26"},
                                   {"nodeName": "", "sliceRange": "10.95.0.64/26"}]}});
    ns.kubectl_ok_stdin(&["create", "-f", "-"], &slices.to_string());
    // As the plugin takes a slice: the object read, replaced at its version.
    let take = |i: usize| {
        let mut read = ns.get_json(&["nodeslicepool", "sliced"]).unwrap();
        read["status"]["allocations"][i]["nodeName"] = a.name.clone().into();
        read.to_string()
    };
    let replace = ["replace", "-f", "-"];
    refused_once_loaded(
        &a_creds,
        &replace,
        Some(&take(0)),
        "may only take free slices",
    );
    let out = kubectl_raw(&a_creds, &replace, Some(&take(1)));
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );

    // IPAMClaims: a's token may record addresses in a claim's status and add more, but not
    // change or remove those it records (the claim's next pod, on any node, is given them).
    for name in ["vm1.net", "probe.net"] {
        ns.create_ipam_claim(name, "net");
    }
    // (Refused once the API server has loaded the policy: probed on a claim of its own, put back
    // by the admin while a's change still goes through.)
    claim_status(
        &a_creds,
        &ns.name,
        "probe.net",
        &["10.94.0.250/32"],
        Some(&a.name),
    )
    .unwrap();
    assert!(
        eventually(30, || {
            let moved = claim_status(
                &a_creds,
                &ns.name,
                "probe.net",
                &["10.94.0.251/32"],
                Some(&a.name),
            );
            let back = json!({"status": {"ips": ["10.94.0.250/32"]}}).to_string();
            let patch = [
                "patch",
                "ipamclaim",
                "probe.net",
                "--subresource=status",
                "--type=merge",
            ];
            if moved.is_ok() {
                ns.kubectl_ok(&[&patch[..], &["-p", &back]].concat());
            }
            moved.is_err_and(|e| e.contains("not change or remove"))
        }),
        "the claims policy was never loaded"
    );
    // Written as the plugin writes it (its store, a merge patch of the status at the version
    // read), with a's credentials.
    let record = |ips: &[&str]| claim_status(&a_creds, &ns.name, "vm1.net", ips, Some(&a.name));
    let recorded = ["10.94.0.200/32", "fd00::5/64"];
    for ips in [&["10.94.0.200/24"][..], &recorded] {
        record(ips).unwrap();
    }
    let why = "but not change or remove those it records (10.94.0.200, fd00::5)";
    // One moved, one dropped.
    for ips in [&["10.94.0.201/24", "fd00::5/64"][..], &["fd00::5/64"]] {
        let err = record(ips).unwrap_err();
        assert!(err.contains(why), "{err}");
    }
    let vm = ns.get_json(&["ipamclaim", "vm1.net"]).unwrap();
    assert_eq!(vm["status"]["ips"], json!(recorded));
    // Every record names the node that wrote it: a's token can neither name b as the recorder
    // (of a new record, or of vm1's) nor record addresses without naming itself.
    let recorder_of = |claim: &str| {
        let c = ns.get_json(&["ipamclaim", claim]).unwrap();
        let conditions = c["status"]["conditions"]
            .as_array()
            .cloned()
            .unwrap_or_default();
        (conditions.iter())
            .filter(|c| c["type"] == whereabouts::crd::claim::RECORDED_BY)
            .map(|c| c["message"].as_str().unwrap().to_owned())
            .collect::<Vec<_>>()
    };
    assert_eq!(recorder_of("vm1.net"), std::slice::from_ref(&a.name));
    ns.create_ipam_claim("vm2.net", "net");
    let forged = ["10.94.0.210/32"];
    let err = claim_status(&a_creds, &ns.name, "vm2.net", &forged, Some(&b.name)).unwrap_err();
    assert!(err.contains("may name only its own node"), "{err}");
    assert!(
        err.contains(&format!("this write names {}", b.name)),
        "{err}"
    );
    let err = claim_status(&a_creds, &ns.name, "vm2.net", &forged, None).unwrap_err();
    assert!(err.contains("only naming its own node"), "{err}");
    let err = claim_status(&a_creds, &ns.name, "vm1.net", &recorded, Some(&b.name)).unwrap_err();
    assert!(err.contains("may name only its own node"), "{err}");
    assert_eq!(recorder_of("vm1.net"), std::slice::from_ref(&a.name));
    assert!(recorder_of("vm2.net").is_empty());
    // b's token takes vm1's record over, naming b (a live migration's target on b).
    claim_status(&b_creds, &ns.name, "vm1.net", &recorded, Some(&b.name)).unwrap();
    assert_eq!(recorder_of("vm1.net"), std::slice::from_ref(&b.name));

    // a's own CHECK, DEL and GC work: GC frees a's entry whose pod is gone, never b's.
    let mut check = a.conf(&ipam);
    check["prevResult"] = first[0].stdout.clone();
    let call = |command, conf: &Value, container, args: &str| {
        Cni::run(&CniCall {
            command,
            conf,
            container,
            ifname: "net1",
            netns: "/var/run/netns/none",
            args,
            path: None,
        })
    };
    let args = format!(
        "IgnoreUnknown=1;K8S_POD_NAMESPACE={};K8S_POD_NAME=a1;K8S_POD_UID=uid-a1",
        ns.name
    );
    let r = call("CHECK", &check, "c-a1", &args);
    assert!(r.ok, "{r:?}");
    let del = a.run(&ns, "DEL", &ipam, &["a1".into()]);
    assert!(del[0].ok, "{:?}", del[0]);
    let mut gc = a.conf(&ipam);
    gc["cniVersion"] = "1.1.0".into();
    gc["cni.dev/valid-attachments"] = json!([]);
    let r = call("GC", &gc, "", "");
    assert!(r.ok, "{r:?}");
    let pods_left = || -> BTreeSet<String> {
        ns.allocations(pool)
            .values()
            .map(|e| {
                e["podref"]
                    .as_str()
                    .unwrap()
                    .rsplit('/')
                    .next()
                    .unwrap()
                    .to_owned()
            })
            .collect()
    };
    assert_eq!(pods_left(), BTreeSet::from(["b1".to_owned()]));

    // Upstream's plugin, with its own identity, writes the same pool (a JSON patch of the entries
    // it changes: ours keep their node), and b's DEL works after it.
    let upstream = SimNode::new(&ns, "u", false);
    let up = upstream.run_with(&upstream_bin(), &ns, "ADD", &ipam, &["up1".into()]);
    assert!(up[0].ok, "{:?}", up[0]);
    assert_eq!(ns.allocations(pool)[&b1]["node"], b.name.as_str());
    let del = b.run(&ns, "DEL", &ipam, &["b1".into()]);
    assert!(del[0].ok, "{:?}", del[0]);
    assert_eq!(pods_left(), BTreeSet::from(["up1".to_owned()]));

    // A node whose token died (its pod deleted, as when the DaemonSet's pod goes; an expired
    // token is refused the same way) fails its ADD with a word on why, and writes nothing.
    kill_token(&a.name, &a_creds);
    let r = a.run(&ns, "ADD", &ipam, &["a3".into()]);
    let msg = r[0].stdout["msg"].as_str().unwrap_or_default();
    assert!(
        msg.contains("does not accept the plugin's credentials") && r[0].stdout["code"] == 11,
        "{:?}",
        r[0]
    );
    assert_eq!(pods_left(), BTreeSet::from(["up1".to_owned()]));
}
