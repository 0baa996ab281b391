//! `whereabouts-operator run`: the long-running operator process.
//!
//! Each component is a task that runs until the shared shutdown signal (SIGTERM or SIGINT) fires:
//! the admin port (probes and metrics), the NAD watch cache (shared by the webhook and the NAD
//! controller), the admission webhook when a certificate is given, and the controllers (pod
//! cleanup, pool audit, NAD/pool reconciliation, leader election). When any task fails, the others
//! are told to stop and the process exits non-zero.

use std::future::Future;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU8, AtomicU64, Ordering};
use std::time::Duration;

use anyhow::Context as _;
use kube::Client;
use kube::runtime::reflector;
use tokio::sync::watch;

use crate::admin::{self, AdminState};
use crate::crd::NetworkAttachmentDefinition;
use crate::metrics::Metrics;
use crate::webhook::{self, WatchedNads, WebhookState, tls::CertFiles};
use nads::{NadChanged, nad_cache};

mod nads;

/// The flags of `run`, each with a `WHEREABOUTS_<NAME>` environment fallback.
#[derive(Debug, Clone, clap::Args)]
pub struct RunArgs {
    /// Plain-HTTP address for /metrics, /livez and /readyz. `[::]` takes IPv4 and IPv6 (on a
    /// kernel without IPv6 it falls back to `0.0.0.0`).
    #[arg(
        long,
        env = "WHEREABOUTS_ADMIN_ADDR",
        default_value = "[::]:8080",
        value_name = "ADDR"
    )]
    pub admin_addr: SocketAddr,
    /// HTTPS address of the admission webhook (POST /validate); `[::]` as `--admin-addr`.
    #[arg(
        long,
        env = "WHEREABOUTS_WEBHOOK_ADDR",
        default_value = "[::]:8443",
        value_name = "ADDR"
    )]
    pub webhook_addr: SocketAddr,
    /// PEM certificate chain of the webhook; the webhook is off without it. Reloaded on change.
    #[arg(
        long,
        env = "WHEREABOUTS_TLS_CERT_FILE",
        value_name = "FILE",
        requires = "tls_key_file"
    )]
    pub tls_cert_file: Option<PathBuf>,
    /// PEM private key of the webhook certificate. Reloaded on change.
    #[arg(
        long,
        env = "WHEREABOUTS_TLS_KEY_FILE",
        value_name = "FILE",
        requires = "tls_cert_file"
    )]
    pub tls_key_file: Option<PathBuf>,
    /// Manage the webhook's certificate when none is given by file: a CA and a serving
    /// certificate for --webhook-service kept in this Secret of the operator's namespace
    /// (`POD_NAMESPACE`), the CA injected into --webhook-configuration, renewed before expiry.
    #[arg(
        long,
        env = "WHEREABOUTS_WEBHOOK_CERTIFICATE_SECRET",
        value_name = "NAME",
        conflicts_with = "tls_cert_file"
    )]
    pub webhook_certificate_secret: Option<String>,
    /// The Service the API server calls the webhook through (the certificate's names).
    #[arg(
        long,
        env = "WHEREABOUTS_WEBHOOK_SERVICE",
        default_value = "whereabouts-webhook",
        value_name = "NAME"
    )]
    pub webhook_service: String,
    /// The ValidatingWebhookConfiguration whose caBundle the operator keeps.
    #[arg(
        long,
        env = "WHEREABOUTS_WEBHOOK_CONFIGURATION",
        default_value = "whereabouts-nad-validation",
        value_name = "NAME"
    )]
    pub webhook_configuration: String,
    /// The failure policy the operator sets once it serves (the install ships `Ignore`, so that
    /// no NAD change is refused before a certificate exists); empty leaves it as installed.
    #[arg(long, env = "WHEREABOUTS_WEBHOOK_FAILURE_POLICY", default_value = "Fail", value_parser = ["Fail", "Ignore", ""], value_name = "POLICY")]
    pub webhook_failure_policy: String,
    /// Where the self-managed serving certificate is written for the webhook to serve (a
    /// writable directory: an emptyDir in the Deployment).
    #[arg(
        long,
        env = "WHEREABOUTS_WEBHOOK_CERT_DIR",
        default_value = "/run/whereabouts-webhook",
        value_name = "DIR"
    )]
    pub webhook_cert_dir: PathBuf,
    /// Webhook connections open at once; more wait in the listen queue. Each costs memory while
    /// open (docs/benchmarks.md, "Webhook under abuse").
    #[arg(long, env = "WHEREABOUTS_WEBHOOK_MAX_CONNECTIONS", default_value_t = webhook::limits::MAX_CONNECTIONS, value_parser = clap::builder::RangedU64ValueParser::<usize>::new().range(1..), value_name = "N")]
    pub webhook_max_connections: usize,
    /// Webhook requests handled at once (each may buffer a body of up to 1 MiB); more wait up to
    /// 1 s for a slot, then get 503.
    #[arg(long, env = "WHEREABOUTS_WEBHOOK_MAX_REQUESTS", default_value_t = webhook::limits::MAX_REQUESTS, value_parser = clap::builder::RangedU64ValueParser::<usize>::new().range(1..), value_name = "N")]
    pub webhook_max_requests: usize,
    /// Namespace of the IP pools (default: the kubeconfig context's namespace, else kube-system).
    #[arg(long, env = "WHEREABOUTS_POOL_NAMESPACE", value_name = "NAMESPACE")]
    pub pool_namespace: Option<String>,
    /// How often the pool audit looks for entries whose pod is gone and for orphan reservations.
    #[arg(long, env = "WHEREABOUTS_AUDIT_INTERVAL", default_value = "5m", value_parser = parse_duration, value_name = "DURATION")]
    pub audit_interval: Duration,
    /// How long an allocation must look stale before the pool audit frees it.
    #[arg(long, env = "WHEREABOUTS_STALE_GRACE", default_value = "60s", value_parser = parse_duration, value_name = "DURATION")]
    pub stale_grace: Duration,
    /// The youngest claim (reservation without a pool entry, by its last write) the audit sweeps.
    /// An ADD at work holds its claim unrecorded for up to 120 s; the default adds a minute for
    /// clocks. Lower it only in tests.
    #[arg(long, env = "WHEREABOUTS_ORPHAN_CLAIM_AGE", default_value = "3m", value_parser = parse_duration, value_name = "DURATION")]
    pub orphan_claim_age: Duration,
    /// How long the kubelet of a Ready node may take to DEL a deleted pod's sandboxes before the
    /// operator frees its addresses; a force-deleted pod's containers may still run meanwhile.
    /// Longer than the node lifecycle controller's grace (40-50 s), so that a dead kubelet's node
    /// turns NotReady first, and those pods wait until it is Ready again or deleted.
    #[arg(long, env = "WHEREABOUTS_DELETED_POD_GRACE", default_value = "60s", value_parser = parse_duration, value_name = "DURATION")]
    pub deleted_pod_grace: Duration,
    /// Elect a leader among operator replicas before running controllers (true or false).
    #[arg(long, env = "WHEREABOUTS_LEADER_ELECTION", default_value_t = true, action = clap::ArgAction::Set, value_name = "BOOL")]
    pub leader_election: bool,
    /// Report what the controllers would change without writing.
    #[arg(long, env = "WHEREABOUTS_DRY_RUN")]
    pub dry_run: bool,
}

