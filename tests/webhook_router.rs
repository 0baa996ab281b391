//! The webhook router, driven with `oneshot` and the AdmissionReview fixtures in
//! tests/fixtures/admission/: one per validation rule, per warning and per malformed request.

use std::path::PathBuf;
use std::sync::Arc;

use axum::body::Body;
use axum::http::{Request, StatusCode};
use http_body_util::BodyExt;
use serde_json::Value;
use tower::ServiceExt;
use whereabouts::crd::{NetworkAttachmentDefinition, NetworkAttachmentDefinitionSpec};
use whereabouts::webhook::{self, NadSource, WebhookState};

fn fixture(name: &str) -> Vec<u8> {
    let path = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("tests/fixtures/admission")
        .join(format!("{name}.json"));
    std::fs::read(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
}

fn nad(ns: &str, name: &str, rv: &str, ipam: Value) -> Arc<NetworkAttachmentDefinition> {
    let mut n = NetworkAttachmentDefinition::new(
        name,
        NetworkAttachmentDefinitionSpec {
            config: serde_json::json!({"cniVersion": "0.3.1", "type": "macvlan", "ipam": ipam})
                .to_string(),
        },
    );
    n.metadata.namespace = Some(ns.to_owned());
    n.metadata.resource_version = Some(rv.to_owned());
    Arc::new(n)
}

/// The cluster as the watch cache sees it: one NAD overlapping `warn-cross-nad` in network
/// `blue`, one with the same range in another network, and the old version of that NAD itself.
fn cluster() -> Arc<dyn NadSource> {
    Arc::new(vec![
        nad(
            "team-b",
            "blue-b",
            "7",
            serde_json::json!({"type": "whereabouts", "range": "10.50.0.128/25", "network_name": "blue"}),
        ),
        nad(
            "team-b",
            "red-b",
            "8",
            serde_json::json!({"type": "whereabouts", "range": "10.50.0.0/24", "network_name": "red"}),
        ),
        nad(
            "team-a",
            "warn-cross-nad",
            "9",
            serde_json::json!({"type": "whereabouts", "range": "10.50.0.0/24", "network_name": "blue"}),
        ),
        nad(
            "team-c",
            "host",
            "10",
            serde_json::json!({"type": "host-local", "subnet": "10.50.0.0/24"}),
        ),
    ])
}

async fn post(body: Vec<u8>) -> (StatusCode, Vec<u8>) {
    let app = webhook::router(WebhookState::new(cluster(), Arc::default()));
    let req = Request::post("/validate")
        .header("content-type", "application/json")
        .body(Body::from(body))
        .unwrap();
    let resp = app.oneshot(req).await.unwrap();
    let status = resp.status();
    (
        status,
        resp.into_body()
            .collect()
            .await
            .unwrap()
            .to_bytes()
            .to_vec(),
    )
}

/// Posts a fixture and returns (allowed, denial message, warnings), checking the echoed uid.
async fn verdict(name: &str) -> (bool, String, Vec<String>) {
    let body = fixture(name);
    let uid = serde_json::from_slice::<Value>(&body).unwrap()["request"]["uid"].clone();
    let (status, out) = post(body).await;
    assert_eq!(
        status,
        StatusCode::OK,
        "{name}: {}",
        String::from_utf8_lossy(&out)
    );
    let review: Value = serde_json::from_slice(&out).unwrap();
    assert_eq!(review["apiVersion"], "admission.k8s.io/v1");
    assert_eq!(review["kind"], "AdmissionReview");
    let resp = &review["response"];
    assert_eq!(resp["uid"], uid, "{name}: uid must be echoed");
    let warnings = resp["warnings"]
        .as_array()
        .map(|w| w.iter().map(|s| s.as_str().unwrap().to_owned()).collect())
        .unwrap_or_default();
    let message = resp["status"]["message"]
        .as_str()
        .unwrap_or_default()
        .to_owned();
    (resp["allowed"].as_bool().unwrap(), message, warnings)
}

async fn allowed_clean(name: &str) {
    let (allowed, msg, warnings) = verdict(name).await;
    assert!(allowed, "{name}: {msg}");
    assert!(warnings.is_empty(), "{name}: {warnings:?}");
}

async fn denied(name: &str, expected: &[&str]) -> String {
    let (allowed, msg, _) = verdict(name).await;
    assert!(!allowed, "{name} should be denied");
    for e in expected {
        assert!(msg.contains(e), "{name}: {msg:?} should contain {e:?}");
    }
    msg
}

async fn warned(name: &str, expected: &str) {
    let (allowed, msg, warnings) = verdict(name).await;
    assert!(allowed, "{name}: {msg}");
    assert!(
        warnings.iter().any(|w| w.contains(expected)),
        "{name}: {warnings:?} should contain {expected:?}"
    );
}

#[tokio::test]
async fn valid_nads_are_allowed_without_warnings() {
    allowed_clean("valid-single").await;
    allowed_clean("valid-conflist").await;
    allowed_clean("valid-update").await;
}

#[tokio::test]
async fn other_ipams_empty_configs_and_deletes_are_untouched() {
    allowed_clean("host-local").await;
    allowed_clean("no-config").await;
    allowed_clean("delete").await;
}

#[tokio::test]
async fn each_rule_denies_with_path_and_value() {
    denied("invalid-json", &["spec.config is not valid JSON"]).await;
    denied(
        "invalid-cidr",
        &[r#"spec.config: ipam.range "abc.169.1.0/24" is not a CIDR"#],
    )
    .await;
    denied(
        "invalid-no-usable",
        &[r#"spec.config: ipam.range "10.0.0.7/32" has no usable address"#],
    )
    .await;
    denied(
        "invalid-start-unparsable",
        &[r#"spec.config: ipam.range_start "10.0.0.x" is not an IP address"#],
    )
    .await;
    denied(
        "invalid-start-outside",
        &[r#"spec.config: ipam.ipRanges[1].range_start "10.0.1.5" is outside range 10.0.3.0/24"#],
    )
    .await;
    denied(
        "invalid-inverted",
        &[r#"spec.config: ipam.range_start "10.0.0.200" is after range_end 10.0.0.100"#],
    )
    .await;
    denied(
        "invalid-exclude-unparsable",
        &[r#"spec.config: ipam.exclude[0] "10.0.0.300/32" is not a CIDR or IP address"#],
    )
    .await;
    denied(
        "invalid-exclude-all",
        &[r#"spec.config: ipam.exclude "10.0.0.0/24" leaves no usable address"#],
    )
    .await;
    denied(
        "invalid-overlap",
        &[r#"spec.config: ipam.ipRanges[1] "10.0.5.0/24" overlaps ipam.ipRanges[0]"#],
    )
    .await;
    denied(
        "invalid-gateway",
        &[r#"spec.config: ipam.gateway "10.0.0.256" is not an IP address"#],
    )
    .await;
    denied(
        "invalid-network-name",
        &[r#"spec.config: ipam.network_name "Blue_Net" is not usable in object names"#],
    )
    .await;
    denied(
        "invalid-node-slice",
        &[r#"spec.config: ipam.node_slice_size "/16" does not fit range 10.0.0.0/24"#],
    )
    .await;
    denied(
        "invalid-conflist",
        &[r#"spec.config: plugins[1].ipam.range_start "10.0.1.5" is outside range 10.0.0.0/24"#],
    )
    .await;
    denied(
        "invalid-update",
        &[r#"spec.config: ipam.range_end "10.0.0.300" is not an IP address"#],
    )
    .await;
}

#[tokio::test]
async fn a_denial_lists_every_problem() {
    let msg = denied(
        "invalid-many",
        &[
            r#"ipam.range "abc.169.1.0/24" is not a CIDR"#,
            r#"ipam.gateway "nope" is not an IP address"#,
            r#"ipam.ipRanges[0].range_end "10.0.9.1" is outside range 10.0.0.0/24"#,
        ],
    )
    .await;
    assert_eq!(msg.matches("spec.config: ").count(), 3, "{msg}");
}

#[tokio::test]
async fn risky_configs_are_allowed_with_warnings() {
    warned(
        "warn-gateway-outside",
        r#"spec.config: ipam.gateway "192.168.0.1" is outside every range"#,
    )
    .await;
    warned(
        "warn-gateway-allocatable",
        r#"spec.config: ipam.gateway "10.0.0.1" is inside the allocatable window"#,
    )
    .await;
    warned(
        "warn-exclude-untouched",
        r#"spec.config: ipam.exclude "10.9.0.0/24" does not touch the window"#,
    )
    .await;
    warned(
        "warn-unknown-key",
        "spec.config: ipam.rnage_end is not a whereabouts setting",
    )
    .await;
}

#[tokio::test]
async fn overlap_with_another_nad_of_the_network_is_a_warning() {
    let (allowed, _, warnings) = verdict("warn-cross-nad").await;
    assert!(allowed);
    assert_eq!(
        warnings.len(),
        1,
        "only team-b/blue-b shares network blue: {warnings:?}"
    );
    assert!(warnings[0].starts_with(r#"spec.config: ipam.range "10.50.0.0/24" overlaps range 10.50.0.128/25 of NetworkAttachmentDefinition team-b/blue-b in network_name "blue""#), "{}", warnings[0]);
}

async fn rejected(body: Vec<u8>, status: StatusCode, expected: &str) {
    let (got, out) = post(body).await;
    let text = String::from_utf8_lossy(&out);
    assert_eq!(got, status, "{text}");
    assert!(
        text.contains(expected),
        "{text:?} should contain {expected:?}"
    );
}

#[tokio::test]
async fn malformed_requests_get_a_4xx_with_a_message() {
    let bad = StatusCode::BAD_REQUEST;
    rejected(
        fixture("malformed-not-json"),
        bad,
        "request body is not an AdmissionReview in JSON",
    )
    .await;
    rejected(
        Vec::new(),
        bad,
        "request body is not an AdmissionReview in JSON",
    )
    .await;
    rejected(fixture("malformed-wrong-kind"), bad, "expects kind AdmissionReview of apiVersion admission.k8s.io/v1, got kind \"AdmissionRequest\"").await;
    rejected(
        fixture("malformed-wrong-version"),
        bad,
        "got kind \"AdmissionReview\" of apiVersion \"admission.k8s.io/v1beta1\"",
    )
    .await;
    rejected(
        fixture("malformed-pod"),
        bad,
        "expects NetworkAttachmentDefinition (k8s.cni.cncf.io/v1), got Pod (core/v1)",
    )
    .await;
    rejected(
        fixture("malformed-no-request"),
        bad,
        "AdmissionReview has no request",
    )
    .await;
    rejected(
        fixture("malformed-no-uid"),
        bad,
        "AdmissionReview request has no uid",
    )
    .await;
    rejected(fixture("malformed-no-object"), bad, "has no object").await;
    // Invalid UTF-8 in a field the webhook does not read: still not JSON (fuzz/admission_review).
    let mut body = fixture("valid-single");
    let at = body.windows(8).position(|w| w == b"username").unwrap();
    body[at + 4] = 0xff;
    rejected(
        body,
        bad,
        "request body is not an AdmissionReview in JSON: not UTF-8: invalid utf-8 sequence",
    )
    .await;
}

#[tokio::test]
async fn huge_bodies_are_refused() {
    let mut body = fixture("valid-single");
    body.resize(webhook::BODY_LIMIT + 1, b' ');
    rejected(body, StatusCode::PAYLOAD_TOO_LARGE, "length limit exceeded").await;
}

#[tokio::test]
async fn only_post_validate_is_served() {
    let app = webhook::router(WebhookState::new(cluster(), Arc::default()));
    let get = app
        .clone()
        .oneshot(Request::get("/validate").body(Body::empty()).unwrap())
        .await
        .unwrap();
    assert_eq!(get.status(), StatusCode::METHOD_NOT_ALLOWED);
    let other = app
        .oneshot(Request::post("/mutate").body(Body::empty()).unwrap())
        .await
        .unwrap();
    assert_eq!(other.status(), StatusCode::NOT_FOUND);
}

#[tokio::test]
async fn readyz_names_each_failing_check() {
    use std::sync::atomic::{AtomicBool, Ordering};
    use whereabouts::admin::{AdminState, router};
    let cert = Arc::new(AtomicBool::new(false));
    let c = cert.clone();
    let state = AdminState::new(String::new)
        .check("webhook-certificate", move || {
            if c.load(Ordering::SeqCst) {
                Ok(())
            } else {
                Err("not loaded".into())
            }
        })
        .check("nad-cache", || Err("not synced".into()));
    let get = |path: &str| Request::get(path).body(Body::empty()).unwrap();
    let resp = router(state.clone()).oneshot(get("/readyz")).await.unwrap();
    assert_eq!(resp.status(), StatusCode::SERVICE_UNAVAILABLE);
    let text = resp.into_body().collect().await.unwrap().to_bytes();
    assert_eq!(
        &text[..],
        b"webhook-certificate: not loaded\nnad-cache: not synced\n"
    );
    cert.store(true, Ordering::SeqCst);
    let ok = AdminState::new(String::new).check("webhook-certificate", move || Ok(()));
    assert_eq!(
        router(ok).oneshot(get("/readyz")).await.unwrap().status(),
        StatusCode::OK
    );
    assert_eq!(
        router(state).oneshot(get("/livez")).await.unwrap().status(),
        StatusCode::OK
    );
}

/// One NAD per namespace, all on one range (the common multi-tenant pattern): the admission gets
/// one warning for its range, with a count and three names, however many NADs share it.
#[tokio::test]
async fn thousands_of_overlapping_nads_give_one_bounded_warning() {
    let many: Vec<Arc<NetworkAttachmentDefinition>> = (0..2000)
        .map(|i| {
            nad(
                &format!("tenant-{i}"),
                "blue-net",
                "1",
                serde_json::json!({"type": "whereabouts", "range": "10.50.0.0/24", "network_name": "blue"}),
            )
        })
        .collect();
    let app = webhook::router(WebhookState::new(Arc::new(many), Arc::default()));
    let req = Request::post("/validate")
        .header("content-type", "application/json")
        .body(Body::from(fixture("warn-cross-nad")))
        .unwrap();
    let out = app
        .oneshot(req)
        .await
        .unwrap()
        .into_body()
        .collect()
        .await
        .unwrap()
        .to_bytes();
    let review: Value = serde_json::from_slice(&out).unwrap();
    let warnings = review["response"]["warnings"].as_array().unwrap();
    assert_eq!(warnings.len(), 1, "{warnings:?}");
    let w = warnings[0].as_str().unwrap();
    assert!(
        w.contains(r#"overlaps 2000 ranges of other NetworkAttachmentDefinitions in network_name "blue": tenant-"#)
            && w.ends_with("and 1997 more; they share addresses through reservations"),
        "{w}"
    );
    assert!(w.len() < 400, "{}", w.len());
}

/// An UPDATE of `valid-update` from `old` to `new` ipam objects: (allowed, message, warnings).
async fn update(old: Value, new: Value) -> (bool, String, Vec<String>) {
    let mut review: Value = serde_json::from_slice(&fixture("valid-update")).unwrap();
    let conf = |ipam: Value| {
        serde_json::json!({"cniVersion": "0.3.1", "name": "net", "type": "macvlan", "ipam": ipam})
            .to_string()
    };
    review["request"]["object"]["spec"]["config"] = conf(new).into();
    review["request"]["oldObject"]["spec"]["config"] = conf(old).into();
    let (status, out) = post(serde_json::to_vec(&review).unwrap()).await;
    assert_eq!(status, StatusCode::OK);
    let r: Value = serde_json::from_slice(&out).unwrap();
    let warnings = r["response"]["warnings"]
        .as_array()
        .map(|w| w.iter().map(|s| s.as_str().unwrap().to_owned()).collect())
        .unwrap_or_default();
    (
        r["response"]["allowed"].as_bool().unwrap(),
        r["response"]["status"]["message"]
            .as_str()
            .unwrap_or_default()
            .to_owned(),
        warnings,
    )
}

#[tokio::test]
async fn node_slice_changes_on_update_are_explained_or_refused() {
    let sliced = |size: &str| serde_json::json!({"type": "whereabouts", "range": "10.2.0.0/22", "node_slice_size": size});
    let (allowed, _, w) = update(sliced("/26"), sliced("/25")).await;
    assert!(allowed);
    assert!(
        w.iter().any(|w| w.contains("changes nodeslicepool net from range 10.2.0.0/22 in /26 slices to range 10.2.0.0/22 in /25 slices")),
        "{w:?}"
    );
    let plain = serde_json::json!({"type": "whereabouts", "range": "10.2.0.0/22"});
    let (allowed, _, w) = update(plain.clone(), sliced("/26")).await;
    assert!(allowed);
    assert!(
        w.iter()
            .any(|w| w.contains("switches range 10.2.0.0/22 to node slices")
                && w.contains("reservations keep")),
        "{w:?}"
    );
    let unguarded = serde_json::json!({"type": "whereabouts", "range": "10.2.0.0/22", "enable_overlapping_ranges": false});
    let (allowed, msg, _) = update(sliced("/26"), unguarded).await;
    assert!(!allowed);
    assert!(
        msg.contains("switches range 10.2.0.0/22 from node slices")
            && msg.contains("enable_overlapping_ranges false"),
        "{msg}"
    );
    let (allowed, _, w) = update(sliced("/26"), sliced("/26")).await;
    assert!(allowed && w.is_empty(), "{w:?}");
}
