//! The admin port: plain HTTP for probes and `/metrics`, never the webhook's TLS port.
//!
//! Readiness reflects real state: each component registers a named check, and `/readyz` answers
//! 200 `ok` only when every check passes, else 503 naming each failing check. [`router`] is a
//! function so more routes (`/metrics`) can be merged in and tests can drive it with `oneshot`.

use std::sync::Arc;

use axum::Router;
use axum::extract::State;
use axum::http::StatusCode;
use axum::routing::get;

type Check = Arc<dyn Fn() -> Result<(), String> + Send + Sync>;

/// The named readiness checks.
#[derive(Clone, Default)]
pub struct AdminState {
    checks: Vec<(&'static str, Check)>,
}

impl AdminState {
    pub fn new() -> Self {
        AdminState::default()
    }

    /// Adds a check: `Err(reason)` makes `/readyz` answer 503 with `name: reason`.
    pub fn check(
        mut self,
        name: &'static str,
        f: impl Fn() -> Result<(), String> + Send + Sync + 'static,
    ) -> Self {
        self.checks.push((name, Arc::new(f)));
        self
    }

    /// Every failing check as `name: reason`.
    pub fn failing(&self) -> Vec<String> {
        self.checks
            .iter()
            .filter_map(|(name, f)| f().err().map(|why| format!("{name}: {why}")))
            .collect()
    }
}

pub fn router(state: AdminState) -> Router {
    Router::new()
        .route("/livez", get(|| async { "ok\n" }))
        .route("/readyz", get(readyz))
        .route("/metrics", get(|| async { crate::metrics::render() }))
        .with_state(state)
}

async fn readyz(State(state): State<AdminState>) -> (StatusCode, String) {
    let failing = state.failing();
    if failing.is_empty() {
        (StatusCode::OK, "ok\n".to_owned())
    } else {
        (
            StatusCode::SERVICE_UNAVAILABLE,
            format!("{}\n", failing.join("\n")),
        )
    }
}
