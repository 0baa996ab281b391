//! What the plugin and the node agent say to each other over the agent's Unix socket: the
//! protocol here, the plugin's side in [`client`] (the agent's side is [`crate::agent::server`]).
//!
//! One request per connection: the plugin writes one JSON [`AgentRequest`] and shuts down its
//! side, the agent answers with one JSON [`AgentReply`] and closes. The request carries exactly
//! what the runtime gave the plugin (the `CNI_*` environment and stdin) and the flat file the
//! plugin found on the node, so the agent validates it again with the same code the plugin uses
//! and the result cannot depend on which of the two ran it.

pub mod client;

use std::collections::BTreeMap;
use std::path::PathBuf;

use serde::{Deserialize, Serialize};
use serde_json::{Map, Value};

use super::protocol::CniError;
use crate::config::trust::CONF_DIR_ENV;

/// Larger requests are refused: a network config is a few kilobytes.
pub const MAX_REQUEST_BYTES: usize = 1 << 20;

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct AgentRequest {
    /// The plugin's `CNI_*` environment variables.
    pub env: BTreeMap<String, String>,
    /// The network config the runtime wrote on the plugin's stdin.
    pub stdin: String,
    /// The flat file the plugin merged, if any.
    pub flat_file: Option<ForwardedFlatFile>,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct ForwardedFlatFile {
    pub path: PathBuf,
    pub conf: Map<String, Value>,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub enum AgentReply {
    /// The command ran; `output` is what the plugin prints (ADD's result), if anything.
    Done { output: Option<Value> },
    /// The command failed with this CNI error.
    Failed {
        code: u32,
        msg: String,
        details: String,
    },
    /// The agent does not run this request (another kubeconfig, a caller it does not serve, too
    /// busy): the plugin runs it itself.
    Direct { reason: String },
}

impl From<CniError> for AgentReply {
    fn from(e: CniError) -> Self {
        AgentReply::Failed {
            code: e.code.number(),
            msg: e.msg,
            details: e.details,
        }
    }
}

impl AgentRequest {
    /// The request for this invocation: the `CNI_*` variables (and [`CONF_DIR_ENV`]) of `vars`,
    /// stdin and the flat file.
    pub fn new(
        vars: impl IntoIterator<Item = (String, String)>,
        stdin: &str,
        flat_file: Option<crate::config::flat::FlatFile>,
    ) -> Self {
        AgentRequest {
            env: vars
                .into_iter()
                // The node's directory too: the agent judges the network config's files
                // against the directories of the plugin's node, not its own container's.
                .filter(|(k, _)| k.starts_with("CNI_") || k == CONF_DIR_ENV)
                .collect(),
            stdin: stdin.to_owned(),
            flat_file: flat_file.map(|(path, conf)| ForwardedFlatFile { path, conf }),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_cni_variables_are_forwarded_and_the_wire_form_round_trips() {
        let vars = [
            ("CNI_COMMAND".to_owned(), "ADD".to_owned()),
            ("HOME".to_owned(), "/root".to_owned()),
            (CONF_DIR_ENV.to_owned(), "/srv/wa".to_owned()),
        ];
        let req = AgentRequest::new(vars, "{}", None);
        assert_eq!(
            req.env.keys().collect::<Vec<_>>(),
            ["CNI_COMMAND", CONF_DIR_ENV]
        );
        let req = AgentRequest::new([("CNI_COMMAND".to_owned(), "ADD".to_owned())], "{}", None);
        let text = serde_json::to_string(&req).unwrap();
        assert_eq!(
            text,
            r#"{"env":{"CNI_COMMAND":"ADD"},"stdin":"{}","flatFile":null}"#
        );
        assert_eq!(serde_json::from_str::<AgentRequest>(&text).unwrap(), req);
        let reply = serde_json::to_string(&AgentReply::Direct { reason: "x".into() }).unwrap();
        assert_eq!(reply, r#"{"direct":{"reason":"x"}}"#);
    }

    /// A number of the flat file reaches the agent as the plugin read it: an integer too large
    /// for u64 is a float, which changed in its last digit on the wire (fuzz/agent_request).
    #[test]
    fn numbers_survive_the_wire() {
        let conf: Map<String, Value> =
            serde_json::from_str(r#"{"kuberna": 55550555001362967828, "x": 0.1}"#).unwrap();
        let req = AgentRequest::new([], "{}", Some(("/f".into(), conf)));
        let text = serde_json::to_string(&req).unwrap();
        assert_eq!(serde_json::from_str::<AgentRequest>(&text).unwrap(), req);
    }

    #[test]
    fn unknown_fields_are_refused() {
        let bad = r#"{"env":{},"stdin":"","flatFile":null,"extra":1}"#;
        let e = serde_json::from_str::<AgentRequest>(bad).unwrap_err();
        assert!(e.to_string().contains("unknown field `extra`"), "{e}");
    }
}
