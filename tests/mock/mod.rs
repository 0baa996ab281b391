//! A scripted mock API server (tower-test) for the operator's mock-API tests: each scenario lists
//! exactly the requests the operator must make, in order, and what the API server answers.

use std::time::Duration;

use http::{Method, Request, Response, StatusCode};
use http_body_util::BodyExt;
use kube::client::Body;
use kube::runtime::reflector;
use kube::runtime::watcher::Event;
use serde_json::{Value, json};
use tokio::sync::watch;
use tower_test::mock;
use whereabouts::controller::{Caches, Context, Options};
use whereabouts::crd::{IPPool, OverlappingRangeIPReservation};

pub type Handle = mock::Handle<Request<Body>, Response<Body>>;

/// A context whose pool and reservation caches hold `pools` and `reservations`, leading, and
/// whose API server is the returned mock.
pub fn context_with(
    pools: Vec<IPPool>,
    reservations: Vec<OverlappingRangeIPReservation>,
    dry_run: bool,
) -> (Context, Handle) {
    let (service, handle) = mock::pair::<Request<Body>, Response<Body>>();
    let client = kube::Client::new(service, "default");
    let (pool_store, mut writer) = reflector::store::<IPPool>();
    for p in pools {
        writer.apply_watcher_event(&Event::Apply(p));
    }
    let (res_store, mut res_writer) = reflector::store::<OverlappingRangeIPReservation>();
    for r in reservations {
        res_writer.apply_watcher_event(&Event::Apply(r));
    }
    let caches = Caches {
        pods: reflector::store().0,
        nads: reflector::store().0,
        pools: pool_store,
        reservations: res_store,
        nodes: reflector::store().0,
        slice_pools: reflector::store().0,
        statefulsets: reflector::store().0,
        claims: reflector::store().0,
    };
    let opts = Options {
        pool_namespace: "kube-system".into(),
        audit_interval: Duration::from_secs(300),
        stale_grace: Duration::from_secs(60),
        orphan_claim_age: whereabouts::controller::audit::ORPHAN_CLAIM_AGE,
        deleted_pod_grace: Duration::from_secs(60),
        dry_run,
        leader_election: false,
        identity: "test".into(),
    };
    let (tx, rx) = watch::channel(true);
    std::mem::forget(tx);
    let metrics = std::sync::Arc::new(whereabouts::metrics::Metrics::new());
    (Context::new(client, opts, caches, rx, metrics), handle)
}

/// One expected request and the answer to give.
pub struct Call {
    pub method: Method,
    pub path: String,
    /// Checks the request body (JSON, or null when empty).
    pub body: fn(&Value),
    pub status: StatusCode,
    pub answer: Value,
}

pub fn any(_: &Value) {}

/// Serves `calls` in order, failing on any other request; then checks nothing else is asked.
pub async fn serve(mut handle: Handle, calls: Vec<Call>) {
    for call in calls {
        let (req, send) = tokio::time::timeout(Duration::from_secs(5), handle.next_request())
            .await
            .expect("a request in time")
            .expect("the client is alive");
        assert_eq!(
            (req.method(), req.uri().path()),
            (&call.method, call.path.as_str()),
            "unexpected request order"
        );
        let bytes = req.into_body().collect().await.unwrap().to_bytes();
        let body: Value = if bytes.is_empty() {
            Value::Null
        } else {
            serde_json::from_slice(&bytes).unwrap()
        };
        (call.body)(&body);
        send.send_response(
            Response::builder()
                .status(call.status)
                .body(Body::from(serde_json::to_vec(&call.answer).unwrap()))
                .unwrap(),
        );
    }
    let extra = tokio::time::timeout(Duration::from_millis(200), handle.next_request()).await;
    assert!(
        !matches!(extra, Ok(Some(_))),
        "a request nobody expected: {:?}",
        extra
            .ok()
            .flatten()
            .map(|(r, _)| format!("{} {}", r.method(), r.uri()))
    );
}

pub fn event_answer() -> Value {
    json!({"apiVersion": "events.k8s.io/v1", "kind": "Event", "metadata": {"name": "e", "namespace": "ns"}, "eventTime": "2026-01-01T00:00:00.000000Z"})
}
