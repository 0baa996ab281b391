//! The CNI boundary: environment and stdin in, one JSON reply (or CNI error) out.
//!
//! Everything the runtime hands us is validated here, and every failure becomes a [`CniError`]
//! with a spec error [`Code`] and a message naming the variable or field and its value.

use std::collections::BTreeMap;
use std::net::IpAddr;

use ipnet::IpNet;
use serde::Serialize;
use serde_json::Value;

pub use super::reply::version_reply;
use crate::config::NetConf;
pub use crate::config::netconf::SUPPORTED_VERSIONS;

/// Error codes of the CNI specification (and ours from 100 up).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Code {
    IncompatibleVersion,
    UnsupportedField,
    InvalidEnv,
    IoFailure,
    Decode,
    InvalidConfig,
    TryAgainLater,
    NotAvailable,
    /// No free address is left in a range (or the pool's object can hold no more entries).
    Exhausted,
    /// CHECK found the stored state differs from the previous result.
    CheckMismatch,
    /// A requested address (or an IPAMClaim's) is outside the ranges or held by another pod.
    AddressUnavailable,
    /// A code this version does not know, passed on as it came (from a newer node agent).
    Other(u32),
}

impl Code {
    const KNOWN: [Code; 11] = [
        Code::IncompatibleVersion,
        Code::UnsupportedField,
        Code::InvalidEnv,
        Code::IoFailure,
        Code::Decode,
        Code::InvalidConfig,
        Code::TryAgainLater,
        Code::NotAvailable,
        Code::Exhausted,
        Code::CheckMismatch,
        Code::AddressUnavailable,
    ];

    /// The number printed in the error object.
    pub fn number(self) -> u32 {
        match self {
            Code::IncompatibleVersion => 1,
            Code::UnsupportedField => 2,
            Code::InvalidEnv => 4,
            Code::IoFailure => 5,
            Code::Decode => 6,
            Code::InvalidConfig => 7,
            Code::TryAgainLater => 11,
            Code::NotAvailable => 50,
            Code::Exhausted => 100,
            Code::CheckMismatch => 101,
            Code::AddressUnavailable => 102,
            Code::Other(n) => n,
        }
    }

    pub fn from_number(n: u32) -> Code {
        Code::KNOWN
            .into_iter()
            .find(|c| c.number() == n)
            .unwrap_or(Code::Other(n))
    }
}

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{msg}")]
pub struct CniError {
    pub code: Code,
    pub msg: String,
    pub details: String,
}

/// The error object printed on stdout (keys in the order JSON objects print them).
#[derive(Serialize)]
struct ErrorReply<'a> {
    #[serde(rename = "cniVersion")]
    cni_version: &'a str,
    code: u32,
    #[serde(skip_serializing_if = "str::is_empty")]
    details: &'a str,
    msg: &'a str,
}

/// `details` of a datastore error whose credentials the API server rejected (401).
pub const UNAUTHENTICATED: &str = "unauthenticated";

impl CniError {
    /// A datastore failure: worth retrying (code 11), its kind in `details`. A 401 says what to
    /// look at: the node's token is short-lived and bound to the DaemonSet's pod on the node.
    pub fn datastore(e: &crate::store::StoreError) -> Self {
        if !e.is_unauthenticated() {
            return CniError::new(Code::TryAgainLater, format!("datastore: {e}"))
                .with_details(e.kind());
        }
        let hint = " (the API server does not accept the plugin's credentials: the token in its \
                    kubeconfig expired or the pod it was issued to is gone; the whereabouts \
                    DaemonSet's pod on this node renews it while it runs)";
        CniError::new(Code::TryAgainLater, format!("datastore: {e}{hint}"))
            .with_details(UNAUTHENTICATED)
    }

    pub fn new(code: Code, msg: impl Into<String>) -> Self {
        CniError {
            code,
            msg: msg.into(),
            details: String::new(),
        }
    }

