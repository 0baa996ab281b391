//! The CNI plugin: commands over a [`Store`], independent of how the store is reached.
//!
//! [`load`] turns environment and stdin into a [`Request`] (every input validated, failures are
//! CNI errors); [`handle`] runs it. The binary only wires a Kubernetes store and prints.

pub mod protocol;

use std::collections::HashSet;
use std::net::IpAddr;
use std::time::Duration;

use serde_json::{Map, Value};

use crate::alloc::{AllocError, Allocate, Direct, Engine, Target};
use crate::config::{
    IpamConfig, NetConf, RangeConfig, Source, flat, problem, result_shape_problem, validate_ipam,
};
use crate::store::Store;
use protocol::{Attachment, CniArgs, CniError, Command, IpResult, code, render_result};

/// Everything a command needs, validated.
#[derive(Debug, Clone)]
pub struct Request {
    pub command: Command,
    pub attachment: Attachment,
    pub args: CniArgs,
    pub conf: NetConf,
    pub ipam: IpamConfig,
    /// What each range's address is allocated from, in the order of `ipam.ranges`.
    pub targets: Vec<Target>,
}

/// The engine's target of one configured range.
pub fn target(range: &RangeConfig, ipam: &IpamConfig) -> Target {
    Target {
        pool: range.pool_name.clone(),
        range: range.range.clone(),
        network: ipam.network_name.clone(),
        overlapping: ipam.enable_overlapping_ranges,
    }
}

/// What the runtime passed: the environment (as a lookup) and stdin.
pub struct Invocation<'a> {
    pub env: &'a dyn Fn(&str) -> Option<String>,
    pub stdin: &'a str,
    pub flat_file: FlatSource,
}

/// Where the flat file comes from.
#[derive(Debug, Clone)]
pub enum FlatSource {
    /// The standard lookup: `configuration_path`, then the well-known paths.
    Lookup,
    /// These paths, in order.
    Paths(Vec<std::path::PathBuf>),
    /// Already read: what the plugin found on the node and forwarded to the node agent.
    Found(Option<flat::FlatFile>),
}

/// Parses and validates an invocation (not VERSION, which needs none of this).
pub fn load(command: Command, inv: &Invocation<'_>) -> Result<Request, CniError> {
    let conf = NetConf::parse(inv.stdin, "network config")
        .map_err(|p| CniError::new(code::DECODE, p.to_string()))?;
    protocol::check_version(&conf)?;
    let (prefix, ipam) = conf
        .runtime_ipam()
        .ok_or_else(|| CniError::new(code::INVALID_CONFIG, "network config has no ipam object"))?;
    let merged = merge_flat_file(ipam, inv)?;
    let validated = validate_ipam(&merged, &prefix, Source::Runtime);
    for w in &validated.warnings {
        tracing::warn!("{w}");
    }
    let ipam = validated.config.ok_or_else(|| {
        CniError::new(
            code::INVALID_CONFIG,
            format!(
                "invalid whereabouts config: {}",
                problem::join(&validated.errors)
            ),
        )
    })?;

    let env = |k: &str| (inv.env)(k).unwrap_or_default();
    let args = CniArgs::parse(&env("CNI_ARGS"))?;
    check_result_shape(&conf.cni_version, &prefix, &ipam, &args)?;
    let attachment = Attachment {
        container_id: env("CNI_CONTAINERID"),
        ifname: env("CNI_IFNAME"),
        podref: args.podref(),
        pod_uid: args.pod_uid.clone(),
    };
    require_env(command, &attachment)?;
    let targets = ipam.ranges.iter().map(|r| target(r, &ipam)).collect();
    Ok(Request {
        command,
        attachment,
        args,
        conf,
        ipam,
        targets,
    })
}

/// The flat file this invocation's config merges (none is fine: the flat file is optional).
pub fn find_flat_file(inv: &Invocation<'_>) -> Result<Option<flat::FlatFile>, CniError> {
    let configuration_path = NetConf::parse(inv.stdin, "network config")
        .ok()
        .and_then(|conf| {
            let (_, ipam) = conf.runtime_ipam()?;
            Some(ipam.get("configuration_path")?.as_str()?.to_owned())
        });
    flat_file_of(inv, configuration_path.as_deref())
}

/// [`find_flat_file`] for a config already parsed, with its `configuration_path`.
fn flat_file_of(
    inv: &Invocation<'_>,
    configuration_path: Option<&str>,
) -> Result<Option<flat::FlatFile>, CniError> {
    let paths = match &inv.flat_file {
        FlatSource::Found(found) => return Ok(found.clone()),
        FlatSource::Paths(paths) => paths.clone(),
        FlatSource::Lookup => flat::candidates(configuration_path),
    };
    flat::load(&paths).map_err(|p| CniError::new(code::INVALID_CONFIG, p.to_string()))
}

