//! Running a validated [`Request`] against a [`Datastore`]: ADD, DEL, CHECK, GC, STATUS, VERSION,
//! each within its deadline, with each range's address claimed (released) by an [`Allocate`]:
//! this process alone, or the node agent's groups.

use std::net::IpAddr;
use std::time::Duration;

use serde_json::Value;

use super::Request;
use super::protocol::{CniError, Code, Command, UNAUTHENTICATED};
use super::reply::{IpResult, Reply, render_result, version_reply};
use super::slices::{SLICE_WAIT, Sliced};
use super::{keep, requested};
use crate::alloc::{AllocError, Allocate, Direct, Engine, Owned, Owner, Target};
use crate::store::Datastore;

/// Overall deadlines, as upstream: the kubelet allows a sandbox four minutes.
pub const ADD_DEADLINE: Duration = Duration::from_secs(110);
/// After an ADD runs out of time, what it took is released within this budget (the total stays
/// within upstream's two minutes), so a timed-out ADD leaves no claim behind.
pub const ROLLBACK_BUDGET: Duration = Duration::from_secs(10);
pub const OTHER_DEADLINE: Duration = Duration::from_secs(60);
// A claim of a running ADD is recorded or rolled back within the lifetime the audit spares.
const _: () = assert!(
    ADD_DEADLINE.as_secs() + ROLLBACK_BUDGET.as_secs() <= crate::alloc::CLAIM_LIFETIME.as_secs()
);

/// Runs a command within what is left of its deadline after `spent` (waiting for the node's
/// plugin slot); an ADD cut off mid-way releases what it took.
pub async fn handle_within<S: Datastore, A: Allocate<S>>(
    store: &S,
    alloc: &A,
    req: &Request,
    spent: Duration,
) -> Result<Option<Reply>, CniError> {
    let deadline = if req.command == Command::Add {
        ADD_DEADLINE
    } else {
        OTHER_DEADLINE
    };
    let left = deadline.saturating_sub(spent);
    if let Ok(result) = tokio::time::timeout(left, handle_with(store, alloc, req)).await {
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
            .map_err(|_| CniError::new(Code::TryAgainLater, "rollback timed out"))
        {
            tracing::error!(error = %e.msg, "could not roll back a timed-out ADD; the operator's audit will release it");
        }
    }
    Err(CniError::new(
        Code::TryAgainLater,
        format!(
            "{:?} did not finish within {}s",
            req.command,
            deadline.as_secs()
        ),
    ))
}

/// Runs a command. `Ok(Some(json))` is printed on stdout; `Ok(None)` prints nothing.
pub async fn handle<S: Datastore>(store: &S, req: &Request) -> Result<Option<Reply>, CniError> {
    handle_with(store, &Direct, req).await
}

/// [`handle`], with ADD's addresses claimed by `alloc`.
pub async fn handle_with<S: Datastore, A: Allocate<S>>(
    store: &S,
    alloc: &A,
    req: &Request,
) -> Result<Option<Reply>, CniError> {
    match req.command {
        Command::Add => add(store, alloc, req).await.map(Some),
        Command::Del => del(store, alloc, req).await.map(|_| None),
        Command::Check => check(store, req).await.map(|_| None),
        Command::Gc => super::gc::gc(store, req).await.map(|_| None),
        Command::Status => status(store).await.map(|_| None),
        Command::Version => Ok(Some(version_reply())),
    }
}

/// Allocates one address per range, in order; all or nothing (an address something other than
/// the pod holds stays with its holder). On a network that keeps addresses, the attachment's
/// holder is read first, and an IPAMClaim's addresses are taken again or recorded on it.
async fn add<S: Datastore, A: Allocate<S>>(
    store: &S,
    alloc: &A,
    req: &Request,
) -> Result<Reply, CniError> {
    let kept = keep::resolve(store, req).await?;
    let Some(claim) = &kept.claim else {
        let ips = allocate_all(store, alloc, req, &kept.who, &req.requested).await?;
        return reply(req, ips);
    };
    let allocated = match keep::claimed(claim) {
        Ok(claimed) if claimed.is_empty() => Ok(req.requested.clone()),
        Ok(claimed) => requested::assign(&req.ipam.ranges, &claimed),
        Err(e) => Err(e),
    };
    let allocated = match allocated {
        Ok(wanted) => allocate_all(store, alloc, req, &kept.who, &wanted).await,
        Err(e) => Err(e),
    };
    match allocated {
        Ok(ips) => {
            let addresses: Vec<ipnet::IpNet> = ips.iter().map(|r| r.address).collect();
            keep::record(
                store,
                claim,
                &addresses,
                &req.args.pod_name,
                req.node.as_deref(),
            )
            .await?;
            reply(req, ips)
        }
        Err(e) => {
            keep::report_failure(store, claim, &e).await;
            Err(e)
        }
    }
}

