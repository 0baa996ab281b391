//! The webhook under abuse, over real TLS on loopback: silent and slow clients are cut at their
//! deadlines, oversized bodies are refused, the connection and request bounds hold, and a valid
//! AdmissionReview is still answered while 500 connections stall. Deadlines are shrunk through
//! `Limits` so no test waits for a production timeout. Certificates come from
//! webhook-certs/mint.sh (needs the openssl CLI).

mod common;
use common::mint;

use std::io::{ErrorKind, Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::AtomicBool;
use std::time::Duration;

use http_body_util::{BodyExt, Full};
use hyper_util::rt::TokioExecutor;
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, ServerName};
use whereabouts::webhook::{self, Limits, WebhookState, tls::CertFiles};

const SHORT: Duration = Duration::from_millis(300);
/// How long a client waits for the server before the test calls the server stuck.
const PATIENCE: Duration = Duration::from_secs(10);

fn client_config(dir: &Path, alpn: &[&[u8]]) -> Arc<rustls::ClientConfig> {
    let mut roots = rustls::RootCertStore::empty();
    roots
        .add(CertificateDer::from_pem_file(dir.join("ca.crt")).unwrap())
        .unwrap();
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let mut config = rustls::ClientConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()
        .unwrap()
        .with_root_certificates(roots)
        .with_no_client_auth();
    config.alpn_protocols = alpn.iter().map(|p| p.to_vec()).collect();
    Arc::new(config)
}

fn review() -> Vec<u8> {
    std::fs::read(
        PathBuf::from(env!("CARGO_MANIFEST_DIR"))
            .join("tests/fixtures/admission/valid-single.json"),
    )
    .unwrap()
}

fn post_head(len: usize, close: bool) -> Vec<u8> {
    format!(
        "POST /validate HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: {len}\r\n{}\r\n",
        if close { "Connection: close\r\n" } else { "" }
    )
    .into_bytes()
}

fn valid_request() -> Vec<u8> {
    let body = review();
    let mut req = post_head(body.len(), true);
    req.extend_from_slice(&body);
    req
}

/// The webhook on a free loopback port with `limits`; stopped (and checked to have run without
/// failing) by [`Server::stop`].
struct Server {
    addr: SocketAddr,
    client: Arc<rustls::ClientConfig>,
    dir: tempfile::TempDir,
    stop: tokio::sync::oneshot::Sender<()>,
    task: tokio::task::JoinHandle<std::io::Result<()>>,
}

fn start(limits: Limits) -> Server {
    let dir = tempfile::tempdir().unwrap();
    mint(dir.path());
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = listener.local_addr().unwrap();
    let (stop, stop_rx) = tokio::sync::oneshot::channel::<()>();
    let files = CertFiles::new(dir.path().join("tls.crt"), dir.path().join("tls.key"));
    let app = webhook::router_with(
        WebhookState::new(Arc::new(Vec::new()), Arc::default()),
        &limits,
    );
    let loaded = Arc::new(AtomicBool::new(false));
    let task = tokio::spawn(webhook::tls::serve(
        listener,
        files,
        app,
        limits,
        loaded,
        async {
            let _ = stop_rx.await;
        },
    ));
    let client = client_config(dir.path(), &[b"http/1.1"]);
    Server {
        addr,
        client,
        dir,
        stop,
        task,
    }
}

impl Server {
    /// The server task is still serving (nothing failed or panicked), and shuts down cleanly.
    async fn stop(self) {
        assert!(!self.task.is_finished(), "the webhook server stopped early");
        self.stop.send(()).unwrap();
        tokio::time::timeout(Duration::from_secs(15), self.task)
            .await
            .expect("graceful shutdown")
            .expect("server task did not panic")
            .expect("server returned no error");
    }
}

type Tls = rustls::StreamOwned<rustls::ClientConnection, TcpStream>;

/// A TLS connection with the handshake done.
fn connect(addr: SocketAddr, client: &Arc<rustls::ClientConfig>) -> Tls {
    let conn =
        rustls::ClientConnection::new(client.clone(), ServerName::IpAddress(addr.ip().into()))
            .unwrap();
    let sock = TcpStream::connect(addr).unwrap();
    sock.set_read_timeout(Some(PATIENCE)).unwrap();
    let mut tls = rustls::StreamOwned::new(conn, sock);
    while tls.conn.is_handshaking() {
        tls.conn.complete_io(&mut tls.sock).unwrap();
    }
    tls
}

/// Everything the server sends until it closes (or PATIENCE passes, which the caller's checks
/// then catch as a missing response).
fn read_all(tls: &mut Tls) -> String {
    let mut out = Vec::new();
    let mut buf = [0u8; 4096];
    loop {
        match tls.read(&mut buf) {
            Ok(0) | Err(_) => break,
            Ok(n) => out.extend_from_slice(&buf[..n]),
        }
    }
    String::from_utf8_lossy(&out).into_owned()
}

