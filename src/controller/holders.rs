//! Addresses held past their pods, freed when their holder goes: a StatefulSet ordinal's when the
//! StatefulSet is deleted or scaled below that ordinal, an IPAMClaim's when the claim is deleted.
//! Either waits until no living pod holds the entry. The decision is pure ([`why_due`]), read
//! from the caches; before an entry is freed its holder is read again from the API server, so a
//! cache that lags behind a new StatefulSet or claim never frees a kept address.

use std::collections::HashMap;
use std::net::IpAddr;

use futures::FutureExt;
use k8s_openapi::api::apps::v1::StatefulSet;
use k8s_openapi::api::core::v1::ObjectReference;
use kube::ResourceExt;

use super::Context;
use super::pools::PoolView;
use crate::alloc::{Engine, Holder};
use crate::crd::{IPAMClaim, IPAllocation};
use crate::ownership::is_pod_gone;
use crate::store::{Datastore, StoreError};

/// The ordinals a StatefulSet has: `start` (`spec.ordinals.start`, 0 by default) up to
/// `start + replicas`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Ordinals {
    pub start: i32,
    pub replicas: i32,
}

impl Ordinals {
    pub fn of(s: &StatefulSet) -> Ordinals {
        let spec = s.spec.as_ref();
        Ordinals {
            start: spec.and_then(|sp| sp.ordinals.as_ref()?.start).unwrap_or(0),
            replicas: spec.and_then(|sp| sp.replicas).unwrap_or(1),
        }
    }

    pub fn has(&self, n: i64) -> bool {
        let start = i64::from(self.start);
        n >= start && n < start + i64::from(self.replicas)
    }
}

/// What the holders' decisions read, by `<namespace>/<name>`: StatefulSets' ordinals, the claims
/// that exist with the addresses their status records, and the live pods' UIDs. A kind whose
/// cache has not listed yet (its CRD or RBAC missing) is `None`, and its entries are left alone.
#[derive(Debug, Default)]
pub struct Holders {
    pub statefulsets: Option<HashMap<String, Ordinals>>,
    pub claims: Option<HashMap<String, Vec<IpAddr>>>,
    pub pods: HashMap<String, String>,
}

