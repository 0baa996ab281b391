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

use std::collections::HashMap;
use std::fmt;
use std::sync::Arc;

use serde::Serialize;
use serde_json::Value;

use crate::config::{NetConf, Problem, Source, result_shape_problem, validate_ipam};
use crate::ipam::AddrRange;

/// Where problems inside a NAD are reported from.
pub const SPEC_CONFIG: &str = "spec.config";

/// One allocatable range of a whereabouts NAD, for the cross-NAD overlap check.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NadRange {
    /// Config path of the range, for example `plugins[1].ipam.ipRanges[0]`.
    pub path: String,
    pub network_name: Option<String>,
    pub range: AddrRange,
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
    let ipams = conf.whereabouts_ipams();
    if ipams.is_empty() {
        return out;
    }
    out.whereabouts = true;
    // The plugin refuses these at every ADD: the same checks, the same words.
    out.errors.extend(conf.version_problem());
    for (prefix, ipam) in ipams {
        let v = validate_ipam(ipam, &prefix, Source::Nad);
        out.errors.extend(v.errors);
        out.warnings.extend(v.warnings);
        if let Some(cfg) = v.config {
            out.errors
                .extend(result_shape_problem(&conf.cni_version, &prefix, &cfg));
            out.ranges.extend(cfg.ranges.into_iter().map(|r| NadRange {
                path: r.path,
                network_name: cfg.network_name.clone(),
                range: r.range,
            }));
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

/// How many of the overlapping NADs a warning names; the others are counted. One warning per
/// range, whatever the number of NADs: a thousand NADs sharing one range (one per namespace, the
/// common multi-tenant pattern) give each NAD one line, not a thousand.
pub const OVERLAP_EXAMPLES: usize = 3;

/// What one range overlaps in other NADs of its network: how many ranges, and the first few.
#[derive(Debug, Default)]
struct Overlaps {
    count: usize,
    /// `(namespace/name, range)` of the first [`OVERLAP_EXAMPLES`] found.
    examples: Vec<(String, ipnet::IpNet)>,
}

/// One warning for every range of `mine` (the NAD `me`, `namespace/name`) whose window overlaps
/// ranges of other NADs in the same network. Ranges of `me` in the index (its stored version) do
/// not count.
pub fn overlap_warnings(mine: &[NadRange], me: &str, index: &RangeIndex) -> Vec<Problem> {
    mine.iter()
        .filter_map(|r| {
            let found = index.overlaps(r, me);
            (found.count > 0).then(|| overlap_problem(r, &found))
        })
        .collect()
}

/// How far back from a range, in window-start order, a query looks for example NADs; the count
/// is exact whatever this is.
const EXAMPLE_LOOKBACK: usize = 64;

/// The ranges of many NADs, for overlap questions: grouped by network name and family (only
/// ranges that share both can overlap) and sorted by window start and by window end, so that how
/// many ranges a window overlaps is two binary searches, and naming a few is a short walk. Built
/// in O(n log n); a query costs O(log n + examples).
#[derive(Debug, Default)]
pub struct RangeIndex {
    groups: HashMap<(Option<String>, bool), Group>,
}

#[derive(Debug, Default)]
struct Group {
    /// `(namespace/name, range)`, by window start.
    entries: Vec<(Arc<str>, NadRange)>,
    /// Window ends, sorted on their own.
    ends: Vec<u128>,
    /// Positions in `entries` of each NAD's ranges.
    by_nad: HashMap<Arc<str>, Vec<usize>>,
}

fn group_key(r: &NadRange) -> (Option<String>, bool) {
    (r.network_name.clone(), r.range.cidr().addr().is_ipv6())
}

impl RangeIndex {
    /// Indexes `(namespace/name, ranges)` of every NAD.
    pub fn build<'a>(nads: impl IntoIterator<Item = (&'a str, &'a [NadRange])>) -> RangeIndex {
        let mut groups: HashMap<(Option<String>, bool), Group> = HashMap::new();
        for (key, ranges) in nads {
            let key: Arc<str> = Arc::from(key);
            for r in ranges {
                let g = groups.entry(group_key(r)).or_default();
                g.entries.push((key.clone(), r.clone()));
            }
        }
        for g in groups.values_mut() {
            g.entries.sort_by_key(|(_, r)| r.range.window_bounds());
            g.ends = g
                .entries
                .iter()
                .map(|(_, r)| r.range.window_bounds().1)
                .collect();
            g.ends.sort_unstable();
            for (p, (key, _)) in g.entries.iter().enumerate() {
                g.by_nad.entry(key.clone()).or_default().push(p);
            }
        }
        RangeIndex { groups }
    }

    /// What `r` overlaps among the ranges of NADs other than `me`.
    fn overlaps(&self, r: &NadRange, me: &str) -> Overlaps {
        let Some(g) = self.groups.get(&group_key(r)) else {
            return Overlaps::default();
        };
        let (lo, hi) = r.range.window_bounds();
        // Ranges starting at or before `hi`, less those that ended before `lo`...
        let started = g
            .entries
            .partition_point(|(_, o)| o.range.window_bounds().0 <= hi);
        let all = started - g.ends.partition_point(|&e| e < lo);
        // ... less `me`'s own.
        let own = g.by_nad.get(me).map_or(0, |ps| {
            ps.iter()
                .filter(|&&p| g.entries[p].1.range.windows_overlap(&r.range))
                .count()
        });
        let mut found = Overlaps {
            count: all - own,
            examples: Vec::new(),
        };
        // Examples: those starting inside the window all overlap; before it, look back a little.
        let first = g
            .entries
            .partition_point(|(_, o)| o.range.window_bounds().0 < lo);
        let inside = g.entries[first..]
            .iter()
            .take_while(|(_, o)| o.range.window_bounds().0 <= hi);
        let before = g.entries[..first].iter().rev().take(EXAMPLE_LOOKBACK);
        for (key, o) in inside.chain(before) {
            if found.examples.len() == OVERLAP_EXAMPLES || found.examples.len() == found.count {
                break;
            }
            if &**key != me && o.range.windows_overlap(&r.range) {
                found.examples.push((key.to_string(), o.range.cidr()));
            }
        }
        found
    }
}

fn overlap_problem(r: &NadRange, found: &Overlaps) -> Problem {
    let network = match &r.network_name {
        Some(n) => format!("network_name {n:?}"),
        None => "the default network (no network_name)".to_owned(),
    };
    let reason = match found.examples.as_slice() {
        [(other, theirs)] if found.count == 1 => format!(
            "overlaps range {theirs} of NetworkAttachmentDefinition {other} in {network}: the two share addresses through reservations"
        ),
        examples => {
            let named: Vec<String> = examples.iter().map(|(o, t)| format!("{o} ({t})")).collect();
            let more = found.count - examples.len();
            format!(
                "overlaps {} ranges of other NetworkAttachmentDefinitions in {network}: {}{}; they share addresses through reservations",
                found.count,
                named.join(", "),
                if more > 0 {
                    format!(" and {more} more")
                } else {
                    String::new()
                }
            )
        }
    };
    Problem::with_value(r.path.clone(), r.range.cidr(), reason)
}

/// How serious a finding of the offline command is.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Severity {
    Error,
    Warning,
}

