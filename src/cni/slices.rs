//! Node slices on the node: the slices of a range this node holds (read from the range's
//! NodeSlicePool, which the operator keeps), the engine's target of each, and taking one more free
//! slice when the node's are full. A slice is allocated like any pool: it is a pool named
//! `[<network_name>-]<node>-<slice>` over a smaller range (see [`crate::ipam::slices`]).

use std::time::Duration;

use tokio::time::Instant;

use ipnet::IpNet;

use super::Request;
use super::protocol::{CniError, Code};
use crate::alloc::Target;
use crate::config::{NodeSlice, RangeConfig};
use crate::crd::NodeSlicePool;
use crate::ipam::naming::{node_slice_pool_name, object_name_problem, slice_pool_name};
use crate::ipam::slices::{is_slice_of, slice_range};
use crate::store::{Datastore, StoreError, Write};

/// How long an ADD waits for the operator to give a node its first slice (a node that has just
/// joined) before it fails saying so.
pub const SLICE_WAIT: Duration = Duration::from_secs(10);
const SLICE_POLL: Duration = Duration::from_millis(250);
/// How old a read of the NodeSlicePool may be to start an ADD or a DEL in the node agent (a
/// burst of ADDs then costs one read, not one per ADD and range); a node that finds no slice of
/// its own, or only full ones, reads again.
const RECENT: Duration = Duration::from_secs(2);
/// Lost races for a free slice before giving up (other nodes taking slices at the same moment).
const SLICE_RACES: u32 = 20;

/// The range `index` of `req` as node slices.
pub struct Sliced<'r> {
    req: &'r Request,
    range: &'r RangeConfig,
    slice: &'r NodeSlice,
    node: &'r str,
    /// The range's NodeSlicePool.
    pub name: String,
}

