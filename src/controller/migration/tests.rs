use k8s_openapi::api::apps::v1::{DaemonSet, Deployment};
use k8s_openapi::apiextensions_apiserver::pkg::apis::apiextensions::v1::CustomResourceDefinition;
use serde_json::{Value, json};

use super::schema::{STATUS_SUBRESOURCE, gap, name_of, ours};
use super::upstream::{KNOWN, Kind, NAMESPACE, evidence};
use super::*;

/// A file of the repository, by its path from the top.
fn repo_file(file: &str) -> String {
    let path = format!("{}/{file}", env!("CARGO_MANIFEST_DIR"));
    std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{path}: {e}"))
}

/// Upstream v0.9.2's CRD as its users installed it (tests/fixtures/upstream-v0.9.2/).
fn upstream_crd(plural: &str) -> CustomResourceDefinition {
    serde_saphyr::from_str(&repo_file(&format!(
        "tests/fixtures/upstream-v0.9.2/whereabouts.cni.cncf.io_{plural}.yaml"
    )))
    .unwrap()
}

fn our_crd(plural: &str) -> CustomResourceDefinition {
    ours()
        .into_iter()
        .find(|c| c.spec.names.plural == plural)
        .unwrap()
}

/// The one object of `kind` in a multi-document manifest, read as kubectl reads it (YAML 1.1:
/// upstream's `defaultMode: 0744` is octal).
fn manifest_object<T: serde::de::DeserializeOwned>(file: &str, kind: &str) -> T {
    let options = serde_saphyr::options! { legacy_octal_numbers: true };
    let docs: Vec<Value> =
        serde_saphyr::from_multiple_with_options(&repo_file(file), options).unwrap();
    let mut of_kind = docs.into_iter().filter(|d| d["kind"] == kind);
    let doc = of_kind
        .next()
        .unwrap_or_else(|| panic!("{file} has no {kind}"));
    assert!(of_kind.next().is_none(), "{file} has two of {kind}");
    serde_json::from_value(doc).unwrap()
}

fn strings(list: &[&str]) -> Vec<String> {
    list.iter().map(|s| (*s).to_owned()).collect()
}

#[test]
fn we_check_the_three_crds_upstream_installs_and_ipamclaims() {
    let names: Vec<String> = ours().iter().map(name_of).collect();
    assert_eq!(
        names,
        strings(&[
            "ippools.whereabouts.cni.cncf.io",
            "overlappingrangeipreservations.whereabouts.cni.cncf.io",
            "nodeslicepools.whereabouts.cni.cncf.io",
            "ipamclaims.k8s.cni.cncf.io",
        ])
    );
}

/// Ours with `status.ownerPod` declared a string, as some ipamclaims releases have it.
fn ipamclaims_with_owner_pod_a_string() -> CustomResourceDefinition {
    let mut crd = serde_json::to_value(our_crd("ipamclaims")).unwrap();
    let schema = &mut crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"];
    schema["properties"]["status"]["properties"]["ownerPod"] = json!({"type": "string"});
    serde_json::from_value(crd).unwrap()
}

#[test]
fn an_ipamclaims_crd_whose_owner_pod_is_a_string_lacks_its_name() {
    let found = gap(
        &our_crd("ipamclaims"),
        Some(&ipamclaims_with_owner_pod_a_string()),
    );
    assert_eq!(found.version.as_deref(), Some("v1alpha1"));
    assert_eq!(found.missing, strings(&["status.ownerPod.name"]));
    assert!(!found.is_fine());
    let message = crd_message(&found.crd, found.version.as_deref(), &found.missing);
    assert!(message.contains("status.ownerPod a string"), "{message}");
    assert!(message.contains("kubectl apply -f crds/"), "{message}");
}

