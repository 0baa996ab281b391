//! HTTPS for the webhook: rustls with the ring provider, TLS 1.2 and 1.3 only, and a certificate
//! that follows its files.
//!
//! The files are polled (content compared every [`POLL`]) rather than watched with inotify: a
//! Kubernetes Secret volume swaps a `..data` symlink, which a poll sees the same way as a plain
//! rewrite. A new pair is only installed when it parses and the key matches the certificate; until
//! then the old one keeps serving and the failure is logged. Connections that are already open keep
//! the configuration they were accepted with, so a reload drops no in-flight request.

use std::future::Future;
use std::io;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use axum::Router;
use axum_server::tls_rustls::{RustlsAcceptor, RustlsConfig};
use rustls::ServerConfig;
use rustls_pki_types::pem::PemObject;
use rustls_pki_types::{CertificateDer, PrivateKeyDer};

use super::limits::{ConnGate, IdleAcceptor, Limits};

/// How often the certificate files are compared with what is being served.
pub const POLL: Duration = Duration::from_secs(1);
/// How long in-flight requests may take to finish at shutdown.
pub const DRAIN: Duration = Duration::from_secs(10);

#[derive(Debug, thiserror::Error)]
pub enum TlsError {
    #[error("reading {path}: {source}")]
    Read { path: PathBuf, source: io::Error },
    #[error("{path}: no PEM certificate found")]
    NoCertificate { path: PathBuf },
    #[error("{path}: no PEM private key found ({detail})")]
    NoKey { path: PathBuf, detail: String },
    #[error("certificate {cert} and key {key} do not form a usable pair: {source}")]
    Pair {
        cert: PathBuf,
        key: PathBuf,
        source: rustls::Error,
    },
}

/// The serving certificate chain and key, as file paths.
#[derive(Debug, Clone)]
pub struct CertFiles {
    pub cert: PathBuf,
    pub key: PathBuf,
}

impl CertFiles {
    pub fn new(cert: impl Into<PathBuf>, key: impl Into<PathBuf>) -> Self {
        CertFiles {
            cert: cert.into(),
            key: key.into(),
        }
    }

    /// Both files' contents; what the poll compares.
    pub fn read(&self) -> Result<Pem, TlsError> {
        let read = |p: &Path| {
            std::fs::read(p).map_err(|source| TlsError::Read {
                path: p.to_owned(),
                source,
            })
        };
        Ok((read(&self.cert)?, read(&self.key)?))
    }

    /// A rustls configuration from PEM contents read from these files.
    pub fn server_config(&self, cert: &[u8], key: &[u8]) -> Result<Arc<ServerConfig>, TlsError> {
        let chain: Vec<CertificateDer<'static>> = CertificateDer::pem_slice_iter(cert)
            .filter_map(Result::ok)
            .collect();
        if chain.is_empty() {
            return Err(TlsError::NoCertificate {
                path: self.cert.clone(),
            });
        }
        let key = PrivateKeyDer::from_pem_slice(key).map_err(|e| TlsError::NoKey {
            path: self.key.clone(),
            detail: e.to_string(),
        })?;
        let pair = |source| TlsError::Pair {
            cert: self.cert.clone(),
            key: self.key.clone(),
            source,
        };
        let provider = Arc::new(rustls::crypto::ring::default_provider());
        let mut config = ServerConfig::builder_with_provider(provider)
            .with_protocol_versions(&[&rustls::version::TLS13, &rustls::version::TLS12])
            .map_err(pair)?
            .with_no_client_auth()
            .with_single_cert(chain, key)
            .map_err(pair)?;
        config.alpn_protocols = vec![b"h2".to_vec(), b"http/1.1".to_vec()];
        Ok(Arc::new(config))
    }

    /// Reads and builds the configuration in one go.
    pub fn load(&self) -> Result<(Arc<ServerConfig>, Pem), TlsError> {
        let pem = self.read()?;
        let config = self.server_config(&pem.0, &pem.1)?;
        Ok((config, pem))
    }
}

/// The certificate and key contents last installed.
pub type Pem = (Vec<u8>, Vec<u8>);

/// Serves `app` over HTTPS on `listener` until `shutdown` resolves, then drains for up to [`DRAIN`].
/// Until the first certificate loads, connections wait in the listen queue and `loaded` stays
/// false (readiness reports it). The connection-level `limits` apply here (deadlines, connection
/// bound, HTTP/2 streams, header size); `app` carries the request-level ones
/// ([`super::router_with`] with the same limits).
pub async fn serve(
    listener: std::net::TcpListener,
    files: CertFiles,
    app: Router,
    limits: Limits,
    loaded: Arc<AtomicBool>,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> io::Result<()> {
    limits
        .check()
        .map_err(|e| io::Error::new(io::ErrorKind::InvalidInput, e))?;
    let mut shutdown = Box::pin(shutdown);
    let (config, seen) = loop {
        match files.load() {
            Ok(ok) => break ok,
            Err(e) => tracing::error!(error = %e, "webhook certificate not loaded; retrying"),
        }
        tokio::select! {
            _ = &mut shutdown => return Ok(()),
            _ = tokio::time::sleep(POLL) => {}
        }
    };
    let rustls = RustlsConfig::from_config(config);
    loaded.store(true, Ordering::SeqCst);
    tracing::info!(cert = %files.cert.display(), "webhook certificate loaded");
    let reloader = tokio::spawn(watch(files, rustls.clone(), seen));
    let handle = axum_server::Handle::new();
    let on_shutdown = handle.clone();
    tokio::spawn(async move {
        shutdown.await;
        on_shutdown.graceful_shutdown(Some(DRAIN));
    });
    listener.set_nonblocking(true)?;
    let acceptor = RustlsAcceptor::new(rustls)
        .handshake_timeout(limits.handshake_timeout)
        .acceptor(IdleAcceptor::new(&limits));
    let mut server = axum_server::from_tcp(listener)?
        .acceptor(acceptor)
        .first_request_timeout(limits.header_read_timeout)
        .handle(handle);
    let http = server.http_builder();
    http.http1()
        .header_read_timeout(limits.header_read_timeout)
        .max_buf_size(limits.max_header_bytes as usize);
    http.http2()
        .max_concurrent_streams(limits.max_streams)
        .max_header_list_size(limits.max_header_bytes);
    let result = server.serve(ConnGate::new(app, &limits)).await;
    reloader.abort();
    result
}

/// Installs the files' pair whenever their contents change and form a usable pair.
async fn watch(files: CertFiles, rustls: RustlsConfig, mut seen: Pem) {
    let mut last_error = String::new();
    loop {
        tokio::time::sleep(POLL).await;
        let now = match files.read() {
            Ok(now) if now != seen => now,
            Ok(_) => continue,
            Err(e) => {
                report(&mut last_error, e);
                continue;
            }
        };
        match files.server_config(&now.0, &now.1) {
            Ok(config) => {
                rustls.reload_from_config(config);
                seen = now;
                last_error.clear();
                tracing::info!(cert = %files.cert.display(), "webhook certificate reloaded");
            }
            Err(e) => report(&mut last_error, e),
        }
    }
}

/// Logs a reload failure once per distinct failure, not once per poll.
fn report(last: &mut String, e: TlsError) {
    let text = e.to_string();
    if *last != text {
        tracing::error!(error = %text, "new webhook certificate not usable; still serving the previous one");
        *last = text;
    }
}
