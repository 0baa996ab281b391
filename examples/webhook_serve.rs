//! The admission webhook alone: the real router over the real TLS stack, with the production
//! limits and an in-memory (empty) set of other NADs instead of the API server's watch cache.
//! For benchmarks that must not need a cluster (bench/webhook_abuse.py).
//!
//!   cargo run --release --example webhook_serve -- ADDR CERT KEY
//!
//! Prints `listening ADDR` once the certificate is loaded; stops on SIGTERM or Ctrl-C.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use anyhow::Context as _;
use whereabouts::webhook::{self, Limits, WebhookState, tls::CertFiles};

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let [addr, cert, key] = args.as_slice() else {
        anyhow::bail!("usage: webhook_serve ADDR CERT KEY");
    };
    let addr: std::net::SocketAddr = addr
        .parse()
        .with_context(|| format!("ADDR {addr:?} is not an address like 127.0.0.1:8443"))?;
    let listener =
        webhook::limits::listen(addr).with_context(|| format!("ADDR {addr}: cannot listen"))?;
    let limits = Limits::default();
    let app = webhook::router_with(
        WebhookState::new(Arc::new(Vec::new()), Arc::default()),
        &limits,
    );
    let loaded = Arc::new(AtomicBool::new(false));
    let server = tokio::spawn(webhook::tls::serve(
        listener,
        CertFiles::new(cert, key),
        app,
        limits,
        loaded.clone(),
        whereabouts::cli::run::signal(),
    ));
    while !loaded.load(Ordering::SeqCst) && !server.is_finished() {
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    println!("listening {addr}");
    server.await?.context("webhook server")
}
