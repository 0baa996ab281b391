//! What the fuzz targets share: how an input is split into parts, the plugin's view of a config,
//! and the properties every CNI error must have.
//!
//! Inputs with several parts (environment, stdin, flat file) separate them with the ASCII record
//! separator 0x1E: valid JSON never holds it unescaped, so a seed stays a readable file and a
//! mutation of one part rarely spills into another. An input without 0x1E is the raw-bytes path.

use whereabouts::cni::protocol::{CniError, Code, Command};
use whereabouts::cni::{FlatSource, Invocation, Request};
use whereabouts::nad_check::NadCheck;

pub const SEPARATOR: u8 = 0x1E;

/// The parts of an input, at most `max` (the last part keeps any further separators).
pub fn parts(data: &[u8], max: usize) -> Vec<&[u8]> {
    data.splitn(max, |b| *b == SEPARATOR).collect()
}

/// A part as the plugin binary reads an environment variable: not UTF-8 counts as unset.
pub fn env_text(part: Option<&[u8]>) -> Option<String> {
    part.and_then(|p| std::str::from_utf8(p).ok())
        .map(str::to_owned)
}

/// The environment of a well-formed ADD from a kubelet, as tests/validator_agrees.rs uses it.
pub fn good_env(key: &str) -> Option<String> {
    match key {
        "CNI_CONTAINERID" => Some("c1".to_owned()),
        "CNI_IFNAME" => Some("net1".to_owned()),
        // Node slices read the node's name; this one is valid.
        "NODENAME" => Some("node-1".to_owned()),
        "CNI_ARGS" => {
            Some("IgnoreUnknown=1;K8S_POD_NAMESPACE=ns;K8S_POD_NAME=p;K8S_POD_UID=u".to_owned())
        }
        _ => None,
    }
}

/// Every error code loading an invocation may return.
const LOAD_CODES: &[Code] = &[
    Code::IncompatibleVersion,
    Code::UnsupportedField,
    Code::InvalidEnv,
    Code::Decode,
    Code::InvalidConfig,
];

/// A typed CNI error with a message, that renders as the CNI error object the runtime parses.
pub fn assert_cni_error(e: &CniError, codes: &[Code]) {
    assert!(
        codes.contains(&e.code),
        "unexpected code {:?} ({})",
        e.code,
        e.msg
    );
    assert!(
        !e.msg.trim().is_empty(),
        "empty message for code {:?}",
        e.code
    );
    let json = e.to_json("");
    assert_eq!(json["code"], e.code.number());
    assert_eq!(json["msg"], e.msg.as_str());
}

/// The invocation of `env`, `stdin`, `flat_file` loaded, checking the shape of any error.
pub fn plugin_load(
    command: Command,
    env: &dyn Fn(&str) -> Option<String>,
    stdin: &str,
    flat_file: FlatSource,
) -> Result<Request, CniError> {
    let got = Invocation::read(env, stdin, flat_file).load(command);
    if let Err(e) = &got {
        assert_cni_error(e, LOAD_CODES);
    }
    got
}

/// Codes that mean "this configuration cannot work" (tests/validator_agrees.rs).
fn is_config_error(c: Code) -> bool {
    matches!(
        c,
        Code::IncompatibleVersion | Code::UnsupportedField | Code::Decode | Code::InvalidConfig
    )
}

/// The property of tests/validator_agrees.rs over arbitrary text: for a config the NAD validator
/// judges as whereabouts, the plugin's ADD (well-formed environment, no flat file) refuses it with
/// a config error exactly when the validator does. Where the validator cannot know (a range left
/// to the node's flat file) it only warns, and where a conflist holds several whereabouts blocks
/// (the plugin reads the first) it may be stricter: there only "accepted means accepted" holds.
pub fn assert_validator_agrees(config: &str, nad: &NadCheck) {
    if !nad.whereabouts
        || nad
            .warnings
            .iter()
            .any(|w| w.reason.contains("flat file must supply"))
    {
        return;
    }
    let refused = match plugin_load(Command::Add, &good_env, config, FlatSource::Paths(vec![])) {
        Ok(_) => None,
        Err(e) => {
            assert!(
                is_config_error(e.code),
                "code {:?} ({}) for a config with a good environment: {config}",
                e.code,
                e.msg
            );
            Some(e.msg)
        }
    };
    let one_block = whereabouts::config::NetConf::parse(config, "x")
        .map(|c| c.whereabouts_ipams().len() <= 1)
        .unwrap_or(true);
    if nad.is_valid() {
        assert!(
            refused.is_none(),
            "the validator accepts, the plugin refuses ({refused:?}): {config}"
        );
    } else if one_block {
        assert!(
            refused.is_some(),
            "the validator refuses ({:?}), the plugin accepts: {config}",
            nad.errors.iter().map(|p| p.to_string()).collect::<Vec<_>>()
        );
    }
}
