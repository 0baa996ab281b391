//! The validating admission webhook for NetworkAttachmentDefinitions.
//!
//! [`router`] is an axum `Router` (tests drive it with `tower::ServiceExt::oneshot`); [`admission`]
//! turns an AdmissionReview into a verdict with the shared validator; [`index`] answers "which
//! other NADs overlap this one" from the operator's watch cache; [`tls`] serves the router over
//! rustls (ring) and swaps the certificate when its files change; [`limits`] bounds what a slow,
//! greedy or hostile client can cost.

pub mod admission;
pub mod certs;
pub mod index;
pub mod limits;
pub mod tls;

use std::sync::Arc;
use std::time::Duration;

use axum::Router;
use axum::body::Bytes;
use axum::extract::{DefaultBodyLimit, State};
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::routing::post;
use tower_http::limit::RequestBodyLimitLayer;
use tower_http::timeout::TimeoutLayer;

pub use index::{NadIndex, NadSource, WatchedNads};
pub use limits::Limits;

use crate::metrics::Metrics;

/// Largest AdmissionReview accepted. The API server caps objects at about 1.5 MiB, but a NAD is a
/// few hundred bytes; a megabyte leaves room for big conflists and none for abuse.
pub const BODY_LIMIT: usize = 1024 * 1024;
/// The API server gives up after `timeoutSeconds` (5 s in our configuration); never hold a request
/// longer than twice that.
pub const REQUEST_TIMEOUT: Duration = Duration::from_secs(10);

/// What the handlers share: the index of the other NADs for the cross-NAD overlap warning, and
/// the operator's metrics the answers are counted in.
#[derive(Clone)]
pub struct WebhookState {
    pub nads: Arc<NadIndex>,
    pub metrics: Arc<Metrics>,
}

impl WebhookState {
    pub fn new(source: Arc<dyn NadSource>, metrics: Arc<Metrics>) -> Self {
        WebhookState {
            nads: Arc::new(NadIndex::new(source)),
            metrics,
        }
    }
}

/// `POST /validate` with the production [`Limits`].
pub fn router(state: WebhookState) -> Router {
    router_with(state, &Limits::default())
}

/// `POST /validate`, with the body size, the requests in flight and the time bounded.
///
/// Outermost first: the deadline (which also ends a body that trickles in), then the body size
/// (a Content-Length above the limit is answered 413 before a byte of the body is read; a body
/// without one is cut at the limit), then a slot among `max_requests` (so only that many bodies
/// are buffered at once).
pub fn router_with(state: WebhookState, limits: &Limits) -> Router {
    Router::new()
        .route("/validate", post(validate))
        .layer(axum::middleware::from_fn_with_state(
            limits::RequestGate::new(limits, state.metrics.clone()),
            limits::admit,
        ))
        .layer(DefaultBodyLimit::max(limits.body_limit))
        .layer(RequestBodyLimitLayer::new(limits.body_limit))
        .layer(TimeoutLayer::with_status_code(
            StatusCode::REQUEST_TIMEOUT,
            limits.request_timeout,
        ))
        .with_state(state)
}

async fn validate(State(state): State<WebhookState>, body: Bytes) -> Response {
    let started = std::time::Instant::now();
    match admission::review(&body, &state.nads) {
        Ok(answer) => {
            let result = if answer.allowed() {
                "allowed"
            } else {
                "denied"
            };
            state
                .metrics
                .record_webhook(&answer.operation, result, started.elapsed());
            axum::Json(answer.into_review()).into_response()
        }
        Err(e) => {
            tracing::debug!(error = %e, "malformed admission request");
            state
                .metrics
                .record_webhook("unknown", "error", started.elapsed());
            (StatusCode::BAD_REQUEST, format!("{e}\n")).into_response()
        }
    }
}
