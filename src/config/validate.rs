//! The one validator: a whereabouts `ipam` object in, a typed [`IpamConfig`] or every problem out.
//!
//! The CNI plugin, the admission webhook and the offline `validate` command all call
//! [`validate_ipam`], so whatever the webhook admits the plugin can use, and the plugin's error for a
//! bad config is word for word the webhook's denial. Problems accumulate: a person fixing a config
//! sees all of them at once.

use std::collections::BTreeSet;
use std::net::IpAddr;

use ipnet::IpNet;
use serde_json::{Map, Value};

use super::problem::Problem;
use crate::ipam::naming::{object_name_problem, pool_name, reservation_name};
use crate::ipam::{AddrRange, Bound, Family, RangeError};

/// Keys upstream understands. Legacy keys of the lease and etcd backends are accepted and unused.
const KNOWN_KEYS: &[&str] = &[
    "type",
    "name",
    "range",
    "range_start",
    "range_end",
    "exclude",
    "ipRanges",
    "gateway",
    "routes",
    "dns",
    "addresses",
    "enable_overlapping_ranges",
    "network_name",
    "node_slice_size",
    "kubernetes",
    "configuration_path",
    "log_file",
    "log_level",
    "agent_socket",
    "leader_lease_duration",
    "leader_renew_deadline",
    "leader_retry_period",
    "sleep_for_race",
    "reconciler_cron_expression",
    "datastore",
    "etcd_host",
    "etcd_username",
    "etcd_password",
    "etcd_key_file",
    "etcd_cert_file",
    "etcd_ca_cert_file",
];
const RANGE_KEYS: &[&str] = &["range", "range_start", "range_end", "exclude"];
const LOG_LEVELS: &[&str] = &["debug", "verbose", "error", "panic"];
/// Where the node agent listens (our addition; the DaemonSet's agent container binds it).
pub const DEFAULT_AGENT_SOCKET: &str = "/run/whereabouts/agent.sock";

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
    let network_name = r.string("network_name").map(str::to_owned);
    let ranges = read_ranges(&mut r, network_name.as_deref());
    let gateway = r.ip("gateway");
    let routes = read_routes(&mut r);
    let dns = r.object("dns").cloned().map(Value::Object);
    let addresses = read_addresses(&mut r);
    let enable_overlapping_ranges = r.bool("enable_overlapping_ranges").unwrap_or(true);
    let kubeconfig = r
        .object("kubernetes")
        .and_then(|k| k.get("kubeconfig"))
        .and_then(Value::as_str)
        .filter(|s| !s.is_empty())
        .map(str::to_owned);
    let log_file = r.string("log_file").map(str::to_owned);
    let log_level = r.string("log_level").map(str::to_owned);
    // The plugin drops a network config's agent_socket (the node's flat file decides), so in a
    // NAD its value is not judged, only pointed out below: refusing it would refuse a NAD every
    // ADD accepts (found by fuzz/cni_config's validator-agreement property).
    let agent_socket = match source {
        Source::Runtime => read_agent_socket(&mut r),
        Source::Nad => None,
    };
    r.string("configuration_path");
    check_node_slice(&mut r, &ranges);
    if let Some(name) = &network_name {
        check_network_name(&mut r, name, &ranges);
    }
    check_overlaps(&mut r, &ranges);
    let mut errors = r.errors;
    if source == Source::Nad && obj.contains_key("agent_socket") {
        out.warnings.push(Problem::at(
            format!("{prefix}.agent_socket"),
            "is node configuration, read from the flat file only: ignored in a network config",
        ));
    }
    if !declares_range(obj) {
        let p = Problem::at(
            format!("{prefix}.range"),
            "is missing: set ipam.range or ipam.ipRanges",
        );
        match source {
            Source::Runtime => errors.push(p),
            Source::Nad => out.warnings.push(Problem::at(
                p.path,
                "is missing: the node's flat file must supply ipam.range or ipam.ipRanges",
            )),
        }
    }
    out.warnings.extend(warnings(
        obj,
        prefix,
        &ranges,
        gateway,
        log_level.as_deref(),
    ));
    if errors.is_empty() && !ranges.is_empty() {
        out.config = Some(IpamConfig {
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
        });
    }
    out.errors = errors;
    out
}