/// No ipamclaims CRD: no VM keeps an address, which is not a fault. Ours missing is one.
#[test]
fn only_the_ipamclaims_crd_may_be_missing() {
    let claims = gap(&our_crd("ipamclaims"), None);
    assert!(claims.is_fine(), "{claims:?}");
    assert!(claims.missing.is_empty());
    let pools = gap(&our_crd("ippools"), None);
    assert!(!pools.is_fine());
    assert!(pools.missing.contains(&"spec".to_owned()), "{pools:?}");
}

#[test]
fn upstreams_ippool_crd_prunes_our_entry_fields_and_status() {
    let found = gap(&our_crd("ippools"), Some(&upstream_crd("ippools")));
    assert_eq!(found.version.as_deref(), Some("v1alpha1"));
    assert_eq!(
        found.missing,
        strings(&[
            "spec.allocations.*.ipamclaimref",
            "spec.allocations.*.node",
            "spec.allocations.*.poduid",
            "spec.allocations.*.statefulset",
            "status",
            STATUS_SUBRESOURCE,
        ])
    );
    assert!(!found.is_fine());
}

#[test]
fn upstreams_reservation_crd_prunes_our_claimant_fields() {
    let plural = "overlappingrangeipreservations";
    let found = gap(&our_crd(plural), Some(&upstream_crd(plural)));
    assert_eq!(
        found.missing,
        strings(&[
            "spec.ipamclaimref",
            "spec.node",
            "spec.poduid",
            "spec.statefulset"
        ])
    );
}

/// Ours adds nothing to upstream's NodeSlicePool (the objects are upstream's, byte for byte).
#[test]
fn upstreams_node_slice_pool_crd_keeps_everything() {
    let found = gap(
        &our_crd("nodeslicepools"),
        Some(&upstream_crd("nodeslicepools")),
    );
    assert!(found.is_fine(), "{found:?}");
}

/// The files of `crds/` (what `kubectl apply -f crds/` installs) are the fix.
#[test]
fn our_shipped_crds_keep_everything() {
    for ours in ours() {
        let plural = &ours.spec.names.plural;
        let installed: CustomResourceDefinition =
            serde_saphyr::from_str(&repo_file(&format!("crds/{plural}.yaml"))).unwrap();
        let found = gap(&ours, Some(&installed));
        assert!(found.is_fine(), "{found:?}");
    }
}

/// An IPPool CRD as JSON whose entries declare `entry` (None: no schema for the map's values).
fn ippool_crd_json(entry: Option<Value>, spec_extra: Value) -> CustomResourceDefinition {
    let mut allocations = json!({"type": "object"});
    if let Some(entry) = entry {
        allocations["additionalProperties"] = entry;
    }
    let mut spec = json!({"type": "object", "properties": {"range": {"type": "string"}, "allocations": allocations}});
    spec.as_object_mut()
        .unwrap()
        .extend(spec_extra.as_object().unwrap().clone());
    serde_json::from_value(json!({
        "apiVersion": "apiextensions.k8s.io/v1", "kind": "CustomResourceDefinition",
        "metadata": {"name": "ippools.whereabouts.cni.cncf.io"},
        "spec": {"group": "whereabouts.cni.cncf.io", "scope": "Namespaced",
            "names": {"kind": "IPPool", "plural": "ippools"},
            "versions": [{"name": "v1alpha1", "served": true, "storage": true,
                "subresources": {"status": {}},
                "schema": {"openAPIV3Schema": {"type": "object", "properties": {
                    "spec": spec,
                    "status": {"type": "object", "x-kubernetes-preserve-unknown-fields": true}}}}}]}
    }))
    .unwrap()
}

fn entry_with(fields: &[&str]) -> Value {
    let properties: serde_json::Map<String, Value> = fields
        .iter()
        .map(|f| ((*f).to_owned(), json!({"type": "string"})))
        .collect();
    json!({"type": "object", "properties": properties})
}

