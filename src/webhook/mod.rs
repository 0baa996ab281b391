//! The validating admission webhook for NetworkAttachmentDefinitions.
//!
//! [`router`] is an axum `Router` (tests drive it with `tower::ServiceExt::oneshot`); [`admission`]
//! turns an AdmissionReview into a verdict with the shared validator; [`index`] answers "which
//! other NADs overlap this one" from the operator's watch cache; [`tls`] serves the router over
//! rustls (ring) and swaps the certificate when its files change.

pub mod admission;
pub mod index;
pub mod tls;

use std::sync::Arc;
use std::time::Duration;

use axum::Router;
use axum::body::Bytes;
use axum::extract::{DefaultBodyLimit, State};
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::routing::post;
use tower_http::timeout::TimeoutLayer;

pub use index::{NadIndex, NadSource, WatchedNads};

/// Largest AdmissionReview accepted. The API server caps objects at about 1.5 MiB, but a NAD is a
/// few hundred bytes; a megabyte leaves room for big conflists and none for abuse.
pub const BODY_LIMIT: usize = 1024 * 1024;
/// The API server gives up after `timeoutSeconds` (5 s in our configuration); never hold a request
/// longer than twice that.
pub const REQUEST_TIMEOUT: Duration = Duration::from_secs(10);

/// What the handlers share: the index of the other NADs for the cross-NAD overlap warning.
#[derive(Clone)]
pub struct WebhookState {
    pub nads: Arc<NadIndex>,
}

impl WebhookState {
    pub fn new(source: Arc<dyn NadSource>) -> Self {
        WebhookState {
            nads: Arc::new(NadIndex::new(source)),
        }
    }
}

/// `POST /validate`, with the body size and time bounded.
pub fn router(state: WebhookState) -> Router {
    Router::new()
        .route("/validate", post(validate))
        .layer(DefaultBodyLimit::max(BODY_LIMIT))
        .layer(TimeoutLayer::with_status_code(
            StatusCode::REQUEST_TIMEOUT,
            REQUEST_TIMEOUT,
        ))
        .with_state(state)
}

async fn validate(State(state): State<WebhookState>, body: Bytes) -> Response {
    let started = std::time::Instant::now();
    match admission::review(&body, &state.nads) {
        Ok((operation, answer)) => {
            let allowed = answer
                .pointer("/response/allowed")
                .and_then(serde_json::Value::as_bool)
                == Some(true);
            crate::metrics::record_webhook(
                &operation,
                if allowed { "allowed" } else { "denied" },
                started.elapsed(),
            );
            axum::Json(answer).into_response()
        }
        Err(e) => {
            tracing::debug!(error = %e, "malformed admission request");
            crate::metrics::record_webhook("unknown", "error", started.elapsed());
            (StatusCode::BAD_REQUEST, format!("{e}\n")).into_response()
        }
    }
}
