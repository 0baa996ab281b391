//! The node's flat file (`whereabouts.conf`) as the plugin reads it from disk and merges it.
//!
//! Input: the file's bytes alone (raw path, merged under a network config that leaves everything
//! to the node), or `flat file 0x1E network config`. Asserts: a file that is not a JSON object is a
//! problem naming the file; the merge keeps every non-empty value of the network config and never
//! takes `enable_overlapping_ranges` from the file; the plugin takes `agent_socket` from the flat
//! file only; every refusal is a typed CNI error.
#![no_main]

use std::path::PathBuf;
use std::sync::OnceLock;

use libfuzzer_sys::fuzz_target;
use serde_json::Value;
use whereabouts::cni::FlatSource;
use whereabouts::cni::protocol::Command;
use whereabouts::config::{DEFAULT_AGENT_SOCKET, NetConf, flat};
use whereabouts_fuzz::{good_env, parts, plugin_load};

/// A network config whose ipam leaves its range, and so nearly everything, to the flat file.
const LEAVES_ALL: &str = r#"{"cniVersion":"1.0.0","name":"n","type":"macvlan","ipam":{"type":"whereabouts","agent_socket":"/nad/socket"}}"#;

/// One file per fuzzing process, rewritten for every input: the plugin's real read path. In
/// memory (/dev/shm) where there is one: a disk write per input would be most of the time spent.
fn file() -> &'static PathBuf {
    static PATH: OnceLock<PathBuf> = OnceLock::new();
    PATH.get_or_init(|| {
        let shm = std::path::Path::new("/dev/shm");
        let dir = if shm.is_dir() {
            shm.to_path_buf()
        } else {
            std::env::temp_dir()
        };
        dir.join(format!("whereabouts-fuzz-flat-{}.conf", std::process::id()))
    })
}

fn is_empty(v: &Value) -> bool {
    match v {
        Value::Null => true,
        Value::String(s) => s.is_empty(),
        Value::Array(a) => a.is_empty(),
        Value::Object(o) => o.is_empty(),
        Value::Bool(b) => !b,
        Value::Number(n) => n.as_f64() == Some(0.0),
    }
}

fuzz_target!(|data: &[u8]| {
    let p = parts(data, 2);
    let stdin = match p.get(1) {
        Some(s) => match std::str::from_utf8(s) {
            Ok(s) => s,
            Err(_) => return,
        },
        None => LEAVES_ALL,
    };
    let path = file();
    std::fs::write(path, p[0]).expect("temp file");
    let found = match flat::load(std::slice::from_ref(path)) {
        Ok(found) => found.expect("the file exists").1,
        Err(problem) => {
            assert_eq!(problem.path, "flat file");
            assert_eq!(
                problem.value.as_deref(),
                Some(path.to_string_lossy().as_ref())
            );
            return;
        }
    };
    check_merge(stdin, &found);
    let got = plugin_load(
        Command::Add,
        &good_env,
        stdin,
        FlatSource::Paths(vec![path.clone()]),
    );
    if let Ok(req) = got {
        // The node decides which socket the plugin trusts, never the network config.
        let expected = match found.get("agent_socket") {
            None | Some(Value::Null) => Some(DEFAULT_AGENT_SOCKET),
            Some(Value::String(s)) if s.is_empty() => None,
            Some(Value::String(s)) => Some(s.as_str()),
            Some(other) => panic!("agent_socket {other} accepted"),
        };
        assert_eq!(req.ipam.agent_socket.as_deref(), expected);
    }
});

/// The merge rules of `config::flat`, checked on the network config's ipam object.
fn check_merge(stdin: &str, flat_conf: &serde_json::Map<String, Value>) {
    let Some(Value::Object(nad)) = NetConf::parse(stdin, "x")
        .ok()
        .and_then(|c| c.runtime_ipam().map(|(_, v)| v.clone()))
    else {
        return;
    };
    let mut merged = nad.clone();
    flat::merge(&mut merged, flat_conf);
    for (key, ours) in &nad {
        if !is_empty(ours) && !ours.is_object() {
            assert_eq!(merged.get(key), Some(ours), "the flat file replaced {key}");
        }
    }
    assert_eq!(
        merged.get("enable_overlapping_ranges"),
        nad.get("enable_overlapping_ranges"),
        "enable_overlapping_ranges came from the flat file"
    );
}
