//! Addresses held past their pods, freed when their holder goes: a StatefulSet ordinal's when the
//! StatefulSet is deleted or scaled below that ordinal, an IPAMClaim's when the claim is deleted.
//! Either waits until no living pod holds the entry. The decision is pure ([`why_due`]), read
//! from the caches; before an entry is freed its holder is read again from the API server, so a
//! cache that lags behind a new StatefulSet or claim never frees a kept address.

use std::collections::{HashMap, HashSet};

use k8s_openapi::api::apps::v1::StatefulSet;
use k8s_openapi::api::core::v1::ObjectReference;
use kube::ResourceExt;

use super::Context;
use super::pools::PoolView;
use crate::alloc::{Engine, Holder};
use crate::crd::{IPAMClaim, IPAllocation};
use crate::ownership::is_pod_gone;
use crate::store::{Datastore, StoreError};

/// What the holders' decisions read: StatefulSets' replicas and the claims that exist, by
/// `<namespace>/<name>`, and the live pods' UIDs.
#[derive(Debug, Default)]
pub struct Holders {
    pub statefulsets: HashMap<String, i32>,
    pub claims: HashSet<String>,
    pub pods: HashMap<String, String>,
}

/// Why a held entry is due to be freed, if it is.
pub fn why_due(entry: &IPAllocation, holders: &Holders) -> Option<String> {
    if !is_pod_gone(entry, &holders.pods) {
        return None;
    }
    match Holder::of(entry) {
        Holder::Pod => None,
        Holder::Claim(claim) => {
            (!holders.claims.contains(&claim)).then(|| format!("IPAMClaim {claim} was deleted"))
        }
        Holder::StatefulSet(name) => {
            let namespace = entry.podref.split_once('/').map_or("", |(ns, _)| ns);
            let key = format!("{namespace}/{name}");
            match holders.statefulsets.get(&key) {
                None => Some(format!("StatefulSet {key} was deleted")),
                Some(replicas) => match ordinal(&entry.podref, &name) {
                    Some(n) if n < i64::from(*replicas) => None,
                    Some(n) => Some(format!(
                        "StatefulSet {key} has {replicas} replicas, ordinal {n} is gone"
                    )),
                    None => Some(format!(
                        "pod {} is not an ordinal of StatefulSet {key}",
                        entry.podref
                    )),
                },
            }
        }
    }
}

/// The ordinal of a StatefulSet pod, `<namespace>/<statefulset>-<ordinal>`.
pub fn ordinal(podref: &str, statefulset: &str) -> Option<i64> {
    let (_, name) = podref.split_once('/')?;
    let digits = name.strip_prefix(statefulset)?.strip_prefix('-')?;
    if digits.is_empty() || !digits.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    digits.parse().ok()
}

/// The holders as the caches have them.
fn from_caches(ctx: &Context) -> Holders {
    let key = |ns: Option<String>, name: String| format!("{}/{name}", ns.unwrap_or_default());
    Holders {
        statefulsets: ctx
            .caches
            .statefulsets
            .state()
            .iter()
            .map(|s| {
                let replicas = s.spec.as_ref().and_then(|sp| sp.replicas).unwrap_or(1);
                (key(s.namespace(), s.name_any()), replicas)
            })
            .collect(),
        claims: ctx
            .caches
            .claims
            .state()
            .iter()
            .map(|c| key(c.namespace(), c.name_any()))
            .collect(),
        pods: ctx
            .caches
            .pods
            .state()
            .iter()
            .map(|p| {
                (
                    key(p.namespace(), p.name_any()),
                    p.uid().unwrap_or_default(),
                )
            })
            .collect(),
    }
}

/// Frees every held entry whose holder is gone. Returns how many were freed.
pub async fn reconcile(ctx: &Context) -> Result<usize, StoreError> {
    let holders = from_caches(ctx);
    let mut freed = 0;
    for view in ctx.pool_views() {
        let due: Vec<(u128, IPAllocation, String)> = view
            .entries
            .iter()
            .filter(|(_, e)| e.is_held())
            .filter_map(|(o, e)| why_due(e, &holders).map(|why| (*o, e.clone(), why)))
            .collect();
        for (offset, entry, why) in due {
            freed += free(ctx, &view, offset, &entry, &why).await?;
        }
    }
    Ok(freed)
}

/// Frees one entry once the API server confirms its holder is gone.
async fn free(
    ctx: &Context,
    view: &PoolView,
    offset: u128,
    entry: &IPAllocation,
    why: &str,
) -> Result<usize, StoreError> {
    if !holder_gone(ctx, entry).await? {
        return Ok(0);
    }
    if ctx.opts.dry_run {
        tracing::info!(pool = %view.name, offset, why, "dry run: would free a held address");
        return Ok(0);
    }
    let released = Engine::new(&ctx.store, &view.target())
        .release_entries(&[(offset, entry.clone())])
        .await?;
    for ip in &released {
        let note = format!("released {ip} of pod {}: {why}", entry.podref);
        tracing::info!(pool = %view.name, %ip, why, "released a held address");
        ctx.pool_event(&view.name, false, "HeldAddressReleased", &note)
            .await;
        if let Some(about) = holder_reference(entry) {
            ctx.event(&about, false, "HeldAddressReleased", &note).await;
        }
    }
    ctx.metrics.record_releases("holder_gone", released.len());
    Ok(released.len())
}

