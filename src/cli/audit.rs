//! `whereabouts-operator audit` (read-only) and `repair --from-report FILE`.
//!
//! `audit` lists the pools, reservations, node slice pools, pods (metadata) and NADs once, reads
//! our CRDs and upstream's known components by name ([`crate::controller::migration`]), and
//! reports every finding of [`crate::controller::findings`] with its evidence. Exit status: 0
//! nothing found, 1 findings, 2 the cluster could not be read. `--output json` is the report
//! `repair` reads.
//!
//! `repair` applies the fixes of the report's repairable findings. Each write holds only if what
//! the report saw is still there: an entry is removed only while it holds the same container and
//! pod, and only when no pod of that name and UID exists now; a reservation is deleted only at
//! the UID and resourceVersion the report saw; a missing reservation is created only if nobody
//! made it since. What changed is skipped and listed. `--dry-run` prints the writes instead.

use std::collections::BTreeSet;
use std::path::PathBuf;

use kube::api::ListParams;
use kube::{Api, Client};
use serde::{Deserialize, Serialize};

use super::list_all;
use crate::alloc::{Engine, Target};
use crate::controller::audit::{LivePods, expected_reservations, last_written};
use crate::controller::findings::{EntryAt, Finding, ListedReservation, Snapshot, audit};
use crate::controller::pools::{PoolView, SliceIndex};
use crate::crd::{
    IPPool, NetworkAttachmentDefinition, NodeSlicePool, OverlappingRangeIPReservation,
};
use crate::ipam::AddrRange;
use crate::store::kubernetes::KubeStore;
use crate::store::{Datastore, Write};

pub const EXIT_CLEAN: u8 = 0;
pub const EXIT_FINDINGS: u8 = 1;
pub const EXIT_ERROR: u8 = 2;

#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum Output {
    Text,
    Json,
}

#[derive(Debug, Clone, clap::Args)]
pub struct AuditArgs {
    /// The namespace of the pools and reservations.
    #[arg(long, default_value = "kube-system")]
    pub pool_namespace: String,
    #[arg(long, short, value_enum, default_value = "text")]
    pub output: Output,
    /// Reservations written more recently than this may be claims whose entry is being written:
    /// reported, not repaired (`30s`, `5m`; the operator's `--orphan-claim-age` default).
    #[arg(long, default_value = "3m", value_parser = crate::cli::run::parse_duration)]
    pub min_age: std::time::Duration,
}

#[derive(Debug, Clone, clap::Args)]
pub struct RepairArgs {
    /// A report written by `audit --output json`.
    #[arg(long, value_name = "FILE")]
    pub from_report: PathBuf,
    /// Print the writes instead of making them.
    #[arg(long)]
    pub dry_run: bool,
}

/// What `audit --output json` prints and `repair` reads.
#[derive(Debug, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Report {
    pub generated: String,
    pub pool_namespace: String,
    pub findings: Vec<Finding>,
}

/// Runs `audit`; returns the exit status.
pub async fn run_audit(args: AuditArgs) -> u8 {
    let findings = match snapshot(&args).await {
        Ok(snap) => audit(&snap),
        Err(e) => {
            eprintln!("audit: cannot read the cluster: {e:#}");
            return EXIT_ERROR;
        }
    };
    let repairable = findings.iter().filter(|f| f.repairable()).count();
    match args.output {
        Output::Text => {
            for f in &findings {
                let mark = if f.repairable() {
                    "repairable"
                } else {
                    "report"
                };
                println!("[{mark}] {f}");
            }
            eprintln!("{} finding(s), {repairable} repairable", findings.len());
        }
        Output::Json => {
            let report = Report {
                generated: k8s_openapi::jiff::Timestamp::now().to_string(),
                pool_namespace: args.pool_namespace.clone(),
                findings: findings.clone(),
            };
            println!(
                "{}",
                serde_json::to_string_pretty(&report).expect("serialises")
            );
        }
    }
    if findings.is_empty() {
        EXIT_CLEAN
    } else {
        EXIT_FINDINGS
    }
}

async fn client() -> anyhow::Result<Client> {
    let (mut config, _) = crate::kubeconfig::load(None).await?;
    crate::kubeconfig::identify(&mut config, "audit");
    Ok(Client::try_from(config)?)
}

