//! `whereabouts-operator install-cni`: the node installer a DaemonSet runs on every node.
//!
//! It copies the `whereabouts` CNI binary into the host's CNI bin dir, writes the flat file
//! (`whereabouts.d/whereabouts.conf`) that points the plugin at a kubeconfig, and writes that
//! kubeconfig with the pod's ServiceAccount token and CA embedded, so the plugin (run by the
//! container runtime on the host) needs none of the pod's files. Then it keeps checking the token
//! and the CA (both rotate) and rewrites what changed.
//!
//! Every file is written to a temporary file in the target's own directory, fsynced, given its
//! final mode and renamed over the target: the runtime sees the old file or the new one, never a
//! half-written binary or kubeconfig. Temporary names start with a dot (the runtime looks plugins
//! up by exact name) and leftovers of a killed run are removed at the next start.

use std::path::{Path, PathBuf};
use std::time::Duration;

use anyhow::{Context as _, bail};
use base64::Engine as _;
use kube::config::{
    AuthInfo, Cluster, Context, Kubeconfig, NamedAuthInfo, NamedCluster, NamedContext,
};

use super::run::parse_duration;

mod arch;
mod files;
mod flat;
mod uninstall;
pub use files::{remove_stale_temps, write_atomic};
pub use flat::flat_file;
pub use uninstall::remove_host_files;

const SA_DIR: &str = "/var/run/secrets/kubernetes.io/serviceaccount";
/// Prefix of every temporary file this installer creates (see [`write_atomic`]).
pub const TEMP_PREFIX: &str = ".whereabouts-install.";

pub const BINARY_MODE: u32 = 0o755;
pub const FLAT_FILE_MODE: u32 = 0o644;
pub const KUBECONFIG_MODE: u32 = 0o600;

/// The flags of `install-cni`, each with a `WHEREABOUTS_<NAME>` environment fallback.
#[derive(Debug, Clone, clap::Args)]
pub struct InstallCniArgs {
    /// Where the host's file system is mounted; every file is written under it.
    #[arg(
        long,
        env = "WHEREABOUTS_HOST_ROOT",
        default_value = "/host",
        value_name = "DIR"
    )]
    pub host_root: PathBuf,
    /// The host's CNI bin dir (as seen from the host).
    #[arg(
        long,
        env = "WHEREABOUTS_CNI_BIN_DIR",
        default_value = "/opt/cni/bin",
        value_name = "DIR",
        value_parser = parse_host_dir
    )]
    pub cni_bin_dir: PathBuf,
    /// The host's CNI config dir (as seen from the host); files go to its `whereabouts.d/`.
    #[arg(
        long,
        env = "WHEREABOUTS_CNI_CONF_DIR",
        default_value = "/etc/cni/net.d",
        value_name = "DIR",
        value_parser = parse_host_dir
    )]
    pub cni_conf_dir: PathBuf,
    /// The CNI plugin to install (default: `whereabouts` next to this executable).
    #[arg(long, env = "WHEREABOUTS_SOURCE_BINARY", value_name = "FILE")]
    pub source_binary: Option<PathBuf>,
    /// The pod's ServiceAccount token, embedded in the kubeconfig.
    #[arg(
        long,
        env = "WHEREABOUTS_TOKEN_FILE",
        default_value = "/var/run/secrets/kubernetes.io/serviceaccount/token",
        value_name = "FILE"
    )]
    pub token_file: PathBuf,
    /// The cluster CA bundle, embedded in the kubeconfig.
    #[arg(
        long,
        env = "WHEREABOUTS_CA_FILE",
        default_value = "/var/run/secrets/kubernetes.io/serviceaccount/ca.crt",
        value_name = "FILE"
    )]
    pub ca_file: PathBuf,
    /// The pod's namespace file (the default of --pool-namespace).
    #[arg(
        long,
        env = "WHEREABOUTS_NAMESPACE_FILE",
        default_value = "/var/run/secrets/kubernetes.io/serviceaccount/namespace",
        value_name = "FILE"
    )]
    pub namespace_file: PathBuf,
    /// API server URL for the plugin (default: https://$KUBERNETES_SERVICE_HOST:$KUBERNETES_SERVICE_PORT).
    #[arg(long, env = "WHEREABOUTS_API_SERVER", value_name = "URL")]
    pub api_server: Option<String>,
    /// Namespace of the IP pools, written as the kubeconfig context's namespace
    /// (default: the content of --namespace-file).
    #[arg(long, env = "WHEREABOUTS_POOL_NAMESPACE", value_name = "NAMESPACE")]
    pub pool_namespace: Option<String>,
    /// `log_level` written into the flat file (debug, verbose, error, panic); none by default.
    #[arg(long, env = "WHEREABOUTS_LOG_LEVEL", value_name = "LEVEL")]
    pub log_level: Option<String>,
    /// How often to check the token and CA for rotation.
    #[arg(long, env = "WHEREABOUTS_INTERVAL", default_value = "30s", value_parser = parse_duration, value_name = "DURATION")]
    pub interval: Duration,
    /// Install once and exit.
    #[arg(long, env = "WHEREABOUTS_ONCE")]
    pub once: bool,
    /// This node's name, written to `whereabouts.d/nodename` where the plugin (ours and
    /// upstream's) looks for it when a network uses node slices. The DaemonSet passes
    /// `spec.nodeName`.
    #[arg(long, env = "NODENAME", value_name = "NAME", value_parser = parse_node_name)]
    pub node_name: Option<String>,
    /// This pod's name and namespace (the DaemonSet passes them from the downward API): when
    /// stopped, the installer removes its host files if its DaemonSet is being deleted.
    #[arg(long, env = "POD_NAME", value_name = "NAME")]
    pub pod_name: Option<String>,
    #[arg(long, env = "POD_NAMESPACE", value_name = "NAMESPACE")]
    pub pod_namespace: Option<String>,
}

