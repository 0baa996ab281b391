//! The offline command's side: NADs read from YAML or JSON files (or the cluster), each checked,
//! and the findings over all of them, overlaps between NADs included.

use std::fmt;

use serde::Serialize;
use serde_json::Value;
use serde_saphyr::Spanned;

use super::{NadCheck, RangeIndex, SPEC_CONFIG, check_spec_config, message, overlap_warnings};
use crate::config::Problem;

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
    pub(super) fn key(&self) -> String {
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
    pub source: Box<serde_saphyr::Error>,
}

/// Reads every NAD of a YAML (multi-document) or JSON text and checks it; other kinds are skipped.
/// `List` documents (as `kubectl get -o yaml` prints them) are opened.
pub fn check_text(file: &str, text: &str) -> Result<Vec<CheckedNad>, ReadError> {
    let mut out = Vec::new();
    for_each_document(text, |document, doc| {
        collect(file, document, &doc, &mut out)
    })
    .map_err(|(document, source)| ReadError {
        file: file.to_owned(),
        document,
        source: Box::new(source),
    })?;
    Ok(out)
}

/// Calls `f` with each document of `text` and its number (as a person counting `---` numbers
/// it), one at a time; stops at a syntax error with the number of the document it is in.
fn for_each_document(
    text: &str,
    mut f: impl FnMut(usize, Value),
) -> Result<(), (usize, serde_saphyr::Error)> {
    // serde-saphyr skips empty documents, so the stream's own order numbers them right only when
    // none can be empty; otherwise (and for an error's position) the text is parsed a second time
    // for where each document starts.
    let starts = (!plain_documents(text)).then(|| document_starts(text));
    let mut input = text.as_bytes();
    let stream = serde_saphyr::read_with_options::<_, Spanned<Value>>(&mut input, read_options());
    for (k, doc) in stream.enumerate() {
        let doc = doc.map_err(|e| {
            let starts = starts.clone().unwrap_or_else(|| document_starts(text));
            let n = e
                .location()
                .map_or(starts.len().max(1), |l| number(&starts, l.line()));
            (n, e)
        })?;
        let n = match &starts {
            Some(starts) => number(starts, doc.referenced.line()),
            None => k + 1,
        };
        f(n, doc.value);
    }
    Ok(())
}

/// The number of the document that holds line `line`, given where each document starts.
fn number(starts: &[u64], line: u64) -> usize {
    starts.partition_point(|&s| s <= line).max(1)
}

/// Whether every document of `text` surely holds a node: no directive (`%`) or end marker
/// (`...`) lines, and after every `---` something that is neither blank nor a comment. Then the
/// n-th document read is document n. When unsure (a comment-like line inside a block scalar, say)
/// it says no, which only costs the second parse.
fn plain_documents(text: &str) -> bool {
    let marker = |line: &str, m: &str| {
        line.strip_prefix(m)
            .is_some_and(|rest| rest.is_empty() || rest.starts_with([' ', '\t']))
    };
    let content = |s: &str| {
        let t = s.trim_start();
        !t.is_empty() && !t.starts_with('#') && !matches!(t, "~" | "null" | "Null" | "NULL")
    };
    let mut waiting = false; // after a `---`, no content yet
    for line in text.lines() {
        if line.starts_with('%') || marker(line, "...") || (waiting && marker(line, "---")) {
            return false;
        }
        if marker(line, "---") {
            waiting = !content(&line[3..]);
        } else if content(line) {
            waiting = false;
        }
    }
    !waiting
}

/// The line each document of `text` begins on, empty documents included, up to a syntax error.
fn document_starts(text: &str) -> Vec<u64> {
    let mut parser = serde_saphyr::granit_parser::Parser::new_from_str(text);
    let mut starts = Vec::new();
    while let Some(Ok((event, span))) = parser.next_event() {
        if let serde_saphyr::granit_parser::Event::DocumentStart(..) = event {
            starts.push(span.start.line() as u64);
        }
    }
    starts
}

