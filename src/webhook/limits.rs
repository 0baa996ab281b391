//! What one client may cost the webhook: time, connections, requests in flight, bytes.
//!
//! The only legitimate client is the API server: it opens a few keep-alive connections (HTTP/2
//! when offered), sends AdmissionReviews of a few kilobytes all at once, and gives up after the
//! webhook's `timeoutSeconds` (5 s, config/webhook/base). Anything slower or bigger is a broken or
//! hostile client, and each limit below makes it cost a bounded amount:
//!
//! | limit | bounds |
//! |---|---|
//! | [`HANDSHAKE_TIMEOUT`] | a connection that never finishes TLS (sends nothing, or a byte at a time) |
//! | [`HEADER_READ_TIMEOUT`] | the first request of a connection (HTTP/1 and HTTP/2), and every HTTP/1 request head |
//! | [`super::REQUEST_TIMEOUT`] | a request whose body trickles in, or whose answer is slow |
//! | [`IDLE_TIMEOUT`] | a connection that sends no request at all for a while |
//! | [`MAX_CONNECTIONS`] | open connections; beyond it new ones wait in the kernel's listen queue ([`LISTEN_BACKLOG`]) |
//! | [`MAX_REQUESTS`] | requests past their headers at once (body memory); beyond it they wait up to [`QUEUE_WAIT`], then 503 |
//! | [`MAX_STREAMS`], [`MAX_HEADER_BYTES`] | HTTP/2 streams per connection, request header size (both protocols) |
//! | [`super::BODY_LIMIT`] | the body: a larger Content-Length is refused with 413 before reading; a chunked body is cut there |
//!
//! [`Limits`] carries them so tests can shrink the deadlines; [`Limits::default`] is production.

use std::convert::Infallible;
use std::future::{Ready, ready};
use std::io;
use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};
use std::time::Duration;

use axum::Router;
use axum::extract::{Request, State};
use axum::http::{HeaderValue, StatusCode, header};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use axum_server::accept::Accept;
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::TcpStream;
use tokio::sync::{OwnedSemaphorePermit, Semaphore};
use tokio::time::{Instant, Sleep};
use tokio_util::sync::PollSemaphore;

use crate::metrics::Metrics;

/// The API server's own TLS handshake to an in-cluster Service takes milliseconds, and its whole
/// call has 5 s (`timeoutSeconds`): a handshake still running after that serves nobody.
pub const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(5);
/// Same reasoning for the request head: the API server writes it at once, and after 5 s it has
/// stopped waiting for our answer anyway. (hyper's own default, 30 s, lets a slowloris hold a
/// connection six times longer.)
pub const HEADER_READ_TIMEOUT: Duration = Duration::from_secs(5);
/// A connection that starts no request for this long is closed. Above Go's `IdleConnTimeout`
/// (90 s, which the API server's transport uses), so the API server normally closes its idle
/// connections first and never races our close with a new request.
pub const IDLE_TIMEOUT: Duration = Duration::from_secs(120);
/// Open connections at once. The API server needs a handful per replica; 1024 is far above that
/// and keeps the worst case (every connection mid-handshake, measured at about 30 KiB each in
/// docs/benchmarks.md "Webhook under abuse") to tens of MiB. Beyond it, new connections wait
/// in the listen queue rather than being refused: a refused API-server connection is an
/// immediate admission failure, a queued one is served as soon as a slot frees (slots free at
/// the deadlines above).
pub const MAX_CONNECTIONS: usize = 1024;
/// Requests past their headers at once. Each may hold a body of up to BODY_LIMIT (1 MiB), so this
/// caps body memory at 32 MiB; validation is CPU-bound and takes well under a millisecond, so
/// more in parallel than this on a few cores would not answer any sooner.
pub const MAX_REQUESTS: usize = 32;
/// How long a request waits for one of the MAX_REQUESTS slots before it is answered 503. Long
/// enough to absorb a burst (32 slots × 1 s is tens of thousands of typical reviews), short
/// enough that the API server (5 s budget) gets a quick answer instead of a timeout.
pub const QUEUE_WAIT: Duration = Duration::from_secs(1);
/// HTTP/2 streams one connection may have open. Go's HTTP/2 client opens another connection
/// when a server's limit is reached; 128 bounds what one connection can queue.
pub const MAX_STREAMS: u32 = 128;
/// Request header bytes (HTTP/2 header list; HTTP/1 read buffer, which holds the head). The API
/// server sends a few hundred bytes of headers; 16 KiB is hyper's HTTP/2 default and leaves room.
pub const MAX_HEADER_BYTES: u32 = 16 * 1024;