/// A node name, checked to be usable in the object names of node slices' pools.
/// A host folder (--cni-bin-dir, --cni-conf-dir): a clean absolute path. A relative one would be
/// written into the flat file as the kubeconfig's path, which the plugin resolves from wherever
/// the runtime runs it; `..` would leave --host-root.
fn parse_host_dir(text: &str) -> Result<PathBuf, String> {
    if crate::config::trust::is_clean_absolute(text) {
        Ok(PathBuf::from(text))
    } else {
        Err(format!(
            "{text:?} is not a clean absolute path (as the host sees it, with no `.`, `..`, `//` or trailing `/`)"
        ))
    }
}

fn parse_node_name(text: &str) -> Result<String, String> {
    match crate::ipam::naming::object_name_problem(text) {
        None => Ok(text.to_owned()),
        Some(why) => Err(format!("{text:?} is not a node name: it {why}")),
    }
}

impl InstallCniArgs {
    /// Defaults for every flag (what a DaemonSet gets with no flags), without reading the
    /// environment.
    pub fn defaults() -> InstallCniArgs {
        let sa = Path::new(SA_DIR);
        InstallCniArgs {
            host_root: "/host".into(),
            cni_bin_dir: "/opt/cni/bin".into(),
            cni_conf_dir: "/etc/cni/net.d".into(),
            source_binary: None,
            token_file: sa.join("token"),
            ca_file: sa.join("ca.crt"),
            namespace_file: sa.join("namespace"),
            api_server: None,
            pool_namespace: None,
            log_level: None,
            interval: Duration::from_secs(30),
            once: false,
            node_name: None,
            pod_name: None,
            pod_namespace: None,
        }
    }

    /// A host path (`/opt/cni/bin`) under --host-root.
    fn under_root(&self, host_path: &Path) -> PathBuf {
        self.host_root
            .join(host_path.strip_prefix("/").unwrap_or(host_path))
    }

    /// The kubeconfig's path as the host (and so the plugin) sees it.
    pub fn host_kubeconfig_path(&self) -> PathBuf {
        self.cni_conf_dir
            .join("whereabouts.d")
            .join("whereabouts.kubeconfig")
    }

    /// Where the binary, the flat file and the kubeconfig are written (under --host-root).
    pub fn targets(&self) -> Targets {
        let conf = self.under_root(&self.cni_conf_dir).join("whereabouts.d");
        Targets {
            binary: self.under_root(&self.cni_bin_dir).join("whereabouts"),
            flat_file: conf.join("whereabouts.conf"),
            kubeconfig: conf.join("whereabouts.kubeconfig"),
            nodename: conf.join("nodename"),
        }
    }
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Targets {
    pub binary: PathBuf,
    pub flat_file: PathBuf,
    pub kubeconfig: PathBuf,
    pub nodename: PathBuf,
}

/// What one pass changed.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct Report {
    pub binary: bool,
    pub flat_file: bool,
    pub kubeconfig: bool,
    pub nodename: bool,
}