/// `agent_socket`: absent means the default path, `""` turns the agent off, anything else must be
/// an absolute path (the plugin runs with whatever working directory the runtime gives it).
fn read_agent_socket(r: &mut Reader<'_>) -> Option<String> {
    match r.obj.get("agent_socket") {
        None | Some(Value::Null) => Some(DEFAULT_AGENT_SOCKET.to_owned()),
        Some(Value::String(s)) if s.is_empty() => None,
        Some(Value::String(s)) if s.starts_with('/') => Some(s.clone()),
        Some(Value::String(s)) => {
            r.errors.push(Problem::with_value(
                r.path("agent_socket"),
                s,
                "must be an absolute path to the node agent's Unix socket, or \"\" to turn the agent off",
            ));
            None
        }
        Some(v) => {
            r.wrong_type("agent_socket", v, "a string");
            None
        }
    }
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

/// Typed access to the keys of one JSON object, recording a problem for every wrong type. Empty
/// strings and nulls read as absent, as Go's zero values do upstream.
struct Reader<'a> {
    obj: &'a Map<String, Value>,
    prefix: &'a str,
    errors: Vec<Problem>,
}

impl<'a> Reader<'a> {
    fn path(&self, key: &str) -> String {
        format!("{}.{key}", self.prefix)
    }

    fn wrong_type(&mut self, key: &str, v: &Value, expected: &str) {
        let path = self.path(key);
        self.errors
            .push(Problem::with_value(path, v, format!("must be {expected}")));
    }

    fn string(&mut self, key: &str) -> Option<&'a str> {
        match self.obj.get(key)? {
            Value::Null => None,
            Value::String(s) if s.is_empty() => None,
            Value::String(s) => Some(s),
            v => {
                self.wrong_type(key, v, "a string");
                None
            }
        }
    }

    fn bool(&mut self, key: &str) -> Option<bool> {
        match self.obj.get(key)? {
            Value::Null => None,
            Value::Bool(b) => Some(*b),
            v => {
                self.wrong_type(key, v, "true or false");
                None
            }
        }
    }

    fn array(&mut self, key: &str) -> &'a [Value] {
        match self.obj.get(key) {
            None | Some(Value::Null) => &[],
            Some(Value::Array(a)) => a,
            Some(v) => {
                self.wrong_type(key, v, "a list");
                &[]
            }
        }
    }

    fn object(&mut self, key: &str) -> Option<&'a Map<String, Value>> {
        match self.obj.get(key)? {
            Value::Null => None,
            Value::Object(o) => Some(o),
            v => {
                self.wrong_type(key, v, "an object");
                None
            }
        }
    }

    fn ip(&mut self, key: &str) -> Option<IpAddr> {
        let text = self.string(key)?;
        let parsed = parse_ip(text);
        if parsed.is_none() {
            let path = self.path(key);
            self.errors
                .push(Problem::with_value(path, text, "is not an IP address"));
        }
        parsed
    }

    /// A nested reader for an element such as `ipRanges[1]`.
    fn nested(&self, obj: &'a Map<String, Value>, prefix: &'a str) -> Reader<'a> {
        Reader {
            obj,
            prefix,
            errors: Vec::new(),
        }
    }
}

fn parse_ip(text: &str) -> Option<IpAddr> {
    text.trim().parse().ok()
}

/// A CIDR, or a bare IP meaning a single address.
fn parse_cidr_or_ip(text: &str) -> Option<IpNet> {
    let t = text.trim();
    t.parse::<IpNet>()
        .ok()
        .or_else(|| t.parse::<IpAddr>().ok().map(IpNet::from))
}

fn read_ranges(r: &mut Reader<'_>, network_name: Option<&str>) -> Vec<RangeConfig> {
    let mut ranges = Vec::new();
    let top_prefix = r.prefix.to_owned();
    if let Some(range) = read_one_range(r, &top_prefix, network_name, true) {
        ranges.push(range);
    }
    for (i, entry) in r.array("ipRanges").iter().enumerate() {
        let prefix = format!("{}.ipRanges[{i}]", r.prefix);
        let Some(obj) = entry.as_object() else {
            r.errors.push(Problem::with_value(
                &prefix,
                entry,
                "must be an object with a range",
            ));
            continue;
        };
        let mut nested = r.nested(obj, &prefix);
        let range = read_one_range(&mut nested, &prefix, network_name, false);
        if range.is_none() && nested.errors.is_empty() {
            nested
                .errors
                .push(Problem::at(format!("{prefix}.range"), "is missing"));
        }
        r.errors.append(&mut nested.errors);
        ranges.extend(range);
    }
    ranges
}

