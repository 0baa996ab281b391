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
}

/// With a path (the flat file's `kubernetes.kubeconfig`): that file. Without: `KUBECONFIG`, then
/// `~/.kube/config`, then the in-cluster service account, as kube-rs infers it.
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
