//! The webhook over real TLS on loopback: the served certificate follows its files, a bad new pair
//! keeps the old one serving, and a request gets its AdmissionReview back over HTTPS.
//! Certificates come from webhook-certs/mint.sh (needs the openssl CLI).

mod common;
use common::mint;

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, ServerName};
use whereabouts::webhook::{self, WebhookState, tls::CertFiles};

fn client_config(dir: &Path) -> Arc<rustls::ClientConfig> {
    let mut roots = rustls::RootCertStore::empty();
    roots
        .add(CertificateDer::from_pem_file(dir.join("ca.crt")).unwrap())
        .unwrap();
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    Arc::new(
        rustls::ClientConfig::builder_with_provider(provider)
            .with_safe_default_protocol_versions()
            .unwrap()
            .with_root_certificates(roots)
            .with_no_client_auth(),
    )
}

/// Connects, verifies the server against the CA, sends `request` and returns the served leaf
/// certificate and the raw HTTP response.
fn exchange(
    addr: SocketAddr,
    config: Arc<rustls::ClientConfig>,
    request: &[u8],
) -> (Vec<u8>, String) {
    let name = ServerName::IpAddress(addr.ip().into());
    let mut conn = rustls::ClientConnection::new(config, name).unwrap();
    let mut sock = TcpStream::connect(addr).unwrap();
    sock.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
    let mut tls = rustls::Stream::new(&mut conn, &mut sock);
    tls.write_all(request).unwrap();
    let mut response = Vec::new();
    let _ = tls.read_to_end(&mut response);
    let leaf = conn.peer_certificates().unwrap()[0].to_vec();
    (leaf, String::from_utf8_lossy(&response).into_owned())
}

type Server = tokio::task::JoinHandle<std::io::Result<()>>;

/// The webhook over TLS on a free loopback port, with the certificate files in `dir`; stops when
/// the returned sender fires.
fn serve_on_loopback(
    dir: &Path,
    loaded: Arc<AtomicBool>,
) -> (SocketAddr, tokio::sync::oneshot::Sender<()>, Server) {
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = listener.local_addr().unwrap();
    let (stop_tx, stop_rx) = tokio::sync::oneshot::channel::<()>();
    let files = CertFiles::new(dir.join("tls.crt"), dir.join("tls.key"));
    let app = webhook::router(WebhookState::new(Arc::new(Vec::new()), Arc::default()));
    let server = tokio::spawn(webhook::tls::serve(
        listener,
        files,
        app,
        webhook::Limits::default(),
        loaded,
        async {
            let _ = stop_rx.await;
        },
    ));
    (addr, stop_tx, server)
}

fn file_leaf(dir: &Path) -> Vec<u8> {
    CertificateDer::from_pem_file(dir.join("tls.crt"))
        .unwrap()
        .to_vec()
}

