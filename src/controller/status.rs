//! IPPool status: what `kubectl get ippools` shows (size, allocated, free, held), counted from
//! the pool cache and written on the status subresource, so it never races the plugins' writes of
//! `spec`. A pool is written only when its counts changed, and at most once per
//! [`MIN_INTERVAL`]: a pool taking hundreds of ADDs a second is still written every few seconds,
//! not for every ADD.

use std::collections::{HashMap, HashSet};
use std::time::{Duration, Instant};

use kube::ResourceExt;
use kube::api::{Api, Patch, PatchParams};

use super::Context;
use super::pools::PoolView;
use super::usage::pool_usage;
use crate::crd::{IPPool, IPPoolStatus};

/// The least time between two status writes of one pool.
pub const MIN_INTERVAL: Duration = Duration::from_secs(10);

/// The status a pool's entries make (without its time).
pub fn status_of(view: &PoolView) -> IPPoolStatus {
    let usage = pool_usage(view);
    IPPoolStatus {
        size: usage.size.to_string(),
        allocated: u64::try_from(usage.allocated).unwrap_or(u64::MAX),
        free: usage.free().to_string(),
        held: view.entries.values().filter(|e| e.is_held()).count() as u64,
        last_updated: String::new(),
    }
}

/// True when `current` says what `want` says (the time aside).
fn up_to_date(current: Option<&IPPoolStatus>, want: &IPPoolStatus) -> bool {
    current.is_some_and(|c| {
        let mut c = c.clone();
        c.last_updated.clear();
        c == *want
    })
}

/// What the loop remembers between passes, by pool name.
#[derive(Default)]
pub struct Written {
    /// When each pool's status was last written.
    at: HashMap<String, Instant>,
    /// The resourceVersion at which each pool's status was last found current: a pool unchanged
    /// since is not counted again, so a pass costs little more than a look at every pool's version.
    current: HashMap<String, String>,
}

impl Written {
    fn due(&self, pool: &str) -> bool {
        self.at
            .get(pool)
            .is_none_or(|at| at.elapsed() >= MIN_INTERVAL)
    }

    /// Forgets pools that are gone.
    fn keep_only(&mut self, names: &HashSet<String>) {
        self.at.retain(|name, _| names.contains(name));
        self.current.retain(|name, _| names.contains(name));
    }
}

/// Writes the status of every cached pool whose counts changed and that was not written in the
/// last [`MIN_INTERVAL`]. Returns how many were written, or the last error once all were tried.
pub async fn reconcile(ctx: &Context, written: &mut Written) -> Result<usize, kube::Error> {
    let api: Api<IPPool> = Api::namespaced(ctx.client.clone(), &ctx.opts.pool_namespace);
    let slices = ctx.slice_index();
    let pools = ctx.caches.pools.state();
    written.keep_only(&pools.iter().map(|p| p.name_any()).collect());
    let (mut count, mut failed) = (0, None);
    for pool in pools.iter() {
        let (name, version) = (pool.name_any(), pool.resource_version().unwrap_or_default());
        if written.current.get(&name) == Some(&version) {
            continue;
        }
        let Some(view) = PoolView::from_pool_in(pool, &slices) else {
            continue;
        };
        let mut want = status_of(&view);
        if up_to_date(pool.status.as_ref(), &want) {
            written.current.insert(name, version);
            continue;
        }
        if !written.due(&view.name) || ctx.opts.dry_run {
            continue;
        }
        want.last_updated = k8s_openapi::jiff::Timestamp::now()
            .strftime("%Y-%m-%dT%H:%M:%SZ")
            .to_string();
        let patch = Patch::Merge(serde_json::json!({"status": want}));
        // Tried, whatever comes of it: a pool that keeps failing is tried again after
        // MIN_INTERVAL, and the pools after it are written meanwhile.
        written.at.insert(view.name.clone(), Instant::now());
        match api
            .patch_status(&view.name, &PatchParams::default(), &patch)
            .await
        {
            Ok(_) => count += 1,
            // Deleted since the cache saw it.
            Err(kube::Error::Api(s)) if s.code == 404 => {}
            Err(e) => failed = Some(e),
        }
    }
    failed.map_or(Ok(count), Err)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::controller::pools::tests::pool;

    #[test]
    fn counts_and_held_entries() {
        let mut p = pool(
            "10.0.0.0-29",
            "10.0.0.0/29",
            &[(1, "ns/a", "u"), (2, "ns/b", "u")],
        );
        p.spec.allocations.get_mut("2").unwrap().statefulset = "web".into();
        let view = PoolView::from_pool(&p).unwrap();
        let s = status_of(&view);
        assert_eq!(
            (s.size.as_str(), s.allocated, s.free.as_str(), s.held),
            ("6", 2, "4", 1)
        );
        let mut current = s.clone();
        current.last_updated = "2026-01-01T00:00:00Z".into();
        assert!(up_to_date(Some(&current), &s));
        current.allocated = 3;
        assert!(!up_to_date(Some(&current), &s));
        assert!(!up_to_date(None, &s));
        let v6 = pool("fd00---64", "fd00::/64", &[]);
        let s = status_of(&PoolView::from_pool(&v6).unwrap());
        assert_eq!(s.size, "18446744073709551614");
    }
}