/// One address per range for `who`: the requested one where `wanted` has one, else dynamic.
async fn allocate_all<S: Datastore, A: Allocate<S>>(
    store: &S,
    alloc: &A,
    req: &Request,
    who: &Owner,
    wanted: &[Option<IpAddr>],
) -> Result<Vec<IpResult>, CniError> {
    let mut ips = Vec::with_capacity(req.targets.len());
    let mut used = Vec::with_capacity(req.targets.len());
    for (i, range) in req.ipam.ranges.iter().enumerate() {
        let allocated = match wanted.get(i).copied().flatten() {
            Some(ip) => allocate_exact(store, &req.targets[i], who, ip).await,
            None => allocate_range(store, alloc, req, who, i).await,
        };
        match allocated {
            Ok((target, ip)) => {
                ips.push(IpResult {
                    // The whole range's prefix, also for a slice (as upstream).
                    address: ipnet::IpNet::new(ip, range.range.cidr().prefix_len())
                        .expect("prefix of the range"),
                    gateway: gateway_for(req, ip),
                });
                used.push(target);
            }
            Err(e) => {
                rollback(store, alloc, who, &used).await;
                return Err(e);
            }
        }
    }
    Ok(ips)
}

/// The result: the ranges' addresses, then the static ones.
fn reply(req: &Request, mut ips: Vec<IpResult>) -> Result<Reply, CniError> {
    ips.extend(static_addresses(req));
    // Cannot fail: `load` checked the result's shape before anything was allocated.
    render_result(
        &req.conf.cni_version,
        &ips,
        &req.ipam.routes,
        req.ipam.dns.as_ref(),
    )
}

/// A requested address, claimed by this process (requests are rare: never grouped).
async fn allocate_exact<S: Datastore>(
    store: &S,
    target: &Target,
    who: &Owner,
    ip: IpAddr,
) -> Result<(Target, IpAddr), CniError> {
    let a = Engine::new(store, target)
        .allocate_exact(ip, who)
        .await
        .map_err(alloc_error)?;
    tracing::info!(ip = %a.ip, pool = %target.pool, pod = %who.podref, "allocated the requested address");
    Ok((target.clone(), a.ip))
}

/// One address of range `i`: from its pool, or from this node's slices in order, taking one more
/// free slice when they are all full.
async fn allocate_range<S: Datastore, A: Allocate<S>>(
    store: &S,
    alloc: &A,
    req: &Request,
    who: &Owner,
    i: usize,
) -> Result<(Target, IpAddr), CniError> {
    let Some(sliced) = Sliced::of(req, i) else {
        let target = &req.targets[i];
        let ip = allocate_in(alloc, store, target, who, false).await?;
        return Ok((target.clone(), ip.expect("only a slice is skipped")));
    };
    let mut targets = sliced.wait_for_targets(store, SLICE_WAIT).await?;
    let mut tried = Vec::new();
    // Ends: every turn of the loop tries a slice not tried before, and there are finitely many.
    loop {
        for target in targets.drain(..) {
            if let Some(ip) = allocate_in(alloc, store, &target, who, true).await? {
                return Ok((target, ip));
            }
            tried.push(target.pool);
        }
        match sliced.next_slice(store, &tried).await? {
            Some(target) => targets.push(target),
            None => return Err(sliced.all_full(tried.len())),
        }
    }
}

/// Allocates from one target: `None` when it is a full `slice` (the next one is tried), an error
/// otherwise.
async fn allocate_in<S: Datastore, A: Allocate<S>>(
    alloc: &A,
    store: &S,
    target: &Target,
    who: &Owner,
    slice: bool,
) -> Result<Option<IpAddr>, CniError> {
    match alloc.allocate(store, target, who).await {
        Ok(a) => {
            tracing::info!(ip = %a.ip, pool = %target.pool, conflicts = a.conflicts, pod = %who.podref, "allocated");
            Ok(Some(a.ip))
        }
        Err(AllocError::Exhausted { .. } | AllocError::PoolFull { .. }) if slice => Ok(None),
        Err(e) => Err(alloc_error(e)),
    }
}

/// The targets range `i` may hold this attachment's address in: its pool, or every slice this
/// node holds (read now, never waited for: DEL, CHECK and GC of a node without slices have
/// nothing there).
pub(super) async fn held_targets<S: Datastore>(
    store: &S,
    req: &Request,
    i: usize,
) -> Result<Vec<Target>, CniError> {
    match Sliced::of(req, i) {
        Some(sliced) => sliced.targets(store).await,
        None => Ok(vec![req.targets[i].clone()]),
    }
}