/// The self-managed certificate's settings from the flags; the namespace is the operator's own.
fn self_managed(args: &RunArgs, secret: &str) -> webhook::certs::SelfManaged {
    let namespace = std::env::var("POD_NAMESPACE")
        .ok()
        .filter(|n| !n.is_empty())
        .unwrap_or_else(|| "whereabouts-operator".to_owned());
    let dir = &args.webhook_cert_dir;
    webhook::certs::SelfManaged {
        namespace,
        secret: secret.to_owned(),
        service: args.webhook_service.clone(),
        webhook_configuration: args.webhook_configuration.clone(),
        failure_policy: Some(args.webhook_failure_policy.clone()).filter(|p| !p.is_empty()),
        files: CertFiles::new(dir.join("tls.crt"), dir.join("tls.key")),
    }
}

/// `90s`, `5m`, `1h30m`, `250ms`: a number followed by a unit, repeated (humantime's units
/// and spellings, such as `1h 30m` or `2 hours`, too).
pub fn parse_duration(text: &str) -> Result<Duration, String> {
    let bad = || format!("{text:?} is not a duration (for example 30s, 5m, 1h30m, 250ms)");
    // humantime also reads fractions (`1.5s`); these flags have only ever taken whole units.
    if text.contains('.') {
        return Err(bad());
    }
    humantime::parse_duration(text.trim()).map_err(|_| bad())
}