/// Reads the holder again: a claim that exists, or a StatefulSet that still has the ordinal,
/// keeps the address whatever the caches said.
async fn holder_gone(ctx: &Context, entry: &IPAllocation) -> Result<bool, StoreError> {
    match Holder::of(entry) {
        Holder::Pod => Ok(false),
        Holder::Claim(claim) => {
            let (ns, name) = claim.split_once('/').unwrap_or_default();
            Ok(ctx.store.get_ipam_claim(ns, name).await?.is_none())
        }
        Holder::StatefulSet(name) => {
            let (namespace, _) = entry.podref.split_once('/').unwrap_or_default();
            let replicas = ctx.store.statefulset_replicas(namespace, &name).await?;
            Ok(match (replicas, ordinal(&entry.podref, &name)) {
                (Some(r), Some(n)) => n >= i64::from(r),
                _ => true,
            })
        }
    }
}

/// The StatefulSet or IPAMClaim an entry's release is reported on.
fn holder_reference(entry: &IPAllocation) -> Option<ObjectReference> {
    let (namespace, _) = entry.podref.split_once('/')?;
    let (api_version, kind, ns, name) = match Holder::of(entry) {
        Holder::Pod => return None,
        Holder::StatefulSet(name) => ("apps/v1", "StatefulSet", namespace.to_owned(), name),
        Holder::Claim(claim) => {
            let (ns, name) = claim.split_once('/')?;
            (
                "k8s.cni.cncf.io/v1alpha1",
                "IPAMClaim",
                ns.to_owned(),
                name.to_owned(),
            )
        }
    };
    Some(ObjectReference {
        api_version: Some(api_version.into()),
        kind: Some(kind.into()),
        namespace: Some(ns),
        name: Some(name),
        ..Default::default()
    })
}

/// Keeps only what the decisions read of a StatefulSet: its name and replicas.
pub fn trim_statefulset(s: &mut StatefulSet) {
    s.metadata.managed_fields = None;
    s.metadata.annotations = None;
    s.status = None;
    if let Some(spec) = s.spec.as_mut() {
        spec.template = Default::default();
        spec.volume_claim_templates = None;
        spec.selector = Default::default();
    }
}

/// Keeps only a claim's name.
pub fn trim_claim(c: &mut IPAMClaim) {
    c.metadata.managed_fields = None;
    c.metadata.annotations = None;
    c.status = None;
}

#[cfg(test)]
mod tests {
    use super::*;

    fn entry(podref: &str, uid: &str, claim: &str, sts: &str) -> IPAllocation {
        IPAllocation {
            id: "c".into(),
            podref: podref.into(),
            poduid: uid.into(),
            ipamclaimref: claim.into(),
            statefulset: sts.into(),
            ..Default::default()
        }
    }

    #[test]
    fn ordinals() {
        assert_eq!(ordinal("ns/web-3", "web"), Some(3));
        assert_eq!(ordinal("ns/web-db-12", "web-db"), Some(12));
        assert_eq!(ordinal("ns/web-db-12", "web"), None);
        assert_eq!(ordinal("ns/web-", "web"), None);
        assert_eq!(ordinal("ns/web-1a", "web"), None);
        assert_eq!(ordinal("web-1", "web"), None);
    }

    #[test]
    fn a_sticky_address_stays_while_its_ordinal_does() {
        let mut h = Holders::default();
        h.statefulsets.insert("ns/web".into(), 3);
        let e = |pod: &str| entry(pod, "u", "", "web");
        // The pod was force-deleted: the ordinal keeps the address for its replacement.
        assert_eq!(why_due(&e("ns/web-2"), &h), None);
        assert_eq!(
            why_due(&e("ns/web-3"), &h).as_deref(),
            Some("StatefulSet ns/web has 3 replicas, ordinal 3 is gone")
        );
        // While the pod lives, nothing is due, whatever the StatefulSet says.
        h.pods.insert("ns/web-3".into(), "u".into());
        assert_eq!(why_due(&e("ns/web-3"), &h), None);
        h.statefulsets.clear();
        assert_eq!(why_due(&e("ns/web-3"), &h), None);
        assert_eq!(
            why_due(&e("ns/web-1"), &h).as_deref(),
            Some("StatefulSet ns/web was deleted")
        );
    }

    #[test]
    fn a_claimed_address_stays_while_its_claim_does() {
        let mut h = Holders::default();
        h.claims.insert("vms/vm1.net".into());
        assert_eq!(
            why_due(&entry("vms/launcher-a", "u", "vms/vm1.net", ""), &h),
            None
        );
        h.claims.clear();
        assert_eq!(
            why_due(&entry("vms/launcher-a", "u", "vms/vm1.net", ""), &h).as_deref(),
            Some("IPAMClaim vms/vm1.net was deleted")
        );
        h.pods.insert("vms/launcher-a".into(), "u".into());
        assert_eq!(
            why_due(&entry("vms/launcher-a", "u", "vms/vm1.net", ""), &h),
            None
        );
        assert_eq!(
            why_due(&entry("vms/p", "u", "", ""), &Holders::default()),
            None,
            "not held"
        );
    }
}