/// Sends `request` on a new connection and returns the raw response.
fn exchange(addr: SocketAddr, client: &Arc<rustls::ClientConfig>, request: &[u8]) -> String {
    let mut tls = connect(addr, client);
    tls.write_all(request).unwrap();
    read_all(&mut tls)
}

fn blocking<T: Send + 'static>(
    f: impl FnOnce() -> T + Send + 'static,
) -> tokio::task::JoinHandle<T> {
    tokio::task::spawn_blocking(f)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_silent_connection_is_closed_at_the_handshake_deadline() {
    let server = start(Limits {
        handshake_timeout: SHORT,
        ..Limits::default()
    });
    let addr = server.addr;
    let outcome = blocking(move || {
        let mut sock = TcpStream::connect(addr).unwrap();
        sock.set_read_timeout(Some(PATIENCE)).unwrap();
        let mut buf = [0u8; 16];
        sock.read(&mut buf).map_err(|e| e.kind())
    })
    .await
    .unwrap();
    // EOF (or a reset): the server closed it. WouldBlock/TimedOut would mean it kept waiting.
    assert!(
        matches!(outcome, Ok(0) | Err(ErrorKind::ConnectionReset)),
        "silent connection not closed by the server: {outcome:?}"
    );
    server.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn headers_sent_a_byte_at_a_time_are_cut() {
    let server = start(Limits {
        header_read_timeout: SHORT,
        ..Limits::default()
    });
    let (addr, client) = (server.addr, server.client.clone());
    let sent = blocking(move || {
        let mut tls = connect(addr, &client);
        tls.write_all(b"POST /validate HTTP/1.1\r\n").unwrap();
        // 200 bytes at 25 ms: 5 s of trickle, far past the 300 ms deadline.
        let trickle = b"X-Slow: ".iter().chain([b'a'; 192].iter());
        for (i, byte) in trickle.enumerate() {
            if tls.write_all(&[*byte]).and_then(|()| tls.flush()).is_err() {
                return i;
            }
            std::thread::sleep(Duration::from_millis(25));
        }
        200
    })
    .await
    .unwrap();
    assert!(sent < 200, "the server read trickled headers for 5 s");
    server.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_declared_10_mb_body_gets_413_before_it_is_sent() {
    let server = start(Limits::default());
    let (addr, client) = (server.addr, server.client.clone());
    let resp = blocking(move || {
        // Only the head: the answer must not depend on a body the server never got.
        exchange(addr, &client, &post_head(10 * 1024 * 1024, false))
    })
    .await
    .unwrap();
    assert!(resp.starts_with("HTTP/1.1 413"), "{resp}");
    server.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_chunked_body_over_the_limit_is_refused() {
    let server = start(Limits::default());
    let (addr, client) = (server.addr, server.client.clone());
    let resp = blocking(move || {
        let mut tls = connect(addr, &client);
        let head = "POST /validate HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nTransfer-Encoding: chunked\r\n\r\n";
        tls.write_all(head.as_bytes()).unwrap();
        let chunk = vec![b' '; 64 * 1024];
        // One chunk past the limit, then the end of the body.
        for _ in 0..=(webhook::BODY_LIMIT / chunk.len()) {
            let framed = [format!("{:x}\r\n", chunk.len()).as_bytes(), &chunk, b"\r\n"].concat();
            if tls.write_all(&framed).is_err() {
                break;
            }
        }
        let _ = tls.write_all(b"0\r\n\r\n");
        read_all(&mut tls)
    })
    .await
    .unwrap();
    assert!(resp.starts_with("HTTP/1.1 413"), "{resp}");
    server.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_body_that_trickles_in_ends_at_the_request_deadline() {
    let server = start(Limits {
        request_timeout: SHORT,
        ..Limits::default()
    });
    let (addr, client) = (server.addr, server.client.clone());
    let resp = blocking(move || {
        let mut tls = connect(addr, &client);
        tls.write_all(&post_head(100, false)).unwrap();
        tls.write_all(b"{\"apiVersion\"").unwrap();
        read_all(&mut tls)
    })
    .await
    .unwrap();
    assert!(resp.starts_with("HTTP/1.1 408"), "{resp}");
    server.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_valid_review_is_answered_while_500_connections_stall() {
    // Production limits: the stalled connections stay open for the whole test (5 s deadlines).
    let server = start(Limits::default());
    let (addr, client) = (server.addr, server.client.clone());
    let resp = blocking(move || {
        // 250 that never start TLS, 250 that stop in the middle of their request head.
        let mut silent: Vec<TcpStream> = (0..250)
            .map(|_| TcpStream::connect(addr).unwrap())
            .collect();
        let mut slow: Vec<Tls> = (0..250)
            .map(|_| {
                let mut tls = connect(addr, &client);
                tls.write_all(b"POST /validate HTTP/1.1\r\nHost: x\r\n")
                    .unwrap();
                tls
            })
            .collect();
        let resp = exchange(addr, &client, &valid_request());
        // Still open: the answer came while all 500 were held, not after they timed out.
        for sock in &mut silent {
            sock.set_nonblocking(true).unwrap();
            let mut b = [0u8; 1];
            assert_eq!(sock.read(&mut b).unwrap_err().kind(), ErrorKind::WouldBlock);
        }
        slow.clear();
        resp
    })
    .await
    .unwrap();
    assert!(resp.starts_with("HTTP/1.1 200"), "{resp}");
    assert!(resp.contains("\"allowed\":true"), "{resp}");
    server.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn requests_beyond_the_in_flight_bound_get_503_with_retry_after() {
    let server = start(Limits {
        max_requests: 1,
        queue_wait: Duration::ZERO,
        ..Limits::default()
    });
    let (addr, client) = (server.addr, server.client.clone());
    blocking(move || {
        // Holds the only slot: its body never completes.
        let mut holder = connect(addr, &client);
        holder.write_all(&post_head(100, false)).unwrap();
        holder.write_all(b"{").unwrap();
        // The holder's request reaches the gate asynchronously; retry until it has.
        let mut shed = String::new();
        for _ in 0..50 {
            shed = exchange(addr, &client, &valid_request());
            if shed.starts_with("HTTP/1.1 503") {
                break;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        assert!(shed.starts_with("HTTP/1.1 503"), "{shed}");
        assert!(
            shed.to_ascii_lowercase().contains("retry-after: 1"),
            "{shed}"
        );
        // Releasing the slot lets the next request through.
        holder.write_all(&[b' '; 99]).unwrap();
        let held = read_all(&mut holder);
        assert!(held.starts_with("HTTP/1.1 400"), "{held}");
        let after = exchange(addr, &client, &valid_request());
        assert!(after.starts_with("HTTP/1.1 200"), "{after}");
    })
    .await
    .unwrap();
    server.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn connections_beyond_the_bound_wait_until_a_slot_frees() {
    let server = start(Limits {
        max_connections: 1,
        ..Limits::default()
    });
    let (addr, client) = (server.addr, server.client.clone());
    blocking(move || {
        let first = TcpStream::connect(addr).unwrap();
        // Make sure the first connection holds the slot before the second one arrives.
        std::thread::sleep(Duration::from_millis(100));
        let (tx, rx) = std::sync::mpsc::channel();
        let c = client.clone();
        let waiting = std::thread::spawn(move || {
            let _ = tx.send(exchange(addr, &c, &valid_request()));
        });
        assert!(
            rx.recv_timeout(Duration::from_millis(500)).is_err(),
            "a second connection was served while the only slot was taken"
        );
        drop(first);
        let resp = rx
            .recv_timeout(PATIENCE)
            .expect("served once the slot freed");
        assert!(resp.starts_with("HTTP/1.1 200"), "{resp}");
        waiting.join().unwrap();
    })
    .await
    .unwrap();
    server.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn http2_is_served_and_an_idle_connection_is_closed() {
    let server = start(Limits {
        request_timeout: SHORT,
        queue_wait: Duration::ZERO,
        idle_timeout: Duration::from_millis(600),
        ..Limits::default()
    });
    let config = client_config(server.dir.path(), &[]);
    let https = hyper_rustls::HttpsConnectorBuilder::new()
        .with_tls_config((*config).clone())
        .https_only()
        .enable_http2()
        .build();
    let uri: http::Uri = format!("https://{}/validate", server.addr).parse().unwrap();
    let io = tower::ServiceExt::oneshot(https, uri.clone())
        .await
        .unwrap();
    let (mut sender, conn) = hyper::client::conn::http2::handshake(TokioExecutor::new(), io)
        .await
        .unwrap();
    let conn = tokio::spawn(conn);
    let req = http::Request::post(uri)
        .header("content-type", "application/json")
        .body(Full::new(bytes(review())))
        .unwrap();
    let resp = sender.send_request(req).await.unwrap();
    assert_eq!(resp.version(), http::Version::HTTP_2);
    assert_eq!(resp.status(), http::StatusCode::OK);
    let body = resp.into_body().collect().await.unwrap().to_bytes();
    assert!(String::from_utf8_lossy(&body).contains("\"allowed\":true"));
    // No further request: the server ends the connection after the idle deadline.
    tokio::time::timeout(PATIENCE, conn)
        .await
        .expect("idle HTTP/2 connection not closed by the server")
        .unwrap()
        .ok();
    server.stop().await;
}

fn bytes(v: Vec<u8>) -> axum::body::Bytes {
    axum::body::Bytes::from(v)
}