fn merge_flat_file(ipam: &Value, inv: &Invocation<'_>) -> Result<Value, CniError> {
    let Some(obj) = ipam.as_object() else {
        return Ok(ipam.clone());
    };
    let mut merged: Map<String, Value> = obj.clone();
    // Which socket root's plugin trusts for its results is the node's decision, not a network
    // config's (anyone who may write a NAD could otherwise point it at a socket of their own).
    if merged.remove("agent_socket").is_some() {
        tracing::warn!(
            "ipam.agent_socket is taken from the node's flat file only; the network config's is ignored"
        );
    }
    let configuration_path = obj.get("configuration_path").and_then(Value::as_str);
    if let Some((path, flat_conf)) = flat_file_of(inv, configuration_path)? {
        tracing::debug!(path = %path.display(), "merging flat file");
        flat::merge(&mut merged, &flat_conf);
    }
    Ok(Value::Object(merged))
}

fn require_env(command: Command, a: &Attachment) -> Result<(), CniError> {
    if !matches!(command, Command::Add | Command::Del | Command::Check) {
        return Ok(());
    }
    let missing = |name: &str| CniError::new(code::INVALID_ENV, format!("{name} is not set"));
    if a.container_id.is_empty() {
        return Err(missing("CNI_CONTAINERID"));
    }
    if a.ifname.is_empty() {
        return Err(missing("CNI_IFNAME"));
    }
    if command == Command::Add && a.podref.is_empty() {
        return Err(CniError::new(
            code::INVALID_ENV,
            "CNI_ARGS has no K8S_POD_NAME/K8S_POD_NAMESPACE: whereabouts records the pod of every address",
        ));
    }
    Ok(())
}

/// Overall deadlines, as upstream: the kubelet allows a sandbox four minutes.
pub const ADD_DEADLINE: Duration = Duration::from_secs(110);
/// After an ADD runs out of time, what it took is released within this budget (the total stays
/// within upstream's two minutes), so a timed-out ADD leaves no claim behind.
pub const ROLLBACK_BUDGET: Duration = Duration::from_secs(10);
pub const OTHER_DEADLINE: Duration = Duration::from_secs(60);

/// Runs a command within its deadline; an ADD cut off mid-way releases what it took.
pub async fn handle_within<S: Store, A: Allocate<S>>(
    store: &S,
    alloc: &A,
    req: &Request,
) -> Result<Option<Value>, CniError> {
    let deadline = if req.command == Command::Add {
        ADD_DEADLINE
    } else {
        OTHER_DEADLINE
    };
    if let Ok(result) = tokio::time::timeout(deadline, handle_with(store, alloc, req)).await {
        return result;
    }
    if req.command == Command::Add {
        // Cut off before its own all-or-nothing rollback: release whatever this attachment
        // holds, as a DEL would.
        let del = Request {
            command: Command::Del,
            ..req.clone()
        };
        if let Err(e) | Ok(Err(e)) = tokio::time::timeout(ROLLBACK_BUDGET, handle(store, &del))
            .await
            .map_err(|_| CniError::new(code::TRY_AGAIN_LATER, "rollback timed out"))
        {
            tracing::error!(error = %e.msg, "could not roll back a timed-out ADD; the operator's audit will release it");
        }
    }
    Err(CniError::new(
        code::TRY_AGAIN_LATER,
        format!(
            "{:?} did not finish within {}s",
            req.command,
            deadline.as_secs()
        ),
    ))
}

/// Runs a command. `Ok(Some(json))` is printed on stdout; `Ok(None)` prints nothing.
pub async fn handle<S: Store>(store: &S, req: &Request) -> Result<Option<Value>, CniError> {
    handle_with(store, &Direct, req).await
}

/// [`handle`], with ADD's addresses claimed by `alloc`.
pub async fn handle_with<S: Store, A: Allocate<S>>(
    store: &S,
    alloc: &A,
    req: &Request,
) -> Result<Option<Value>, CniError> {
    match req.command {
        Command::Add => add(store, alloc, req).await.map(Some),
        Command::Del => del(store, alloc, req).await.map(|_| None),
        Command::Check => check(store, req).await.map(|_| None),
        Command::Gc => gc(store, req).await.map(|_| None),
        Command::Status => status(store).await.map(|_| None),
        Command::Version => Ok(Some(protocol::version_reply())),
    }
}