#[test]
fn a_crd_with_every_field_is_fine_and_one_without_some_names_them() {
    let all = [
        "id",
        "podref",
        "ifname",
        "poduid",
        "statefulset",
        "ipamclaimref",
        "node",
    ];
    let ours = our_crd("ippools");
    let full = gap(
        &ours,
        Some(&ippool_crd_json(Some(entry_with(&all)), json!({}))),
    );
    assert!(full.is_fine(), "{full:?}");
    let partial = gap(
        &ours,
        Some(&ippool_crd_json(Some(entry_with(&all[..5])), json!({}))),
    );
    assert_eq!(
        partial.missing,
        strings(&["spec.allocations.*.ipamclaimref", "spec.allocations.*.node"])
    );
    let no_entries = gap(&ours, Some(&ippool_crd_json(None, json!({}))));
    assert_eq!(no_entries.missing, strings(&["spec.allocations.*"]));
}

/// `x-kubernetes-preserve-unknown-fields` keeps whatever is below it, at any level.
#[test]
fn preserved_unknown_fields_are_kept() {
    let ours = our_crd("ippools");
    let open_entries = json!({"type": "object", "x-kubernetes-preserve-unknown-fields": true});
    assert!(gap(&ours, Some(&ippool_crd_json(Some(open_entries), json!({})))).is_fine());
    let open_spec = json!({"x-kubernetes-preserve-unknown-fields": true});
    assert!(
        gap(
            &ours,
            Some(&ippool_crd_json(Some(entry_with(&["id"])), open_spec))
        )
        .is_fine()
    );
    let any_value = json!(true);
    assert!(gap(&ours, Some(&ippool_crd_json(Some(any_value), json!({})))).is_fine());
}

/// Objects are stored in the storage version's schema, whatever version a client writes.
#[test]
fn the_storage_version_is_the_one_compared() {
    let ours = our_crd("ippools");
    let mut installed = upstream_crd("ippools");
    let mut served_only = our_crd("ippools").spec.versions[0].clone();
    served_only.storage = false;
    installed.spec.versions[0].name = "v1beta1".into();
    installed.spec.versions.insert(0, served_only);
    let found = gap(&ours, Some(&installed));
    assert_eq!(found.version.as_deref(), Some("v1beta1"));
    assert_eq!(found.missing.len(), 6, "{found:?}");
}

#[test]
fn a_crd_that_is_not_installed_lacks_everything() {
    let found = gap(&our_crd("ippools"), None);
    assert_eq!(found.version, None);
    assert_eq!(
        found.missing,
        strings(&["spec", "status", STATUS_SUBRESOURCE])
    );
    let text = crd_message(&found.crd, None, &found.missing);
    assert!(text.contains("is not installed"), "{text}");
}

#[test]
fn upstreams_daemonset_and_node_slice_controller_are_recognised() {
    let ds: DaemonSet = manifest_object(
        "tests/fixtures/upstream-v0.9.2/daemonset-install.yaml",
        "DaemonSet",
    );
    assert_eq!(
        (
            ds.metadata.namespace.as_deref(),
            ds.metadata.name.as_deref()
        ),
        (Some(NAMESPACE), Some(KNOWN[0].name))
    );
    let spec = ds.spec.unwrap().template.spec.unwrap();
    assert_eq!(
        evidence(&spec).as_deref(),
        Some("container whereabouts runs /ip-control-loop")
    );
    let controller: Deployment = manifest_object(
        "tests/fixtures/upstream-v0.9.2/node-slice-controller.yaml",
        "Deployment",
    );
    assert_eq!(
        (
            controller.metadata.namespace.as_deref(),
            controller.metadata.name.as_deref()
        ),
        (Some(NAMESPACE), Some(KNOWN[2].name))
    );
    assert_eq!(
        evidence(&controller.spec.unwrap().template.spec.unwrap()).as_deref(),
        Some("container whereabouts runs /node-slice-controller")
    );
}

