//! One invocation of the plugin as the runtime made it, read once: the `CNI_*` environment, the
//! network config on stdin (parsed once), the node's flat file (found and read once) and the two
//! merged (once). Logging, the node agent hand-off and the command all work from this.
//!
//! [`Invocation::load`] validates it into a [`Request`]; every failure is a CNI error naming the
//! variable or field and its value.

use std::path::{Path, PathBuf};

use serde_json::{Map, Value};

use super::protocol::{CniArgs, CniError, Code, Command, check_version};
use super::{requested, slices};
use crate::alloc::{Owner, Target};
use crate::config::netconf::one_address_per_family;
use crate::config::trust::{self, NamedFile, NodeKeyProblems, TrustedDirs, Untrusted};
use crate::config::{
    IpamConfig, NetConf, Problem, RangeConfig, Source, StaticAddress, flat, kept_in_slices_problem,
    node_slice_pool_problem, problem, result_shape_problem, validate_ipam,
};

/// Everything a command needs, validated.
#[derive(Debug, Clone)]
pub struct Request {
    pub command: Command,
    pub attachment: Owner,
    pub args: CniArgs,
    pub conf: NetConf,
    pub ipam: IpamConfig,
    /// What each range's address is allocated from, in the order of `ipam.ranges` (a sliced
    /// range's target is its whole range; the node's slices are read by [`super::slices`]).
    pub targets: Vec<Target>,
    /// The node's name: required when a range is sliced (`node_slice_size`), else recorded in
    /// the entries and claims when found (see [`slices::node_name`]).
    pub node: Option<String>,
    /// The address requested for each range (`runtimeConfig.ips`, `args.cni.ips`), if any.
    pub requested: Vec<Option<std::net::IpAddr>>,
    /// Set when the network config (not the node's flat file) named `ipam.kubeconfig`: the file
    /// must pass [`NamedFile::check`] before it is read.
    pub kubeconfig_check: Option<NamedFile>,
    /// Whether this network keeps addresses past their pods.
    pub keep: Keep,
}

/// How a network keeps addresses past their pods (see [`super::keep`]).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Keep {
    pub sticky_statefulset: bool,
    pub persistent_ips: bool,
}

/// The engine's target of one configured range.
pub fn target(range: &RangeConfig, ipam: &IpamConfig) -> Target {
    Target {
        pool: range.pool_name.clone(),
        range: range.range.clone(),
        network: ipam.network_name.clone(),
        overlapping: ipam.enable_overlapping_ranges,
        node: None,
    }
}

/// Where the flat file comes from.
#[derive(Debug, Clone)]
pub enum FlatSource {
    /// The standard lookup: a trusted `configuration_path`, the node's directory from the
    /// environment, then the well-known paths (see `find_flat_file`).
    Lookup,
    /// These paths, in order.
    Paths(Vec<std::path::PathBuf>),
    /// Already read: what the plugin found on the node and forwarded to the node agent.
    Found(Option<flat::FlatFile>),
}

/// `log_file` and `log_level` of the merged config.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Logging {
    pub file: Option<String>,
    pub level: Option<String>,
}

/// What the runtime passed, read and parsed once (see the module docs).
#[derive(Debug, Clone)]
pub struct Invocation {
    container_id: String,
    ifname: String,
    cni_args: String,
    /// The network config, or why it is not one.
    conf: Result<NetConf, CniError>,
    /// The node's flat file, if any, or why it could not be read.
    flat_file: Result<Option<flat::FlatFile>, CniError>,
    /// The ipam object the plugin was called for (with its path), the flat file merged in.
    ipam: Option<(String, Value)>,
    /// What the network config may not say: files outside the node's directories (refused by
    /// `load`) and node keys it set that were ignored (warned of).
    node_keys: NodeKeyProblems,
    /// A kubeconfig that the network config named inside the node's directories.
    kubeconfig_check: Option<NamedFile>,
    /// `NODENAME`, the node's name.
    nodename_env: Option<String>,
}

