//! Which slice pools hold entries, and whose slices they are: from the pools' labels, and only
//! for unlabelled pools (upstream's) from their names.

use std::collections::{BTreeMap, BTreeSet};

use ipnet::IpNet;
use kube::ResourceExt;

use crate::crd::IPPool;
use crate::ipam::naming::{NODE_LABEL, labelled_network, pool_name, slice_pool_name};

/// The pools that hold entries: their names, and for the pools whose labels say so, which node's
/// slice of which network each is.
#[derive(Debug, Default)]
pub struct LivePools {
    names: BTreeSet<String>,
    /// Names of the pools without such labels (upstream's), read by name.
    unlabelled: BTreeSet<String>,
    /// Labelled slice pools: (network, slice) -> node.
    labelled: BTreeMap<(Option<String>, IpNet), String>,
    /// The same pools by (slice, node), whatever their network: what a NodeSlicePool's
    /// retirement asks for each of its slices.
    labelled_slices: BTreeSet<(IpNet, String)>,
}

impl LivePools {
    /// The pools of `pools` that hold entries.
    pub fn of<'a>(pools: impl IntoIterator<Item = &'a IPPool>) -> LivePools {
        let mut live = LivePools::default();
        for p in pools.into_iter().filter(|p| !p.spec.allocations.is_empty()) {
            let name = p.name_any();
            match labelled_slice(&name, p) {
                Some(((network, slice), node)) => {
                    live.labelled_slices.insert((slice, node.clone()));
                    live.labelled.insert((network, slice), node);
                }
                None => {
                    live.unlabelled.insert(name.clone());
                }
            }
            live.names.insert(name);
        }
        live
    }

    /// Unlabelled live pools of these names (as upstream's plugin makes them).
    pub fn named<'a>(names: impl IntoIterator<Item = &'a str>) -> LivePools {
        let names: BTreeSet<String> = names.into_iter().map(str::to_owned).collect();
        LivePools {
            unlabelled: names.clone(),
            names,
            ..LivePools::default()
        }
    }

    pub fn contains(&self, pool: &str) -> bool {
        self.names.contains(pool)
    }

    /// The node whose live pool is `network`'s `slice`: its labels say so; an unlabelled pool
    /// (upstream's) is read by its name, `[<network>-]<node>-<slice>`, the first by name.
    pub fn owner(&self, network: Option<&str>, slice: IpNet) -> Option<String> {
        let (network, slice) = (
            network.filter(|n| !n.is_empty()).map(str::to_owned),
            slice.trunc(),
        );
        if let Some(node) = self.labelled.get(&(network.clone(), slice)) {
            return Some(node.clone());
        }
        let prefix = network.map(|n| format!("{n}-")).unwrap_or_default();
        let suffix = format!("-{}", pool_name(None, slice));
        self.unlabelled.iter().find_map(|pool| {
            let node = pool.strip_prefix(&prefix)?.strip_suffix(&suffix)?;
            (!node.is_empty()).then(|| node.to_owned())
        })
    }

    /// Whether `node`'s pool of `slice` holds entries, in whichever network (a NodeSlicePool does
    /// not say whether its network is named).
    pub fn slice_in_use(&self, node: &str, slice: IpNet) -> bool {
        let slice = slice.trunc();
        let bare = slice_pool_name(None, node, slice);
        let suffix = format!("-{bare}");
        !node.is_empty()
            && (self.labelled_slices.contains(&(slice, node.to_owned()))
                || self
                    .unlabelled
                    .iter()
                    .any(|p| *p == bare || p.ends_with(&suffix)))
    }
}

/// ((network, slice), node) of a pool whose labels name it a node's slice and compose its name.
fn labelled_slice(name: &str, pool: &IPPool) -> Option<((Option<String>, IpNet), String)> {
    let labels = pool.metadata.labels.as_ref()?;
    let node = labels.get(NODE_LABEL)?;
    let slice: IpNet = pool.spec.range.parse().ok()?;
    let network = labelled_network(name, labels, slice.trunc())?;
    Some(((network, slice.trunc()), node.clone()))
}