/// Allocates one address per range, in order; all or nothing.
async fn add<S: Store, A: Allocate<S>>(
    store: &S,
    alloc: &A,
    req: &Request,
) -> Result<Value, CniError> {
    let mut ips = Vec::with_capacity(req.targets.len());
    for (i, target) in req.targets.iter().enumerate() {
        match alloc.allocate(store, target, &req.attachment).await {
            Ok(a) => {
                tracing::info!(ip = %a.ip, pool = %target.pool, conflicts = a.conflicts, pod = %req.attachment.podref, "allocated");
                ips.push(IpResult {
                    address: ipnet::IpNet::new(a.ip, target.range.cidr().prefix_len())
                        .expect("prefix of the range"),
                    gateway: gateway_for(req, a.ip),
                });
            }
            Err(e) => {
                rollback(store, alloc, req, i).await;
                return Err(alloc_error(e));
            }
        }
    }
    ips.extend(static_addresses(req));
    // Cannot fail: `load` checked the result's shape before anything was allocated.
    render_result(
        &req.conf.cni_version,
        &ips,
        &req.ipam.routes,
        req.ipam.dns.as_ref(),
    )
}

/// 0.1.0 and 0.2.0 results hold one address per family: refuse a config, or CNI_ARGS `IP=`, that
/// would give more, before anything is allocated (the validator refuses such a NAD alike).
fn check_result_shape(
    cni_version: &str,
    prefix: &str,
    ipam: &IpamConfig,
    args: &CniArgs,
) -> Result<(), CniError> {
    let invalid = |p: crate::config::Problem| {
        CniError::new(
            code::INVALID_CONFIG,
            format!("invalid whereabouts config: {p}"),
        )
    };
    if let Some(p) = result_shape_problem(cni_version, prefix, ipam) {
        return Err(invalid(p));
    }
    if args.ips.is_empty() || !crate::config::netconf::one_address_per_family(cni_version) {
        return Ok(());
    }
    let mut with_args = ipam.clone();
    with_args
        .addresses
        .extend(args.ips.iter().map(|ip| crate::config::StaticAddress {
            address: *ip,
            gateway: None,
        }));
    match result_shape_problem(cni_version, prefix, &with_args) {
        Some(p) => Err(CniError::new(
            code::INVALID_ENV,
            format!("CNI_ARGS IP: {p}"),
        )),
        None => Ok(()),
    }
}

/// Releases what ranges `0..upto` took, so a failed ADD leaves nothing behind.
async fn rollback<S: Store, A: Allocate<S>>(store: &S, alloc: &A, req: &Request, upto: usize) {
    for target in &req.targets[..upto] {
        if let Err(e) = alloc.release(store, target, &req.attachment).await {
            tracing::error!(pool = %target.pool, error = %e, "could not roll back a partial ADD; the audit will release it");
        }
    }
}

fn gateway_for(req: &Request, ip: IpAddr) -> Option<IpAddr> {
    req.ipam.gateway.filter(|gw| gw.is_ipv4() == ip.is_ipv4())
}

fn static_addresses(req: &Request) -> Vec<IpResult> {
    let from_config = req.ipam.addresses.iter().map(|a| IpResult {
        address: a.address,
        gateway: a.gateway,
    });
    let from_args = req.args.ips.iter().map(|net| IpResult {
        address: *net,
        gateway: req
            .args
            .gateways
            .iter()
            .copied()
            .find(|gw| net.contains(gw)),
    });
    from_config.chain(from_args).collect()
}

fn alloc_error(e: AllocError) -> CniError {
    match &e {
        AllocError::Exhausted { .. } | AllocError::PoolFull { .. } => {
            CniError::new(code::EXHAUSTED, e.to_string())
        }
        // Defence in depth: the estimate missed (metadata larger than allowed for), and etcd
        // refused the write. Retrying cannot help.
        AllocError::Store(s) if s.is_too_large() => CniError::new(
            code::EXHAUSTED,
            format!("datastore: {s}: the pool has grown past the largest object the API server can store; split the range into smaller ranges or use node slices (docs/reliability.md, Limits)"),
        )
        .with_details(s.kind()),
        AllocError::TooManyConflicts { .. } | AllocError::Agent(_) => {
            CniError::new(code::TRY_AGAIN_LATER, e.to_string())
        }
        AllocError::Store(s) => {
            CniError::new(code::TRY_AGAIN_LATER, format!("datastore: {s}")).with_details(s.kind())
        }
    }
}

/// Releases every range; a failing range does not stop the others, and any failure is reported
/// so the runtime retries (a second DEL is harmless).
async fn del<S: Store, A: Allocate<S>>(
    store: &S,
    alloc: &A,
    req: &Request,
) -> Result<(), CniError> {
    let mut failures = Vec::new();
    for target in &req.targets {
        match alloc.release(store, target, &req.attachment).await {
            Ok(ips) => tracing::info!(pool = %target.pool, released = ?ips, "released"),
            Err(e) => failures.push(format!("{}: {e}", target.pool)),
        }
    }
    if failures.is_empty() {
        Ok(())
    } else {
        Err(CniError::new(
            code::TRY_AGAIN_LATER,
            format!("datastore: {}", failures.join("; ")),
        ))
    }
}