/// Reads `range`, `range_start`, `range_end` and `exclude` from one object. `path` is where the
/// range is reported: the ipam object itself for the top-level range, `ipRanges[i]` otherwise.
fn read_one_range(
    r: &mut Reader<'_>,
    prefix: &str,
    network_name: Option<&str>,
    top_level: bool,
) -> Option<RangeConfig> {
    let range_text = r.string("range");
    let mut start = r.ip("range_start");
    let mut end = r.ip("range_end");
    let excludes = read_excludes(r);
    let range_text = range_text?;
    let cidr_text = match range_text.split_once('-') {
        // The `START-CIDR` form: START is range_start, the CIDR's own address is range_end.
        Some((s, cidr)) => {
            let Some(s) = parse_ip(s) else {
                r.errors.push(Problem::with_value(
                    r.path("range"),
                    range_text,
                    "is not a CIDR or START-CIDR (the start is not an IP address)",
                ));
                return None;
            };
            if start.is_some() || end.is_some() {
                r.errors.push(Problem::with_value(
                    r.path("range"),
                    range_text,
                    "gives a start in START-CIDR form; do not also set range_start or range_end",
                ));
                return None;
            }
            start = Some(s);
            end = cidr.parse::<IpNet>().ok().map(|n| n.addr());
            cidr
        }
        None => range_text,
    };
    let Ok(cidr) = cidr_text.trim().parse::<IpNet>() else {
        r.errors.push(Problem::with_value(
            r.path("range"),
            range_text,
            "is not a CIDR (expected for example 10.0.0.0/24 or fd00::/64)",
        ));
        return None;
    };
    // The bounds are checked even when an exclude did not parse, so every problem is reported;
    // the range is only usable when all excludes parsed.
    let result = AddrRange::new(cidr, start, end, &excludes.nets).map_err(|e| match e {
        RangeError::FamilyMismatch {
            bound: Bound::Exclude(i),
            value,
            cidr,
        } => RangeError::FamilyMismatch {
            bound: Bound::Exclude(excludes.positions[i]),
            value,
            cidr,
        },
        other => other,
    });
    match result {
        // An exclude that did not parse is reported above; the range is not usable without it.
        Ok(_) if !excludes.complete => None,
        Ok(range) => {
            let path = if top_level {
                format!("{prefix}.range")
            } else {
                prefix.to_owned()
            };
            Some(RangeConfig {
                path,
                pool_name: pool_name(network_name, range.cidr()),
                range,
            })
        }
        Err(e) => {
            r.errors.push(range_problem(
                prefix,
                range_text,
                &excludes.nets,
                start,
                end,
                e,
            ));
            None
        }
    }
}

/// The excludes that parse, with their positions in the list as written, and whether all did.
struct Excludes {
    nets: Vec<IpNet>,
    positions: Vec<usize>,
    complete: bool,
}

fn read_excludes(r: &mut Reader<'_>) -> Excludes {
    let mut ex = Excludes {
        nets: Vec::new(),
        positions: Vec::new(),
        complete: true,
    };
    for (i, v) in r.array("exclude").iter().enumerate() {
        match v.as_str().and_then(parse_cidr_or_ip) {
            Some(net) => {
                ex.nets.push(net);
                ex.positions.push(i);
            }
            None => {
                ex.complete = false;
                let path = format!("{}.exclude[{i}]", r.prefix);
                let shown = v
                    .as_str()
                    .map(str::to_owned)
                    .unwrap_or_else(|| v.to_string());
                r.errors.push(Problem::with_value(
                    path,
                    shown,
                    "is not a CIDR or IP address",
                ));
            }
        }
    }
    ex
}