    pub fn with_details(mut self, details: impl Into<String>) -> Self {
        self.details = details.into();
        self
    }

    /// The error object printed on stdout.
    pub fn to_json(&self, cni_version: &str) -> Value {
        let cni_version = if cni_version.is_empty() {
            "1.1.0"
        } else {
            cni_version
        };
        let reply = ErrorReply {
            cni_version,
            code: self.code.number(),
            details: &self.details,
            msg: &self.msg,
        };
        serde_json::to_value(reply).expect("errors serialise")
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Command {
    Add,
    Del,
    Check,
    Version,
    Status,
    Gc,
}

impl Command {
    pub fn parse(text: &str) -> Result<Command, CniError> {
        Ok(match text {
            "ADD" => Command::Add,
            "DEL" => Command::Del,
            "CHECK" => Command::Check,
            "VERSION" => Command::Version,
            "STATUS" => Command::Status,
            "GC" => Command::Gc,
            other => {
                return Err(CniError::new(
                    Code::InvalidEnv,
                    format!(
                        "CNI_COMMAND {other:?} is not one of ADD, DEL, CHECK, VERSION, STATUS, GC"
                    ),
                ));
            }
        })
    }
}

pub use crate::alloc::Owner;

/// `CNI_ARGS` (`K=V;K=V`) as whereabouts understands it.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct CniArgs {
    pub pod_name: String,
    pub pod_namespace: String,
    pub pod_uid: String,
    /// Static addresses from `IP=` (comma-separated CIDRs).
    pub ips: Vec<IpNet>,
    /// Gateways from `GATEWAY=` (comma-separated IPs), attached to the static address containing each.
    pub gateways: Vec<IpAddr>,
}

impl CniArgs {
    pub fn parse(text: &str) -> Result<CniArgs, CniError> {
        let bad = |msg: String| CniError::new(Code::InvalidEnv, msg);
        // Ordered by key, so that of two unknown keys the same one is named at every call (a
        // HashMap named either, found by fuzz/agent_request); the last of a repeated key wins.
        let mut pairs = BTreeMap::new();
        for part in text.split(';').filter(|p| !p.is_empty()) {
            let (k, v) = part
                .split_once('=')
                .ok_or_else(|| bad(format!("CNI_ARGS entry {part:?} is not KEY=VALUE")))?;
            pairs.insert(k.to_owned(), v.to_owned());
        }
        let ignore_unknown = pairs
            .get("IgnoreUnknown")
            .is_some_and(|v| v == "1" || v.eq_ignore_ascii_case("true"));
        let mut args = CniArgs::default();
        for (k, v) in &pairs {
            match k.as_str() {
                "K8S_POD_NAME" => args.pod_name = v.clone(),
                "K8S_POD_NAMESPACE" => args.pod_namespace = v.clone(),
                "K8S_POD_UID" => args.pod_uid = v.clone(),
                "K8S_POD_INFRA_CONTAINER_ID" | "IgnoreUnknown" => {}
                "IP" => args.ips = split_parse(v).map_err(|item| bad(format!("CNI_ARGS IP {item:?} is not an address with a prefix length (for example 10.0.0.5/24)")))?,
                "GATEWAY" => args.gateways = split_parse(v).map_err(|item| bad(format!("CNI_ARGS GATEWAY {item:?} is not an IP address")))?,
                other if !ignore_unknown => return Err(bad(format!("CNI_ARGS key {other:?} is not known (set IgnoreUnknown=1 to allow it)"))),
                _ => {}
            }
        }
        Ok(args)
    }