/// Checks that every range holds an entry for this attachment whose address is in `prevResult`.
async fn check<S: Store>(store: &S, req: &Request) -> Result<(), CniError> {
    let prev: Vec<IpAddr> = req
        .conf
        .value
        .pointer("/prevResult/ips")
        .and_then(Value::as_array)
        .into_iter()
        .flatten()
        .filter_map(|ip| ip.get("address")?.as_str()?.parse::<ipnet::IpNet>().ok())
        .map(|n| n.addr())
        .collect();
    let mismatch = |msg: String| CniError::new(code::CHECK_MISMATCH, msg);
    for range in &req.ipam.ranges {
        let pool = store
            .get_pool(&range.pool_name)
            .await
            .map_err(|e| CniError::new(code::TRY_AGAIN_LATER, format!("datastore: {e}")))?;
        let held = pool
            .as_ref()
            .and_then(|p| {
                p.allocations.iter().find(|(_, e)| {
                    e.id == req.attachment.container_id && e.ifname == req.attachment.ifname
                })
            })
            .and_then(|(o, _)| range.range.addr_at(*o));
        match held {
            None => {
                return Err(mismatch(format!(
                    "pool {} holds no address for container {} interface {}",
                    range.pool_name, req.attachment.container_id, req.attachment.ifname
                )));
            }
            Some(ip) if !prev.contains(&ip) => {
                return Err(mismatch(format!(
                    "pool {} holds {ip} for this attachment, prevResult has {prev:?}",
                    range.pool_name
                )));
            }
            Some(_) => {}
        }
    }
    Ok(())
}

/// CNI 1.1 GC: releases entries of this network's pools whose attachment is not in
/// `cni.dev/valid-attachments` *and* whose pod no longer exists. The list a runtime passes covers
/// its own node only, so the pod check is what keeps other nodes' live pods safe.
async fn gc<S: Store>(store: &S, req: &Request) -> Result<usize, CniError> {
    let valid = valid_attachments(&req.conf.value)?;
    let retry = |e: crate::store::StoreError| {
        CniError::new(code::TRY_AGAIN_LATER, format!("datastore: {e}"))
    };
    let mut pods = None;
    let mut released = 0;
    for target in &req.targets {
        let Some(pool) = store.get_pool(&target.pool).await.map_err(retry)? else {
            continue;
        };
        let unknown: Vec<_> = pool
            .allocations
            .iter()
            .filter(|(_, e)| !valid.contains(&(e.id.clone(), e.ifname.clone())))
            .map(|(o, e)| (*o, e.clone()))
            .collect();
        if unknown.is_empty() {
            continue;
        }
        if pods.is_none() {
            pods = Some(store.pod_uids().await.map_err(retry)?);
        }
        let pods = pods.as_ref().expect("loaded above");
        let gone: Vec<_> = unknown
            .into_iter()
            .filter(|(_, e)| crate::ownership::is_stale(e, pods))
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

fn valid_attachments(conf: &Value) -> Result<HashSet<(String, String)>, CniError> {
    let list = conf
        .get("cni.dev/valid-attachments")
        .and_then(Value::as_array)
        .ok_or_else(|| {
            CniError::new(
                code::INVALID_CONFIG,
                "GC needs cni.dev/valid-attachments in the network config",
            )
        })?;
    list.iter()
        .map(|a| {
            let id = a.get("containerID").and_then(Value::as_str);
            let ifname = a.get("ifname").and_then(Value::as_str);
            match (id, ifname) {
                (Some(id), Some(ifname)) => Ok((id.to_owned(), ifname.to_owned())),
                _ => Err(CniError::new(
                    code::INVALID_CONFIG,
                    format!("cni.dev/valid-attachments entry {a} needs containerID and ifname"),
                )),
            }
        })
        .collect()
}

/// STATUS: ready when the datastore answers.
async fn status<S: Store>(store: &S) -> Result<(), CniError> {
    store
        .get_pool("whereabouts-status-probe")
        .await
        .map(|_| ())
        .map_err(|e| CniError::new(code::NOT_AVAILABLE, format!("datastore unreachable: {e}")))
}

/// `log_file` and `log_level` from the merged config, read before validation so that logging is
/// set up even for an invalid config.
pub fn logging_settings(inv: &Invocation<'_>) -> (Option<String>, Option<String>) {
    let Ok(conf) = NetConf::parse(inv.stdin, "network config") else {
        return (None, None);
    };
    let Some((_, ipam)) = conf.runtime_ipam() else {
        return (None, None);
    };
    let merged = merge_flat_file(ipam, inv).unwrap_or_else(|_| ipam.clone());
    let text = |k: &str| {
        merged
            .get(k)
            .and_then(Value::as_str)
            .filter(|s| !s.is_empty())
            .map(str::to_owned)
    };
    (text("log_file"), text("log_level"))
}
