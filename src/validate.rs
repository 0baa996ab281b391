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

use std::collections::BTreeMap;
use std::fmt;

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

impl Overlaps {
    fn add(&mut self, other: &str, theirs: &NadRange) {
        self.count += 1;
        if self.examples.len() < OVERLAP_EXAMPLES {
            self.examples.push((other.to_owned(), theirs.range.cidr()));
        }
    }
}

/// One warning for every range of `mine` whose window overlaps ranges of other NADs in the same
/// network. `others` yields `(namespace/name, ranges)`; the caller leaves the NAD itself out.
pub fn overlap_warnings<'a>(
    mine: &[NadRange],
    others: impl IntoIterator<Item = (&'a str, &'a [NadRange])>,
) -> Vec<Problem> {
    let mut found: Vec<Overlaps> = mine.iter().map(|_| Overlaps::default()).collect();
    for (other, ranges) in others {
        for theirs in ranges {
            for (r, f) in mine.iter().zip(found.iter_mut()) {
                if r.network_name == theirs.network_name && r.range.windows_overlap(&theirs.range) {
                    f.add(other, theirs);
                }
            }
        }
    }
    mine.iter()
        .zip(found)
        .filter(|(_, f)| f.count > 0)
        .map(|(r, f)| overlap_problem(r, &f))
        .collect()
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
    for (i, r, found) in overlaps_per_range(nads) {
        let n = &nads[i];
        per_nad[i].push(n.finding(Severity::Warning, &overlap_problem(r, &found)));
    }
    per_nad.into_iter().flatten().collect()
}

type Indexed<'a> = (usize, &'a NadRange);

/// How far back from a range, in window-start order, the report looks for example NADs; the
/// count is exact whatever this is.
const EXAMPLE_LOOKBACK: usize = 64;

/// For every range of every NAD that overlaps ranges of other NADs in its network: the NAD, the
/// range and what it overlaps. Ranges are grouped by network and family and sorted by window
/// start and by window end, so each range's count is two binary searches: O(n log n) in all,
/// however many pairs overlap.
fn overlaps_per_range(nads: &[CheckedNad]) -> Vec<(usize, &NadRange, Overlaps)> {
    let mut by_network: BTreeMap<(Option<&str>, bool), Vec<Indexed<'_>>> = BTreeMap::new();
    for (i, n) in nads.iter().enumerate() {
        for r in &n.check.ranges {
            let v6 = r.range.cidr().addr().is_ipv6();
            by_network
                .entry((r.network_name.as_deref(), v6))
                .or_default()
                .push((i, r));
        }
    }
    let mut out = Vec::new();
    for (_, mut ranges) in by_network {
        ranges.sort_by_key(|(_, r)| r.range.window_bounds());
        let starts: Vec<u128> = ranges
            .iter()
            .map(|(_, r)| r.range.window_bounds().0)
            .collect();
        let mut ends: Vec<u128> = ranges
            .iter()
            .map(|(_, r)| r.range.window_bounds().1)
            .collect();
        ends.sort_unstable();
        let mut by_nad: BTreeMap<usize, Vec<&NadRange>> = BTreeMap::new();
        for &(i, r) in &ranges {
            by_nad.entry(i).or_default().push(r);
        }
        for (p, &(i, r)) in ranges.iter().enumerate() {
            let (lo, hi) = r.range.window_bounds();
            // Ranges starting at or before `hi`, less those that ended before `lo`.
            let all = starts.partition_point(|&s| s <= hi) - ends.partition_point(|&e| e < lo);
            // ... less this NAD's own (the range itself included).
            let own = by_nad[&i]
                .iter()
                .filter(|o| o.range.windows_overlap(&r.range))
                .count();
            if all == own {
                continue;
            }
            let mut found = Overlaps {
                count: all - own,
                examples: Vec::new(),
            };
            let later = ranges[p + 1..]
                .iter()
                .take_while(|(_, o)| o.range.window_bounds().0 <= hi);
            let earlier = ranges[..p].iter().rev().take(EXAMPLE_LOOKBACK);
            for (j, o) in later.chain(earlier) {
                if found.examples.len() == OVERLAP_EXAMPLES {
                    break;
                }
                if *j != i && o.range.windows_overlap(&r.range) {
                    found.examples.push((nads[*j].key(), o.range.cidr()));
                }
            }
            out.push((i, r, found));
        }
    }
    out
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
        let found = overlaps_per_range(&nads);
        let seen: Vec<(usize, usize, &str)> = found
            .iter()
            .map(|(i, _, f)| (*i, f.count, f.examples[0].0.as_str()))
            .collect();
        assert_eq!(seen, [(0, 1, "ns/d"), (3, 1, "ns/a")]);
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
            let mut got: Vec<(usize, String, usize)> = overlaps_per_range(&nads)
                .into_iter()
                .map(|(i, r, f)| {
                    assert_eq!(f.examples.len(), f.count.min(OVERLAP_EXAMPLES), "{f:?}");
                    (i, r.path.clone(), f.count)
                })
                .collect();
            want.sort();
            got.sort();
            assert_eq!(got, want);
        }
    }

    /// One NAD per namespace on one range: one line per NAD, naming three others and counting.
    #[test]
    fn many_nads_on_one_range_give_one_bounded_warning_each() {
        let text: String = (0..1000)
            .map(|k| {
                let c = r#"{"cniVersion":"1.0.0","type":"macvlan","ipam":{"type":"whereabouts","range":"10.0.0.0/16"}}"#;
                format!("---\n{}\n", nad(&format!("n{k}"), c))
            })
            .collect();
        let nads = check_text("f.yaml", &text).unwrap();
        let f = findings(&nads);
        assert_eq!(f.len(), 1000);
        assert!(
            f[0].message.ends_with("overlaps 999 ranges of other NetworkAttachmentDefinitions in the default network (no network_name): ns/n1 (10.0.0.0/16), ns/n2 (10.0.0.0/16), ns/n3 (10.0.0.0/16) and 996 more; they share addresses through reservations"),
            "{}",
            f[0].message
        );
        assert!(f.iter().all(|f| f.message.len() < 400));
    }
}