impl<'r> Sliced<'r> {
    /// `None` when the range is not sliced.
    pub fn of(req: &'r Request, index: usize) -> Option<Sliced<'r>> {
        let range = &req.ipam.ranges[index];
        let slice = range.node_slice.as_ref()?;
        Some(Sliced {
            req,
            range,
            slice,
            node: req.node.as_deref().unwrap_or_default(),
            name: node_slice_pool_name(&network(req), index, range.range.cidr()),
        })
    }

    /// The targets of this node's slices, in the NodeSlicePool's order; none when the pool does
    /// not exist or gives this node nothing.
    pub async fn targets<S: Datastore>(&self, store: &S) -> Result<Vec<Target>, CniError> {
        let pool = store
            .get_node_slice_pool_recent(&self.name, RECENT)
            .await
            .map_err(retry)?;
        Ok(pool.map(|p| self.mine(&p)).unwrap_or_default())
    }

    /// As [`targets`](Self::targets), waiting up to `wait` for the operator to assign a first
    /// slice; an error that says what is missing when none came.
    pub async fn wait_for_targets<S: Datastore>(
        &self,
        store: &S,
        wait: Duration,
    ) -> Result<Vec<Target>, CniError> {
        let until = Instant::now() + wait;
        let mut max_age = RECENT;
        loop {
            let pool = store
                .get_node_slice_pool_recent(&self.name, max_age)
                .await
                .map_err(retry)?;
            max_age = Duration::ZERO;
            let mine = pool.as_ref().map(|p| self.mine(p)).unwrap_or_default();
            if !mine.is_empty() {
                return Ok(mine);
            }
            if Instant::now() >= until {
                return Err(self.no_slice(pool.as_ref(), wait));
            }
            tokio::time::sleep(SLICE_POLL).await;
        }
    }

    /// The next slice to try once the slices in `tried` are full: one this node has been given
    /// since (a concurrent ADD on this node took it, or the operator), else the first free slice
    /// that has an address to give, taken by compare-and-swap on the NodeSlicePool so that two
    /// nodes never take one slice. `None` when no slice is free.
    pub async fn next_slice<S: Datastore>(
        &self,
        store: &S,
        tried: &[String],
    ) -> Result<Option<Target>, CniError> {
        for _ in 0..SLICE_RACES {
            let Some(mut pool) = store.get_node_slice_pool(&self.name).await.map_err(retry)? else {
                return Ok(None);
            };
            // A burst of ADDs on one node finds its slice full at once: the first takes a slice,
            // the others use it rather than each taking one more.
            if let Some(new) = self
                .mine(&pool)
                .into_iter()
                .find(|t| !tried.contains(&t.pool))
            {
                return Ok(Some(new));
            }
            let status = pool.status.get_or_insert_with(Default::default);
            let free = status.allocations.iter_mut().find(|a| {
                a.node_name.is_empty()
                    && a.slice_range
                        .parse()
                        .is_ok_and(|s| self.usable(s).is_some())
            });
            let Some(free) = free else {
                return Ok(None);
            };
            free.node_name = self.node.to_owned();
            let slice: IpNet = free.slice_range.parse().expect("checked above");
            match store.replace_node_slice_pool(&pool).await.map_err(retry)? {
                Write::Done => {
                    tracing::info!(nodeslicepool = %self.name, %slice, node = self.node, "took another node slice: this node's were full");
                    return Ok(self.usable(slice));
                }
                Write::Missing => return Ok(None),
                Write::Conflict => {}
            }
        }
        Err(CniError::new(
            Code::TryAgainLater,
            format!(
                "nodeslicepool {}: lost {SLICE_RACES} races for a free slice",
                self.name
            ),
        ))
    }

    /// The error of a range whose slices (and the free ones) are all full.
    pub fn all_full(&self, held: usize) -> CniError {
        CniError::new(
            Code::Exhausted,
            format!(
                "no free address in range {} for node {}: its {held} slice(s) of {} are full and nodeslicepool {} has no free slice left; use a larger range or a smaller node_slice_size",
                self.range.range.cidr(),
                self.node,
                self.slice.text,
                self.name
            ),
        )
    }

    fn mine(&self, pool: &NodeSlicePool) -> Vec<Target> {
        let allocations = pool.status.iter().flat_map(|s| &s.allocations);
        allocations
            .filter(|a| a.node_name == self.node)
            .filter_map(|a| self.usable(a.slice_range.parse().ok()?))
            .collect()
    }

    /// The target of `slice`, when it is a slice of this range with an address to give (a slice
    /// of an older layout, kept by the operator until it drains, is used as long as it lies in
    /// the range).
    fn usable(&self, slice: IpNet) -> Option<Target> {
        let whole = self.range.range.cidr();
        if !is_slice_of(whole, slice) {
            return None;
        }
        let range = slice_range(&self.range.range, slice).ok()?;
        Some(Target {
            pool: slice_pool_name(self.req.ipam.network_name.as_deref(), self.node, slice),
            range,
            network: self.req.ipam.network_name.clone(),
            overlapping: self.req.ipam.enable_overlapping_ranges,
            node: Some(self.node.to_owned()),
        })
    }

    fn no_slice(&self, pool: Option<&NodeSlicePool>, wait: Duration) -> CniError {
        let why = match pool {
            None => "does not exist: the operator (whereabouts-operator run) creates it for a NAD with node_slice_size".to_owned(),
            Some(p) if p.spec.range != self.range.range.cidr().trunc().to_string() => format!(
                "is for range {} (this config: {}); the operator re-slices once the old slices are drained",
                p.spec.range,
                self.range.range.cidr().trunc()
            ),
            Some(_) => "assigns it no slice yet (more nodes than slices, or the operator has not seen the node)".to_owned(),
        };
        CniError::new(
            Code::TryAgainLater,
            format!(
                "no allocated node slice for node {} after waiting {}s: nodeslicepool {} {why}",
                self.node,
                wait.as_secs(),
                self.name
            ),
        )
    }
}

fn network(req: &Request) -> String {
    crate::config::node_slice_base(&req.conf.name, &req.ipam)
}

fn retry(e: StoreError) -> CniError {
    CniError::datastore(&e)
}

/// Where the node's name is read from, as upstream: `NODENAME`, else `<configuration_path>/nodename`,
/// else (ours) `nodename` next to the flat file the installer wrote, else `/etc/hostname`.
pub struct NodeNameSources<'a> {
    pub env: Option<&'a str>,
    pub configuration_path: Option<&'a str>,
    pub flat_file: Option<&'a std::path::Path>,
    pub hostname_file: &'a std::path::Path,
}

