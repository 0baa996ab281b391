//! The one validator: a whereabouts `ipam` object in, a typed [`IpamConfig`] or every problem out.
//!
//! The CNI plugin, the admission webhook and the offline `validate` command all call
//! [`validate_ipam`], so whatever the webhook admits the plugin can use, and the plugin's error for a
//! bad config is word for word the webhook's denial. Problems accumulate: a person fixing a config
//! sees all of them at once.
//!
//! By concern: `ranges` reads the ranges and checks them against each other, `addresses` the
//! routes and static addresses, `warnings` what a config may say but probably does not mean;
//! `reader` is the typed access to an object's keys they all share.

mod addresses;
mod ranges;
mod reader;
mod warnings;

use std::net::IpAddr;

use ipnet::IpNet;
use serde_json::{Map, Value};

use super::problem::Problem;
use super::trust::{self, TrustedDirs};
use crate::ipam::{AddrRange, Family};
use addresses::{read_addresses, read_routes};
use ranges::{check_network_name, check_node_slice, check_overlaps, read_ranges};
use reader::Reader;
use warnings::warnings;

/// Where the node agent listens (our addition; the DaemonSet's agent container binds it).
pub const DEFAULT_AGENT_SOCKET: &str = "/run/whereabouts/agent.sock";
/// Where the plugin processes of a node take their slots (`plugin_slots_dir`, ours).
pub const DEFAULT_PLUGIN_SLOTS_DIR: &str = "/run/whereabouts/plugin-slots";
/// How many plugin processes of a node talk to the API server at once (`plugin_slots`, ours).
/// Measured in docs/benchmarks.md: 8 takes one node's burst of 200 ADDs 1.5x faster than 4 (still
/// about 2x slower than unbounded) and a 10-node storm through the runtime's retries 15% faster;
/// 16 overloads the API server in that storm.
pub const DEFAULT_PLUGIN_SLOTS: u32 = 8;
/// The most slots a node may have: each waiting plugin holds a file descriptor per slot.
pub const MAX_PLUGIN_SLOTS: u64 = 256;

/// The node's bound on its plugin processes that run a request themselves (no agent, or the agent
/// handed it back): `count` lock files in `dir`, one held by each process at work.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PluginSlots {
    pub count: u32,
    pub dir: String,
}

/// Where a config comes from decides what may be missing: a NAD may leave keys to the node's flat
/// file, a config handed to the plugin at runtime has already been merged with it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Source {
    Runtime,
    Nad,
}

/// One allocatable range, as the plugin and the operator use it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RangeConfig {
    /// Where the range was written, for messages: `ipam.range` or `ipam.ipRanges[1]`.
    pub path: String,
    pub range: AddrRange,
    pub pool_name: String,
    /// Node slices of this range (`node_slice_size`), if the range is sliced.
    pub node_slice: Option<NodeSlice>,
}

