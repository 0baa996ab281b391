//! The admin port: plain HTTP for probes and `/metrics`, never the webhook's TLS port.
//!
//! Readiness reflects real state: each component registers a named check, and `/readyz` answers
//! 200 `ok` only when every check passes, else 503 naming each failing check. `/livez` works the
//! same over the liveness checks (none: the process answers, which is all the operator needs; the
//! node agent adds one). `/metrics` renders what the process was given: the operator's registry or
//! the agent's. [`router`] is a function so tests can drive it with `oneshot`.

use std::io;
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr};
use std::sync::Arc;

use axum::Router;
use axum::extract::State;
use axum::http::StatusCode;
use axum::routing::get;

/// Binds a TCP listener at `addr` with `backlog`. `[::]`, the default of the operator's
/// listeners, takes both families on Linux (IPv4 peers as mapped addresses), so IPv6-only,
/// dual-stack and IPv4 clusters all reach it; on a kernel without IPv6 (`ipv6.disable=1`) it
/// falls back to `0.0.0.0`, with a warning. Returns the listener and the address it has.
pub fn listen(addr: SocketAddr, backlog: u32) -> io::Result<(std::net::TcpListener, SocketAddr)> {
    match bind(addr, backlog) {
        Err(e) if addr.ip() == IpAddr::V6(Ipv6Addr::UNSPECIFIED) && no_ipv6(&e) => {
            let v4 = SocketAddr::new(Ipv4Addr::UNSPECIFIED.into(), addr.port());
            tracing::warn!(%addr, error = %e, "this kernel has no IPv6: listening on {v4}");
            Ok((bind(v4, backlog)?, v4))
        }
        other => other.map(|l| (l, addr)),
    }
}

fn bind(addr: SocketAddr, backlog: u32) -> io::Result<std::net::TcpListener> {
    let socket = if addr.is_ipv4() {
        tokio::net::TcpSocket::new_v4()?
    } else {
        tokio::net::TcpSocket::new_v6()?
    };
    // As std's TcpListener::bind does: a restarted process can bind while old connections linger.
    socket.set_reuseaddr(true)?;
    socket.bind(addr)?;
    socket.listen(backlog)?.into_std()
}

fn no_ipv6(e: &io::Error) -> bool {
    use rustix::io::Errno;
    matches!(
        Errno::from_io_error(e),
        Some(Errno::AFNOSUPPORT | Errno::ADDRNOTAVAIL)
    )
}

type Check = Arc<dyn Fn() -> Result<(), String> + Send + Sync>;
type Render = Arc<dyn Fn() -> String + Send + Sync>;

/// The named readiness and liveness checks, and the metrics to serve.
#[derive(Clone)]
pub struct AdminState {
    checks: Vec<(&'static str, Check)>,
    live: Vec<(&'static str, Check)>,
    render: Render,
}

impl AdminState {
    /// No checks yet; `/metrics` serves `render`'s text (e.g. `move || metrics.render()`).
    pub fn new(render: impl Fn() -> String + Send + Sync + 'static) -> Self {
        AdminState {
            checks: Vec::new(),
            live: Vec::new(),
            render: Arc::new(render),
        }
    }

    /// Adds a liveness check: `Err(reason)` makes `/livez` answer 503 with `name: reason`.
    pub fn live(
        mut self,
        name: &'static str,
        f: impl Fn() -> Result<(), String> + Send + Sync + 'static,
    ) -> Self {
        self.live.push((name, Arc::new(f)));
        self
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

    /// Every failing readiness check as `name: reason`.
    pub fn failing(&self) -> Vec<String> {
        failing(&self.checks)
    }
}

fn failing(checks: &[(&'static str, Check)]) -> Vec<String> {
    checks
        .iter()
        .filter_map(|(name, f)| f().err().map(|why| format!("{name}: {why}")))
        .collect()
}

pub fn router(state: AdminState) -> Router {
    Router::new()
        .route("/livez", get(livez))
        .route("/readyz", get(readyz))
        .route(
            "/metrics",
            get(|State(state): State<AdminState>| async move { (state.render)() }),
        )
        .with_state(state)
}

async fn livez(State(state): State<AdminState>) -> (StatusCode, String) {
    answer(failing(&state.live))
}

async fn readyz(State(state): State<AdminState>) -> (StatusCode, String) {
    answer(state.failing())
}

fn answer(failing: Vec<String>) -> (StatusCode, String) {
    if failing.is_empty() {
        (StatusCode::OK, "ok\n".to_owned())
    } else {
        (
            StatusCode::SERVICE_UNAVAILABLE,
            format!("{}\n", failing.join("\n")),
        )
    }
}

#[cfg(test)]
mod tests {
    use axum::body::Body;
    use axum::http::Request;
    use http_body_util::BodyExt as _;
    use tower::ServiceExt as _;

    use super::*;

    #[tokio::test]
    async fn the_unspecified_ipv6_address_takes_both_families() {
        let (listener, bound) = listen("[::]:0".parse().unwrap(), 16).unwrap();
        let port = listener.local_addr().unwrap().port();
        assert!(bound.ip().is_unspecified());
        for peer in ["127.0.0.1", "::1"] {
            let peer: IpAddr = peer.parse().unwrap();
            if bound.is_ipv4() && peer.is_ipv6() {
                continue; // a kernel without IPv6: the fallback took 0.0.0.0
            }
            std::net::TcpStream::connect((peer, port))
                .unwrap_or_else(|e| panic!("{peer} cannot reach [::]:{port}: {e}"));
        }
    }

    async fn get(state: &AdminState, path: &str) -> (StatusCode, String) {
        let req = Request::get(path).body(Body::empty()).unwrap();
        let resp = router(state.clone()).oneshot(req).await.unwrap();
        let status = resp.status();
        let body = resp.into_body().collect().await.unwrap().to_bytes();
        (status, String::from_utf8(body.to_vec()).unwrap())
    }

    #[tokio::test]
    async fn livez_names_each_failing_liveness_check_and_metrics_can_be_another_registry() {
        let metrics = crate::metrics::Metrics::new();
        let plain = AdminState::new(move || metrics.render());
        assert_eq!(get(&plain, "/livez").await, (StatusCode::OK, "ok\n".into()));
        let (_, text) = get(&plain, "/metrics").await;
        assert!(text.contains("whereabouts_build_info"), "{text}");

        let agent = AdminState::new(|| "agent_only 1\n".into())
            .live("socket", || Err("no answer on /run/x.sock for 31s".into()))
            .check("socket", || Ok(()));
        assert_eq!(
            get(&agent, "/livez").await,
            (
                StatusCode::SERVICE_UNAVAILABLE,
                "socket: no answer on /run/x.sock for 31s\n".into()
            )
        );
        assert_eq!(get(&agent, "/readyz").await.0, StatusCode::OK);
        assert_eq!(get(&agent, "/metrics").await.1, "agent_only 1\n");
    }
}