/// Turns a core range error into a problem naming the field the user wrote.
fn range_problem(
    prefix: &str,
    range_text: &str,
    excludes: &[IpNet],
    start: Option<IpAddr>,
    end: Option<IpAddr>,
    e: RangeError,
) -> Problem {
    let field = |b: Bound| format!("{prefix}.{b}");
    match e {
        RangeError::NoUsableAddress { .. } => Problem::with_value(
            format!("{prefix}.range"),
            range_text,
            "has no usable address (a prefix needs at least two host bits)",
        ),
        RangeError::FamilyMismatch { bound, value, cidr } => Problem::with_value(
            field(bound),
            value,
            format!("is not of the same address family as range {cidr}"),
        ),
        RangeError::Outside { bound, value, cidr } => {
            Problem::with_value(field(bound), value, format!("is outside range {cidr}"))
        }
        RangeError::Inverted { .. } => Problem::with_value(
            field(Bound::Start),
            start.map(|s| s.to_string()).unwrap_or_default(),
            format!(
                "is after range_end {}",
                end.map(|s| s.to_string()).unwrap_or_default()
            ),
        ),
        RangeError::AllExcluded { cidr, first, last } => Problem::with_value(
            format!("{prefix}.exclude"),
            excludes
                .iter()
                .map(ToString::to_string)
                .collect::<Vec<_>>()
                .join(","),
            format!("leaves no usable address in range {cidr} (window {first} to {last})"),
        ),
    }
}

fn read_routes(r: &mut Reader<'_>) -> Vec<Value> {
    let mut routes = Vec::new();
    for (i, v) in r.array("routes").iter().enumerate() {
        let path = format!("{}.routes[{i}]", r.prefix);
        let dst = v.get("dst").and_then(Value::as_str);
        if dst.and_then(|d| d.trim().parse::<IpNet>().ok()).is_none() {
            let shown = v
                .get("dst")
                .map(|d| {
                    d.as_str()
                        .map(str::to_owned)
                        .unwrap_or_else(|| d.to_string())
                })
                .unwrap_or_default();
            r.errors.push(Problem::with_value(
                format!("{path}.dst"),
                shown,
                "is not a CIDR",
            ));
            continue;
        }
        if let Some(gw) = v.get("gw").filter(|g| !g.is_null())
            && gw.as_str().and_then(parse_ip).is_none()
        {
            r.errors.push(Problem::with_value(
                format!("{path}.gw"),
                gw,
                "is not an IP address",
            ));
            continue;
        }
        routes.push(v.clone());
    }
    routes
}

fn read_addresses(r: &mut Reader<'_>) -> Vec<StaticAddress> {
    let mut addresses = Vec::new();
    for (i, v) in r.array("addresses").iter().enumerate() {
        let path = format!("{}.addresses[{i}]", r.prefix);
        let text = v.get("address").and_then(Value::as_str).unwrap_or_default();
        let Ok(address) = text.trim().parse::<IpNet>() else {
            r.errors.push(Problem::with_value(
                format!("{path}.address"),
                text,
                "is not an address with a prefix length (for example 10.0.0.5/24)",
            ));
            continue;
        };
        let gateway = match v
            .get("gateway")
            .and_then(Value::as_str)
            .filter(|s| !s.is_empty())
        {
            None => None,
            Some(g) => match parse_ip(g) {
                Some(ip) => Some(ip),
                None => {
                    r.errors.push(Problem::with_value(
                        format!("{path}.gateway"),
                        g,
                        "is not an IP address",
                    ));
                    continue;
                }
            },
        };
        addresses.push(StaticAddress { address, gateway });
    }
    addresses
}

/// Node slices are not implemented yet; the size is still checked so the message is precise.
fn check_node_slice(r: &mut Reader<'_>, ranges: &[RangeConfig]) {
    let Some(text) = r.string("node_slice_size") else {
        return;
    };
    let path = r.path("node_slice_size");
    let prefix_len = text.trim().trim_start_matches('/').parse::<u8>().ok();
    let problem = match (prefix_len, ranges.first()) {
        (None, _) => "is not a prefix length (for example /28)".to_owned(),
        (Some(p), Some(first))
            if p < first.range.cidr().prefix_len() || p > first.range.cidr().max_prefix_len() =>
        {
            format!(
                "does not fit range {}: a slice must be smaller than the range",
                first.range.cidr()
            )
        }
        _ => "is not supported yet: remove node_slice_size to allocate from the whole range"
            .to_owned(),
    };
    r.errors.push(Problem::with_value(path, text, problem));
}

/// The network name prefixes every pool and reservation name, so both must stay valid names.
fn check_network_name(r: &mut Reader<'_>, name: &str, ranges: &[RangeConfig]) {
    let path = r.path("network_name");
    if let Some(why) = object_name_problem(name) {
        r.errors.push(Problem::with_value(
            path,
            name,
            format!("is not usable in object names: {why}"),
        ));
        return;
    }
    for range in ranges {
        let last = range.range.window().1;
        for object in [range.pool_name.clone(), reservation_name(Some(name), last)] {
            if let Some(why) = object_name_problem(&object) {
                r.errors.push(Problem::with_value(
                    path.clone(),
                    name,
                    format!("gives the object name {object:?}, which {why}"),
                ));
            }
        }
    }
}

