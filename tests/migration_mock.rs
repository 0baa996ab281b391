//! The migration checks against a scripted mock API server: the exact reads (one GET per CRD and
//! per known upstream object, nothing listed), the Warning Events and the gauges.

mod mock;

use http::{Method, StatusCode};
use kube::CustomResourceExt;
use mock::{Call, any, context_with, event_answer, serve};
use serde_json::{Value, json};
use whereabouts::controller::migration::{self, upstream::KNOWN};
use whereabouts::crd::IPAMClaim;

const CRDS: &str = "/apis/apiextensions.k8s.io/v1/customresourcedefinitions";
const PLURALS: [&str; 3] = [
    "ippools",
    "overlappingrangeipreservations",
    "nodeslicepools",
];

fn repo_file(path: &str) -> String {
    std::fs::read_to_string(format!("{}/{path}", env!("CARGO_MANIFEST_DIR"))).unwrap()
}

/// The one object of `kind` in a manifest, as JSON (YAML 1.1 octal, as kubectl reads it).
fn manifest(path: &str, kind: &str) -> Value {
    let options = serde_saphyr::options! { legacy_octal_numbers: true };
    let docs: Vec<Value> =
        serde_saphyr::from_multiple_with_options(&repo_file(path), options).unwrap();
    let mut doc = docs.into_iter().find(|d| d["kind"] == kind).unwrap();
    doc["metadata"]["uid"] = json!(format!("uid-{kind}"));
    doc
}

fn upstream_crd(plural: &str) -> Value {
    manifest(
        &format!("tests/fixtures/upstream-v0.9.2/whereabouts.cni.cncf.io_{plural}.yaml"),
        "CustomResourceDefinition",
    )
}

fn get(path: String, answer: Value) -> Call {
    Call {
        method: Method::GET,
        path,
        body: any,
        status: StatusCode::OK,
        answer,
    }
}

fn not_found(path: String) -> Call {
    Call {
        method: Method::GET,
        path,
        body: any,
        status: StatusCode::NOT_FOUND,
        answer: json!({"apiVersion": "v1", "kind": "Status", "status": "Failure",
            "reason": "NotFound", "code": 404, "message": "not found"}),
    }
}

fn crd_get(plural: &str, answer: Value) -> Call {
    get(format!("{CRDS}/{plural}.whereabouts.cni.cncf.io"), answer)
}

const IPAMCLAIMS: &str = "ipamclaims.k8s.cni.cncf.io";

/// Our ipamclaims CRD, `status.ownerPod` declared a string (as some ipamclaims releases have it).
fn ipamclaims_with_owner_pod_a_string() -> Value {
    let mut crd = serde_json::to_value(IPAMClaim::crd()).unwrap();
    crd["metadata"]["uid"] = json!("uid-ipamclaims");
    let schema = &mut crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"];
    schema["properties"]["status"]["properties"]["ownerPod"] = json!({"type": "string"});
    crd
}

/// The path of KNOWN[i] in kube-system.
fn known_path(i: usize) -> String {
    let known = &KNOWN[i];
    let (group, resource) = match known.kind.resource() {
        "daemonset" => ("apps", "daemonsets"),
        "deployment" => ("apps", "deployments"),
        _ => ("batch", "cronjobs"),
    };
    format!(
        "/apis/{group}/v1/namespaces/kube-system/{resource}/{}",
        known.name
    )
}

fn event(namespace: &str, check: fn(&Value)) -> Call {
    Call {
        method: Method::POST,
        path: format!("/apis/events.k8s.io/v1/namespaces/{namespace}/events"),
        body: check,
        status: StatusCode::CREATED,
        answer: event_answer(),
    }
}

fn metric_lines(ctx: &whereabouts::controller::Context, family: &str) -> Vec<String> {
    ctx.metrics
        .render()
        .lines()
        .filter(|l| l.starts_with(family))
        .map(str::to_owned)
        .collect()
}

