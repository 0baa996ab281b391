//! The CNI boundary: environment and stdin in, one JSON reply (or CNI error) out.
//!
//! Everything the runtime hands us is validated here, and every failure becomes a [`CniError`]
//! with a spec error code and a message naming the variable or field and its value.

use std::collections::BTreeMap;
use std::net::IpAddr;

use ipnet::IpNet;
use serde_json::{Value, json};

use crate::ipam::Family;

use crate::config::NetConf;
pub use crate::config::netconf::SUPPORTED_VERSIONS;
use crate::config::netconf::one_address_per_family;

/// Error codes of the CNI specification (and ours from 100 up).
pub mod code {
    pub const INCOMPATIBLE_VERSION: u32 = 1;
    pub const UNSUPPORTED_FIELD: u32 = 2;
    pub const INVALID_ENV: u32 = 4;
    pub const IO_FAILURE: u32 = 5;
    pub const DECODE: u32 = 6;
    pub const INVALID_CONFIG: u32 = 7;
    pub const TRY_AGAIN_LATER: u32 = 11;
    pub const NOT_AVAILABLE: u32 = 50;
    /// No free address is left in a range.
    pub const EXHAUSTED: u32 = 100;
    /// CHECK found the stored state differs from the previous result.
    pub const CHECK_MISMATCH: u32 = 101;
}

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{msg}")]
pub struct CniError {
    pub code: u32,
    pub msg: String,
    pub details: String,
}

impl CniError {
    pub fn new(code: u32, msg: impl Into<String>) -> Self {
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
        let version = if cni_version.is_empty() {
            "1.1.0"
        } else {
            cni_version
        };
        let mut v = json!({"cniVersion": version, "code": self.code, "msg": self.msg});
        if !self.details.is_empty() {
            v["details"] = json!(self.details);
        }
        v
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
                    code::INVALID_ENV,
                    format!(
                        "CNI_COMMAND {other:?} is not one of ADD, DEL, CHECK, VERSION, STATUS, GC"
                    ),
                ));
            }
        })
    }
}

pub use crate::alloc::Attachment;

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
        let bad = |msg: String| CniError::new(code::INVALID_ENV, msg);
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

/// One address of a result.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct IpResult {
    pub address: IpNet,
    pub gateway: Option<IpAddr>,
}

/// Renders an ADD result in the configuration's version: 0.3.x and 0.4.0 carry `version` per IP,
/// 1.x does not; 0.1.0 and 0.2.0 have one `ip4` and one `ip6` object, each with its routes.
pub fn render_result(
    cni_version: &str,
    ips: &[IpResult],
    routes: &[Value],
    dns: Option<&Value>,
) -> Result<Value, CniError> {
    let mut result = if one_address_per_family(cni_version) {
        render_ip4_ip6(cni_version, ips, routes)?
    } else {
        render_ips(cni_version, ips, routes)
    };
    result["dns"] = dns.cloned().unwrap_or_else(|| json!({}));
    Ok(result)
}

fn render_ips(cni_version: &str, ips: &[IpResult], routes: &[Value]) -> Value {
    let legacy = cni_version.starts_with("0.");
    let ips: Vec<Value> = ips
        .iter()
        .map(|ip| {
            let mut v = json!({"address": ip.address.to_string()});
            if let Some(gw) = ip.gateway {
                v["gateway"] = json!(gw.to_string());
            }
            if legacy {
                v["version"] = json!(Family::of(ip.address.addr()).version_str());
            }
            v
        })
        .collect();
    let mut result = json!({"cniVersion": cni_version, "ips": ips});
    if !routes.is_empty() {
        result["routes"] = json!(routes);
    }
    result
}

/// The 0.1.0/0.2.0 shape. `load` refuses a config or CNI_ARGS `IP=` that would give two
/// addresses of one family; refusing it here too keeps a result from silently dropping one.
fn render_ip4_ip6(
    cni_version: &str,
    ips: &[IpResult],
    routes: &[Value],
) -> Result<Value, CniError> {
    let mut result = json!({"cniVersion": cni_version});
    for (family, key) in [(Family::V4, "ip4"), (Family::V6, "ip6")] {
        let mine: Vec<&IpResult> = ips
            .iter()
            .filter(|ip| Family::of(ip.address.addr()) == family)
            .collect();
        let [ip] = mine.as_slice() else {
            if mine.is_empty() {
                continue;
            }
            let list: Vec<String> = mine.iter().map(|ip| ip.address.to_string()).collect();
            return Err(CniError::new(
                code::INVALID_CONFIG,
                format!(
                    "cniVersion {cni_version:?} results hold one {} address, this ADD has {} ({}): use cniVersion 0.3.0 or later",
                    family.name(),
                    mine.len(),
                    list.join(", ")
                ),
            ));
        };
        let mut v = json!({"ip": ip.address.to_string()});
        if let Some(gw) = ip.gateway {
            v["gateway"] = json!(gw.to_string());
        }
        let family_routes: Vec<&Value> = routes
            .iter()
            .filter(|r| route_family(r) == Some(family))
            .collect();
        if !family_routes.is_empty() {
            v["routes"] = json!(family_routes);
        }
        result[key] = v;
    }
    Ok(result)
}