impl Invocation {
    /// Reads an invocation: `env` looks up the runtime's variables, `stdin` is the network config.
    pub fn read(env: &dyn Fn(&str) -> Option<String>, stdin: &str, flat: FlatSource) -> Self {
        let conf = NetConf::parse(stdin, "network config")
            .map_err(|p| CniError::new(Code::Decode, p.to_string()));
        let runtime_ipam = conf.as_ref().ok().and_then(NetConf::runtime_ipam);
        let dirs = TrustedDirs::from_env(env);
        // Judged before anything is opened: the network config is its author's, not the node's.
        let (mut node_keys, kubeconfig_check) = match &runtime_ipam {
            Some((prefix, Value::Object(ipam))) => (
                trust::network_config_problems(ipam, prefix, &dirs),
                trust::kubeconfig_check(ipam, prefix, &dirs),
            ),
            _ => Default::default(),
        };
        let (flat_file, refused) = find_flat_file(flat, runtime_ipam.as_ref(), &dirs);
        let ipam = runtime_ipam.map(|(path, ipam)| {
            let mut merged = merge(ipam, flat_file.as_ref().ok(), &dirs);
            if refused.is_some()
                && let Some(m) = merged.as_object_mut()
            {
                m.remove("configuration_path");
            }
            (path, merged)
        });
        node_keys.errors.extend(refused);
        let var = |k: &str| env(k).unwrap_or_default();
        Invocation {
            container_id: var("CNI_CONTAINERID"),
            ifname: var("CNI_IFNAME"),
            cni_args: var("CNI_ARGS"),
            conf,
            flat_file,
            ipam,
            node_keys,
            kubeconfig_check,
            nodename_env: env("NODENAME"),
        }
    }

    /// The flat file this invocation merged (none is fine: the flat file is optional).
    pub fn flat_file(&self) -> Result<Option<flat::FlatFile>, CniError> {
        self.flat_file.clone()
    }

    /// The `cniVersion` an error reply carries: the config's own text, empty when there is none.
    pub fn error_version(&self) -> &str {
        let conf = self.conf.as_ref().ok();
        conf.and_then(|c| c.value.get("cniVersion")?.as_str())
            .unwrap_or_default()
    }

    /// `log_file` and `log_level` from the merged config, known even when the config is invalid
    /// (so that logging is set up before its errors are reported).
    pub fn logging(&self) -> Logging {
        let text = |k: &str| {
            let (_, ipam) = self.ipam.as_ref()?;
            let value = ipam.get(k)?.as_str()?;
            (!value.is_empty()).then(|| value.to_owned())
        };
        Logging {
            file: text("log_file"),
            level: text("log_level"),
        }
    }