const PROBE: &[u8] = b"GET /nothing HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n";

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rotated_certificate_files_are_served_without_restart() {
    let dir = tempfile::tempdir().unwrap();
    mint(dir.path());
    let first = file_leaf(dir.path());
    let loaded = Arc::new(AtomicBool::new(false));
    let (addr, stop_tx, server) = serve_on_loopback(dir.path(), loaded.clone());
    let client = client_config(dir.path());
    let d = dir.path().to_owned();
    let c = client.clone();

    tokio::task::spawn_blocking(move || {
        // The first pair, and a real admission request over HTTPS.
        let (leaf, _) = exchange(addr, c.clone(), PROBE);
        assert_eq!(leaf, first);
        let body = std::fs::read(PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/admission/invalid-cidr.json")).unwrap();
        let mut req = format!("POST /validate HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: {}\r\nConnection: close\r\n\r\n", body.len()).into_bytes();
        req.extend_from_slice(&body);
        let (_, resp) = exchange(addr, c.clone(), &req);
        assert!(resp.starts_with("HTTP/1.1 200"), "{resp}");
        assert!(resp.contains("uid-invalid-cidr") && resp.contains("is not a CIDR"), "{resp}");

        // Rotate: same CA, new serving certificate; a new connection sees it within a few polls.
        mint(&d);
        let second = file_leaf(&d);
        assert_ne!(second, first);
        wait_for_leaf(addr, &c, &second);

        // A broken pair is refused; the previous certificate keeps serving.
        std::fs::write(d.join("tls.crt"), "-----BEGIN CERTIFICATE-----\nnot base64\n-----END CERTIFICATE-----\n").unwrap();
        std::thread::sleep(webhook::tls::POLL * 3);
        assert_eq!(exchange(addr, c.clone(), PROBE).0, second);

        // And the next good pair is picked up again.
        mint(&d);
        let third = file_leaf(&d);
        wait_for_leaf(addr, &c, &third);
    })
    .await
    .unwrap();
    assert!(loaded.load(Ordering::SeqCst));
    stop_tx.send(()).unwrap();
    tokio::time::timeout(Duration::from_secs(15), server)
        .await
        .expect("graceful shutdown")
        .unwrap()
        .unwrap();
}

fn wait_for_leaf(addr: SocketAddr, client: &Arc<rustls::ClientConfig>, want: &[u8]) {
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        if exchange(addr, client.clone(), PROBE).0 == want {
            return;
        }
        assert!(
            Instant::now() < deadline,
            "new certificate not served within 10 s"
        );
        std::thread::sleep(Duration::from_millis(200));
    }
}

#[test]
fn certificate_pairs_are_checked_before_use() {
    let dir = tempfile::tempdir().unwrap();
    mint(dir.path());
    let files = CertFiles::new(dir.path().join("tls.crt"), dir.path().join("tls.key"));
    let (config, _) = files.load().unwrap();
    assert!(config.alpn_protocols.contains(&b"http/1.1".to_vec()));
    let mismatched = CertFiles::new(dir.path().join("tls.crt"), dir.path().join("ca.key"));
    let err = mismatched.load().unwrap_err().to_string();
    assert!(err.contains("do not form a usable pair"), "{err}");
    let missing = CertFiles::new(dir.path().join("nope.crt"), dir.path().join("tls.key"));
    assert!(missing.load().unwrap_err().to_string().contains("nope.crt"));
}

/// Runs `openssl s_client` with one protocol version forced; true when the handshake completes.
fn handshake_with(addr: SocketAddr, dir: &Path, version: &str) -> bool {
    let out = Command::new("openssl")
        // SECLEVEL=0 lets the client itself offer old versions, so a refusal is the server's.
        .args([
            "s_client",
            version,
            "-cipher",
            "DEFAULT:@SECLEVEL=0",
            "-connect",
            &addr.to_string(),
            "-CAfile",
        ])
        .arg(dir.join("ca.crt"))
        .stdin(std::process::Stdio::null())
        .output()
        .expect("openssl CLI");
    let text = String::from_utf8_lossy(&out.stdout);
    out.status.success() && text.contains("Verify return code: 0 (ok)")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn only_tls_1_2_and_newer_are_spoken() {
    let dir = tempfile::tempdir().unwrap();
    mint(dir.path());
    let (addr, stop_tx, server) = serve_on_loopback(dir.path(), Arc::new(AtomicBool::new(false)));
    let d = dir.path().to_owned();
    let results = tokio::task::spawn_blocking(move || {
        ["-tls1", "-tls1_1", "-tls1_2", "-tls1_3"].map(|v| handshake_with(addr, &d, v))
    })
    .await
    .unwrap();
    assert_eq!(
        results,
        [false, false, true, true],
        "TLS 1.0, 1.1 refused; 1.2, 1.3 served"
    );
    stop_tx.send(()).unwrap();
    tokio::time::timeout(Duration::from_secs(15), server)
        .await
        .expect("graceful shutdown")
        .unwrap()
        .unwrap();
}