/// Readiness of the NAD watch cache.
const SYNCING: u8 = 0;
const SYNCED: u8 = 1;
const CRD_ABSENT: u8 = 2;

type Task = Pin<Box<dyn Future<Output = anyhow::Result<()>> + Send>>;

/// A shutdown signal every task can wait on.
#[derive(Clone)]
pub struct Shutdown(watch::Receiver<bool>);

impl Shutdown {
    pub async fn wait(mut self) {
        let _ = self.0.wait_for(|stop| *stop).await;
    }
}

pub async fn run(args: RunArgs) -> anyhow::Result<()> {
    let (stop_tx, stop_rx) = watch::channel(false);
    let shutdown = Shutdown(stop_rx);
    // The operator's one registry: the controllers and the webhook count into it, the admin port
    // renders it.
    let metrics = Arc::new(Metrics::new());
    let admin_state = AdminState::new({
        let metrics = metrics.clone();
        move || metrics.render()
    });
    let mut components = Components {
        tasks: Vec::new(),
        admin_state,
        metrics,
        shutdown,
    };
    let (client, namespace) = client().await?;
    let nads = components.start_nad_cache(client.clone());
    let tasks = components
        .start_webhook(&args, &nads, &client)?
        .start_controllers(&args, client, namespace, nads)
        .start_admin(&args)
        .await?;
    supervise(tasks, stop_tx).await
}

/// What `run` builds the components into, one after the other: the tasks the supervisor runs,
/// the admin port's readiness checks (each component adds its own), and what they all share.
struct Components {
    tasks: Vec<Task>,
    admin_state: AdminState,
    metrics: Arc<Metrics>,
    shutdown: Shutdown,
}

/// The NAD watch cache: its store, who hears of its changes, and its readiness.
struct Nads {
    store: reflector::Store<NetworkAttachmentDefinition>,
    changed: Arc<tokio::sync::Notify>,
    generation: Arc<AtomicU64>,
    cache: Arc<AtomicU8>,
}

impl Components {
    /// One NAD watch feeds both the webhook (overlap warnings) and the NAD controller.
    fn start_nad_cache(&mut self, client: Client) -> Nads {
        let (store, writer) = reflector::store::<NetworkAttachmentDefinition>();
        let nads = Nads {
            store,
            changed: Arc::new(tokio::sync::Notify::new()),
            generation: Arc::new(AtomicU64::new(0)),
            cache: Arc::new(AtomicU8::new(SYNCING)),
        };
        self.tasks.push(Box::pin(nad_cache(
            client,
            writer,
            nads.cache.clone(),
            NadChanged {
                notify: nads.changed.clone(),
                generation: nads.generation.clone(),
            },
            self.shutdown.clone(),
        )));
        nads
    }