/// Connections the kernel holds for us once MAX_CONNECTIONS are open (the listen queue). The
/// standard library listens with 128; past the queue, a new connection's SYN is dropped and the
/// client retries it after 1 s, then 3 s, which the API server's 5 s budget cannot afford. The
/// kernel caps it at `net.core.somaxconn` (4096 by default since Linux 5.4).
pub const LISTEN_BACKLOG: u32 = 1024;

/// A listening socket for the webhook on `addr`, with [`LISTEN_BACKLOG`]. Must run inside the
/// Tokio runtime.
pub fn listen(addr: SocketAddr) -> io::Result<std::net::TcpListener> {
    crate::admin::listen(addr, LISTEN_BACKLOG).map(|(listener, _)| listener)
}

/// The webhook's limits; `Default` is what production runs with.
#[derive(Debug, Clone)]
pub struct Limits {
    pub handshake_timeout: Duration,
    pub header_read_timeout: Duration,
    pub request_timeout: Duration,
    pub idle_timeout: Duration,
    pub max_connections: usize,
    pub max_requests: usize,
    pub queue_wait: Duration,
    pub max_streams: u32,
    pub max_header_bytes: u32,
    pub body_limit: usize,
}

impl Default for Limits {
    fn default() -> Self {
        Limits {
            handshake_timeout: HANDSHAKE_TIMEOUT,
            header_read_timeout: HEADER_READ_TIMEOUT,
            request_timeout: super::REQUEST_TIMEOUT,
            idle_timeout: IDLE_TIMEOUT,
            max_connections: MAX_CONNECTIONS,
            max_requests: MAX_REQUESTS,
            queue_wait: QUEUE_WAIT,
            max_streams: MAX_STREAMS,
            max_header_bytes: MAX_HEADER_BYTES,
            body_limit: super::BODY_LIMIT,
        }
    }
}

#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum LimitsError {
    #[error("webhook limit {field} must be at least {min}, got {value}")]
    TooSmall {
        field: &'static str,
        value: String,
        min: String,
    },
}

impl Limits {
    /// Every limit usable, and the idle deadline longer than any request can take (so it never
    /// cuts a request in progress; see [`IdleStream`]).
    pub fn check(&self) -> Result<(), LimitsError> {
        let at_least = |field, value: u64, min: u64| {
            (value >= min).then_some(()).ok_or(LimitsError::TooSmall {
                field,
                value: value.to_string(),
                min: min.to_string(),
            })
        };
        at_least("max_connections", self.max_connections as u64, 1)?;
        at_least("max_requests", self.max_requests as u64, 1)?;
        at_least("max_streams", u64::from(self.max_streams), 1)?;
        // hyper refuses an HTTP/1 read buffer below 8 KiB.
        at_least("max_header_bytes", u64::from(self.max_header_bytes), 8192)?;
        at_least("body_limit", self.body_limit as u64, 1)?;
        for (field, d) in [
            ("handshake_timeout", self.handshake_timeout),
            ("header_read_timeout", self.header_read_timeout),
            ("request_timeout", self.request_timeout),
        ] {
            if d.is_zero() {
                return Err(LimitsError::TooSmall {
                    field,
                    value: format!("{d:?}"),
                    min: "1ms".into(),
                });
            }
        }
        let longest_request = self.queue_wait + self.request_timeout;
        if self.idle_timeout <= longest_request {
            return Err(LimitsError::TooSmall {
                field: "idle_timeout",
                value: format!("{:?}", self.idle_timeout),
                min: format!("more than queue_wait + request_timeout = {longest_request:?}"),
            });
        }
        Ok(())
    }
}