/// Two ranges of one config whose windows overlap would hand out two addresses from one window to
/// each interface, which is never what was meant.
fn check_overlaps(r: &mut Reader<'_>, ranges: &[RangeConfig]) {
    for (i, a) in ranges.iter().enumerate() {
        for b in &ranges[..i] {
            if a.range.windows_overlap(&b.range) {
                r.errors.push(Problem::with_value(
                    a.path.clone(),
                    a.range.cidr(),
                    format!("overlaps {} ({})", b.path, b.range.cidr()),
                ));
            }
        }
    }
}

fn warnings(
    obj: &Map<String, Value>,
    prefix: &str,
    ranges: &[RangeConfig],
    gateway: Option<IpAddr>,
    log_level: Option<&str>,
) -> Vec<Problem> {
    let mut w = Vec::new();
    let known: BTreeSet<&str> = KNOWN_KEYS.iter().copied().collect();
    for key in obj.keys().filter(|k| !known.contains(k.as_str())) {
        w.push(Problem::at(
            format!("{prefix}.{key}"),
            "is not a whereabouts setting and is ignored",
        ));
    }
    if let Some(Value::Array(entries)) = obj.get("ipRanges") {
        for (i, e) in entries.iter().enumerate() {
            for key in e
                .as_object()
                .into_iter()
                .flat_map(|o| o.keys())
                .filter(|k| !RANGE_KEYS.contains(&k.as_str()))
            {
                w.push(Problem::at(
                    format!("{prefix}.ipRanges[{i}].{key}"),
                    "is not a range setting and is ignored",
                ));
            }
        }
    }
    if let Some(level) = log_level.filter(|l| !LOG_LEVELS.contains(l)) {
        w.push(Problem::with_value(
            format!("{prefix}.log_level"),
            level,
            format!("is not one of {}; using error", LOG_LEVELS.join(", ")),
        ));
    }
    for range in ranges {
        for net in range
            .range
            .excludes()
            .iter()
            .filter(|n| !range.range.window_touches(n))
        {
            w.push(Problem::with_value(
                format!("{}.exclude", range.path.trim_end_matches(".range")),
                net,
                format!("does not touch the window of range {}", range.range.cidr()),
            ));
        }
    }
    w.extend(ranges.iter().filter_map(pool_object_warning));
    if let Some(gw) = gateway {
        w.extend(gateway_warnings(prefix, gw, ranges));
    }
    w
}

/// A window with more addresses than one IPPool object can record: the pool stops taking ADDs
/// long before the range is used up. Windows beyond 2^32 addresses (IPv6 /64s and the like) are
/// sized by convention, not to be filled, and get no warning.
fn pool_object_warning(range: &RangeConfig) -> Option<Problem> {
    let addresses = range.range.free_count(&BTreeSet::new());
    let capacity = crate::crd::size::typical_capacity();
    (addresses > capacity as u128 && addresses <= 1 << 32).then(|| {
        Problem::with_value(
            range.path.clone(),
            range.range.cidr(),
            format!(
                "has {addresses} allocatable addresses, but one IPPool object records about {capacity} (at ~{} bytes an entry under etcd's 1.5 MiB request limit): once that full, ADDs fail with \"cannot hold another entry\"; use smaller ranges (several NADs, or range_start/range_end windows) or node slices",
                crate::crd::size::typical_entry_bytes()
            ),
        )
    })
}

fn gateway_warnings(prefix: &str, gw: IpAddr, ranges: &[RangeConfig]) -> Option<Problem> {
    let path = format!("{prefix}.gateway");
    if !ranges.is_empty() && !ranges.iter().any(|r| r.range.cidr().contains(&gw)) {
        return Some(Problem::with_value(path, gw, "is outside every range"));
    }
    let inside = ranges.iter().find(|r| {
        r.range
            .offset_of(gw)
            .is_some_and(|o| r.range.is_allocatable(o))
    })?;
    Some(Problem::with_value(
        path,
        gw,
        format!(
            "is inside the allocatable window of {} and may be handed to a pod: add it to exclude or narrow range_start/range_end",
            inside.range.cidr()
        ),
    ))
}