/// Releases what a failed ADD took, so it leaves nothing behind (but what a holder keeps).
async fn rollback<S: Datastore, A: Allocate<S>>(
    store: &S,
    alloc: &A,
    who: &Owner,
    used: &[Target],
) {
    for target in used {
        if let Err(e) = alloc.release(store, target, who).await {
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
            CniError::new(Code::Exhausted, e.to_string())
        }
        // Defence in depth: the estimate missed (metadata larger than allowed for), and etcd
        // refused the write. Retrying cannot help.
        AllocError::Datastore(s) if s.is_too_large() => CniError::new(
            Code::Exhausted,
            format!("datastore: {s}: the pool has grown past the largest object the API server can store; split the range into smaller ranges or use node slices (docs/reliability.md, Limits)"),
        )
        .with_details(s.kind()),
        AllocError::Unavailable { .. } => CniError::new(Code::AddressUnavailable, e.to_string()),
        AllocError::TooManyConflicts { .. } | AllocError::Agent(_) => {
            CniError::new(Code::TryAgainLater, e.to_string())
        }
        AllocError::Datastore(s) => CniError::datastore(s),
    }
}

/// Releases every range; a failing range does not stop the others, and any failure is reported
/// so the runtime retries (a second DEL is harmless).
async fn del<S: Datastore, A: Allocate<S>>(
    store: &S,
    alloc: &A,
    req: &Request,
) -> Result<(), CniError> {
    let mut failures = Vec::new();
    // Whether every failure was the API server refusing the credentials (see `cni::plugin`).
    let mut unauthenticated = true;
    let mut fail = |msg: String, rejected: bool| {
        unauthenticated &= rejected;
        failures.push(msg);
    };
    for i in 0..req.targets.len() {
        let targets = match held_targets(store, req, i).await {
            Ok(targets) => targets,
            Err(e) => {
                fail(e.msg, e.details == UNAUTHENTICATED);
                continue;
            }
        };
        for target in &targets {
            match alloc.release(store, target, &req.attachment).await {
                Ok(ips) => tracing::info!(pool = %target.pool, released = ?ips, "released"),
                Err(e) => fail(format!("{}: {e}", target.pool), e.is_unauthenticated()),
            }
            if req.keep.persistent_ips {
                match keep::release_unclaimed(store, target, &req.attachment).await {
                    Ok(ips) if !ips.is_empty() => {
                        tracing::info!(pool = %target.pool, released = ?ips, "released: their IPAMClaim is gone");
                    }
                    Ok(_) => {}
                    Err(e) => fail(format!("{}: {e}", target.pool), e.is_unauthenticated()),
                }
            }
        }
    }
    if failures.is_empty() {
        return Ok(());
    }
    let e = CniError::new(
        Code::TryAgainLater,
        format!("datastore: {}", failures.join("; ")),
    );
    Err(if unauthenticated {
        e.with_details(UNAUTHENTICATED)
    } else {
        e
    })
}

/// Checks that every range holds an entry for this attachment whose address is in `prevResult`.
async fn check<S: Datastore>(store: &S, req: &Request) -> Result<(), CniError> {
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
    let mismatch = |msg: String| CniError::new(Code::CheckMismatch, msg);
    for i in 0..req.targets.len() {
        let targets = held_targets(store, req, i).await?;
        let (pool, held) = held_in(store, req, &targets).await?;
        match held {
            None => {
                return Err(mismatch(format!(
                    "pool {pool} holds no address for container {} interface {}",
                    req.attachment.container_id, req.attachment.ifname
                )));
            }
            Some(ip) if !prev.contains(&ip) => {
                return Err(mismatch(format!(
                    "pool {pool} holds {ip} for this attachment, prevResult has {prev:?}"
                )));
            }
            Some(_) => {}
        }
    }
    Ok(())
}

/// The first of `targets` whose pool holds this attachment's entry, and its address; or, when
/// none does, the pools looked in (a sliced range: every slice of this node, read one at a time).
async fn held_in<S: Datastore>(
    store: &S,
    req: &Request,
    targets: &[Target],
) -> Result<(String, Option<IpAddr>), CniError> {
    for target in targets {
        let pool = store
            .get_pool(&target.pool)
            .await
            .map_err(|e| CniError::datastore(&e))?;
        let entry = pool.as_ref().and_then(|p| {
            p.allocations
                .iter()
                .find(|(_, e)| e.same_attachment(&req.attachment))
        });
        if let Some(ip) = entry.and_then(|(offset, _)| target.range.addr_at(*offset)) {
            return Ok((target.pool.clone(), Some(ip)));
        }
    }
    let looked: Vec<&str> = targets.iter().map(|t| t.pool.as_str()).collect();
    let looked = match looked.as_slice() {
        [] => "(none: this node holds no slice of the range)".to_owned(),
        pools => pools.join(", "),
    };
    Ok((looked, None))
}

/// STATUS: ready when the datastore answers.
async fn status<S: Datastore>(store: &S) -> Result<(), CniError> {
    store
        .get_pool("whereabouts-status-probe")
        .await
        .map(|_| ())
        .map_err(|e| CniError::new(Code::NotAvailable, format!("datastore unreachable: {e}")))
}
