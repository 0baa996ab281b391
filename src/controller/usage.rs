//! Pool and network usage, computed from the caches when `/metrics` is scraped.
//!
//! A pool's size is the usable window of its CIDR; a network's size is the window of its NAD's
//! range after range_start, range_end and exclude, and its allocated count is the pool entries that
//! fall inside that window. Sizes are u128 (a /64 holds 2^64 - 2 addresses) and exported as f64,
//! which rounds but never wraps or panics.

use std::collections::BTreeSet;
use std::sync::Arc;

use kube::ResourceExt;
use kube::runtime::reflector::Store;
use prometheus::core::{Collector, Desc};
use prometheus::proto::MetricFamily;
use prometheus::{GaugeVec, Opts};

use super::pools::{PoolView, SliceIndex};
use crate::crd::{IPPool, NetworkAttachmentDefinition, NodeSlicePool};
use crate::ipam::slices::is_slice_of;
use crate::nad_check::check_spec_config;

#[derive(Debug, Clone, PartialEq)]
pub struct Usage {
    pub size: u128,
    pub allocated: u128,
}

impl Usage {
    pub fn free(&self) -> u128 {
        self.size.saturating_sub(self.allocated)
    }
}

/// A pool's usage: entries outside the window (written under another config) are not counted.
pub fn pool_usage(pool: &PoolView) -> Usage {
    let taken: BTreeSet<u128> = pool.entries.keys().copied().collect();
    let size = pool.range.size();
    Usage {
        size,
        allocated: size - pool.range.free_count(&taken),
    }
}

/// Usage of each range of each whereabouts NAD: (network `<ns>/<nad>`, range CIDR, usage).
pub fn network_usage(
    nads: &[Arc<NetworkAttachmentDefinition>],
    pools: &[PoolView],
) -> Vec<(String, String, Usage)> {
    let mut out = Vec::new();
    for nad in nads {
        let network = format!("{}/{}", nad.namespace().unwrap_or_default(), nad.name_any());
        for range in check_spec_config(&nad.spec.config).ranges {
            let allocated: u128 = pools
                .iter()
                .filter(|p| allocates(p, &range))
                .map(|p| {
                    let in_window = |o: &&u128| {
                        p.ip(**o)
                            .and_then(|ip| range.range.offset_of(ip))
                            .is_some_and(|o| range.range.is_allocatable(o))
                    };
                    p.entries.keys().filter(in_window).count() as u128
                })
                .sum();
            out.push((
                network.clone(),
                range.range.cidr().to_string(),
                Usage {
                    size: range.range.size(),
                    allocated,
                },
            ));
        }
    }
    out
}

/// True when `pool` holds addresses of `range`: its pool, or (sliced) one of its node slices'.
fn allocates(pool: &PoolView, range: &crate::nad_check::NadRange) -> bool {
    match &range.slices {
        None => pool.name == range.pool_name(),
        Some((_, size)) => {
            pool.network_name == range.network_name
                && pool.range.cidr().prefix_len() == size.prefix
                && is_slice_of(range.range.cidr(), pool.range.cidr())
        }
    }
}

/// The scrape-time collector over the operator's caches.
pub struct UsageCollector {
    pools: Store<IPPool>,
    slice_pools: Store<NodeSlicePool>,
    nads: Store<NetworkAttachmentDefinition>,
    descs: Vec<Desc>,
}

fn gauge(name: &str, help: &str, labels: &[&str]) -> GaugeVec {
    GaugeVec::new(Opts::new(name, help), labels).expect("valid metric")
}

fn families() -> [GaugeVec; 7] {
    [
        gauge(
            "whereabouts_pool_size_addresses",
            "Usable addresses of the pool's CIDR.",
            &["pool", "range"],
        ),
        gauge(
            "whereabouts_pool_allocated_addresses",
            "Allocated addresses of the pool.",
            &["pool", "range"],
        ),
        gauge(
            "whereabouts_pool_free_addresses",
            "Free addresses of the pool.",
            &["pool", "range"],
        ),
        gauge(
            "whereabouts_pool_object_bytes",
            "Estimated size of the pool's IPPool object as stored; writes fail beyond the budget.",
            &["pool", "range"],
        ),
        gauge(
            "whereabouts_pool_object_budget_bytes",
            "The largest IPPool object an ADD grows (etcd's request limit less room for metadata).",
            &["pool", "range"],
        ),
        gauge(
            "whereabouts_network_size_addresses",
            "Allocatable addresses of a NAD range after range_start, range_end and exclude.",
            &["network", "range"],
        ),
        gauge(
            "whereabouts_network_allocated_addresses",
            "Allocated addresses inside a NAD range's window.",
            &["network", "range"],
        ),
    ]
}

/// Names of the usage metrics, for checks of dashboards and rules.
pub fn family_names() -> Vec<String> {
    families()
        .iter()
        .flat_map(|g| g.desc().into_iter().map(|d| d.fq_name.clone()))
        .collect()
}

impl UsageCollector {
    pub fn new(
        pools: Store<IPPool>,
        slice_pools: Store<NodeSlicePool>,
        nads: Store<NetworkAttachmentDefinition>,
    ) -> Self {
        let descs = families()
            .iter()
            .flat_map(|g| g.desc().into_iter().cloned())
            .collect();
        UsageCollector {
            pools,
            slice_pools,
            nads,
            descs,
        }
    }
}