/// The slots of [`MAX_REQUESTS`], how long a request may wait for one, and where a request shed
/// for want of one is counted.
#[derive(Clone)]
pub struct RequestGate {
    slots: Arc<Semaphore>,
    wait: Duration,
    metrics: Arc<Metrics>,
}

impl RequestGate {
    pub fn new(limits: &Limits, metrics: Arc<Metrics>) -> Self {
        RequestGate {
            slots: Arc::new(Semaphore::new(limits.max_requests)),
            wait: limits.queue_wait,
            metrics,
        }
    }
}

/// Middleware: a request runs (and reads its body) only while it holds a slot. Load is shed with
/// 503 and `Retry-After: 1`; under `failurePolicy: Fail` the API server turns that into a refused
/// NAD change ("failed calling webhook"), which the user or controller retries.
pub async fn admit(State(gate): State<RequestGate>, req: Request, next: Next) -> Response {
    let started = std::time::Instant::now();
    let slot = tokio::time::timeout(gate.wait, gate.slots.acquire_owned()).await;
    let Ok(Ok(_slot)) = slot else {
        gate.metrics
            .record_webhook("unknown", "overloaded", started.elapsed());
        let mut resp = (
            StatusCode::SERVICE_UNAVAILABLE,
            "webhook overloaded: too many requests in flight\n",
        )
            .into_response();
        resp.headers_mut()
            .insert(header::RETRY_AFTER, HeaderValue::from_static("1"));
        return resp;
    };
    next.run(req).await
}

/// One open connection: its slot of [`MAX_CONNECTIONS`] (freed when the last user of this drops,
/// i.e. when the connection's task ends) and when it last started a request.
struct Conn {
    _slot: Option<OwnedSemaphorePermit>,
    last_request: Mutex<Instant>,
}

impl Conn {
    fn touch(&self) {
        if let Ok(mut last) = self.last_request.lock() {
            *last = Instant::now();
        }
    }

    fn last_request(&self) -> Instant {
        // A poisoned lock only means a panic elsewhere mid-store of an Instant: the value is whole.
        *self.last_request.lock().unwrap_or_else(|p| p.into_inner())
    }
}

/// The make-service the server asks for a service per accepted connection. Its `poll_ready`
/// waits for a connection slot, and the server does not accept the next connection until it is
/// ready: beyond MAX_CONNECTIONS, connections wait in the kernel's listen queue.
pub struct ConnGate {
    router: Router,
    slots: PollSemaphore,
    ready: Option<OwnedSemaphorePermit>,
}

impl ConnGate {
    pub fn new(router: Router, limits: &Limits) -> Self {
        ConnGate {
            router,
            slots: PollSemaphore::new(Arc::new(Semaphore::new(limits.max_connections))),
            ready: None,
        }
    }
}

impl tower::Service<SocketAddr> for ConnGate {
    type Response = ConnService;
    type Error = Infallible;
    type Future = Ready<Result<ConnService, Infallible>>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Infallible>> {
        if self.ready.is_none() {
            match self.slots.poll_acquire(cx) {
                Poll::Ready(Some(slot)) => self.ready = Some(slot),
                // The semaphore is never closed; stay pending rather than over-admit.
                Poll::Ready(None) | Poll::Pending => return Poll::Pending,
            }
        }
        Poll::Ready(Ok(()))
    }

    fn call(&mut self, _peer: SocketAddr) -> Self::Future {
        // `poll_ready` left a slot here; the server always calls it first (tower's contract).
        let slot = self
            .ready
            .take()
            .or_else(|| self.slots.clone_inner().try_acquire_owned().ok());
        if slot.is_none() {
            tracing::warn!("webhook connection admitted without a free connection slot");
        }
        ready(Ok(ConnService {
            router: self.router.clone(),
            conn: Arc::new(Conn {
                _slot: slot,
                last_request: Mutex::new(Instant::now()),
            }),
        }))
    }
}

/// The router for one connection; notes when each request starts (for the idle deadline).
#[derive(Clone)]
pub struct ConnService {
    router: Router,
    conn: Arc<Conn>,
}