    /// The admission webhook, when a certificate is given: ready once the certificate is loaded
    /// and the NAD cache has synced. Its port is bound here, so a bad address fails the start.
    fn start_webhook(
        mut self,
        args: &RunArgs,
        nads: &Nads,
        client: &Client,
    ) -> anyhow::Result<Self> {
        let loaded = Arc::new(AtomicBool::new(false));
        let files = match (
            &args.tls_cert_file,
            &args.tls_key_file,
            &args.webhook_certificate_secret,
        ) {
            (Some(cert), Some(key), _) => CertFiles::new(cert, key),
            (_, _, Some(secret)) => {
                let cfg = self_managed(args, secret);
                let files = cfg.files.clone();
                tracing::info!(secret = %secret, namespace = %cfg.namespace, service = %cfg.service, "the webhook manages its own certificate");
                let (l, c) = (loaded.clone(), nads.cache.clone());
                // Ready as /readyz says: the certificate loaded and the NAD cache synced.
                let ready = move || l.load(Ordering::SeqCst) && c.load(Ordering::SeqCst) != SYNCING;
                let (client, stop) = (client.clone(), self.shutdown.clone());
                self.tasks.push(Box::pin(async move {
                    webhook::certs::run(client, cfg, ready, stop.wait()).await;
                    Ok(())
                }));
                files
            }
            _ => {
                tracing::info!(
                    "no --tls-cert-file/--tls-key-file or --webhook-certificate-secret: the admission webhook is off"
                );
                return Ok(self);
            }
        };
        let (l, c) = (loaded.clone(), nads.cache.clone());
        self.admin_state = self
            .admin_state
            .check("webhook-certificate", move || {
                l.load(Ordering::SeqCst)
                    .then_some(())
                    .ok_or_else(|| "not loaded".to_owned())
            })
            .check("nad-cache", move || match c.load(Ordering::SeqCst) {
                SYNCING => Err("not synced".to_owned()),
                _ => Ok(()),
            });
        let listener = webhook::limits::listen(args.webhook_addr)
            .with_context(|| format!("--webhook-addr {}: cannot listen", args.webhook_addr))?;
        let limits = webhook::Limits {
            max_connections: args.webhook_max_connections,
            max_requests: args.webhook_max_requests,
            ..webhook::Limits::default()
        };
        let app = webhook::router_with(
            WebhookState::new(
                Arc::new(WatchedNads {
                    store: nads.store.clone(),
                    generation: nads.generation.clone(),
                }),
                self.metrics.clone(),
            ),
            &limits,
        );
        let (stop, addr) = (self.shutdown.clone(), args.webhook_addr);
        self.tasks.push(Box::pin(async move {
            tracing::info!(addr = %addr, "admission webhook listening (HTTPS)");
            webhook::tls::serve(listener, files, app, limits, loaded, stop.wait())
                .await
                .context("webhook server")
        }));
        Ok(self)
    }

    /// The controllers (pod cleanup, pool audit, NAD/pool reconciliation, leader election), with
    /// the readiness checks of their caches and of the election.
    fn start_controllers(
        mut self,
        args: &RunArgs,
        client: Client,
        namespace: String,
        nads: Nads,
    ) -> Self {
        let health = Arc::new(crate::controller::Health::default());
        let (h1, h2) = (health.clone(), health.clone());
        self.admin_state = self
            .admin_state
            .check("caches", move || flag(&h1.caches_synced, "not synced"))
            .check("leader-election", move || {
                flag(&h2.election_running, "not running")
            });
        if args.orphan_claim_age < crate::alloc::CLAIM_LIFETIME {
            tracing::warn!(
                orphan_claim_age = ?args.orphan_claim_age,
                claim_lifetime = ?crate::alloc::CLAIM_LIFETIME,
                "--orphan-claim-age is below the time an ADD may hold its claim unrecorded: the audit may delete the claim of an ADD at work (for tests only)"
            );
        }
        let opts = crate::controller::Options {
            pool_namespace: args.pool_namespace.clone().unwrap_or(namespace),
            audit_interval: args.audit_interval,
            stale_grace: args.stale_grace,
            orphan_claim_age: args.orphan_claim_age,
            deleted_pod_grace: args.deleted_pod_grace,
            dry_run: args.dry_run,
            leader_election: args.leader_election,
            identity: identity(),
        };
        tracing::info!(pool_namespace = %opts.pool_namespace, identity = %opts.identity, dry_run = opts.dry_run, "controllers starting");
        let (stop, metrics) = (self.shutdown.clone(), self.metrics.clone());
        let Nads { store, changed, .. } = nads;
        self.tasks.push(Box::pin(async move {
            crate::controller::run(client, opts, health, store, changed, metrics, stop.wait()).await
        }));
        self
    }

