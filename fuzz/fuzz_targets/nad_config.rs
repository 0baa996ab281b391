//! A NetworkAttachmentDefinition's `spec.config` through the shared validator, as the webhook and
//! `whereabouts-operator validate` judge it.
//!
//! Input: the `spec.config` text alone (raw path), or `spec.config 0x1E YAML` where the second
//! part is a file for the offline command (`nad_check::check_text`). Asserts: every problem names
//! a path and a reason; a config that is not whereabouts gets no verdict; a valid one has a range
//! or leaves it to the flat file; the validator and the plugin agree; the offline report over the
//! config's NAD says the same as the check of its `spec.config`.
#![no_main]

use libfuzzer_sys::fuzz_target;
use serde_json::json;
use whereabouts::nad_check::{
    NadCheck, RangeIndex, check_object, check_spec_config, check_text, findings, message,
    overlap_warnings,
};
use whereabouts_fuzz::{assert_validator_agrees, parts};

fuzz_target!(|data: &[u8]| {
    let p = parts(data, 2);
    let Ok(config) = std::str::from_utf8(p[0]) else {
        return;
    };
    let check = check_spec_config(config);
    assert_well_formed(&check);
    assert_validator_agrees(config, &check);
    assert_offline_agrees(config, &check);
    if let Some(Ok(yaml)) = p.get(1).map(|y| std::str::from_utf8(y))
        && let Ok(nads) = check_text("fuzz.yaml", yaml)
    {
        for f in findings(&nads) {
            assert!(!f.message.is_empty() && !f.path.is_empty());
        }
    }
});

fn assert_well_formed(check: &NadCheck) {
    if !check.whereabouts {
        assert!(check.errors.is_empty() && check.warnings.is_empty() && check.ranges.is_empty());
        return;
    }
    for p in check.errors.iter().chain(&check.warnings) {
        assert!(!p.path.is_empty(), "problem without a path: {p:?}");
        assert!(
            !p.reason.trim().is_empty(),
            "problem without a reason: {p:?}"
        );
        assert!(message(p).starts_with("spec.config"), "{}", message(p));
    }
    if check.is_valid() {
        let left_to_node = check
            .warnings
            .iter()
            .any(|w| w.reason.contains("flat file must supply"));
        assert!(
            !check.ranges.is_empty() || left_to_node,
            "valid without a range"
        );
    }
    // The cross-NAD check against itself under another name: every range overlaps itself.
    let index = RangeIndex::build([("ns/other", check.ranges.as_slice())]);
    let overlaps = overlap_warnings(&check.ranges, "ns/me", &index);
    assert_eq!(
        overlaps.len(),
        check.ranges.len(),
        "a range that does not overlap itself"
    );
    assert!(overlap_warnings(&check.ranges, "ns/other", &index).is_empty());
}

/// The offline command reads the same config inside a NAD object: same errors, same warnings.
fn assert_offline_agrees(config: &str, check: &NadCheck) {
    let object = json!({"apiVersion": "k8s.cni.cncf.io/v1", "kind": "NetworkAttachmentDefinition",
                        "metadata": {"name": "n", "namespace": "ns"}, "spec": {"config": config}});
    let nad = check_object("f", 1, &object).expect("a NAD");
    assert_eq!(nad.check.errors, check.errors);
    if check.whereabouts {
        assert_eq!(nad.check.warnings, check.warnings);
    }
}