/// One line of the offline command's report.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Finding {
    pub file: String,
    /// 1-based index of the YAML document in the file (items of a List count as documents).
    pub document: usize,
    pub namespace: Option<String>,
    pub name: String,
    pub severity: Severity,
    /// Full path inside the object: `spec.config` or `spec.config: ipam.range`.
    pub path: String,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub value: Option<String>,
    pub reason: String,
    /// The whole message, as the webhook would word it.
    pub message: String,
}

impl fmt::Display for Finding {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let object = match &self.namespace {
            Some(ns) => format!("{ns}/{}", self.name),
            None => self.name.clone(),
        };
        let severity = match self.severity {
            Severity::Error => "error",
            Severity::Warning => "warning",
        };
        write!(
            f,
            "{}:{}: {severity}: NetworkAttachmentDefinition {object}: {}",
            self.file, self.document, self.message
        )
    }
}

/// A NAD read from a file (or the cluster), with its check.
#[derive(Debug, Clone)]
pub struct CheckedNad {
    pub file: String,
    pub document: usize,
    pub namespace: Option<String>,
    pub name: String,
    pub check: NadCheck,
}

impl CheckedNad {
    fn key(&self) -> String {
        match &self.namespace {
            Some(ns) => format!("{ns}/{}", self.name),
            None => self.name.clone(),
        }
    }