    /// The admin port (probes and metrics), last: it serves the checks every component added.
    /// Returns the tasks, now all there.
    async fn start_admin(mut self, args: &RunArgs) -> anyhow::Result<Vec<Task>> {
        let (listener, addr) = admin::listen(args.admin_addr, 1024)
            .with_context(|| format!("--admin-addr {}: cannot listen", args.admin_addr))?;
        let admin_listener = tokio::net::TcpListener::from_std(listener)?;
        let (stop, admin_state) = (self.shutdown.clone(), self.admin_state);
        self.tasks.push(Box::pin(async move {
            tracing::info!(addr = %addr, "admin port listening (HTTP)");
            axum::serve(admin_listener, admin::router(admin_state))
                .with_graceful_shutdown(stop.wait())
                .await
                .context("admin server")
        }));
        Ok(self.tasks)
    }
}

/// Runs every task; the first failure or a signal stops them all.
async fn supervise(tasks: Vec<Task>, stop: watch::Sender<bool>) -> anyhow::Result<()> {
    let mut set = tokio::task::JoinSet::new();
    for t in tasks {
        set.spawn(t);
    }
    let mut result = Ok(());
    tokio::select! {
        () = signal() => tracing::info!("shutting down"),
        Some(first) = set.join_next() => {
            result = flatten(first);
            if result.is_ok() {
                result = Err(anyhow::anyhow!("a component stopped unexpectedly"));
            }
        }
    }
    let _ = stop.send(true);
    let drain = async {
        while let Some(done) = set.join_next().await {
            if let Err(e) = flatten(done) {
                tracing::error!(error = %format!("{e:#}"), "component failed during shutdown");
            }
        }
    };
    if tokio::time::timeout(webhook::tls::DRAIN + Duration::from_secs(2), drain)
        .await
        .is_err()
    {
        tracing::warn!("components did not stop in time");
    }
    result
}

fn flatten(r: Result<anyhow::Result<()>, tokio::task::JoinError>) -> anyhow::Result<()> {
    r.map_err(anyhow::Error::from)?
}

pub async fn signal() {
    use tokio::signal::unix::{SignalKind, signal};
    let mut term = signal(SignalKind::terminate()).expect("install SIGTERM handler");
    tokio::select! {
        _ = term.recv() => {}
        _ = tokio::signal::ctrl_c() => {}
    }
}

fn flag(f: &AtomicBool, why: &str) -> Result<(), String> {
    f.load(Ordering::SeqCst)
        .then_some(())
        .ok_or_else(|| why.to_owned())
}

/// This replica's name in the leader Lease: the pod name in a cluster (downward API `POD_NAME`),
/// else the host name and process id.
fn identity() -> String {
    std::env::var("POD_NAME")
        .ok()
        .filter(|n| !n.is_empty())
        .unwrap_or_else(|| {
            let host = std::fs::read_to_string("/proc/sys/kernel/hostname").unwrap_or_default();
            format!("{}-{}", host.trim(), std::process::id())
        })
}

async fn client() -> anyhow::Result<(Client, String)> {
    let (mut config, namespace) = crate::kubeconfig::load(None).await?;
    crate::kubeconfig::identify(&mut config, "operator");
    Ok((Client::try_from(config)?, namespace))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn durations() {
        assert_eq!(parse_duration("5m"), Ok(Duration::from_secs(300)));
        assert_eq!(parse_duration("1h30m"), Ok(Duration::from_secs(5400)));
        assert_eq!(parse_duration("250ms"), Ok(Duration::from_millis(250)));
        for bad in ["", "5", "m", "5x", "-1s", "1.5s"] {
            assert!(parse_duration(bad).is_err(), "{bad}");
        }
    }
}
