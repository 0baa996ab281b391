//! What the installer does when it is stopped: nothing, unless its DaemonSet is being deleted
//! (an uninstall). Then it removes what it put on the host, as long as no pod of this node still
//! holds an address: such a pod's DEL needs the plugin, so the files stay, working until the
//! token dies with this pod (the plugin's DEL then succeeds without freeing; see `cni::plugin`),
//! and a reinstall rewrites them.
//!
//! A rolling update, a drain or a node restart stops the installer too, with its DaemonSet in
//! place: it must not touch the host then, or every pod's DEL would fail until it is back. So
//! anything short of a DaemonSet that is certainly gone (404) or being deleted leaves the files.

use std::path::Path;
use std::time::Duration;

use k8s_openapi::api::apps::v1::DaemonSet;
use k8s_openapi::api::core::v1::Pod;
use kube::Api;
use kube::api::ListParams;

use super::{InstallCniArgs, Targets, pool_namespace};
use crate::crd::IPPool;

/// Within the DaemonSet's termination grace period (5 s).
const BUDGET: Duration = Duration::from_secs(3);

/// On SIGTERM: removes the host files when the DaemonSet is going away and the node holds no
/// address. Every failure leaves the files as they are (logged).
pub async fn on_stop(args: &InstallCniArgs) {
    let (Some(pod), Some(namespace)) = (&args.pod_name, &args.pod_namespace) else {
        return;
    };
    match tokio::time::timeout(BUDGET, decide(args, pod, namespace)).await {
        Ok(Ok(Decision::Keep(why))) => tracing::info!(%why, "leaving the host's files"),
        Ok(Ok(Decision::Remove)) => match remove_host_files(args) {
            Ok(removed) => tracing::info!(?removed, "uninstalled: removed the host's files"),
            Err(e) => tracing::error!(error = %format!("{e:#}"), "uninstall: removing failed"),
        },
        Ok(Err(e)) => tracing::warn!(error = %format!("{e:#}"), "leaving the host's files"),
        Err(_) => tracing::warn!("leaving the host's files: the API server did not answer in time"),
    }
}

#[derive(Debug, PartialEq, Eq)]
enum Decision {
    Keep(String),
    Remove,
}

async fn decide(args: &InstallCniArgs, pod: &str, namespace: &str) -> anyhow::Result<Decision> {
    let client = kube::Client::try_default().await?;
    let me = Api::<Pod>::namespaced(client.clone(), namespace)
        .get(pod)
        .await?;
    let Some(owner) = me
        .metadata
        .owner_references
        .unwrap_or_default()
        .into_iter()
        .find(|o| o.kind == "DaemonSet")
    else {
        return Ok(Decision::Keep("this pod has no DaemonSet".into()));
    };
    let daemonsets = Api::<DaemonSet>::namespaced(client.clone(), namespace);
    // A DaemonSet of that name that is not being deleted keeps the files, whether it is ours or
    // a successor (a reinstall racing this pod's termination): its installer owns them now.
    if let Some(ds) = daemonsets.get_opt(&owner.name).await?
        && ds.metadata.deletion_timestamp.is_none()
    {
        return Ok(Decision::Keep(format!(
            "DaemonSet {} is in place",
            owner.name
        )));
    }
    let Some(node) = &args.node_name else {
        return Ok(Decision::Keep(
            "NODENAME is not set: cannot tell this node's entries".into(),
        ));
    };
    let pools = Api::<IPPool>::namespaced(client, &pool_namespace(args)?);
    let held = held_on(&pools.list(&ListParams::default()).await?.items, node);
    if held.is_empty() {
        Ok(Decision::Remove)
    } else {
        Ok(Decision::Keep(format!(
            "DaemonSet {} is gone but pods of node {node} still hold addresses ({}): their DELs need the plugin",
            owner.name,
            held.join(", ")
        )))
    }
}

/// The pods (namespace/name) with an entry recorded by `node`.
fn held_on(pools: &[IPPool], node: &str) -> Vec<String> {
    let mut pods: Vec<String> = pools
        .iter()
        .flat_map(|p| p.spec.allocations.values())
        .filter(|e| e.node == node)
        .map(|e| e.podref.clone())
        .collect();
    pods.sort();
    pods.dedup();
    pods
}

/// Removes the plugin (only if it is the one this installer writes: an upstream binary copied
/// over it stays), the kubeconfig, the nodename file, the installer's keys of the flat file (the
/// file goes when nothing else is left in it) and `whereabouts.d` when empty. Returns the paths
/// removed or rewritten.
pub fn remove_host_files(args: &InstallCniArgs) -> anyhow::Result<Vec<String>> {
    let t: Targets = args.targets();
    let mut done = vec![];
    let ours = super::source_binary(args).and_then(|s| Ok(std::fs::read(s)?))?;
    if std::fs::read(&t.binary).is_ok_and(|b| b == ours) {
        remove(&t.binary, &mut done)?;
    }
    remove(&t.kubeconfig, &mut done)?;
    remove(&t.nodename, &mut done)?;
    if let Some(bytes) = super::read_if_present(&t.flat_file)? {
        match super::flat::without_installer_keys(args, &bytes) {
            Some(rest) => {
                super::write_atomic(&t.flat_file, rest.as_bytes(), super::FLAT_FILE_MODE)?;
                done.push(format!("{} (kept the admin's keys)", t.flat_file.display()));
            }
            None => remove(&t.flat_file, &mut done)?,
        }
    }
    if let Some(dir) = t.kubeconfig.parent()
        && std::fs::remove_dir(dir).is_ok()
    {
        done.push(dir.display().to_string());
    }
    Ok(done)
}

fn remove(path: &Path, done: &mut Vec<String>) -> std::io::Result<()> {
    match std::fs::remove_file(path) {
        Ok(()) => {
            done.push(path.display().to_string());
            Ok(())
        }
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(()),
        Err(e) => Err(e),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::crd::{IPAllocation, IPPoolSpec};

    fn pool(entries: &[(&str, &str)]) -> IPPool {
        let allocations = entries
            .iter()
            .enumerate()
            .map(|(i, (podref, node))| {
                let e = IPAllocation {
                    podref: podref.to_string(),
                    node: node.to_string(),
                    ..Default::default()
                };
                (i.to_string(), e)
            })
            .collect();
        IPPool::new(
            "p",
            IPPoolSpec {
                range: "10.0.0.0/24".into(),
                allocations,
            },
        )
    }

    #[test]
    fn only_this_nodes_entries_hold_the_files() {
        let pools = [
            pool(&[("a/x", "n1"), ("a/y", "n2"), ("a/x", "n1")]),
            pool(&[("b/z", "n1"), ("c/legacy", "")]),
        ];
        assert_eq!(held_on(&pools, "n1"), ["a/x", "b/z"]);
        assert_eq!(held_on(&pools, "n3"), Vec::<String>::new());
    }
}