/// Why a held entry (holding `ip`) is due to be freed, if it is.
pub fn why_due(entry: &IPAllocation, ip: Option<IpAddr>, holders: &Holders) -> Option<String> {
    if !is_pod_gone(entry, &holders.pods) {
        return None;
    }
    match Holder::of_entry(entry) {
        Holder::Pod => None,
        Holder::Claim(claim) => match holders.claims.as_ref()?.get(&claim) {
            None => Some(format!("IPAMClaim {claim} was deleted")),
            // Left by an ADD that lost the race to record the claim's first addresses.
            Some(ips) if !ips.is_empty() && ip.is_some_and(|ip| !ips.contains(&ip)) => {
                Some(format!("IPAMClaim {claim} records other addresses"))
            }
            Some(_) => None,
        },
        Holder::StatefulSet(name) => {
            let namespace = entry.podref.split_once('/').map_or("", |(ns, _)| ns);
            let key = format!("{namespace}/{name}");
            match holders.statefulsets.as_ref()?.get(&key) {
                None => Some(format!("StatefulSet {key} was deleted")),
                Some(ordinals) => match ordinal(&entry.podref, &name) {
                    Some(n) if ordinals.has(n) => None,
                    Some(n) => Some(format!(
                        "StatefulSet {key} has {} replicas from ordinal {}, ordinal {n} is gone",
                        ordinals.replicas, ordinals.start
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
    // Whether a cache has listed once, asked without waiting.
    let listed = |ready: Option<Result<(), _>>| matches!(ready, Some(Ok(())));
    let statefulsets =
        listed(ctx.caches.statefulsets.wait_until_ready().now_or_never()).then(|| {
            ctx.caches
                .statefulsets
                .state()
                .iter()
                .map(|s| (key(s.namespace(), s.name_any()), Ordinals::of(s)))
                .collect()
        });
    let claims = listed(ctx.caches.claims.wait_until_ready().now_or_never()).then(|| {
        ctx.caches
            .claims
            .state()
            .iter()
            .map(|c| (key(c.namespace(), c.name_any()), claim_ips(c)))
            .collect()
    });
    Holders {
        statefulsets,
        claims,
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

/// The addresses a claim's status records (prefix lengths dropped).
fn claim_ips(c: &IPAMClaim) -> Vec<IpAddr> {
    c.status
        .iter()
        .flat_map(|s| &s.ips)
        .filter_map(|t| t.split('/').next()?.trim().parse().ok())
        .collect()
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
            .filter_map(|(o, e)| why_due(e, view.ip(*o), &holders).map(|why| (*o, e.clone(), why)))
            .collect();
        for (offset, entry, why) in due {
            // One entry that cannot be checked or freed (a read refused, a write lost) does not
            // hold up the others; the next pass tries it again.
            match free(ctx, &view, offset, &entry, &why).await {
                Ok(n) => freed += n,
                Err(e) => {
                    tracing::warn!(pool = %view.name, offset, error = %e, "could not free a held address")
                }
            }
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
    if !holder_gone(ctx, entry, view.ip(offset)).await? {
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

/// Reads the holder again: a claim that exists (and records this address, or none yet), or a
/// StatefulSet that still has the ordinal, keeps the address whatever the caches said.
async fn holder_gone(
    ctx: &Context,
    entry: &IPAllocation,
    ip: Option<IpAddr>,
) -> Result<bool, StoreError> {
    match Holder::of_entry(entry) {
        Holder::Pod => Ok(false),
        Holder::Claim(claim) => {
            let (ns, name) = claim.split_once('/').unwrap_or_default();
            Ok(match ctx.store.get_ipam_claim(ns, name).await? {
                None => true,
                Some(c) => {
                    let ips = claim_ips(&c);
                    !ips.is_empty() && ip.is_some_and(|ip| !ips.contains(&ip))
                }
            })
        }
        Holder::StatefulSet(name) => {
            let (namespace, _) = entry.podref.split_once('/').unwrap_or_default();
            let found = ctx.store.get_statefulset(namespace, &name).await?;
            Ok(
                match (
                    found.as_ref().map(Ordinals::of),
                    ordinal(&entry.podref, &name),
                ) {
                    (Some(ordinals), Some(n)) => !ordinals.has(n),
                    _ => true,
                },
            )
        }
    }
}

/// The StatefulSet or IPAMClaim an entry's release is reported on.
fn holder_reference(entry: &IPAllocation) -> Option<ObjectReference> {
    let (namespace, _) = entry.podref.split_once('/')?;
    match Holder::of_entry(entry) {
        Holder::Pod => None,
        Holder::StatefulSet(name) => Some(ObjectReference {
            api_version: Some("apps/v1".into()),
            kind: Some("StatefulSet".into()),
            namespace: Some(namespace.into()),
            name: Some(name),
            ..Default::default()
        }),
        Holder::Claim(claim) => {
            let (ns, name) = claim.split_once('/')?;
            Some(ipam_claim_object(ns, name))
        }
    }
}

/// IPAMClaim `namespace/name`, as Events about it refer to it.
pub fn ipam_claim_object(namespace: &str, name: &str) -> ObjectReference {
    ObjectReference {
        api_version: Some("k8s.cni.cncf.io/v1alpha1".into()),
        kind: Some("IPAMClaim".into()),
        namespace: Some(namespace.into()),
        name: Some(name.into()),
        ..Default::default()
    }
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

/// Keeps only a claim's name and what its status records: the addresses, the owner pod, the node
/// that wrote them and when (the status's managedFields times, without their fields), for
/// [`super::claim_records`].
pub fn trim_claim(c: &mut IPAMClaim) {
    if let Some(managers) = c.metadata.managed_fields.as_mut() {
        managers.retain(|m| m.subresource.as_deref() == Some("status"));
        for m in managers {
            m.fields_v1 = None;
        }
    }
    c.metadata.annotations = None;
    if let Some(status) = c.status.as_mut() {
        (status.conditions).retain(|c| c.type_ == crate::crd::claim::RECORDED_BY);
    }
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

    fn ip(s: &str) -> Option<IpAddr> {
        Some(s.parse().unwrap())
    }

    fn with_statefulset(start: i32, replicas: i32) -> Holders {
        let ordinals = Ordinals { start, replicas };
        Holders {
            statefulsets: Some([("ns/web".to_owned(), ordinals)].into()),
            claims: Some(HashMap::new()),
            ..Default::default()
        }
    }

    #[test]
    fn a_sticky_address_stays_while_its_ordinal_does() {
        let mut h = with_statefulset(0, 3);
        let e = |pod: &str| entry(pod, "u", "", "web");
        let at = ip("10.0.0.5");
        // The pod was force-deleted: the ordinal keeps the address for its replacement.
        assert_eq!(why_due(&e("ns/web-2"), at, &h), None);
        assert_eq!(
            why_due(&e("ns/web-3"), at, &h).as_deref(),
            Some("StatefulSet ns/web has 3 replicas from ordinal 0, ordinal 3 is gone")
        );
        // While the pod lives, nothing is due, whatever the StatefulSet says.
        h.pods.insert("ns/web-3".into(), "u".into());
        assert_eq!(why_due(&e("ns/web-3"), at, &h), None);
        h.statefulsets = Some(HashMap::new());
        assert_eq!(why_due(&e("ns/web-3"), at, &h), None);
        assert_eq!(
            why_due(&e("ns/web-1"), at, &h).as_deref(),
            Some("StatefulSet ns/web was deleted")
        );
        // Not listed yet (no RBAC, say): nothing is decided.
        h.statefulsets = None;
        assert_eq!(why_due(&e("ns/web-1"), at, &h), None);
    }

    #[test]
    fn ordinals_may_start_above_zero() {
        let h = with_statefulset(5, 3);
        let e = |pod: &str| entry(pod, "u", "", "web");
        for kept in ["ns/web-5", "ns/web-7"] {
            assert_eq!(why_due(&e(kept), ip("10.0.0.5"), &h), None, "{kept}");
        }
        for gone in ["ns/web-4", "ns/web-8", "ns/web-0"] {
            assert!(why_due(&e(gone), ip("10.0.0.5"), &h).is_some(), "{gone}");
        }
    }

    #[test]
    fn a_claimed_address_stays_while_its_claim_does() {
        let mut h = Holders {
            claims: Some([("vms/vm1.net".to_owned(), vec![])].into()),
            ..Default::default()
        };
        let claimed = entry("vms/launcher-a", "u", "vms/vm1.net", "");
        let at = ip("10.0.0.5");
        assert_eq!(why_due(&claimed, at, &h), None);
        // The claim records its addresses: an entry of the claim at another is a stray.
        h.claims = Some([("vms/vm1.net".to_owned(), vec![at.unwrap()])].into());
        assert_eq!(why_due(&claimed, at, &h), None);
        assert_eq!(
            why_due(&claimed, ip("10.0.0.6"), &h).as_deref(),
            Some("IPAMClaim vms/vm1.net records other addresses")
        );
        h.claims = Some(HashMap::new());
        assert_eq!(
            why_due(&claimed, at, &h).as_deref(),
            Some("IPAMClaim vms/vm1.net was deleted")
        );
        h.pods.insert("vms/launcher-a".into(), "u".into());
        assert_eq!(why_due(&claimed, at, &h), None);
        let plain = entry("vms/p", "u", "", "");
        assert_eq!(why_due(&plain, at, &Holders::default()), None, "not held");
    }
}
