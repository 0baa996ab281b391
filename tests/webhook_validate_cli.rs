//! `whereabouts-operator validate`: the real binary on the sample and invalid NAD files.

use std::io::Write;
use std::path::PathBuf;
use std::process::{Command, Output, Stdio};

fn repo() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

fn validate(args: &[&str], stdin: &str) -> Output {
    let mut child = Command::new(env!("CARGO_BIN_EXE_whereabouts-operator"))
        .arg("validate")
        .args(args)
        .current_dir(repo())
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    child
        .stdin
        .take()
        .unwrap()
        .write_all(stdin.as_bytes())
        .unwrap();
    child.wait_with_output().unwrap()
}

fn files(dir: &str, prefix: &str) -> Vec<String> {
    let mut out: Vec<String> = std::fs::read_dir(repo().join(dir))
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .filter(|n| n.starts_with(prefix) && n.ends_with(".yaml"))
        .map(|n| format!("{dir}/{n}"))
        .collect();
    out.sort();
    out
}

/// The `# expect: ...` comment at the top of an invalid fixture.
pub fn expected(file: &str) -> String {
    let text = std::fs::read_to_string(repo().join(file)).unwrap();
    text.lines()
        .next()
        .and_then(|l| l.strip_prefix("# expect: "))
        .unwrap_or_else(|| panic!("{file}: no `# expect:` line"))
        .to_owned()
}

#[test]
fn the_samples_are_valid() {
    // The NAD samples (the folder also holds their kustomization).
    let samples = files("config/samples", "whereabouts-");
    assert!(samples.len() >= 5);
    let args: Vec<&str> = samples.iter().map(String::as_str).collect();
    let out = validate(&args, "");
    assert_eq!(
        out.status.code(),
        Some(0),
        "{}",
        String::from_utf8_lossy(&out.stdout)
    );
    assert!(String::from_utf8_lossy(&out.stderr).contains(&format!(
        "{} NetworkAttachmentDefinition(s) checked: 0 invalid",
        samples.len()
    )));
}

#[test]
fn each_invalid_fixture_fails_with_its_message() {
    let fixtures = files("tests/fixtures/nads", "invalid-");
    assert!(fixtures.len() >= 12);
    for file in &fixtures {
        let out = validate(&[file], "");
        let stdout = String::from_utf8_lossy(&out.stdout);
        assert_eq!(out.status.code(), Some(1), "{file}: {stdout}");
        let name = file.rsplit('/').next().unwrap().trim_end_matches(".yaml");
        let line = format!(
            "{file}:1: error: NetworkAttachmentDefinition {name}: {}",
            expected(file)
        );
        assert!(
            stdout.lines().any(|l| l.starts_with(&line)),
            "{file}: {stdout:?} should have a line starting {line:?}"
        );
    }
}

const MIXED: &str = r#"apiVersion: v1
kind: ConfigMap
metadata: {name: not-a-nad}
---
apiVersion: k8s.cni.cncf.io/v1
kind: NetworkAttachmentDefinition
metadata: {name: a, namespace: team}
spec:
  config: '{"type": "macvlan", "ipam": {"type": "whereabouts", "range": "10.0.0.0/24", "range_end": "10.0.1.1", "gateway": "x"}}'
---
apiVersion: k8s.cni.cncf.io/v1
kind: NetworkAttachmentDefinition
metadata: {name: b, namespace: team}
spec:
  config: '{"type": "bridge", "ipam": {"type": "host-local", "subnet": "10.0.0.0/24"}}'
"#;

#[test]
fn stdin_multi_document_skips_other_kinds_and_lists_every_problem() {
    let out = validate(&["-"], MIXED);
    assert_eq!(out.status.code(), Some(1));
    let stdout = String::from_utf8_lossy(&out.stdout);
    let lines: Vec<&str> = stdout.lines().collect();
    assert_eq!(
        lines,
        [
            r#"-:2: error: NetworkAttachmentDefinition team/a: spec.config: ipam.range_end "10.0.1.1" is outside range 10.0.0.0/24"#,
            r#"-:2: error: NetworkAttachmentDefinition team/a: spec.config: ipam.gateway "x" is not an IP address"#,
        ],
        "{stdout}"
    );
}

