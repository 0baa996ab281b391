//! `whereabouts-operator agent`: the node agent the DaemonSet runs next to the installer.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use anyhow::{Context as _, bail};

use super::run::{parse_duration, signal};
use crate::admin::{self, AdminState};
use crate::agent::batch::{Limits, MAX_POOL_QUEUE, MAX_QUEUED};
use crate::agent::health::Health;
use crate::agent::{Agent, bind, unbind};
use crate::config::DEFAULT_AGENT_SOCKET;
use crate::metrics::agent::AgentMetrics;
use crate::store::kubernetes::KubeStore;

/// The flags of `agent`, each with a `WHEREABOUTS_<NAME>` environment fallback.
#[derive(Debug, Clone, clap::Args)]
pub struct AgentArgs {
    /// The Unix socket the plugin connects to (its `agent_socket`), created owner-only.
    #[arg(long, env = "WHEREABOUTS_SOCKET", default_value = DEFAULT_AGENT_SOCKET, value_name = "PATH")]
    pub socket: PathBuf,
    /// The agent's own kubeconfig (default: KUBECONFIG, ~/.kube/config, then the in-cluster
    /// ServiceAccount, whose rotating token is re-read).
    #[arg(long, env = "WHEREABOUTS_KUBECONFIG", value_name = "FILE")]
    pub kubeconfig: Option<String>,
    /// Namespace of the IP pools (default: the kubeconfig context's namespace, else kube-system).
    /// Must be the namespace of the plugin kubeconfig this agent serves.
    #[arg(long, env = "WHEREABOUTS_POOL_NAMESPACE", value_name = "NAMESPACE")]
    pub pool_namespace: Option<String>,
    /// Requests whose `kubernetes.kubeconfig` is this path are run by the agent; others (another
    /// cluster or namespace) are handed back to the plugin. "" matches configs without one.
    #[arg(
        long,
        env = "WHEREABOUTS_SERVES_KUBECONFIG",
        default_value = "/etc/cni/net.d/whereabouts.d/whereabouts.kubeconfig",
        value_name = "PATH"
    )]
    pub serves_kubeconfig: String,
    /// How long requests in flight may finish after SIGTERM.
    #[arg(long, env = "WHEREABOUTS_GRACE", default_value = "20s", value_parser = parse_duration)]
    pub grace: Duration,
    /// Plain-HTTP address for /metrics, /livez and /readyz: `IP:PORT`, `[IPv6]:PORT`, or an
    /// IPv6 address without brackets followed by `:PORT` (the last colon is the port's, so the
    /// downward API's `status.hostIP` works for either family). The DaemonSet runs on the host
    /// network, so this is a port of the node: it binds the node's own address there, never every
    /// address (the default is loopback). 9437 is clear of the kubelet (10248, 10250), kube-proxy
    /// (10249, 10256), node-exporter (9100), Calico (9091, 9099), Cilium (9879, 9890, 9962-9965)
    /// and NodePorts (30000-32767).
    #[arg(
        long,
        env = "WHEREABOUTS_ADMIN_ADDR",
        default_value = "127.0.0.1:9437",
        value_name = "ADDR",
        value_parser = parse_admin_addr
    )]
    pub admin_addr: SocketAddr,
    /// Requests one pool's queue holds before the agent hands the next ones back to the plugin
    /// (which then runs them within the node's `plugin_slots`).
    #[arg(long, env = "WHEREABOUTS_MAX_QUEUED_PER_POOL", default_value_t = MAX_POOL_QUEUE, value_parser = clap::builder::RangedU64ValueParser::<usize>::new().range(1..))]
    pub max_queued_per_pool: usize,
    /// Requests all queues hold together before the agent hands the next ones back.
    #[arg(long, env = "WHEREABOUTS_MAX_QUEUED", default_value_t = MAX_QUEUED, value_parser = clap::builder::RangedU64ValueParser::<usize>::new().range(1..))]
    pub max_queued: usize,
}