/// Installs, then (without --once) re-checks every --interval until SIGTERM or SIGINT. A failed
/// re-check is logged and retried; only the first pass must succeed.
pub async fn run(args: InstallCniArgs) -> anyhow::Result<()> {
    // Handlers first: a SIGTERM during the first pass must end the loop cleanly, not kill the
    // process with the default action (the signal future below registers nothing until polled).
    use tokio::signal::unix::{SignalKind, signal};
    let mut term = signal(SignalKind::terminate()).context("install the SIGTERM handler")?;
    let mut int = signal(SignalKind::interrupt()).context("install the SIGINT handler")?;
    let targets = args.targets();
    for dir in [&targets.binary, &targets.kubeconfig] {
        if let Some(dir) = dir.parent() {
            remove_stale_temps(dir);
        }
    }
    let report = install_once(&args)?;
    tracing::info!(
        binary = %targets.binary.display(),
        kubeconfig = %targets.kubeconfig.display(),
        changed = ?report,
        "installed"
    );
    if args.once {
        return Ok(());
    }
    loop {
        tokio::select! {
            _ = term.recv() => {
                tracing::info!("shutting down");
                uninstall::on_stop(&args).await;
                return Ok(());
            }
            _ = int.recv() => {
                tracing::info!("shutting down");
                return Ok(());
            }
            () = tokio::time::sleep(args.interval) => {}
        }
        match install_once(&args) {
            Ok(r) if r != Report::default() => tracing::info!(changed = ?r, "updated"),
            Ok(_) => {}
            Err(e) => tracing::error!(error = %format!("{e:#}"), "update failed; retrying"),
        }
    }
}

/// One pass: reads the sources, writes each target whose bytes differ.
pub fn install_once(args: &InstallCniArgs) -> anyhow::Result<Report> {
    let targets = args.targets();
    let source = source_binary(args)?;
    let binary = std::fs::read(&source)
        .with_context(|| format!("--source-binary {}: cannot read", source.display()))?;
    let (bin_dir, file_name) = (
        targets.binary.parent().expect("targets have a parent"),
        targets
            .binary
            .file_name()
            .unwrap_or_default()
            .to_string_lossy(),
    );
    arch::check(&binary, bin_dir, &file_name)
        .with_context(|| format!("--source-binary {}", source.display()))?;
    let kubeconfig = kubeconfig(args)?;

    for (dir, flag) in [
        (targets.binary.parent(), "--cni-bin-dir"),
        (targets.kubeconfig.parent(), "--cni-conf-dir"),
    ] {
        let dir = dir.expect("targets have a parent");
        std::fs::create_dir_all(dir)
            .with_context(|| format!("{flag}: cannot create {}", dir.display()))?;
    }
    let flat = flat_file(args, read_if_present(&targets.flat_file)?.as_deref())
        .with_context(|| format!("--cni-conf-dir: {}", targets.flat_file.display()))?;
    Ok(Report {
        binary: write_atomic(&targets.binary, &binary, BINARY_MODE)
            .with_context(|| format!("--cni-bin-dir: installing {}", targets.binary.display()))?,
        kubeconfig: write_atomic(&targets.kubeconfig, kubeconfig.as_bytes(), KUBECONFIG_MODE)
            .with_context(|| format!("--cni-conf-dir: writing {}", targets.kubeconfig.display()))?,
        flat_file: write_atomic(&targets.flat_file, flat.as_bytes(), FLAT_FILE_MODE)
            .with_context(|| format!("--cni-conf-dir: writing {}", targets.flat_file.display()))?,
        nodename: match &args.node_name {
            Some(name) => write_atomic(
                &targets.nodename,
                format!("{name}\n").as_bytes(),
                FLAT_FILE_MODE,
            )
            .with_context(|| format!("--cni-conf-dir: writing {}", targets.nodename.display()))?,
            None => false,
        },
    })
}

/// The plugin to install: --source-binary, else `whereabouts` next to this executable.
fn source_binary(args: &InstallCniArgs) -> anyhow::Result<PathBuf> {
    match &args.source_binary {
        Some(p) => Ok(p.clone()),
        None => Ok(std::env::current_exe()
            .context("cannot find this executable to locate the plugin; set --source-binary")?
            .with_file_name("whereabouts")),
    }
}

/// The file at `path`, `None` when there is none yet.
fn read_if_present(path: &Path) -> anyhow::Result<Option<Vec<u8>>> {
    match std::fs::read(path) {
        Ok(bytes) => Ok(Some(bytes)),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(None),
        Err(e) => Err(e).with_context(|| format!("--cni-conf-dir: reading {}", path.display())),
    }
}

fn read_flag(path: &Path, flag: &str) -> anyhow::Result<Vec<u8>> {
    std::fs::read(path).with_context(|| format!("{flag} {}: cannot read", path.display()))
}