    fn finding(&self, severity: Severity, p: &Problem) -> Finding {
        let path = if p.path.starts_with("spec.") {
            p.path.clone()
        } else {
            format!("{SPEC_CONFIG}: {}", p.path)
        };
        Finding {
            file: self.file.clone(),
            document: self.document,
            namespace: self.namespace.clone(),
            name: self.name.clone(),
            severity,
            path,
            value: p.value.clone(),
            reason: p.reason.clone(),
            message: message(p),
        }
    }
}

/// Why a file could not be read as YAML.
#[derive(Debug, thiserror::Error)]
#[error("{file}: document {document}: {source}")]
pub struct ReadError {
    pub file: String,
    pub document: usize,
    #[source]
    pub source: serde_yaml::Error,
}

/// Reads every NAD of a YAML (multi-document) or JSON text and checks it; other kinds are skipped.
/// `List` documents (as `kubectl get -o yaml` prints them) are opened.
pub fn check_text(file: &str, text: &str) -> Result<Vec<CheckedNad>, ReadError> {
    let mut out = Vec::new();
    for (i, doc) in serde_yaml::Deserializer::from_str(text).enumerate() {
        let document = i + 1;
        let value = serde_yaml::Value::deserialize(doc).map_err(|source| ReadError {
            file: file.to_owned(),
            document,
            source,
        })?;
        let value: Value = match serde_json::to_value(&value) {
            Ok(v) => v,
            // YAML with non-string keys and the like: not a Kubernetes object.
            Err(_) => continue,
        };
        collect(file, document, &value, &mut out);
    }
    Ok(out)
}

use serde::Deserialize as _;

fn collect(file: &str, document: usize, value: &Value, out: &mut Vec<CheckedNad>) {
    let kind = value
        .get("kind")
        .and_then(Value::as_str)
        .unwrap_or_default();
    if kind.ends_with("List") {
        for item in value
            .get("items")
            .and_then(Value::as_array)
            .into_iter()
            .flatten()
        {
            collect(file, document, item, out);
        }
        return;
    }
    if let Some(nad) = check_object(file, document, value) {
        out.push(nad);
    }
}

/// Checks one object given as JSON when it is a `k8s.cni.cncf.io` NetworkAttachmentDefinition.
pub fn check_object(file: &str, document: usize, value: &Value) -> Option<CheckedNad> {
    let api_version = value.get("apiVersion").and_then(Value::as_str)?;
    let kind = value.get("kind").and_then(Value::as_str)?;
    if kind != "NetworkAttachmentDefinition" || !api_version.starts_with("k8s.cni.cncf.io/") {
        return None;
    }
    let meta = value.get("metadata");
    let text = |k: &str| {
        meta.and_then(|m| m.get(k))
            .and_then(Value::as_str)
            .map(str::to_owned)
    };
    let mut check = match value.get("spec").and_then(|s| s.get("config")) {
        None | Some(Value::Null) => NadCheck::default(),
        Some(Value::String(s)) => check_spec_config(s),
        Some(other) => NadCheck {
            whereabouts: true,
            errors: vec![Problem::with_value(
                SPEC_CONFIG,
                other,
                "must be a string holding the JSON network config",
            )],
            ..NadCheck::default()
        },
    };
    if !check.whereabouts {
        check.warnings.clear();
    }
    Some(CheckedNad {
        file: file.to_owned(),
        document,
        namespace: text("namespace"),
        name: text("name").unwrap_or_else(|| "(unnamed)".to_owned()),
        check,
    })
}