impl Collector for UsageCollector {
    fn desc(&self) -> Vec<&Desc> {
        self.descs.iter().collect()
    }

    fn collect(&self) -> Vec<MetricFamily> {
        let all = families();
        let [
            size,
            allocated,
            free,
            bytes,
            budget,
            net_size,
            net_allocated,
        ] = &all;
        let slices = SliceIndex::new(&self.slice_pools.state());
        let pools: Vec<PoolView> = self
            .pools
            .state()
            .iter()
            .filter_map(|p| PoolView::from_pool_in(p, &slices))
            .collect();
        for p in &pools {
            let u = pool_usage(p);
            let labels = [p.name.as_str(), &p.range.cidr().to_string()];
            size.with_label_values(&labels).set(u.size as f64);
            allocated.with_label_values(&labels).set(u.allocated as f64);
            free.with_label_values(&labels).set(u.free() as f64);
            bytes
                .with_label_values(&labels)
                .set(crate::crd::size::pool_bytes(labels[1], &p.entries) as f64);
            budget
                .with_label_values(&labels)
                .set(crate::crd::size::POOL_OBJECT_BUDGET as f64);
        }
        for (network, range, u) in network_usage(&self.nads.state(), &pools) {
            net_size
                .with_label_values(&[network.as_str(), &range])
                .set(u.size as f64);
            net_allocated
                .with_label_values(&[network.as_str(), &range])
                .set(u.allocated as f64);
        }
        all.iter().flat_map(|g| g.collect()).collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::crd::{IPAllocation, IPPoolSpec, NetworkAttachmentDefinitionSpec};

    fn pool(name: &str, range: &str, offsets: &[u128]) -> PoolView {
        let allocations = offsets
            .iter()
            .map(|o| {
                (
                    o.to_string(),
                    IPAllocation {
                        id: format!("c{o}"),
                        podref: "ns/p".into(),
                        ..Default::default()
                    },
                )
            })
            .collect();
        PoolView::from_pool(&IPPool::new(
            name,
            IPPoolSpec {
                range: range.into(),
                allocations,
            },
        ))
        .unwrap()
    }

    #[test]
    fn pool_usage_counts_only_the_window() {
        // Offset 0 (the network address) and 255 (broadcast) are outside the window.
        let u = pool_usage(&pool("10.0.0.0-24", "10.0.0.0/24", &[0, 1, 2, 255]));
        assert_eq!(
            u,
            Usage {
                size: 254,
                allocated: 2
            }
        );
        assert_eq!(u.free(), 252);
    }

    #[test]
    fn ipv6_sizes_beyond_2_pow_53_do_not_wrap() {
        let u = pool_usage(&pool("fd00---64", "fd00::/64", &[1, 1 << 60]));
        assert_eq!(u.size, (1u128 << 64) - 2);
        assert_eq!(u.allocated, 2);
        assert_eq!(u.size as f64, 18446744073709551614f64);
        let whole = pool_usage(&pool(
            &crate::ipam::naming::pool_name(None, "::/0".parse().unwrap()),
            "::/0",
            &[],
        ));
        assert_eq!(whole.size, u128::MAX - 1);
        assert!((whole.size as f64).is_finite());
    }

    #[test]
    fn network_usage_applies_start_end_and_exclude() {
        let mut nad = NetworkAttachmentDefinition::new("net", NetworkAttachmentDefinitionSpec {
            config: r#"{"type":"macvlan","ipam":{"type":"whereabouts","range":"10.0.0.0/24","range_start":"10.0.0.10","range_end":"10.0.0.19","exclude":["10.0.0.12/31"]}}"#.into(),
        });
        nad.metadata.namespace = Some("ns".into());
        let pools = vec![pool("10.0.0.0-24", "10.0.0.0/24", &[5, 10, 11, 12, 19])];
        let u = network_usage(&[Arc::new(nad)], &pools);
        // Window .10-.19 (10 addresses) less .12/.13: 8; allocated inside it: .10, .11, .19.
        assert_eq!(
            u,
            vec![(
                "ns/net".to_owned(),
                "10.0.0.0/24".to_owned(),
                Usage {
                    size: 8,
                    allocated: 3
                }
            )]
        );
    }

    #[test]
    fn the_collector_renders_every_family() {
        let (pools, mut w) = kube::runtime::reflector::store::<IPPool>();
        let (nads, _nw) = kube::runtime::reflector::store::<NetworkAttachmentDefinition>();
        let mut p = IPPool::new(
            "10.0.0.0-24",
            IPPoolSpec {
                range: "10.0.0.0/24".into(),
                allocations: Default::default(),
            },
        );
        p.spec.allocations.insert(
            "3".into(),
            IPAllocation {
                id: "c".into(),
                podref: "ns/p".into(),
                ..Default::default()
            },
        );
        w.apply_watcher_event(&kube::runtime::watcher::Event::Apply(p));
        let c = UsageCollector::new(pools, kube::runtime::reflector::store().0, nads);
        let names: Vec<String> = c.collect().iter().map(|f| f.name().to_owned()).collect();
        assert!(
            names.contains(&"whereabouts_pool_allocated_addresses".to_owned()),
            "{names:?}"
        );
        let allocated = c
            .collect()
            .into_iter()
            .find(|f| f.name() == "whereabouts_pool_allocated_addresses")
            .unwrap();
        assert_eq!(allocated.get_metric()[0].get_gauge().get_value(), 1.0);
    }
}