    pub fn podref(&self) -> String {
        if self.pod_name.is_empty() {
            String::new()
        } else {
            format!("{}/{}", self.pod_namespace, self.pod_name)
        }
    }
}

fn split_parse<T: std::str::FromStr>(text: &str) -> Result<Vec<T>, String> {
    text.split(',')
        .map(str::trim)
        .filter(|s| !s.is_empty())
        .map(|s| s.parse().map_err(|_| s.to_owned()))
        .collect()
}

/// Checks that we can answer in the configuration's version.
pub fn check_version(conf: &NetConf) -> Result<(), CniError> {
    match conf.version_problem() {
        None => Ok(()),
        Some(p) => Err(CniError::new(Code::IncompatibleVersion, p.to_string())),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn args_parse_and_reject() {
        let a = CniArgs::parse("IgnoreUnknown=1;K8S_POD_NAMESPACE=ns;K8S_POD_NAME=p;K8S_POD_UID=u;K8S_POD_INFRA_CONTAINER_ID=c;FOO=bar").unwrap();
        assert_eq!(a.podref(), "ns/p");
        assert_eq!(a.pod_uid, "u");
        let e = CniArgs::parse("K8S_POD_NAME=p;FOO=bar").unwrap_err();
        assert_eq!(
            e.msg,
            r#"CNI_ARGS key "FOO" is not known (set IgnoreUnknown=1 to allow it)"#
        );
        assert_eq!(e.code, Code::InvalidEnv);
        assert!(
            CniArgs::parse("garbage")
                .unwrap_err()
                .msg
                .contains("\"garbage\" is not KEY=VALUE")
        );
        let s = CniArgs::parse("IP=10.0.0.5/24,2001::5/64;GATEWAY=10.0.0.1").unwrap();
        assert_eq!(s.ips.len(), 2);
        assert!(
            CniArgs::parse("IP=10.0.0.5")
                .unwrap_err()
                .msg
                .contains("\"10.0.0.5\"")
        );
        assert_eq!(CniArgs::parse("").unwrap(), CniArgs::default());
    }

    /// The same CNI_ARGS give the same error every time: the first unknown key by name.
    #[test]
    fn args_errors_are_deterministic() {
        for _ in 0..20 {
            let e = CniArgs::parse("K8S_POD_NAME=p;ZZZ=1;AAA=2;K8S_POD_NAMESPACE=n").unwrap_err();
            assert_eq!(
                e.msg,
                r#"CNI_ARGS key "AAA" is not known (set IgnoreUnknown=1 to allow it)"#
            );
        }
        let last_wins = CniArgs::parse("K8S_POD_NAME=a;K8S_POD_NAME=b").unwrap();
        assert_eq!(last_wins.pod_name, "b");
    }

    /// The numbers are the CNI specification's (and ours from 100 up), and a number the plugin
    /// does not know (from a newer node agent) is passed on as it came.
    #[test]
    fn codes_keep_their_numbers() {
        let numbers: Vec<u32> = Code::KNOWN.iter().map(|c| c.number()).collect();
        assert_eq!(numbers, [1, 2, 4, 5, 6, 7, 11, 50, 100, 101, 102]);
        for c in Code::KNOWN {
            assert_eq!(Code::from_number(c.number()), c);
        }
        assert_eq!(Code::from_number(999), Code::Other(999));
        let e = CniError::new(Code::Exhausted, "full").with_details("d");
        assert_eq!(
            e.to_json("").to_string(),
            r#"{"cniVersion":"1.1.0","code":100,"details":"d","msg":"full"}"#
        );
    }

    #[test]
    fn versions() {
        let conf = |v: &str| NetConf::parse(&format!(r#"{{"cniVersion":{v}}}"#), "stdin").unwrap();
        assert!(check_version(&conf(r#""0.4.0""#)).is_ok());
        assert!(check_version(&conf(r#""0.2.0""#)).is_ok());
        let e = check_version(&conf(r#""1.2.3.4""#)).unwrap_err();
        assert_eq!(e.code, Code::IncompatibleVersion);
        assert!(
            e.msg
                .starts_with(r#"cniVersion "1.2.3.4" is not supported"#),
            "{}",
            e.msg
        );
        assert!(Command::parse("ADDD").is_err());
    }
}
