//! CNI GC: the leaks of this node, told from live pods by the runtime's list of valid attachments
//! and each candidate's pod, read by name.

use std::collections::HashMap;

use serde_json::Value;

use super::Request;
use super::commands::held_targets;
use super::protocol::{CniError, Code};
use crate::alloc::{Engine, Owned, Owner};
use crate::store::Datastore;

/// CNI 1.1 GC: releases this node's entries of this network's pools whose attachment is not in
/// `cni.dev/valid-attachments` *and* whose pod is gone (no pod of the name, or one with another
/// UID). The list a runtime passes covers its own node only, so entries of other nodes, and
/// entries that record no node (upstream's, ours from before nodes were recorded), are never
/// GC's: the operator frees those whose pods are gone.
pub(super) async fn gc<S: Datastore>(store: &S, req: &Request) -> Result<usize, CniError> {
    let valid = valid_attachments(&req.conf.value)?;
    let Some(node) = req.node.as_deref() else {
        tracing::warn!(
            "gc: the node's name is unknown (NODENAME, whereabouts.d/nodename): nothing is released"
        );
        return Ok(0);
    };
    let retry = |e: crate::store::StoreError| CniError::datastore(&e);
    let mut pods = HashMap::new();
    let mut released = 0;
    let mut targets = Vec::new();
    for i in 0..req.targets.len() {
        targets.extend(held_targets(store, req, i).await?);
    }
    for target in &targets {
        let Some(pool) = store.get_pool(&target.pool).await.map_err(retry)? else {
            continue;
        };
        let unknown: Vec<_> = pool
            .allocations
            .iter()
            .filter(|(_, e)| e.node == node && !is_valid(&valid, e))
            .map(|(o, e)| (*o, e.clone()))
            .collect();
        if unknown.is_empty() {
            continue;
        }
        live_pods(store, &unknown, &mut pods).await.map_err(retry)?;
        let gone: Vec<_> = unknown
            .into_iter()
            .filter(|(_, e)| crate::ownership::is_stale(e, &pods))
            .collect();
        released += Engine::new(store, target)
            .release_entries(&gone)
            .await
            .map_err(retry)?
            .len();
    }
    tracing::info!(released, "gc");
    Ok(released)
}

/// Adds the UIDs of the pods of `entries` not looked up yet to `live` (a pod that does not exist
/// is left out): one GET of metadata per pod, a few at a time, instead of a list of every pod,
/// which the node's identity has no right to.
async fn live_pods<S: Datastore>(
    store: &S,
    entries: &[(u128, crate::crd::IPAllocation)],
    live: &mut HashMap<String, String>,
) -> Result<(), crate::store::StoreError> {
    let mut podrefs: Vec<String> = entries.iter().map(|(_, e)| e.podref.clone()).collect();
    podrefs.sort_unstable();
    podrefs.dedup();
    podrefs.retain(|p| !live.contains_key(p));
    for chunk in podrefs.chunks(8) {
        let gets = chunk.iter().map(|podref| async move {
            match podref.split_once('/') {
                Some((namespace, name)) => store.get_pod(namespace, name).await,
                None => Ok(None),
            }
        });
        for (podref, pod) in chunk.iter().zip(futures::future::join_all(gets).await) {
            if let Some(pod) = pod? {
                live.insert(podref.clone(), pod.uid);
            }
        }
    }
    Ok(())
}

/// The runtime's valid attachments by container id.
type Valid = HashMap<String, Vec<Owner>>;

/// Whether `entry` is one of the runtime's valid attachments ([`Owned::same_attachment`]).
fn is_valid(valid: &Valid, entry: &crate::crd::IPAllocation) -> bool {
    valid
        .get(&entry.id)
        .is_some_and(|list| list.iter().any(|v| entry.same_attachment(v)))
}

fn valid_attachments(conf: &Value) -> Result<Valid, CniError> {
    let list = conf
        .get("cni.dev/valid-attachments")
        .and_then(Value::as_array)
        .ok_or_else(|| {
            CniError::new(
                Code::InvalidConfig,
                "GC needs cni.dev/valid-attachments in the network config",
            )
        })?;
    let mut valid = Valid::new();
    for a in list {
        let id = a.get("containerID").and_then(Value::as_str);
        let ifname = a.get("ifname").and_then(Value::as_str);
        let (Some(id), Some(ifname)) = (id, ifname) else {
            return Err(CniError::new(
                Code::InvalidConfig,
                format!("cni.dev/valid-attachments entry {a} needs containerID and ifname"),
            ));
        };
        let owner = Owner {
            container_id: id.to_owned(),
            ifname: ifname.to_owned(),
            ..Owner::default()
        };
        valid.entry(id.to_owned()).or_default().push(owner);
    }
    Ok(valid)
}