/// A cluster that ran upstream v0.9.2: its CRDs, its DaemonSet and its node-slice controller.
#[tokio::test]
async fn upstreams_crds_and_components_are_reported_with_events_and_gauges() {
    let (ctx, handle) = context_with(vec![], vec![], false);
    let ds = manifest(
        "tests/fixtures/upstream-v0.9.2/daemonset-install.yaml",
        "DaemonSet",
    );
    let controller = manifest(
        "tests/fixtures/upstream-v0.9.2/node-slice-controller.yaml",
        "Deployment",
    );
    let mut calls: Vec<Call> = PLURALS
        .iter()
        .map(|p| crd_get(p, upstream_crd(p)))
        .collect();
    calls.extend([
        get(
            format!("{CRDS}/{IPAMCLAIMS}"),
            ipamclaims_with_owner_pod_a_string(),
        ),
        get(known_path(0), ds),
        not_found(known_path(1)),
        get(known_path(2), controller),
        not_found(known_path(3)),
        not_found(known_path(4)),
        // A cluster-scoped object's Events go to `default`.
        event("default", |b| {
            assert_eq!(b["type"], "Warning");
            assert_eq!(b["reason"], "CrdMissingFields");
            assert_eq!(b["regarding"]["kind"], "CustomResourceDefinition");
            assert_eq!(b["regarding"]["name"], "ippools.whereabouts.cni.cncf.io");
            let note = b["note"].as_str().unwrap();
            assert!(note.contains("spec.allocations.*.poduid"), "{note}");
            assert!(note.contains("kubectl apply -f crds/"), "{note}");
        }),
        event("default", |b| {
            let name = "overlappingrangeipreservations.whereabouts.cni.cncf.io";
            assert_eq!(b["regarding"]["name"], name);
        }),
        event("default", |b| {
            assert_eq!(b["reason"], "CrdMissingFields");
            assert_eq!(b["regarding"]["name"], IPAMCLAIMS);
            let note = b["note"].as_str().unwrap();
            assert!(
                note.contains("lacks 1 field(s) whereabouts writes: status.ownerPod.name"),
                "{note}"
            );
            assert!(note.contains("a VM's addresses are not kept"), "{note}");
        }),
        event("kube-system", |b| {
            assert_eq!(b["type"], "Warning");
            assert_eq!(b["reason"], "UpstreamComponentRunning");
            assert_eq!(b["regarding"]["kind"], "DaemonSet");
            assert_eq!(b["regarding"]["uid"], "uid-DaemonSet");
            let note = b["note"].as_str().unwrap();
            assert!(note.contains("runs /ip-control-loop"), "{note}");
            assert!(
                note.contains("kubectl -n kube-system delete daemonset whereabouts "),
                "{note}"
            );
        }),
        event("kube-system", |b| {
            assert_eq!(b["regarding"]["name"], "whereabouts-controller");
        }),
    ]);
    let server = tokio::spawn(serve(handle, calls));
    let seen = migration::check_once(&ctx).await;
    server.await.unwrap();

    assert_eq!(
        metric_lines(&ctx, "whereabouts_crd_fields_missing{"),
        [
            r#"whereabouts_crd_fields_missing{crd="ipamclaims.k8s.cni.cncf.io"} 1"#,
            r#"whereabouts_crd_fields_missing{crd="ippools.whereabouts.cni.cncf.io"} 6"#,
            r#"whereabouts_crd_fields_missing{crd="nodeslicepools.whereabouts.cni.cncf.io"} 0"#,
            r#"whereabouts_crd_fields_missing{crd="overlappingrangeipreservations.whereabouts.cni.cncf.io"} 4"#,
        ]
    );
    let components = metric_lines(&ctx, "whereabouts_upstream_components{");
    assert_eq!(components.len(), KNOWN.len(), "{components:#?}");
    let running: Vec<&String> = components.iter().filter(|l| l.ends_with(" 1")).collect();
    assert_eq!(
        running,
        [
            r#"whereabouts_upstream_components{kind="daemonset",name="whereabouts",namespace="kube-system"} 1"#,
            r#"whereabouts_upstream_components{kind="deployment",name="whereabouts-controller",namespace="kube-system"} 1"#,
        ]
    );
    let kinds: Vec<&str> = seen.findings().iter().map(|f| f.kind()).collect();
    assert_eq!(
        kinds,
        [
            "crd-missing-fields",
            "crd-missing-fields",
            "crd-missing-fields",
            "upstream-component",
            "upstream-component"
        ]
    );
}