/// A range's node slice size: the prefix length, and the text as configured (a NodeSlicePool
/// stores it verbatim in `spec.sliceSize`, as upstream does).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NodeSlice {
    pub prefix: u8,
    pub text: String,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StaticAddress {
    /// The address with its prefix length; host bits are kept (it is the interface address).
    pub address: IpNet,
    pub gateway: Option<IpAddr>,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct IpamConfig {
    /// Top-level `range` first, then `ipRanges` in order: one address is allocated from each.
    pub ranges: Vec<RangeConfig>,
    pub gateway: Option<IpAddr>,
    /// Copied into the result as given (after checking that they parse).
    pub routes: Vec<Value>,
    pub dns: Option<Value>,
    pub addresses: Vec<StaticAddress>,
    pub enable_overlapping_ranges: bool,
    pub network_name: Option<String>,
    pub kubeconfig: Option<String>,
    pub log_file: Option<String>,
    pub log_level: Option<String>,
    /// The node agent's Unix socket (`agent_socket`, our addition): ADDs and DELs go through the
    /// agent when it listens there, directly to the API server otherwise. `None`: never.
    pub agent_socket: Option<String>,
    /// The node's bound on plugin processes at work (`plugin_slots`, `plugin_slots_dir`: the flat
    /// file's, like `agent_socket`). `None`: unbounded (`plugin_slots: 0`).
    pub plugin_slots: Option<PluginSlots>,
    /// `sticky_statefulset` (ours): a StatefulSet pod's ordinal keeps its address while the
    /// StatefulSet has that ordinal.
    pub sticky_statefulset: bool,
    /// `allowPersistentIPs` in the ipam object (for conflists, whose top level the plugin does not
    /// see); at the top level of a single-plugin config it counts too.
    pub allow_persistent_ips: bool,
}

/// The NodeSlicePools of `cfg`'s sliced ranges are named after the network (`network_name`, else
/// the network config's `name`), so that name must be a valid object name once slices are on. The
/// plugin and the validator refuse such a config with the same words.
pub fn node_slice_pool_problem(prefix: &str, conf_name: &str, cfg: &IpamConfig) -> Option<Problem> {
    if cfg.ranges.iter().all(|r| r.node_slice.is_none()) {
        return None;
    }
    let name = node_slice_base(conf_name, cfg);
    let why = crate::ipam::naming::object_name_problem(&name)?;
    Some(Problem::with_value(
        format!("{prefix}.node_slice_size"),
        &name,
        format!(
            "names the NodeSlicePool after the network (network_name, else the config's name), and {name:?} {why}: set a network_name that is a valid object name"
        ),
    ))
}

/// Addresses that follow a pod (`sticky_statefulset`, IPAMClaims with `persistent_ips`) cannot
/// live in node slices: a node allocates only from its own slices, and a pod that comes back on
/// another node could not take its address along. The plugin and the validator refuse the mix
/// with the same words.
pub fn kept_in_slices_problem(
    prefix: &str,
    persistent_ips: bool,
    cfg: &IpamConfig,
) -> Option<Problem> {
    let sliced = cfg.ranges.iter().find(|r| r.node_slice.is_some())?;
    let key = if cfg.sticky_statefulset {
        "sticky_statefulset"
    } else if persistent_ips {
        "allowPersistentIPs"
    } else {
        return None;
    };
    Some(Problem::at(
        format!("{prefix}.{key}"),
        format!(
            "cannot be combined with node_slice_size ({} is sliced): a node allocates only from its own slices, so a pod that comes back on another node could not keep its address",
            sliced.path
        ),
    ))
}

/// The NodeSlicePool base name: `network_name`, else the network config's `name` (upstream).
pub fn node_slice_base(conf_name: &str, cfg: &IpamConfig) -> String {
    match cfg.network_name.as_deref() {
        Some(n) if !n.is_empty() => n.to_owned(),
        _ => conf_name.to_owned(),
    }
}

/// What is wrong with answering `cfg` in `cni_version`, if anything: 0.1.0 and 0.2.0 results hold
/// one address per family (`ip4`, `ip6`), so a config that gives two of one family (two ranges,
/// or a range and a static address) fails every ADD there, as upstream's does. The plugin checks
/// this before it allocates anything, and the validator refuses such a NAD with the same words.
pub fn result_shape_problem(cni_version: &str, prefix: &str, cfg: &IpamConfig) -> Option<Problem> {
    if !super::netconf::one_address_per_family(cni_version) {
        return None;
    }
    let ranges = cfg
        .ranges
        .iter()
        .map(|r| (r.range.family(), r.path.clone()));
    let statics = cfg.addresses.iter().enumerate().map(|(i, a)| {
        (
            Family::of(a.address.addr()),
            format!("{prefix}.addresses[{i}]"),
        )
    });
    let given: Vec<(Family, String)> = ranges.chain(statics).collect();
    [Family::V4, Family::V6].into_iter().find_map(|family| {
        let paths: Vec<&str> = given
            .iter()
            .filter(|(f, _)| *f == family)
            .map(|(_, p)| p.as_str())
            .collect();
        (paths.len() > 1).then(|| {
            Problem::with_value(
                "cniVersion",
                cni_version,
                format!(
                    "results hold one address per family, but {} {} addresses are configured ({}): use cniVersion 0.3.0 or later",
                    paths.len(),
                    family.name(),
                    paths.join(", ")
                ),
            )
        })
    })
}

/// The outcome of validation: a config only when there are no errors; warnings either way.
#[derive(Debug, Clone, Default)]
pub struct Validated {
    pub config: Option<IpamConfig>,
    pub errors: Vec<Problem>,
    pub warnings: Vec<Problem>,
}

/// Validates one `ipam` object found at `prefix` (normally `ipam`, or `plugins[1].ipam`).
pub fn validate_ipam(ipam: &Value, prefix: &str, source: Source) -> Validated {
    let mut out = Validated::default();
    let Some(obj) = ipam.as_object() else {
        out.errors
            .push(Problem::at(prefix, "must be a JSON object"));
        return out;
    };
    let mut r = Reader {
        obj,
        prefix,
        errors: Vec::new(),
    };
    let cfg = read_config(&mut r, source);
    check_ranges(&mut r, &cfg);
    let mut errors = r.errors;
    if source == Source::Nad {
        // The node's directories as every node has them; the plugin checks the same text (and the
        // file itself) against its own node's, which may add one (`trust::CONF_DIR_ENV`).
        let node_keys = trust::network_config_problems(obj, prefix, &TrustedDirs::well_known());
        errors.extend(node_keys.errors);
        out.warnings.extend(node_keys.warnings);
    }
    if !declares_range(obj) {
        missing_range(prefix, source, &mut errors, &mut out.warnings);
    }
    out.warnings.extend(warnings(
        obj,
        prefix,
        &cfg.ranges,
        cfg.gateway,
        cfg.log_level.as_deref(),
    ));
    out.warnings.extend(addresses::inside_ranges(
        prefix,
        &cfg.addresses,
        &cfg.ranges,
    ));
    if errors.is_empty() && !cfg.ranges.is_empty() {
        out.config = Some(cfg);
    }
    out.errors = errors;
    out
}

/// Reads every key of the object, in the order their problems are reported; the config is only
/// usable when `r` has no errors after the checks across ranges.
fn read_config(r: &mut Reader<'_>, source: Source) -> IpamConfig {
    let network_name = r.string("network_name").map(str::to_owned);
    let mut ranges = read_ranges(r, network_name.as_deref());
    check_node_slice(r, &mut ranges);
    let gateway = r.ip("gateway");
    let routes = read_routes(r);
    let dns = r.object("dns").cloned().map(Value::Object);
    let addresses = read_addresses(r);
    let enable_overlapping_ranges = r.bool("enable_overlapping_ranges").unwrap_or(true);
    let kubeconfig = r
        .object("kubernetes")
        .and_then(|k| k.get("kubeconfig"))
        .and_then(Value::as_str)
        .filter(|s| !s.is_empty())
        .map(str::to_owned);
    let log_level = r.string("log_level").map(str::to_owned);
    // The plugin drops a network config's agent_socket and log_file (the node's flat file
    // decides), so in a NAD their values are not judged, only pointed out (`trust`): refusing
    // them would refuse a NAD every ADD accepts (found by fuzz/cni_config's validator-agreement
    // property).
    let (agent_socket, log_file, plugin_slots) = match source {
        Source::Runtime => (
            read_agent_socket(r),
            r.string("log_file").map(str::to_owned),
            read_plugin_slots(r),
        ),
        Source::Nad => (None, None, None),
    };
    r.string("configuration_path");
    let sticky_statefulset = r.bool("sticky_statefulset").unwrap_or(false);
    let allow_persistent_ips = r.bool("allowPersistentIPs").unwrap_or(false);
    IpamConfig {
        sticky_statefulset,
        allow_persistent_ips,
        ranges,
        gateway,
        routes,
        dns,
        addresses,
        enable_overlapping_ranges,
        network_name,
        kubeconfig,
        log_file,
        log_level,
        agent_socket,
        plugin_slots,
    }
}

/// The checks across the ranges read: the names they give objects, overlaps.
fn check_ranges(r: &mut Reader<'_>, cfg: &IpamConfig) {
    if let Some(name) = &cfg.network_name {
        check_network_name(r, name, &cfg.ranges);
    }
    check_overlaps(r, &cfg.ranges);
}

/// A config without a range: an error at runtime, only a warning in a NAD, whose ranges the
/// node's flat file may supply.
fn missing_range(
    prefix: &str,
    source: Source,
    errors: &mut Vec<Problem>,
    warned: &mut Vec<Problem>,
) {
    let p = Problem::at(
        format!("{prefix}.range"),
        "is missing: set ipam.range or ipam.ipRanges",
    );
    match source {
        Source::Runtime => errors.push(p),
        Source::Nad => warned.push(Problem::at(
            p.path,
            "is missing: the node's flat file must supply ipam.range or ipam.ipRanges",
        )),
    }
}

/// `agent_socket`: absent means the default path, `""` turns the agent off, anything else must be
/// an absolute path (the plugin runs with whatever working directory the runtime gives it).
fn read_agent_socket(r: &mut Reader<'_>) -> Option<String> {
    if r.obj.get("agent_socket").and_then(Value::as_str) == Some("") {
        return None;
    }
    read_absolute_path(
        r,
        "agent_socket",
        DEFAULT_AGENT_SOCKET,
        "must be an absolute path to the node agent's Unix socket, or \"\" to turn the agent off",
    )
}

/// A node key naming a host path: `default` when absent, else an absolute path; `why` follows
/// the value in the problem of a relative one.
fn read_absolute_path(r: &mut Reader<'_>, key: &str, default: &str, why: &str) -> Option<String> {
    match r.obj.get(key) {
        None | Some(Value::Null) => Some(default.to_owned()),
        Some(Value::String(s)) if s.starts_with('/') => Some(s.clone()),
        Some(Value::String(s)) => {
            r.errors.push(Problem::with_value(r.path(key), s, why));
            None
        }
        Some(v) => {
            r.wrong_type(key, v, "a string");
            None
        }
    }
}

/// `plugin_slots` (a count, 0 = unbounded) and `plugin_slots_dir` (an absolute path).
fn read_plugin_slots(r: &mut Reader<'_>) -> Option<PluginSlots> {
    let count = match r.obj.get("plugin_slots") {
        None | Some(Value::Null) => Some(u64::from(DEFAULT_PLUGIN_SLOTS)),
        Some(Value::Number(n)) if n.as_u64().is_some_and(|n| n <= MAX_PLUGIN_SLOTS) => n.as_u64(),
        Some(v) => {
            let why = format!("must be a whole number from 0 (unbounded) to {MAX_PLUGIN_SLOTS}");
            r.errors
                .push(Problem::with_value(r.path("plugin_slots"), v, why));
            None
        }
    };
    let dir = read_absolute_path(
        r,
        "plugin_slots_dir",
        DEFAULT_PLUGIN_SLOTS_DIR,
        "must be an absolute path to a directory (created if missing)",
    );
    let count = u32::try_from(count?).ok().filter(|&n| n > 0)?;
    Some(PluginSlots { count, dir: dir? })
}

/// True when the config names a range at all; whether it is a good one is checked elsewhere.
fn declares_range(obj: &Map<String, Value>) -> bool {
    let present = |k: &str| {
        obj.get(k).is_some_and(|v| {
            !(v.is_null() || v.as_str() == Some("") || v.as_array().is_some_and(Vec::is_empty))
        })
    };
    present("range") || present("ipRanges")
}