#[test]
fn json_output_for_tooling() {
    let out = validate(&["--output", "json", "-"], MIXED);
    assert_eq!(out.status.code(), Some(1));
    let doc: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(doc["checked"], 2);
    assert_eq!(doc["invalid"], 1);
    let first = &doc["findings"][0];
    assert_eq!(first["file"], "-");
    assert_eq!(first["document"], 2);
    assert_eq!(first["namespace"], "team");
    assert_eq!(first["name"], "a");
    assert_eq!(first["severity"], "error");
    assert_eq!(first["path"], "spec.config: ipam.range_end");
    assert_eq!(first["value"], "10.0.1.1");
    assert_eq!(first["reason"], "is outside range 10.0.0.0/24");
}

#[test]
fn json_input_and_overlaps_across_files_warn_but_pass() {
    let dir = tempfile::tempdir().unwrap();
    let a = dir.path().join("a.json");
    std::fs::write(&a, serde_json::json!({"apiVersion": "k8s.cni.cncf.io/v1", "kind": "NetworkAttachmentDefinition", "metadata": {"name": "a"},
        "spec": {"config": r#"{"ipam": {"type": "whereabouts", "range": "10.9.0.0/16"}}"#}}).to_string()).unwrap();
    let out = validate(
        &[
            a.to_str().unwrap(),
            "config/samples/whereabouts-single-range.yaml",
            "-",
        ],
        "apiVersion: k8s.cni.cncf.io/v1\nkind: NetworkAttachmentDefinition\nmetadata: {name: b}\nspec:\n  config: '{\"ipam\": {\"type\": \"whereabouts\", \"range\": \"10.9.3.0/24\"}}'\n",
    );
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert_eq!(out.status.code(), Some(0), "{stdout}");
    assert!(stdout.contains(r#"warning: NetworkAttachmentDefinition a: spec.config: ipam.range "10.9.0.0/16" overlaps range 10.9.3.0/24 of NetworkAttachmentDefinition b"#), "{stdout}");
}

#[test]
fn usage_and_read_errors_exit_2() {
    let none = validate(&[], "");
    assert_eq!(none.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&none.stderr).contains("give one or more FILEs"));
    let missing = validate(&["no/such/file.yaml"], "");
    assert_eq!(missing.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&missing.stderr).contains("no/such/file.yaml"));
    let bad_yaml = validate(&["-"], "a: [unclosed\n");
    assert_eq!(bad_yaml.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&bad_yaml.stderr).contains("-: document 1"));
    let bad_flag = validate(&["--output", "xml", "-"], "");
    assert_eq!(bad_flag.status.code(), Some(2));
}

#[test]
fn run_refuses_bad_flags_naming_flag_and_value() {
    let run = |args: &[&str], env: &[(&str, &str)]| {
        Command::new(env!("CARGO_BIN_EXE_whereabouts-operator"))
            .arg("run")
            .args(args)
            .envs(env.iter().copied())
            .output()
            .unwrap()
    };
    let out = run(&["--audit-interval", "5x"], &[]);
    assert_eq!(out.status.code(), Some(2));
    assert!(
        String::from_utf8_lossy(&out.stderr).contains("invalid value '5x' for '--audit-interval")
    );
    let out = run(&[], &[("WHEREABOUTS_ADMIN_ADDR", "nope")]);
    assert_eq!(out.status.code(), Some(2));
    assert!(
        String::from_utf8_lossy(&out.stderr).contains("invalid value 'nope' for '--admin-addr")
    );
    let out = run(&["--tls-cert-file", "x"], &[]);
    assert_eq!(out.status.code(), Some(2));
    let out = run(&["--stale-grace", "1.5s"], &[]);
    assert_eq!(out.status.code(), Some(2));
}