/// The family of a route's `dst` (validated to parse when the config was read).
fn route_family(route: &Value) -> Option<Family> {
    let dst: IpNet = route.get("dst")?.as_str()?.parse().ok()?;
    Some(Family::of(dst.addr()))
}

/// Checks that we can answer in the configuration's version.
pub fn check_version(conf: &NetConf) -> Result<(), CniError> {
    match conf.version_problem() {
        None => Ok(()),
        Some(p) => Err(CniError::new(code::INCOMPATIBLE_VERSION, p.to_string())),
    }
}

pub fn version_reply() -> Value {
    json!({"cniVersion": "1.1.0", "supportedVersions": SUPPORTED_VERSIONS})
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
        assert_eq!(e.code, code::INVALID_ENV);
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

    #[test]
    fn results_follow_the_version() {
        let ips = [
            IpResult {
                address: "10.0.0.5/24".parse().unwrap(),
                gateway: Some("10.0.0.1".parse().unwrap()),
            },
            IpResult {
                address: "2001::5/64".parse().unwrap(),
                gateway: None,
            },
        ];
        let old = render_result("0.3.1", &ips, &[], None).unwrap();
        assert_eq!(old["ips"][0]["version"], "4");
        assert_eq!(old["ips"][1]["version"], "6");
        let routes = [
            json!({"dst": "0.0.0.0/0"}),
            json!({"dst": "::/0", "gw": "2001::1"}),
        ];
        let new = render_result("1.0.0", &ips, &routes, None).unwrap();
        assert!(new["ips"][0].get("version").is_none());
        assert_eq!(new["ips"][0]["gateway"], "10.0.0.1");
        assert_eq!(new["routes"][0]["dst"], "0.0.0.0/0");
        // 0.1.0 and 0.2.0: one object per family, each with its own routes.
        for v in ["0.1.0", "0.2.0"] {
            let r = render_result(v, &ips, &routes, None).unwrap();
            assert_eq!(
                r,
                json!({"cniVersion": v,
                       "ip4": {"ip": "10.0.0.5/24", "gateway": "10.0.0.1", "routes": [{"dst": "0.0.0.0/0"}]},
                       "ip6": {"ip": "2001::5/64", "routes": [{"dst": "::/0", "gw": "2001::1"}]},
                       "dns": {}})
            );
        }
        let v4_only = render_result("0.2.0", &ips[..1], &[], None).unwrap();
        assert!(v4_only.get("ip6").is_none() && v4_only.get("ips").is_none());
        let two_v4 = [
            ips[0].clone(),
            IpResult {
                address: "10.0.0.6/24".parse().unwrap(),
                gateway: None,
            },
        ];
        let e = render_result("0.2.0", &two_v4, &[], None).unwrap_err();
        assert_eq!(e.code, code::INVALID_CONFIG);
        assert!(
            e.msg
                .contains("one IPv4 address, this ADD has 2 (10.0.0.5/24, 10.0.0.6/24)"),
            "{}",
            e.msg
        );
    }

    #[test]
    fn versions() {
        let conf = |v: &str| NetConf::parse(&format!(r#"{{"cniVersion":{v}}}"#), "stdin").unwrap();
        assert!(check_version(&conf(r#""0.4.0""#)).is_ok());
        assert!(check_version(&conf(r#""0.2.0""#)).is_ok());
        let e = check_version(&conf(r#""1.2.3.4""#)).unwrap_err();
        assert_eq!(e.code, code::INCOMPATIBLE_VERSION);
        assert!(
            e.msg
                .starts_with(r#"cniVersion "1.2.3.4" is not supported"#),
            "{}",
            e.msg
        );
        assert!(Command::parse("ADDD").is_err());
    }
}
