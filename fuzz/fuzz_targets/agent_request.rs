//! The node agent's socket protocol: the bytes a plugin writes, as a connection from a served
//! caller turns them into a request (`agent::server::parse_request`).
//!
//! Input: the bytes alone (raw path), or `stdin 0x1E CNI_COMMAND 0x1E CNI_ARGS 0x1E flat file`
//! built into the request a plugin sends (`AgentRequest::new`), so that mutations reach the
//! validation behind the JSON. Asserts: bytes the agent cannot read are handed back to the plugin
//! (`Direct`) with a reason; a refusal is a typed CNI error with a message; only VERSION is
//! answered without running; a request survives the wire (serialize, parse) unchanged; the agent
//! decides as the plugin does on the same input.
#![no_main]

use libfuzzer_sys::fuzz_target;
use serde_json::Value;
use whereabouts::cni::handoff::{AgentReply, AgentRequest};
use whereabouts::agent::server::parse_request;
use whereabouts::cni::FlatSource;
use whereabouts::cni::protocol::{CniError, Code, Command};
use whereabouts_fuzz::{assert_cni_error, env_text, parts, plugin_load};

fuzz_target!(|data: &[u8]| {
    let p = parts(data, 4);
    if p.len() == 1 {
        check_reply(data, parse_request(data).err());
        return;
    }
    let Ok(stdin) = std::str::from_utf8(p[0]) else {
        return;
    };
    let command = env_text(p.get(1).copied()).unwrap_or_default();
    let args = env_text(p.get(2).copied()).unwrap_or_default();
    let flat = p
        .get(3)
        .and_then(|f| serde_json::from_slice::<Value>(f).ok())
        .and_then(|v| v.as_object().cloned())
        .map(|m| ("/etc/cni/net.d/whereabouts.d/whereabouts.conf".into(), m));
    let vars = [
        ("CNI_COMMAND", command.as_str()),
        ("CNI_ARGS", args.as_str()),
        ("CNI_CONTAINERID", "c1"),
        ("CNI_IFNAME", "net1"),
        ("PATH", "/opt/cni/bin"),
    ]
    .map(|(k, v)| (k.to_owned(), v.to_owned()));
    let request = AgentRequest::new(vars, stdin, flat.clone());
    let wire = serde_json::to_vec(&request).expect("requests serialize");
    let back: AgentRequest =
        serde_json::from_slice(&wire).expect("the agent reads what the plugin wrote");
    assert_eq!(back, request, "changed on the wire");
    assert!(
        !back.env.contains_key("PATH"),
        "a non-CNI variable forwarded"
    );
    let agent = parse_request(&wire);
    check_reply(&wire, agent.as_ref().err().cloned());
    // The plugin, on the same input with the same flat file.
    let Ok(command) = Command::parse(&command) else {
        return;
    };
    if command == Command::Version {
        return;
    }
    let env = |k: &str| request.env.get(k).cloned();
    let plugin = plugin_load(command, &env, stdin, FlatSource::Found(flat));
    match (agent, plugin) {
        (Ok(a), Ok(b)) => assert_eq!(format!("{a:?}"), format!("{b:?}")),
        (
            Err(AgentReply::Failed { code, msg, .. }),
            Err(CniError {
                code: c, msg: m, ..
            }),
        ) => {
            assert_eq!((code, msg), (c.number(), m));
        }
        (a, b) => panic!("agent {a:?}, plugin {b:?}"),
    }
});

/// The shape of the agent's answer to bytes it will not run.
fn check_reply(data: &[u8], reply: Option<AgentReply>) {
    match reply {
        None => {}
        Some(AgentReply::Direct { reason }) => {
            assert!(
                reason.starts_with("the agent cannot read the request: "),
                "{reason}"
            );
            assert!(
                serde_json::from_slice::<AgentRequest>(data).is_err(),
                "readable yet Direct"
            );
        }
        Some(AgentReply::Failed {
            code: c,
            msg,
            details,
        }) => assert_cni_error(
            &CniError::new(Code::from_number(c), msg).with_details(details),
            &[
                Code::IncompatibleVersion,
                Code::UnsupportedField,
                Code::InvalidEnv,
                Code::Decode,
                Code::InvalidConfig,
            ],
        ),
        Some(AgentReply::Done { output }) => {
            let req: AgentRequest =
                serde_json::from_slice(data).expect("Done for a readable request");
            assert_eq!(
                req.env.get("CNI_COMMAND").map(String::as_str),
                Some("VERSION")
            );
            assert_eq!(
                output,
                Some(whereabouts::cni::protocol::version_reply().to_value())
            );
        }
    }
}