/// Our node DaemonSet never matches, even named as upstream's and run from an image of that name.
#[test]
fn ours_is_never_upstreams() {
    let mut ds: DaemonSet = manifest_object("config/cni/daemonset.yaml", "DaemonSet");
    let spec = ds.spec.as_mut().unwrap().template.spec.as_mut().unwrap();
    assert_eq!(evidence(spec), None);
    for c in &mut spec.containers {
        c.image = Some("ghcr.io/k8snetworkplumbingwg/whereabouts:v1.0.0".into());
    }
    assert_eq!(evidence(spec), None);
}

#[test]
fn upstreams_image_is_recognised_when_mirrored_and_without_a_command() {
    let spec = |image: &str| -> k8s_openapi::api::core::v1::PodSpec {
        serde_json::from_value(json!({"containers": [{"name": "w", "image": image}]})).unwrap()
    };
    for image in [
        "ghcr.io/k8snetworkplumbingwg/whereabouts:latest-amd64",
        "registry.local:5000/k8snetworkplumbingwg/whereabouts@sha256:0123",
        "k8snetworkplumbingwg/whereabouts",
    ] {
        assert_eq!(
            evidence(&spec(image)),
            Some(format!("container w runs image {image}"))
        );
    }
    for image in [
        "registry.local:5000/whereabouts:0.1.0",
        "k8snetworkplumbingwg/whereabouts-ops:1",
    ] {
        assert_eq!(evidence(&spec(image)), None, "{image}");
    }
}

/// What the log, the Event and the finding say fits an Event's note (1 KiB at most).
#[test]
fn messages_name_the_object_and_the_fix_and_fit_an_event() {
    let found = gap(&our_crd("ippools"), Some(&upstream_crd("ippools")));
    let text = crd_message(&found.crd, found.version.as_deref(), &found.missing);
    assert!(text.len() <= 1024, "{} bytes: {text}", text.len());
    for part in [
        "ippools.whereabouts.cni.cncf.io",
        "spec.allocations.*.poduid",
        "kubectl apply -f crds/",
        "kubectl apply -k config/crd",
        "kubectl apply -f charts/whereabouts/crds/",
    ] {
        assert!(text.contains(part), "{part}: {text}");
    }
    for known in &KNOWN {
        let text = upstream_message(known.kind, NAMESPACE, known.name, "container w runs /x");
        assert!(text.len() <= 1024, "{} bytes: {text}", text.len());
        let remove = format!(
            "kubectl -n kube-system delete {} {}",
            known.kind, known.name
        );
        assert!(text.contains(&remove), "{text}");
        assert!(text.contains("Migration from upstream"), "{text}");
    }
    assert_eq!(Kind::CronJob.to_string(), "cronjob");
}

#[test]
fn an_observation_gives_one_finding_per_danger() {
    let found = gap(&our_crd("ippools"), Some(&upstream_crd("ippools")));
    let fine = gap(&our_crd("nodeslicepools"), Some(&our_crd("nodeslicepools")));
    let seen = Observation {
        crds: vec![(found, None), (fine, None)],
        checked: KNOWN.iter().collect(),
        running: vec![Sighting {
            known: &KNOWN[0],
            evidence: "container whereabouts runs /ip-control-loop".into(),
            reference: Default::default(),
        }],
        unreadable: vec![],
    };
    let findings = seen.findings();
    let kinds: Vec<&str> = findings.iter().map(|f| f.kind()).collect();
    assert_eq!(kinds, ["crd-missing-fields", "upstream-component"]);
    assert!(findings.iter().all(|f| !f.repairable()));
    let text = findings[1].to_string();
    assert!(
        text.starts_with("upstream-component: daemonset kube-system/whereabouts is upstream"),
        "{text}"
    );
    // The JSON report round-trips (repair reads it).
    let json = serde_json::to_string(&findings).unwrap();
    let back: Vec<Finding> = serde_json::from_str(&json).unwrap();
    assert_eq!(back, findings);
}