async fn snapshot(args: &AuditArgs) -> anyhow::Result<Snapshot> {
    let client = client().await?;
    let ns = &args.pool_namespace;
    let pools = list_all(&Api::<IPPool>::namespaced(client.clone(), ns)).await?;
    let slice_pools = list_all(&Api::<NodeSlicePool>::namespaced(client.clone(), ns)).await?;
    let reservations = list_all(&Api::<OverlappingRangeIPReservation>::namespaced(
        client.clone(),
        ns,
    ))
    .await?;
    // NADs are optional (a cluster without Multus has no such API).
    let nads = list_all(&Api::<NetworkAttachmentDefinition>::all(client.clone()))
        .await
        .unwrap_or_default();
    // Our CRDs and upstream's components, each by name; what this identity may not read is said
    // and skipped.
    let migration = crate::controller::migration::observe(&client).await;
    for e in &migration.unreadable {
        eprintln!("audit: {e}");
    }
    let pods_api = Api::<k8s_openapi::api::core::v1::Pod>::all(client);
    let mut pods = LivePods::default();
    let mut params = ListParams::default().limit(500);
    loop {
        let page = pods_api.list_metadata(&params).await?;
        page.items.iter().for_each(|p| pods.add(p));
        match page.metadata.continue_.filter(|c| !c.is_empty()) {
            Some(token) => params = params.continue_token(&token),
            None => break,
        }
    }
    let now = k8s_openapi::jiff::Timestamp::now().as_second();
    let reservations = reservations
        .into_iter()
        .map(|r| ListedReservation {
            name: r.metadata.name.clone().unwrap_or_default(),
            uid: r.metadata.uid.clone().unwrap_or_default(),
            resource_version: r.metadata.resource_version.clone().unwrap_or_default(),
            // As the operator's sweep judges it: by the claim's last write.
            age: last_written(&r).map(|t| now.saturating_sub(t).max(0) as u64),
            spec: r.spec,
        })
        .collect();
    Ok(Snapshot {
        pools,
        slice_pools: slice_pools.into_iter().map(std::sync::Arc::new).collect(),
        reservations,
        pods,
        nads,
        min_age: args.min_age.as_secs(),
        migration,
    })
}

/// What a repair did with one finding.
enum Outcome {
    Done(String),
    Skipped(String),
}

/// Runs `repair`; returns the exit status (0 done, skipped ones included; 2 on errors).
pub async fn run_repair(args: RepairArgs) -> u8 {
    let report: Report = match std::fs::read_to_string(&args.from_report)
        .map_err(|e| e.to_string())
        .and_then(|t| serde_json::from_str(&t).map_err(|e| format!("not an audit report: {e}")))
    {
        Ok(r) => r,
        Err(e) => {
            eprintln!("repair: {}: {e}", args.from_report.display());
            return EXIT_ERROR;
        }
    };
    let store = match client().await {
        Ok(c) => KubeStore::new(c, &report.pool_namespace),
        Err(e) => {
            eprintln!("repair: cannot reach the cluster: {e:#}");
            return EXIT_ERROR;
        }
    };
    // The reservations the pools imply now: a reservation the report calls an orphan may since
    // have been adopted by the retry of its ADD, which records the entry without touching it.
    let implied = match implied_reservations(&report.pool_namespace).await {
        Ok(names) => names,
        Err(e) => {
            eprintln!("repair: cannot read the pools: {e:#}");
            return EXIT_ERROR;
        }
    };
    let (mut done, mut skipped, mut failed) = (0, 0, 0);
    for f in report.findings.iter().filter(|f| f.repairable()) {
        match repair_one(&store, f, &implied, args.dry_run).await {
            Ok(Outcome::Done(what)) => {
                done += 1;
                println!("{what}");
            }
            Ok(Outcome::Skipped(why)) => {
                skipped += 1;
                println!("skipped {}: {why}", f.kind());
            }
            Err(e) => {
                failed += 1;
                eprintln!("repair: {f}: {e}");
            }
        }
    }
    let verb = if args.dry_run {
        "would apply"
    } else {
        "applied"
    };
    eprintln!("{verb} {done}, skipped {skipped} (changed since the report), failed {failed}");
    if failed > 0 { EXIT_ERROR } else { EXIT_CLEAN }
}

/// The reservation names the pools of `namespace` imply, read now.
async fn implied_reservations(namespace: &str) -> anyhow::Result<BTreeSet<String>> {
    let client = client().await?;
    let pools = list_all(&Api::<IPPool>::namespaced(client.clone(), namespace)).await?;
    let slice_pools: Vec<_> = list_all(&Api::<NodeSlicePool>::namespaced(client, namespace))
        .await?
        .into_iter()
        .map(std::sync::Arc::new)
        .collect();
    let slices = SliceIndex::new(&slice_pools);
    let views: Vec<PoolView> = pools
        .iter()
        .filter_map(|p| PoolView::from_pool_in(p, &slices))
        .collect();
    Ok(expected_reservations(&views))
}