    /// Validates the invocation for `command` (not VERSION, which needs none of this).
    pub fn load(&self, command: Command) -> Result<Request, CniError> {
        let conf = self.conf.clone()?;
        check_version(&conf)?;
        if let Some(p) = conf.plugins_problem() {
            return Err(CniError::new(
                Code::InvalidConfig,
                format!("invalid network config: {p}"),
            ));
        }
        let Some((prefix, merged)) = &self.ipam else {
            return Err(CniError::new(
                Code::InvalidConfig,
                "network config has no ipam object",
            ));
        };
        // Only an object is merged with the flat file (anything else is refused below).
        if merged.is_object() {
            self.flat_file.as_ref().map_err(Clone::clone)?;
        }
        // DEL goes on without them (they were dropped from `merged`): a NAD admitted before this
        // rule must not keep the runtime from deleting its sandboxes.
        if !self.node_keys.errors.is_empty() && command != Command::Del {
            return Err(invalid_config(problem::join(&self.node_keys.errors)));
        }
        for w in self.node_keys.warnings.iter().chain(&self.node_keys.errors) {
            tracing::warn!("{w}");
        }
        let ipam = validated(merged, prefix)?;
        if let Some(p) = node_slice_pool_problem(prefix, &conf.name, &ipam) {
            return Err(invalid_config(&p));
        }
        let mut args = CniArgs::parse(&self.cni_args)?;
        // Only ADD reads them: a bad `ips` must not keep the runtime from deleting the sandbox.
        let requested = if command == Command::Add {
            requested::read(&conf.value)?
        } else {
            Vec::new()
        };
        if !requested.is_empty() && !args.ips.is_empty() {
            // The CNI conventions: a plugin that honours `ips` ignores CNI_ARGS `IP`.
            tracing::info!("CNI_ARGS IP is ignored: the config requests addresses (ips)");
            args.ips.clear();
        }
        check_result_shape(&conf.cni_version, prefix, &ipam, &args)?;
        let keep = Keep {
            sticky_statefulset: ipam.sticky_statefulset,
            persistent_ips: ipam.allow_persistent_ips
                || conf.allow_persistent_ips().map_err(|p| {
                    CniError::new(Code::InvalidConfig, format!("invalid network config: {p}"))
                })?,
        };
        if let Some(p) = kept_in_slices_problem(prefix, keep.persistent_ips, &ipam) {
            return Err(invalid_config(&p));
        }
        let requested = requested::assign(&ipam.ranges, &requested)?;
        let node = self.node_name(merged, &ipam)?;
        let attachment = Owner {
            container_id: self.container_id.clone(),
            ifname: self.ifname.clone(),
            podref: args.podref(),
            pod_uid: args.pod_uid.clone(),
            node: node.clone().unwrap_or_default(),
            holder: Default::default(),
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
            node,
            requested,
            keep,
            kubeconfig_check: self.kubeconfig_check.clone(),
        })
    }

    /// The node's name (see [`slices::node_name`]): an error only when a range is sliced, which
    /// cannot do without it. Elsewhere an entry without a node is still an entry: CNI GC leaves
    /// it to the operator, and with node credentials the node-limits policy refuses its claim,
    /// naming the missing node.
    fn node_name(&self, merged: &Value, ipam: &IpamConfig) -> Result<Option<String>, CniError> {
        let sliced = ipam.ranges.iter().any(|r| r.node_slice.is_some());
        let flat_file = self.flat_file.as_ref().ok().and_then(Option::as_ref);
        let from = slices::NodeNameSources {
            env: self.nodename_env.as_deref(),
            configuration_path: merged.get("configuration_path").and_then(Value::as_str),
            flat_file: flat_file.map(|(path, _)| path.as_path()),
            hostname_file: std::path::Path::new("/etc/hostname"),
        };
        match slices::node_name(&from) {
            Ok(name) => Ok(Some(name)),
            Err(e) if sliced => Err(e),
            Err(e) => {
                tracing::debug!(error = %e.msg, "the node's name is unknown: entries record none");
                Ok(None)
            }
        }
    }
}

/// The flat file: a network config's `configuration_path` first, if the node's directories hold
/// it and the file passes [`trust::check_file`] (one that does not exist is passed over, as any
/// missing candidate is), then the node's directory from the environment, then the well-known
/// paths. One whose file fails the checks on disk is not followed: the problem is returned beside
/// the flat file found without it (an ADD refuses it; a DEL goes on with the node's own).
fn find_flat_file(
    source: FlatSource,
    runtime_ipam: Option<&(String, &Value)>,
    dirs: &TrustedDirs,
) -> (Result<Option<flat::FlatFile>, CniError>, Option<Problem>) {
    let mut paths = match source {
        FlatSource::Found(found) => return (Ok(found), None),
        FlatSource::Paths(paths) => return (load_flat(&paths), None),
        FlatSource::Lookup => flat::candidates(dirs.node_dir()),
    };
    let named = runtime_ipam.and_then(|(prefix, ipam)| {
        let path = ipam.get("configuration_path")?.as_str()?;
        Some((prefix, path, dirs.holding(path)?))
    });
    let mut refused = None;
    if let Some((prefix, path, dir)) = named {
        match trust::check_file(Path::new(path), dir) {
            Ok(real) => paths.insert(0, real),
            Err(Untrusted::Missing) => {}
            Err(Untrusted::Refused(why)) => {
                let key = format!("{prefix}.configuration_path");
                refused = Some(Problem::with_value(key, path, why));
            }
        }
    }
    (load_flat(&paths), refused)
}