/// The report on a set of NADs: each one's errors and warnings, plus a warning for every pair of
/// NADs in one network whose ranges overlap. Ranges are swept in order of their window start, so
/// ten thousand NADs cost a sort, not a hundred million comparisons.
pub fn findings(nads: &[CheckedNad]) -> Vec<Finding> {
    let mut per_nad: Vec<Vec<Finding>> = nads
        .iter()
        .map(|n| {
            let mut f: Vec<Finding> = n
                .check
                .errors
                .iter()
                .map(|p| n.finding(Severity::Error, p))
                .collect();
            f.extend(
                n.check
                    .warnings
                    .iter()
                    .map(|p| n.finding(Severity::Warning, p)),
            );
            f
        })
        .collect();
    let keys: Vec<String> = nads.iter().map(CheckedNad::key).collect();
    let index = RangeIndex::build(
        nads.iter()
            .zip(&keys)
            .map(|(n, k)| (k.as_str(), n.check.ranges.as_slice())),
    );
    for ((n, key), found) in nads.iter().zip(&keys).zip(per_nad.iter_mut()) {
        for p in overlap_warnings(&n.check.ranges, key, &index) {
            found.push(n.finding(Severity::Warning, &p));
        }
    }
    per_nad.into_iter().flatten().collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn nad(name: &str, config: &str) -> String {
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

    #[test]
    fn documents_lists_and_other_kinds() {
        let text = format!(
            "{}\n---\napiVersion: v1\nkind: ConfigMap\nmetadata: {{name: x}}\n---\n{}\n",
            nad(
                "a",
                r#"{"type":"macvlan","ipam":{"type":"whereabouts","range":"10.0.0.0/24"}}"#
            ),
            nad(
                "b",
                r#"{"type":"macvlan","ipam":{"type":"whereabouts","range":"10.0.0.128/25"}}"#
            ),
        );
        let nads = check_text("f.yaml", &text).unwrap();
        assert_eq!(nads.len(), 2);
        assert_eq!(nads[1].document, 3);
        let f = findings(&nads);
        assert_eq!(f.len(), 2, "{f:?}");
        assert!(f.iter().all(|f| f.severity == Severity::Warning));
        assert!(
            f[0].message.contains("overlaps range 10.0.0.128/25"),
            "{}",
            f[0]
        );
        assert!(f[0].to_string().starts_with("f.yaml:1: warning: NetworkAttachmentDefinition ns/a: spec.config: ipam.range \"10.0.0.0/24\" overlaps"), "{}", f[0]);
    }

    #[test]
    fn overlap_sweep_respects_network_names() {
        let mk = |name: &str, range: &str, net: Option<&str>| {
            let mut ipam = serde_json::json!({"type": "whereabouts", "range": range});
            if let Some(n) = net {
                ipam["network_name"] = n.into();
            }
            check_object(
                "f",
                1,
                &serde_json::from_str(&nad(name, &serde_json::json!({"ipam": ipam}).to_string()))
                    .unwrap(),
            )
            .unwrap()
        };
        let nads = vec![
            mk("a", "10.0.0.0/16", None),
            mk("b", "10.0.5.0/24", Some("blue")),
            mk("c", "10.1.0.0/24", None),
            mk("d", "10.0.200.0/24", None),
        ];
        let seen: Vec<(usize, usize, String)> = overlaps_of(&nads)
            .into_iter()
            .map(|(i, _, f)| (i, f.count, f.examples[0].0.clone()))
            .collect();
        assert_eq!(seen, [(0, 1, "ns/d".to_owned()), (3, 1, "ns/a".to_owned())]);
    }

    /// Each NAD's ranges queried against the index of all, as `findings` does: (NAD, range path,
    /// what it overlaps).
    fn overlaps_of(nads: &[CheckedNad]) -> Vec<(usize, String, Overlaps)> {
        let keys: Vec<String> = nads.iter().map(CheckedNad::key).collect();
        let index = RangeIndex::build(
            nads.iter()
                .zip(&keys)
                .map(|(n, k)| (k.as_str(), n.check.ranges.as_slice())),
        );
        let mut out = Vec::new();
        for (i, (n, k)) in nads.iter().zip(&keys).enumerate() {
            for r in &n.check.ranges {
                let f = index.overlaps(r, k);
                if f.count > 0 {
                    out.push((i, r.path.clone(), f));
                }
            }
        }
        out
    }

    /// The binary-search counts equal a brute-force count, over random layouts of ranges in two
    /// networks, with NADs of one and two ranges.
    #[test]
    fn overlap_counts_match_brute_force() {
        let mut rng = fastrand::Rng::with_seed(7);
        for _ in 0..200 {
            let nads: Vec<CheckedNad> = (0..rng.usize(1..40))
                .map(|k| {
                    let range = |rng: &mut fastrand::Rng| {
                        let prefix = rng.u8(26..31);
                        let base =
                            u32::from(std::net::Ipv4Addr::new(10, 0, 0, 0)) + rng.u32(0..64) * 8;
                        format!("{}/{prefix}", std::net::Ipv4Addr::from(base))
                    };
                    let mut ipam =
                        serde_json::json!({"type": "whereabouts", "range": range(&mut rng)});
                    if rng.bool() {
                        ipam["ipRanges"] = serde_json::json!([{"range": range(&mut rng)}]);
                    }
                    if rng.bool() {
                        ipam["network_name"] = "blue".into();
                    }
                    let text = nad(
                        &format!("n{k}"),
                        &serde_json::json!({"ipam": ipam}).to_string(),
                    );
                    check_object("f", k + 1, &serde_json::from_str(&text).unwrap()).unwrap()
                })
                .collect();
            let mut want = Vec::new();
            for (i, n) in nads.iter().enumerate() {
                for r in &n.check.ranges {
                    let count = nads
                        .iter()
                        .enumerate()
                        .filter(|(j, _)| *j != i)
                        .flat_map(|(_, o)| &o.check.ranges)
                        .filter(|o| {
                            o.network_name == r.network_name && o.range.windows_overlap(&r.range)
                        })
                        .count();
                    if count > 0 {
                        want.push((i, r.path.clone(), count));
                    }
                }
            }
            let mut got: Vec<(usize, String, usize)> = overlaps_of(&nads)
                .into_iter()
                .map(|(i, path, f)| {
                    assert_eq!(f.examples.len(), f.count.min(OVERLAP_EXAMPLES), "{f:?}");
                    (i, path, f.count)
                })
                .collect();
            want.sort();
            got.sort();
            assert_eq!(got, want);
        }
    }

    /// One NAD per namespace on one range: one line per NAD, naming three others and counting.
    /// (A /20: a larger window adds its own warning, that one pool object cannot record it.)
    #[test]
    fn many_nads_on_one_range_give_one_bounded_warning_each() {
        let text: String = (0..1000)
            .map(|k| {
                let c = r#"{"cniVersion":"1.0.0","type":"macvlan","ipam":{"type":"whereabouts","range":"10.0.0.0/20"}}"#;
                format!("---\n{}\n", nad(&format!("n{k}"), c))
            })
            .collect();
        let nads = check_text("f.yaml", &text).unwrap();
        let f = findings(&nads);
        assert_eq!(f.len(), 1000);
        assert!(
            f[0].message.ends_with("overlaps 999 ranges of other NetworkAttachmentDefinitions in the default network (no network_name): ns/n1 (10.0.0.0/20), ns/n2 (10.0.0.0/20), ns/n3 (10.0.0.0/20) and 996 more; they share addresses through reservations"),
            "{}",
            f[0].message
        );
        assert!(f.iter().all(|f| f.message.len() < 400));
    }
}