/// The node's name, checked to be usable in object names.
pub fn node_name(from: &NodeNameSources<'_>) -> Result<String, CniError> {
    // The node's name is environment, not configuration.
    let invalid = |m: String| CniError::new(Code::InvalidEnv, m);
    let (name, source) = match from.env.map(str::trim).filter(|n| !n.is_empty()) {
        Some(n) => (n.to_owned(), "NODENAME".to_owned()),
        None => read_name_file(from).ok_or_else(|| {
            invalid("node_slice_size needs the node's name: set NODENAME, or write it to <configuration_path>/nodename (whereabouts-operator install-cni does), or /etc/hostname".into())
        })?,
    };
    if let Some(why) = object_name_problem(&name) {
        return Err(invalid(format!(
            "node name {name:?} (from {source}) is not usable in object names: {why}"
        )));
    }
    Ok(name)
}

fn read_name_file(from: &NodeNameSources<'_>) -> Option<(String, String)> {
    let by_config = from
        .configuration_path
        .filter(|p| !p.is_empty())
        .map(|p| std::path::Path::new(p).join("nodename"));
    let by_flat = from
        .flat_file
        .and_then(|f| f.parent())
        .map(|d| d.join("nodename"));
    let candidates = by_config
        .into_iter()
        .chain(by_flat)
        .chain([from.hostname_file.to_path_buf()]);
    candidates.into_iter().find_map(|path| {
        // A node name is at most 253 bytes; a larger file is not a name.
        let text = std::fs::read(&path).ok().filter(|t| t.len() <= 1024)?;
        let name = String::from_utf8(text).ok()?.trim().to_owned();
        (!name.is_empty()).then(|| (name, path.display().to_string()))
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn node_name_sources_in_upstream_order() {
        let dir = tempfile::tempdir().unwrap();
        let conf_dir = dir.path().join("conf");
        let flat_dir = dir.path().join("whereabouts.d");
        std::fs::create_dir_all(&conf_dir).unwrap();
        std::fs::create_dir_all(&flat_dir).unwrap();
        let hostname = dir.path().join("hostname");
        std::fs::write(&hostname, "host-from-etc\n").unwrap();
        let flat = flat_dir.join("whereabouts.conf");
        let conf = conf_dir.to_str().unwrap();
        let mut from = NodeNameSources {
            env: None,
            configuration_path: Some(conf),
            flat_file: Some(&flat),
            hostname_file: &hostname,
        };
        assert_eq!(node_name(&from).unwrap(), "host-from-etc");
        std::fs::write(flat_dir.join("nodename"), "node-b\n").unwrap();
        assert_eq!(node_name(&from).unwrap(), "node-b");
        std::fs::write(conf_dir.join("nodename"), " node-a ").unwrap();
        assert_eq!(node_name(&from).unwrap(), "node-a");
        from.env = Some("node-env");
        assert_eq!(node_name(&from).unwrap(), "node-env");
        from.env = Some("Bad_Name");
        let e = node_name(&from).unwrap_err();
        assert!(e.msg.contains("\"Bad_Name\" (from NODENAME)"), "{}", e.msg);
        let missing = dir.path().join("none");
        let nothing = NodeNameSources {
            env: None,
            configuration_path: None,
            flat_file: None,
            hostname_file: &missing,
        };
        assert!(node_name(&nothing).unwrap_err().msg.contains("NODENAME"));
    }
}