fn load_flat(paths: &[PathBuf]) -> Result<Option<flat::FlatFile>, CniError> {
    flat::load(paths).map_err(|p| CniError::new(Code::InvalidConfig, p.to_string()))
}

/// The ipam object with the flat file merged in. Which socket root's plugin trusts for its
/// results, where root's plugin writes its log and which credentials it uses are the node's
/// decisions, not a network config's (anyone who may write a NAD could otherwise point them at a
/// socket or a file of their own): the config's `agent_socket` and `log_file`, and file keys
/// outside the node's directories, are dropped; the flat file's apply.
fn merge(ipam: &Value, flat_file: Option<&Option<flat::FlatFile>>, dirs: &TrustedDirs) -> Value {
    let Some(obj) = ipam.as_object() else {
        return ipam.clone();
    };
    let mut merged: Map<String, Value> = obj.clone();
    trust::strip_node_keys(&mut merged, dirs);
    if let Some(Some((path, flat_conf))) = flat_file {
        tracing::debug!(path = %path.display(), "merging flat file");
        flat::merge(&mut merged, flat_conf);
    }
    Value::Object(merged)
}

fn validated(merged: &Value, prefix: &str) -> Result<IpamConfig, CniError> {
    let validated = validate_ipam(merged, prefix, Source::Runtime);
    for w in &validated.warnings {
        tracing::warn!("{w}");
    }
    validated
        .config
        .ok_or_else(|| invalid_config(problem::join(&validated.errors)))
}

fn require_env(command: Command, a: &Owner) -> Result<(), CniError> {
    if !matches!(command, Command::Add | Command::Del | Command::Check) {
        return Ok(());
    }
    let missing = |name: &str| CniError::new(Code::InvalidEnv, format!("{name} is not set"));
    if a.container_id.is_empty() {
        return Err(missing("CNI_CONTAINERID"));
    }
    if a.ifname.is_empty() {
        return Err(missing("CNI_IFNAME"));
    }
    if command == Command::Add && a.podref.is_empty() {
        return Err(CniError::new(
            Code::InvalidEnv,
            "CNI_ARGS has no K8S_POD_NAME/K8S_POD_NAMESPACE: whereabouts records the pod of every address",
        ));
    }
    Ok(())
}

/// 0.1.0 and 0.2.0 results hold one address per family: refuse a config, or CNI_ARGS `IP=`, that
/// would give more, before anything is allocated (the validator refuses such a NAD alike).
fn check_result_shape(
    cni_version: &str,
    prefix: &str,
    ipam: &IpamConfig,
    args: &CniArgs,
) -> Result<(), CniError> {
    if let Some(p) = result_shape_problem(cni_version, prefix, ipam) {
        return Err(invalid_config(&p));
    }
    if args.ips.is_empty() || !one_address_per_family(cni_version) {
        return Ok(());
    }
    let mut with_args = ipam.clone();
    with_args
        .addresses
        .extend(args.ips.iter().map(|ip| StaticAddress {
            address: *ip,
            gateway: None,
        }));
    match result_shape_problem(cni_version, prefix, &with_args) {
        Some(p) => Err(args_problem(p)),
        None => Ok(()),
    }
}

fn args_problem(p: Problem) -> CniError {
    CniError::new(Code::InvalidEnv, format!("CNI_ARGS IP: {p}"))
}

/// A problem (or the joined problems) of the whereabouts config, as the plugin reports it.
pub fn invalid_config(p: impl std::fmt::Display) -> CniError {
    CniError::new(
        Code::InvalidConfig,
        format!("invalid whereabouts config: {p}"),
    )
}
