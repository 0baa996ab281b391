//! Checking NetworkAttachmentDefinitions: the NAD-level wrapper around the one validator, shared by
//! the admission webhook and the offline `whereabouts-operator validate` command.
//!
//! A NAD's `spec.config` is a JSON string holding a plugin config or a conflist; every whereabouts
//! `ipam` block in it goes through [`validate_ipam`] with [`Source::Nad`]. Problems are reported
//! with `spec.config: ` in front of the config path, so a message reads the same in a denial, in the
//! CLI and in the plugin's error. NADs of other IPAMs are "not ours" and never judged.
//!
//! The cross-NAD check (two NADs of one `network_name` whose windows overlap share addresses through
//! reservations) needs the other NADs: the webhook takes them from its watch cache, the CLI from the
//! other documents it reads (or the cluster).

mod overlap;
mod report;

use serde_json::Value;

use crate::config::{
    NetConf, NodeSlice, Problem, Source, kept_in_slices_problem, node_slice_base,
    node_slice_pool_problem, result_shape_problem, validate_ipam,
};
use crate::ipam::AddrRange;
use crate::ipam::naming::node_slice_pool_name;
pub use overlap::{OVERLAP_EXAMPLES, RangeIndex, overlap_warnings};
pub use report::{CheckedNad, Finding, ReadError, Severity, check_object, check_text, findings};

/// Where problems inside a NAD are reported from.
pub const SPEC_CONFIG: &str = "spec.config";

/// One allocatable range of a whereabouts NAD, for the cross-NAD overlap check.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NadRange {
    /// Config path of the range, for example `plugins[1].ipam.ipRanges[0]`.
    pub path: String,
    pub network_name: Option<String>,
    pub range: AddrRange,
    /// The range's node slices: its NodeSlicePool's name and the slice size, if it is sliced.
    pub slices: Option<(String, NodeSlice)>,
    /// `enable_overlapping_ranges`: reservations guard its addresses across pools.
    pub overlapping: bool,
}

impl NadRange {
    /// The IPPool this range allocates from.
    pub fn pool_name(&self) -> String {
        crate::ipam::naming::pool_name(self.network_name.as_deref(), self.range.cidr())
    }
}

/// The verdict on one NAD's `spec.config`.
#[derive(Debug, Clone, Default)]
pub struct NadCheck {
    /// False when the config has no whereabouts ipam (then nothing else is set).
    pub whereabouts: bool,
    pub errors: Vec<Problem>,
    pub warnings: Vec<Problem>,
    /// The ranges of every valid whereabouts block.
    pub ranges: Vec<NadRange>,
}

impl NadCheck {
    pub fn is_valid(&self) -> bool {
        self.errors.is_empty()
    }
}

/// Validates a NAD's `spec.config` text. Problem paths are relative to `spec.config` except for
/// the JSON error, which is `spec.config` itself; [`message`] renders both the same way.
pub fn check_spec_config(config: &str) -> NadCheck {
    let mut out = NadCheck::default();
    if config.trim().is_empty() {
        // Multus then reads the config from a file on the node: not ours to judge.
        return out;
    }
    let conf = match NetConf::parse(config, SPEC_CONFIG) {
        Ok(conf) => conf,
        Err(p) => {
            // A config that is not even JSON may still have been meant for whereabouts; say so
            // only when it mentions us, other IPAMs' broken NADs are not our business.
            if config.contains(crate::config::netconf::IPAM_TYPE) {
                out.whereabouts = true;
                out.errors.push(p);
            }
            return out;
        }
    };
    if let Some(p) = conf
        .plugins_problem()
        .filter(|_| conf.mentions_whereabouts())
    {
        // Nothing in it can be loaded, so nothing else is judged (the plugin refuses it alike).
        out.whereabouts = true;
        out.errors.push(p);
        return out;
    }
    let ipams = conf.whereabouts_ipams();
    if ipams.is_empty() {
        return out;
    }
    out.whereabouts = true;
    // The plugin refuses these at every ADD: the same checks, the same words.
    out.errors.extend(conf.version_problem());
    out.errors.extend(conf.allow_persistent_ips().err());
    for (prefix, ipam) in ipams {
        let v = validate_ipam(ipam, &prefix, Source::Nad);
        out.errors.extend(v.errors);
        out.warnings.extend(v.warnings);
        if let Some(cfg) = v.config {
            out.errors
                .extend(result_shape_problem(&conf.cni_version, &prefix, &cfg));
            out.errors
                .extend(node_slice_pool_problem(&prefix, &conf.name, &cfg));
            let persistent = conf.allow_persistent_ips().unwrap_or(false);
            out.errors.extend(kept_in_slices_problem(
                &prefix,
                persistent || cfg.allow_persistent_ips,
                &cfg,
            ));
            let base = node_slice_base(&conf.name, &cfg);
            for (i, r) in cfg.ranges.into_iter().enumerate() {
                let slices = r
                    .node_slice
                    .map(|size| (node_slice_pool_name(&base, i, r.range.cidr()), size));
                out.ranges.push(NadRange {
                    path: r.path,
                    network_name: cfg.network_name.clone(),
                    range: r.range,
                    slices,
                    overlapping: cfg.enable_overlapping_ranges,
                });
            }
        }
    }
    out
}

/// A problem as a person reads it: `spec.config: ipam.range "x" is not a CIDR ...`.
pub fn message(p: &Problem) -> String {
    if p.path == SPEC_CONFIG || p.path.starts_with("spec.") {
        p.to_string()
    } else {
        format!("{SPEC_CONFIG}: {p}")
    }
}

/// The `spec.config` text of a NAD object given as JSON (`None` when it has none).
pub fn spec_config(object: &Value) -> Option<&str> {
    object.get("spec")?.get("config")?.as_str()
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A NAD object as JSON text, in namespace `ns`.
    pub(super) fn nad(name: &str, config: &str) -> String {
        serde_json::json!({"apiVersion": "k8s.cni.cncf.io/v1", "kind": "NetworkAttachmentDefinition",
            "metadata": {"name": name, "namespace": "ns"}, "spec": {"config": config}})
        .to_string()
    }

    #[test]
    fn problems_carry_the_spec_config_prefix() {
        let c = check_spec_config(
            r#"{"cniVersion":"1.0.0","type":"macvlan","ipam":{"type":"whereabouts","range":"10.0.0.0/24","ipRanges":[{"range":"10.0.1.0/24"},{"range":"10.0.2.0/24","range_start":"10.0.1.5"}]}}"#,
        );
        assert!(c.whereabouts);
        let msgs: Vec<String> = c.errors.iter().map(message).collect();
        assert_eq!(
            msgs,
            [
                r#"spec.config: ipam.ipRanges[1].range_start "10.0.1.5" is outside range 10.0.2.0/24"#
            ]
        );
    }

    #[test]
    fn other_ipams_and_empty_configs_are_not_ours() {
        let c = check_spec_config(r#"{"type":"bridge","ipam":{"type":"host-local"}}"#);
        assert!(!c.whereabouts && c.is_valid());
        assert!(!check_spec_config("").whereabouts);
        assert!(!check_spec_config("{not json").whereabouts);
        let bad = check_spec_config(r#"{"ipam":{"type":"whereabouts""#);
        assert!(bad.whereabouts && !bad.is_valid());
        assert!(message(&bad.errors[0]).starts_with("spec.config is not valid JSON"));
    }
}
