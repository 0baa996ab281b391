//! The CNI plugin's input as the binary reads it: the network config on stdin, `CNI_ARGS`,
//! `CNI_COMMAND`, `CNI_CONTAINERID`, `CNI_IFNAME`.
//!
//! Input: `stdin` alone (raw path: an ADD with a kubelet's environment), or
//! `stdin 0x1E CNI_ARGS 0x1E CNI_COMMAND 0x1E CNI_CONTAINERID 0x1E CNI_IFNAME` (missing parts keep
//! the kubelet's values). Asserts: every refusal is a typed CNI error with a spec code and a
//! message; a loaded request carries the environment it was given; on the raw path the validator
//! and the plugin agree (`whereabouts_fuzz::assert_validator_agrees`).
#![no_main]

use libfuzzer_sys::fuzz_target;
use whereabouts::cni::FlatSource;
use whereabouts::cni::protocol::{CniArgs, Code, Command};
use whereabouts::nad_check::check_spec_config;
use whereabouts_fuzz::{
    assert_cni_error, assert_validator_agrees, env_text, good_env, parts, plugin_load,
};

fuzz_target!(|data: &[u8]| {
    let p = parts(data, 5);
    // The binary reads stdin with `read_to_string`: bytes that are not UTF-8 never reach `load`.
    let Ok(stdin) = std::str::from_utf8(p[0]) else {
        return;
    };
    if p.len() == 1 {
        assert_validator_agrees(stdin, &check_spec_config(stdin));
        return;
    }
    let given = |i: usize, key: &str| match p.get(i) {
        Some(part) => env_text(Some(part)),
        None => good_env(key),
    };
    let args = given(1, "CNI_ARGS");
    let command_text = p
        .get(2)
        .map_or(Some("ADD".to_owned()), |c| env_text(Some(c)));
    let container_id = given(3, "CNI_CONTAINERID");
    let ifname = given(4, "CNI_IFNAME");
    let command = match Command::parse(command_text.as_deref().unwrap_or_default()) {
        // VERSION reads nothing: the binary answers it before `load`.
        Ok(Command::Version) => return,
        Ok(c) => c,
        Err(e) => {
            assert_cni_error(&e, &[Code::InvalidEnv]);
            return;
        }
    };
    let env = |key: &str| match key {
        "CNI_ARGS" => args.clone(),
        "CNI_CONTAINERID" => container_id.clone(),
        "CNI_IFNAME" => ifname.clone(),
        _ => None,
    };
    let Ok(req) = plugin_load(command, &env, stdin, FlatSource::Paths(vec![])) else {
        return;
    };
    assert_eq!(req.command, command);
    assert_eq!(
        req.attachment.container_id,
        container_id.unwrap_or_default()
    );
    assert_eq!(req.attachment.ifname, ifname.unwrap_or_default());
    let parsed = CniArgs::parse(args.as_deref().unwrap_or_default()).expect("load parsed these");
    assert_eq!(req.attachment.podref, parsed.podref());
    if matches!(command, Command::Add | Command::Del | Command::Check) {
        assert!(!req.attachment.container_id.is_empty() && !req.attachment.ifname.is_empty());
    }
    if command == Command::Add {
        assert!(!req.attachment.podref.is_empty(), "ADD without a pod");
    }
    assert!(!req.ipam.ranges.is_empty(), "a loaded config has a range");
});