/// Plain scalars read as YAML 1.2's core schema has them, as Kubernetes reads a manifest: `yes`,
/// `on`, `010` and `1_000` stay strings, `.inf` and `.nan` are numbers (JSON's null). The budget
/// is lifted to what the offline command always read: a `List` of every NAD of a large cluster is
/// one document of millions of nodes; nesting stays bounded, at 128 levels.
fn read_options() -> serde_saphyr::Options {
    serde_saphyr::options! {
        strict_booleans: true,
        leading_zero_numbers_as_strings: true,
        underscored_numbers_as_strings: true,
        non_finite_float_policy: serde_saphyr::NonFiniteFloatPolicy::PassThrough,
        budget: serde_saphyr::budget! {
            max_events: usize::MAX,
            max_nodes: usize::MAX,
            max_total_scalar_bytes: usize::MAX,
            max_depth: 128,
        },
    }
}

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
    use crate::nad_check::tests::nad;

    /// Empty documents (a template that rendered nothing, a comment alone) count, as they always
    /// did, so a finding's number is the one a person counting `---` arrives at; so does the
    /// document a syntax error is in.
    #[test]
    fn empty_documents_count_and_errors_name_their_document() {
        let b = nad(
            "b",
            r#"{"type":"macvlan","ipam":{"type":"whereabouts","range":"10.0.0.0/24"}}"#,
        );
        let text = format!("# Source: chart/a.yaml\n---\n# Source: chart/b.yaml\n---\n{b}\n");
        let nads = check_text("f.yaml", &text).unwrap();
        assert_eq!(nads.len(), 1);
        assert_eq!(nads[0].document, 2);
        let text = format!("{b}\n---\n---\nkind: [unclosed\n");
        let err = check_text("f.yaml", &text).unwrap_err();
        assert_eq!(err.document, 3, "{err}");
        assert!(err.to_string().starts_with("f.yaml: document 3: "), "{err}");
    }

    /// The numbers from the stream's order (the fast path) are those the document starts give,
    /// for every text the fast path takes; the texts it must not take, it does not.
    #[test]
    fn numbering_by_order_agrees_with_the_document_starts() {
        let texts = [
            "a: 1\n---\nb: 2\n---\nc: 3\n",
            "---\na: 1\n---\nb: 2\n",
            "# head\n---\na: 1\n--- {b: 2}\n---\n# c\nc: 3\n",
            "a: |\n  x\n  # y\n---\nb: 2\n",
            "--- ~\n---\nb: 2\n",
            "---\nnull\n---\nb: 2\n",
            "---\n# only a comment\n---\nb: 2\n",
            "a: 1\n...\n---\nb: 2\n",
            "%YAML 1.2\n---\na: 1\n",
            "a: 1\n---\n",
            "[1, 2]\n---\n- x\n",
        ];
        for text in texts {
            let by_starts: Vec<usize> = {
                let starts = document_starts(text);
                let mut input = text.as_bytes();
                serde_saphyr::read_with_options::<_, Spanned<Value>>(&mut input, read_options())
                    .map(|d| {
                        let line = d.unwrap().referenced.line();
                        starts.partition_point(|&s| s <= line).max(1)
                    })
                    .collect()
            };
            let mut got = Vec::new();
            for_each_document(text, |n, _| got.push(n)).unwrap();
            assert_eq!(got, by_starts, "{text:?}");
            if plain_documents(text) {
                let by_order: Vec<usize> = (1..=by_starts.len()).collect();
                assert_eq!(by_starts, by_order, "fast path wrong for {text:?}");
            }
        }
        assert!(plain_documents("a: 1\n---\nb: 2\n"));
        assert!(!plain_documents("---\n# c\n---\nb: 2\n"));
        assert!(!plain_documents("--- ~\n---\nb: 2\n"));
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