/// `--admin-addr`: a socket address, or an unbracketed IPv6 address and a port.
pub fn parse_admin_addr(text: &str) -> Result<SocketAddr, String> {
    if let Ok(addr) = text.parse() {
        return Ok(addr);
    }
    let bad = || {
        format!("{text:?} is not an address and port (10.0.0.1:9437, [fd00::1]:9437, fd00::1:9437)")
    };
    let (ip, port) = text.rsplit_once(':').ok_or_else(bad)?;
    let ip: std::net::Ipv6Addr = ip.parse().map_err(|_| bad())?;
    let port: u16 = port.parse().map_err(|_| bad())?;
    Ok(SocketAddr::from((ip, port)))
}

pub async fn run(args: AgentArgs) -> anyhow::Result<()> {
    if !args.socket.is_absolute() {
        bail!("--socket {:?}: must be an absolute path", args.socket);
    }
    let (mut config, context_namespace) = crate::kubeconfig::load(args.kubeconfig.as_deref())
        .await
        .context("kubernetes client config")?;
    let namespace = args.pool_namespace.unwrap_or(context_namespace);
    if let Some(problem) = crate::ipam::naming::object_name_problem(&namespace) {
        bail!("--pool-namespace {namespace:?}: {problem}");
    }
    config.connect_timeout = Some(Duration::from_secs(10));
    crate::kubeconfig::identify(&mut config, "agent");
    let store = KubeStore::over_http2(config, &namespace).context("kubernetes client")?;
    // The admin port first: a port taken is a configuration error to report before the socket
    // is taken over.
    let admin_listener = tokio::net::TcpListener::bind(args.admin_addr)
        .await
        .with_context(|| format!("--admin-addr {}: cannot listen", args.admin_addr))?;
    // The port actually bound: `:0` (tests running agents side by side) picks a free one.
    let admin = admin_listener.local_addr()?;
    let (listener, own_uid) = bind(&args.socket).await?;
    tracing::info!(socket = %args.socket.display(), %namespace, serves = %args.serves_kubeconfig, %admin, "node agent listening");
    // The agent's one registry: what it counts and what its admin port renders.
    let metrics = Arc::new(AgentMetrics::new());
    let limits = Limits {
        per_pool: args.max_queued_per_pool,
        total: args.max_queued,
    };
    let agent = Arc::new(Agent::with_limits(
        store,
        args.serves_kubeconfig,
        own_uid,
        limits,
        metrics.clone(),
    ));
    metrics.register_collector(Box::new(agent.batcher().depth_collector()));
    let health = Arc::new(Health::new(&args.socket));
    health.set_bound(true);
    tokio::spawn(serve_admin(admin_listener, health.clone(), metrics));
    let probes = health.clone();
    tokio::spawn(async move { probes.probe_forever().await });
    let shutdown = async move {
        signal().await;
        health.set_bound(false);
        tracing::info!("shutting down");
    };
    // New requests are handed back at once, those of containers with work here wait for it;
    // the socket goes only when that work is done (or the grace is over).
    agent.serve(listener, shutdown, args.grace).await;
    unbind(&args.socket);
    tracing::info!(socket = %args.socket.display(), "socket removed");
    Ok(())
}

/// `/livez` (the agent answers itself on its socket), `/readyz` (the socket is bound) and the
/// agent's `/metrics`, until the process ends.
async fn serve_admin(
    listener: tokio::net::TcpListener,
    health: Arc<Health>,
    metrics: Arc<AgentMetrics>,
) {
    let (live, ready) = (health.clone(), health);
    let state = AdminState::new(move || metrics.render())
        .live("socket", move || live.live())
        .check("socket", move || ready.ready());
    if let Err(e) = axum::serve(listener, admin::router(state)).await {
        tracing::error!(error = %e, "the admin port stopped; /livez fails and the kubelet restarts the agent");
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn admin_addresses_of_either_family() {
        let ok = |t: &str| parse_admin_addr(t).unwrap().to_string();
        assert_eq!(ok("10.0.0.1:9437"), "10.0.0.1:9437");
        assert_eq!(ok("[fd00::1]:9437"), "[fd00::1]:9437");
        assert_eq!(ok("fd00::1:9437"), "[fd00::1]:9437");
        for bad in [
            "",
            "9437",
            "10.0.0.1",
            "10.0.0.1:x",
            "node:9437",
            ":9437",
            "fd00::1:99999",
        ] {
            let e = parse_admin_addr(bad).unwrap_err();
            assert!(e.contains("is not an address and port"), "{bad}: {e}");
        }
    }
}