async fn repair_one(
    store: &KubeStore,
    f: &Finding,
    implied: &BTreeSet<String>,
    dry_run: bool,
) -> anyhow::Result<Outcome> {
    match f {
        Finding::StaleEntry { at, .. } => remove_entry(store, at, dry_run).await,
        Finding::OrphanReservation { name, .. } if implied.contains(name) => Ok(Outcome::Skipped(
            format!("overlappingrangeipreservation {name} backs a pool entry now"),
        )),
        Finding::OrphanReservation {
            name,
            uid,
            resource_version,
            ..
        } => {
            if dry_run {
                return Ok(Outcome::Done(format!(
                    "would delete overlappingrangeipreservation {name} (uid {uid}, resourceVersion {resource_version})"
                )));
            }
            Ok(
                match store
                    .delete_reservation(name, uid, Some(resource_version))
                    .await?
                {
                    Write::Done => {
                        Outcome::Done(format!("deleted overlappingrangeipreservation {name}"))
                    }
                    _ => Outcome::Skipped(format!(
                        "overlappingrangeipreservation {name} changed or is gone"
                    )),
                },
            )
        }
        Finding::MissingReservation { at, reservation } => {
            create_reservation(store, at, reservation, dry_run).await
        }
        _ => Ok(Outcome::Skipped("not repairable".into())),
    }
}

fn target_of(at: &EntryAt) -> anyhow::Result<(Target, u128)> {
    let cidr: ipnet::IpNet = at.range.parse()?;
    let target = Target {
        pool: at.pool.clone(),
        range: AddrRange::new(cidr, None, None, &[])?,
        network: at.network.clone(),
        overlapping: true,
        node: None,
    };
    Ok((target, at.offset.parse()?))
}

/// Removes a stale entry (and its reservation) unless its pod exists now or the entry changed.
async fn remove_entry(store: &KubeStore, at: &EntryAt, dry_run: bool) -> anyhow::Result<Outcome> {
    let e = &at.entry;
    let (ns, name) = e.podref.split_once('/').unwrap_or(("", &e.podref));
    if let Some(pod) = store.get_pod(ns, name).await? {
        // The entry's pod (this UID, or any pod of the name when none was recorded) lives.
        if e.poduid.is_empty() || e.poduid == pod.uid {
            return Ok(Outcome::Skipped(format!("pod {} exists now", e.podref)));
        }
    }
    let address = at.address.as_deref().unwrap_or("?");
    if dry_run {
        return Ok(Outcome::Done(format!(
            "would remove {address} (offset {}) of pod {} from pool {}",
            at.offset, e.podref, at.pool
        )));
    }
    let (target, offset) = target_of(at)?;
    let released = Engine::new(store, &target)
        .release_entries(&[(offset, e.clone())])
        .await?;
    Ok(if released.is_empty() {
        Outcome::Skipped(format!(
            "pool {} no longer holds {address} for container {}",
            at.pool, e.id
        ))
    } else {
        Outcome::Done(format!(
            "removed {address} of pod {} from pool {}",
            e.podref, at.pool
        ))
    })
}

/// Creates the reservation an entry lacks, if nobody made one since.
async fn create_reservation(
    store: &KubeStore,
    at: &EntryAt,
    name: &str,
    dry_run: bool,
) -> anyhow::Result<Outcome> {
    let (target, offset) = target_of(at)?;
    let Some(ip) = target.ip(offset) else {
        return Ok(Outcome::Skipped(format!(
            "offset {offset} is outside {}",
            at.range
        )));
    };
    let Some(pool) = store.get_pool(&at.pool).await? else {
        return Ok(Outcome::Skipped(format!("pool {} is gone", at.pool)));
    };
    if pool
        .allocations
        .get(&offset)
        .is_none_or(|now| *now != at.entry)
    {
        return Ok(Outcome::Skipped(format!(
            "pool {} changed at {ip}",
            at.pool
        )));
    }
    if dry_run {
        return Ok(Outcome::Done(format!(
            "would create overlappingrangeipreservation {name} for pod {}",
            at.entry.podref
        )));
    }
    let e = &at.entry;
    let spec = crate::crd::OverlappingRangeIPReservationSpec::from(e);
    Ok(
        match store.create_reservation(name, &spec, &at.pool, ip).await?.0 {
            Write::Done => Outcome::Done(format!(
                "created overlappingrangeipreservation {name} for pod {}",
                e.podref
            )),
            _ => Outcome::Skipped(format!("overlappingrangeipreservation {name} exists now")),
        },
    )
}