/// Our own CRDs and our own DaemonSet (even named as upstream's) are no danger; a read the
/// operator may not make is skipped, and the rest still checked.
#[tokio::test]
async fn ours_is_quiet_and_a_forbidden_read_is_skipped() {
    let (ctx, handle) = context_with(vec![], vec![], false);
    let mut ours = manifest("config/cni/daemonset.yaml", "DaemonSet");
    ours["metadata"]["name"] = json!("whereabouts");
    ours["metadata"]["namespace"] = json!("kube-system");
    let mut calls: Vec<Call> = whereabouts::crd::all()
        .into_iter()
        .take(PLURALS.len())
        .zip(PLURALS)
        .map(|((_, crd), plural)| crd_get(plural, serde_json::to_value(crd).unwrap()))
        .collect();
    let claims = serde_json::to_value(IPAMClaim::crd()).unwrap();
    calls.extend([
        get(format!("{CRDS}/{IPAMCLAIMS}"), claims),
        get(known_path(0), ours),
        not_found(known_path(1)),
        Call {
            method: Method::GET,
            path: known_path(2),
            body: any,
            status: StatusCode::FORBIDDEN,
            answer: json!({"apiVersion": "v1", "kind": "Status", "status": "Failure",
                "reason": "Forbidden", "code": 403, "message": "deployments.apps \"whereabouts-controller\" is forbidden"}),
        },
        not_found(known_path(3)),
        not_found(known_path(4)),
    ]);
    let server = tokio::spawn(serve(handle, calls));
    let seen = migration::check_once(&ctx).await;
    server.await.unwrap();

    assert!(seen.findings().is_empty(), "{:?}", seen.findings());
    assert_eq!(seen.unreadable.len(), 1);
    let why = seen.unreadable[0].to_string();
    assert!(
        why.starts_with("cannot check deployment kube-system/whereabouts-controller: ")
            && why.contains("config/rbac/operator.yaml"),
        "{why}"
    );
    assert!(
        metric_lines(&ctx, "whereabouts_crd_fields_missing{")
            .iter()
            .all(|l| l.ends_with(" 0"))
    );
    let components = metric_lines(&ctx, "whereabouts_upstream_components{");
    assert_eq!(components.len(), KNOWN.len() - 1, "{components:#?}");
    assert!(components.iter().all(|l| l.ends_with(" 0")));
}

/// `--dry-run` writes nothing, Events included; the log and the gauges still say it.
#[tokio::test]
async fn a_dry_run_reports_without_events() {
    let (ctx, handle) = context_with(vec![], vec![], true);
    let mut calls: Vec<Call> = PLURALS
        .iter()
        .map(|p| crd_get(p, upstream_crd(p)))
        .collect();
    // No ipamclaims CRD: nothing to report about it.
    calls.push(not_found(format!("{CRDS}/{IPAMCLAIMS}")));
    calls.push(get(
        known_path(0),
        manifest(
            "tests/fixtures/upstream-v0.9.2/daemonset-install.yaml",
            "DaemonSet",
        ),
    ));
    calls.extend((1..KNOWN.len()).map(|i| not_found(known_path(i))));
    let server = tokio::spawn(serve(handle, calls));
    let seen = migration::check_once(&ctx).await;
    server.await.unwrap();
    assert_eq!(seen.findings().len(), 3);
    assert!(
        ctx.metrics
            .render()
            .contains(r#"kind="daemonset",name="whereabouts",namespace="kube-system"} 1"#)
    );
}
