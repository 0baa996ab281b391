//! Loading a Kubernetes client configuration and the namespace where pools live.
//!
//! Upstream keeps pools in the namespace of the kubeconfig's current context, `kube-system` when
//! the context names none; kube-rs would default to `default`, so the namespace is read here.

use kube::config::{Config, KubeConfigOptions, Kubeconfig};

pub const DEFAULT_POOL_NAMESPACE: &str = "kube-system";

#[derive(Debug, thiserror::Error)]
pub enum KubeconfigError {
    #[error("kubeconfig {path}: {source}")]
    Read {
        path: String,
        source: kube::config::KubeconfigError,
    },
    #[error("kubernetes client config: {0}")]
    Infer(#[from] kube::config::InferConfigError),
    #[error(
        "kubeconfig {path}: user {user:?} gets its credentials by running a command ({how}), which the CNI plugin never does (it runs as root, for configs anyone who may write a NAD controls): give it a token or a client certificate"
    )]
    RunsCommand {
        path: String,
        user: String,
        how: &'static str,
    },
}

/// The operator's, the agent's and the CLI's credentials. With a path (a flag): that file.
/// Without: `KUBECONFIG`, then `~/.kube/config`, then the in-cluster service account, as kube-rs
/// infers it. The CNI plugin uses [`load_node`] instead.
pub async fn load(path: Option<&str>) -> Result<(Config, String), KubeconfigError> {
    match path {
        Some(path) => {
            let read = |source| KubeconfigError::Read {
                path: path.to_owned(),
                source,
            };
            let kubeconfig = Kubeconfig::read_from(path).map_err(read)?;
            let namespace = context_namespace(&kubeconfig);
            let config = Config::from_custom_kubeconfig(kubeconfig, &KubeConfigOptions::default())
                .await
                .map_err(read)?;
            Ok((config, namespace))
        }
        None => {
            let namespace = Kubeconfig::read()
                .ok()
                .map(|k| context_namespace(&k))
                .unwrap_or_else(|| DEFAULT_POOL_NAMESPACE.to_owned());
            Ok((Config::infer().await?, namespace))
        }
    }
}

/// Names this component in every request (`User-Agent: whereabouts-<component>/<version>`): the
/// API server records it as the field manager of what it writes (`managedFields`, which the
/// chaos tier's history and `kubectl get -o yaml --show-managed-fields` read), in its audit log
/// and in API Priority and Fairness metrics. Without it every write of ours showed as "unknown".
pub fn identify(config: &mut Config, component: &str) {
    let agent = format!("whereabouts-{component}/{}", env!("CARGO_PKG_VERSION"));
    if let Ok(value) = axum::http::HeaderValue::from_str(&agent) {
        config
            .headers
            .retain(|(name, _)| name != axum::http::header::USER_AGENT);
        config.headers.push((axum::http::header::USER_AGENT, value));
    }
}

/// The CNI plugin's kubeconfig: that file only, never the ambient credentials, and refused when
/// any of its users would run a command (`exec`, `auth-provider`: kube-client runs both for
/// whatever kubeconfig it loads).
pub async fn load_node(path: &std::path::Path) -> Result<(Config, String), KubeconfigError> {
    let shown = path.display().to_string();
    let read = |source| KubeconfigError::Read {
        path: shown.clone(),
        source,
    };
    let kubeconfig = Kubeconfig::read_from(path).map_err(read)?;
    if let Some((user, how)) = command_user(&kubeconfig) {
        return Err(KubeconfigError::RunsCommand {
            path: shown,
            user,
            how,
        });
    }
    let namespace = context_namespace(&kubeconfig);
    let config = Config::from_custom_kubeconfig(kubeconfig, &KubeConfigOptions::default())
        .await
        .map_err(read)?;
    Ok((config, namespace))
}

/// The first user of `kubeconfig` that would run a command for its credentials, and how.
fn command_user(kubeconfig: &Kubeconfig) -> Option<(String, &'static str)> {
    kubeconfig.auth_infos.iter().find_map(|named| {
        let user = named.auth_info.as_ref()?;
        let how = if user.exec.is_some() {
            "exec"
        } else if user.auth_provider.is_some() {
            "auth-provider"
        } else {
            return None;
        };
        Some((named.name.clone(), how))
    })
}

/// The current context's namespace, or `kube-system`.
pub fn context_namespace(kubeconfig: &Kubeconfig) -> String {
    let current = kubeconfig.current_context.as_deref().unwrap_or_default();
    kubeconfig
        .contexts
        .iter()
        .find(|c| c.name == current)
        .and_then(|c| c.context.as_ref()?.namespace.clone())
        .filter(|n| !n.is_empty())
        .unwrap_or_else(|| DEFAULT_POOL_NAMESPACE.to_owned())
}

/// The longest an API request of the HTTP/2 client may take to answer.
const REQUEST_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(30);

/// A client that speaks HTTP/2 when the API server offers it (it does): every request of the
/// process shares one TLS connection. kube-rs's own client is HTTP/1.1 only and opens a
/// connection per request in flight, which for the node agent means tens of handshakes per burst
/// and tens of connections per node at the API server. Same layers as kube-rs's client: base
/// URI, authentication (refreshing tokens), extra headers.
pub fn http2_client(config: Config) -> Result<kube::Client, kube::Error> {
    use hyper_util::rt::{TokioExecutor, TokioTimer};
    use kube::client::ConfigExt as _;
    if config.tls_server_name.is_some() || config.proxy_url.is_some() {
        // Neither is wired here; kube-rs's client handles both.
        return kube::Client::try_from(config);
    }
    let tls = config.rustls_client_config()?;
    let mut http = hyper_util::client::legacy::connect::HttpConnector::new();
    http.enforce_http(false);
    http.set_connect_timeout(config.connect_timeout);
    // HTTP/2 writes a request as several small frames: with Nagle's algorithm on, the second
    // waits for the server's delayed ACK (measured: 33 ms sequential ADDs became 115 ms).
    http.set_nodelay(true);
    let https = hyper_rustls::HttpsConnectorBuilder::new()
        .with_tls_config(tls)
        .https_or_http()
        .enable_all_versions()
        .wrap_connector(http);
    let client: hyper_util::client::legacy::Client<_, kube::client::Body> =
        hyper_util::client::legacy::Client::builder(TokioExecutor::new())
            .timer(TokioTimer::new())
            // Finds a dead connection within a minute instead of at the next request's timeout.
            .http2_keep_alive_interval(std::time::Duration::from_secs(30))
            .http2_keep_alive_timeout(std::time::Duration::from_secs(20))
            .build(https);
    let service = tower::ServiceBuilder::new()
        .layer(config.base_uri_layer())
        .option_layer(config.auth_layer()?)
        .layer(config.extra_headers_layer()?)
        // One stalled request must not hold a pool's worker (and every ADD queued behind it)
        // until the plugins' deadlines: it fails and is retried like any other API error. The
        // limit runs until the response headers, so a watch's body is not cut off.
        .layer(tower::timeout::TimeoutLayer::new(REQUEST_TIMEOUT))
        .map_err(tower::BoxError::from)
        .service(client);
    Ok(kube::Client::new(service, config.default_namespace))
}