/// The API server URL: --api-server, else from the in-cluster service environment.
pub fn api_server(args: &InstallCniArgs) -> anyhow::Result<String> {
    if let Some(url) = args.api_server.as_deref().filter(|u| !u.is_empty()) {
        return Ok(url.to_owned());
    }
    let host = std::env::var("KUBERNETES_SERVICE_HOST").unwrap_or_default();
    let port = std::env::var("KUBERNETES_SERVICE_PORT").unwrap_or_default();
    if host.is_empty() || port.is_empty() {
        bail!(
            "--api-server is not set and KUBERNETES_SERVICE_HOST/KUBERNETES_SERVICE_PORT are not in the environment"
        );
    }
    Ok(if host.contains(':') {
        format!("https://[{host}]:{port}")
    } else {
        format!("https://{host}:{port}")
    })
}

/// The kubeconfig the plugin uses: the token and CA embedded, the pool namespace as the context
/// namespace.
pub fn kubeconfig(args: &InstallCniArgs) -> anyhow::Result<String> {
    let token = read_token(args)?;
    let ca = read_ca(args)?;
    let namespace = pool_namespace(args)?;
    let server = api_server(args)?;
    let config = plugin_kubeconfig(server, &ca, &token, namespace);
    // Plain scalars, not folded blocks: the token and the CA data are long single words.
    let yaml = serde_saphyr::to_string_with_options(
        &config,
        serde_saphyr::ser_options! { prefer_block_scalars: false },
    )
    .context("serialise the kubeconfig")?;
    Ok(format!(
        "# Written by whereabouts-operator install-cni for the whereabouts CNI plugin; rewritten when\n\
         # the ServiceAccount token or the CA changes.\n\
         {yaml}"
    ))
}

/// The ServiceAccount token (--token-file), trimmed: an empty one would authenticate nothing.
fn read_token(args: &InstallCniArgs) -> anyhow::Result<String> {
    let token = String::from_utf8(read_flag(&args.token_file, "--token-file")?)
        .with_context(|| format!("--token-file {}: not UTF-8", args.token_file.display()))?;
    let token = token.trim();
    if token.is_empty() {
        bail!("--token-file {}: is empty", args.token_file.display());
    }
    Ok(token.to_owned())
}

/// The CA bundle (--ca-file), which must hold a PEM certificate for the plugin to trust the API
/// server.
fn read_ca(args: &InstallCniArgs) -> anyhow::Result<Vec<u8>> {
    let ca = read_flag(&args.ca_file, "--ca-file")?;
    if !String::from_utf8_lossy(&ca).contains("-----BEGIN CERTIFICATE-----") {
        bail!(
            "--ca-file {}: holds no PEM certificate",
            args.ca_file.display()
        );
    }
    Ok(ca)
}

/// The pools' namespace: --pool-namespace, else the pod's own (--namespace-file).
fn pool_namespace(args: &InstallCniArgs) -> anyhow::Result<String> {
    if let Some(ns) = args.pool_namespace.as_deref().filter(|n| !n.is_empty()) {
        return Ok(ns.to_owned());
    }
    let ns = String::from_utf8_lossy(&read_flag(&args.namespace_file, "--namespace-file")?)
        .trim()
        .to_owned();
    if ns.is_empty() {
        bail!(
            "--namespace-file {}: is empty (or set --pool-namespace)",
            args.namespace_file.display()
        );
    }
    Ok(ns)
}

/// One cluster, one user and one context, all named `whereabouts`, and nothing else: the fields
/// kube's types leave unset are not written, so kubectl reads the file as well as the plugin.
fn plugin_kubeconfig(server: String, ca: &[u8], token: &str, namespace: String) -> Kubeconfig {
    let name = || "whereabouts".to_owned();
    Kubeconfig {
        api_version: Some("v1".to_owned()),
        kind: Some("Config".to_owned()),
        clusters: vec![NamedCluster {
            name: name(),
            cluster: Some(Cluster {
                server: Some(server),
                certificate_authority_data: Some(CA_DATA.encode(ca)),
                ..Cluster::default()
            }),
            ..NamedCluster::default()
        }],
        auth_infos: vec![NamedAuthInfo {
            name: name(),
            auth_info: Some(AuthInfo {
                token: Some(token.into()),
                ..AuthInfo::default()
            }),
            ..NamedAuthInfo::default()
        }],
        contexts: vec![NamedContext {
            name: name(),
            context: Some(Context {
                cluster: name(),
                user: Some(name()),
                namespace: Some(namespace),
                ..Context::default()
            }),
            ..NamedContext::default()
        }],
        current_context: Some(name()),
        ..Kubeconfig::default()
    }
}

/// How the CA bundle is embedded (`certificate-authority-data`): standard base64 with padding,
/// as client-go and kube-rs decode it.
pub const CA_DATA: base64::engine::GeneralPurpose = base64::engine::general_purpose::STANDARD;

#[cfg(test)]
mod tests;