impl<B> tower::Service<axum::http::Request<B>> for ConnService
where
    Router: tower::Service<axum::http::Request<B>>,
{
    type Response = <Router as tower::Service<axum::http::Request<B>>>::Response;
    type Error = <Router as tower::Service<axum::http::Request<B>>>::Error;
    type Future = <Router as tower::Service<axum::http::Request<B>>>::Future;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        tower::Service::poll_ready(&mut self.router, cx)
    }

    fn call(&mut self, req: axum::http::Request<B>) -> Self::Future {
        self.conn.touch();
        self.router.call(req)
    }
}

/// The acceptor under TLS: wraps the TCP stream so that it ends when the connection starts no
/// request for `idle` (HTTP/2 has no such deadline of its own; for HTTP/1 it is a backstop).
#[derive(Clone)]
pub struct IdleAcceptor {
    idle: Duration,
}

impl IdleAcceptor {
    pub fn new(limits: &Limits) -> Self {
        IdleAcceptor {
            idle: limits.idle_timeout,
        }
    }
}

impl Accept<TcpStream, ConnService> for IdleAcceptor {
    type Stream = IdleStream;
    type Service = ConnService;
    type Future = Ready<io::Result<(IdleStream, ConnService)>>;

    fn accept(&self, stream: TcpStream, service: ConnService) -> Self::Future {
        let conn = service.conn.clone();
        let deadline = conn.last_request() + self.idle;
        ready(Ok((
            IdleStream {
                inner: stream,
                conn,
                idle: self.idle,
                timer: Box::pin(tokio::time::sleep_until(deadline)),
            },
            service,
        )))
    }
}

/// A TCP stream whose reads fail with `TimedOut` once its connection has started no request for
/// `idle`. Checked only while a read is pending, which is exactly when the peer is silent; a
/// request in progress is never cut, because `Limits::check` keeps `idle` above the longest a
/// request can take.
pub struct IdleStream {
    inner: TcpStream,
    conn: Arc<Conn>,
    idle: Duration,
    timer: Pin<Box<Sleep>>,
}

impl IdleStream {
    /// Ready(true) when the connection has been idle too long; re-arms the timer otherwise.
    fn poll_idle(&mut self, cx: &mut Context<'_>) -> Poll<bool> {
        loop {
            if self.timer.as_mut().poll(cx).is_pending() {
                return Poll::Pending;
            }
            let due = self.conn.last_request() + self.idle;
            if due <= Instant::now() {
                return Poll::Ready(true);
            }
            self.timer.as_mut().reset(due);
        }
    }
}

impl AsyncRead for IdleStream {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        let this = &mut *self;
        match Pin::new(&mut this.inner).poll_read(cx, buf) {
            Poll::Pending => match this.poll_idle(cx) {
                Poll::Ready(true) => Poll::Ready(Err(io::Error::new(
                    io::ErrorKind::TimedOut,
                    "webhook connection idle: no request started within the idle timeout",
                ))),
                _ => Poll::Pending,
            },
            done => done,
        }
    }
}

impl AsyncWrite for IdleStream {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.inner).poll_write(cx, buf)
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.inner).poll_flush(cx)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.inner).poll_shutdown(cx)
    }

    fn poll_write_vectored(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.inner).poll_write_vectored(cx, bufs)
    }

    fn is_write_vectored(&self) -> bool {
        self.inner.is_write_vectored()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn production_limits_are_consistent() {
        assert_eq!(Limits::default().check(), Ok(()));
    }

    #[test]
    fn unusable_limits_name_the_field_and_value() {
        let zero = Limits {
            max_connections: 0,
            ..Limits::default()
        };
        let e = zero.check().unwrap_err().to_string();
        assert!(e.contains("max_connections") && e.contains("got 0"), "{e}");
        let short_idle = Limits {
            idle_timeout: Duration::from_secs(5),
            ..Limits::default()
        };
        let e = short_idle.check().unwrap_err().to_string();
        assert!(e.contains("idle_timeout") && e.contains("5s"), "{e}");
        let small_headers = Limits {
            max_header_bytes: 100,
            ..Limits::default()
        };
        assert!(
            small_headers
                .check()
                .unwrap_err()
                .to_string()
                .contains("max_header_bytes")
        );
    }
}
