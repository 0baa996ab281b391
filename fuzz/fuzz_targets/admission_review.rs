//! An AdmissionReview body through the webhook's router (`POST /validate`), as the API server
//! sends it.
//!
//! Input: the body alone (raw path), or `spec.config 0x1E operation` wrapped into a well-formed
//! review of a NAD (operation defaults to CREATE), so that mutations reach the validator.
//! Asserts: the router never panics and answers every body with 200 (a verdict) or 400 (413 over
//! the size limit), never a 5xx; a 200 is an AdmissionReview whose response carries the request's uid; a denial has a
//! message; `admission::review` and the router say the same; a wrapped CREATE is allowed exactly
//! when the validator accepts the config (or it is not whereabouts).
#![no_main]

use std::sync::{Arc, OnceLock};

use axum::body::Body;
use axum::http::{Request, StatusCode};
use http_body_util::BodyExt;
use libfuzzer_sys::fuzz_target;
use serde_json::{Value, json};
use tower::ServiceExt;
use whereabouts::crd::{NetworkAttachmentDefinition, NetworkAttachmentDefinitionSpec};
use whereabouts::nad_check::check_spec_config;
use whereabouts::webhook::{self, NadSource, WebhookState, admission};
use whereabouts_fuzz::parts;

/// A cluster with two NADs in network `blue`, so that overlap warnings are reached.
fn state() -> &'static WebhookState {
    static STATE: OnceLock<WebhookState> = OnceLock::new();
    STATE.get_or_init(|| {
        let nad = |name: &str, ipam: Value| {
            let mut n = NetworkAttachmentDefinition::new(
                name,
                NetworkAttachmentDefinitionSpec {
                    config: json!({"cniVersion": "0.3.1", "type": "macvlan", "ipam": ipam})
                        .to_string(),
                },
            );
            n.metadata.namespace = Some("team-b".to_owned());
            n.metadata.resource_version = Some("1".to_owned());
            Arc::new(n)
        };
        let source: Arc<dyn NadSource> = Arc::new(vec![
            nad(
                "blue",
                json!({"type": "whereabouts", "range": "10.0.0.0/24", "network_name": "blue"}),
            ),
            nad(
                "plain",
                json!({"type": "whereabouts", "range": "10.0.0.128/25"}),
            ),
        ]);
        WebhookState::new(source, Arc::default())
    })
}

fn runtime() -> &'static tokio::runtime::Runtime {
    static RT: OnceLock<tokio::runtime::Runtime> = OnceLock::new();
    RT.get_or_init(|| {
        tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .expect("runtime")
    })
}

fn post(body: Vec<u8>) -> (StatusCode, Vec<u8>) {
    runtime().block_on(async {
        let req = Request::post("/validate")
            .header("content-type", "application/json")
            .body(Body::from(body))
            .expect("request");
        let resp = webhook::router(state().clone())
            .oneshot(req)
            .await
            .expect("infallible");
        let status = resp.status();
        let bytes = resp.into_body().collect().await.expect("body").to_bytes();
        (status, bytes.to_vec())
    })
}

/// A review as the API server sends it: `resource` and `userInfo` are always there (kube's
/// AdmissionRequest, which the webhook reads a CREATE or UPDATE into, requires them).
fn wrapped(config: &str, operation: &str) -> Vec<u8> {
    json!({"apiVersion": "admission.k8s.io/v1", "kind": "AdmissionReview", "request": {
        "uid": "u-1", "name": "mine", "namespace": "team-a", "operation": operation,
        "kind": {"group": "k8s.cni.cncf.io", "version": "v1", "kind": "NetworkAttachmentDefinition"},
        "resource": {"group": "k8s.cni.cncf.io", "version": "v1", "resource": "network-attachment-definitions"},
        "userInfo": {"username": "fuzz"},
        "object": {"apiVersion": "k8s.cni.cncf.io/v1", "kind": "NetworkAttachmentDefinition",
                   "metadata": {"name": "mine", "namespace": "team-a"}, "spec": {"config": config}}}})
    .to_string()
    .into_bytes()
}

fuzz_target!(|data: &[u8]| {
    let p = parts(data, 2);
    if p.len() == 1 {
        answer(data.to_vec());
        return;
    }
    let (Ok(config), Ok(operation)) = (std::str::from_utf8(p[0]), std::str::from_utf8(p[1])) else {
        return;
    };
    let operation = if operation.is_empty() {
        "CREATE"
    } else {
        operation
    };
    let verdict = answer(wrapped(config, operation)).expect("a well-formed review gets a verdict");
    if matches!(operation, "CREATE" | "UPDATE") {
        let check = check_spec_config(config);
        let allowed = verdict["response"]["allowed"] == json!(true);
        assert_eq!(allowed, !check.whereabouts || check.is_valid(), "{config}");
    } else {
        assert_eq!(
            verdict["response"]["allowed"],
            json!(true),
            "{operation} refused"
        );
    }
});

/// Posts `body`; returns the AdmissionReview answered, `None` for a 400.
fn answer(body: Vec<u8>) -> Option<Value> {
    let direct = admission::review(&body, &state().nads);
    let request_uid = serde_json::from_slice::<Value>(&body).ok().and_then(|v| {
        v.pointer("/request/uid")
            .and_then(Value::as_str)
            .map(str::to_owned)
    });
    let len = body.len();
    let (status, reply) = post(body);
    match status {
        StatusCode::OK => {
            let expected = serde_json::to_value(
                direct.expect("200 where review() refuses").into_review(),
            )
            .expect("a review serialises");
            let got: Value = serde_json::from_slice(&reply).expect("a JSON verdict");
            assert_eq!(got, expected, "the router and review() differ");
            assert_eq!(got["kind"], "AdmissionReview");
            assert_eq!(got["apiVersion"], admission::API_VERSION);
            let response = &got["response"];
            assert_eq!(response["uid"].as_str(), request_uid.as_deref());
            let allowed = response["allowed"].as_bool().expect("allowed is a bool");
            if !allowed {
                let msg = response["status"]["message"].as_str().unwrap_or_default();
                assert!(!msg.trim().is_empty(), "a denial without a message");
            }
            Some(got)
        }
        StatusCode::BAD_REQUEST => {
            match direct {
                Err(e) => assert_eq!(String::from_utf8_lossy(&reply).trim_end(), e.to_string()),
                // axum refuses a body over the limit before review() sees it.
                Ok(_) => assert!(len > webhook::BODY_LIMIT, "400 for a review with a verdict"),
            }
            None
        }
        StatusCode::PAYLOAD_TOO_LARGE => {
            assert!(len > webhook::BODY_LIMIT, "413 for {len} bytes");
            None
        }
        other => panic!("status {other} for a request body"),
    }
}
