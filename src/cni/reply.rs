//! What the plugin prints on stdout after a successful command: typed replies, serialised in the
//! shape the config's `cniVersion` asks for.

use std::net::IpAddr;

use ipnet::IpNet;
use serde::Serialize;
use serde_json::{Value, json};

use super::protocol::{CniError, Code};
use crate::config::netconf::{SUPPORTED_VERSIONS, one_address_per_family};
use crate::ipam::Family;

/// A successful command's output. Fields are declared in the order JSON objects print their keys
/// (sorted), so the text is the same as the untyped objects this replaced.
#[derive(Debug, Clone, PartialEq, Serialize)]
#[serde(untagged)]
pub enum Reply {
    /// ADD's result, 0.3.0 and later.
    Ips(IpsResult),
    /// ADD's result, 0.1.0 and 0.2.0.
    PerFamily(PerFamilyResult),
    /// VERSION's answer.
    Version(VersionInfo),
}

impl Reply {
    /// The reply as a JSON value (what the node agent forwards to the plugin).
    pub fn to_value(&self) -> Value {
        serde_json::to_value(self).expect("replies serialise")
    }
}

impl std::fmt::Display for Reply {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&serde_json::to_string(self).expect("replies serialise"))
    }
}

#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct IpsResult {
    #[serde(rename = "cniVersion")]
    pub cni_version: String,
    pub dns: Value,
    pub ips: Vec<IpEntry>,
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub routes: Vec<Value>,
}

#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct IpEntry {
    pub address: IpNet,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub gateway: Option<IpAddr>,
    /// `"4"` or `"6"`, in 0.3.x and 0.4.0 results only.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub version: Option<&'static str>,
}

#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct PerFamilyResult {
    #[serde(rename = "cniVersion")]
    pub cni_version: String,
    pub dns: Value,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub ip4: Option<FamilyEntry>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub ip6: Option<FamilyEntry>,
}

#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct FamilyEntry {
    #[serde(skip_serializing_if = "Option::is_none")]
    pub gateway: Option<IpAddr>,
    pub ip: IpNet,
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub routes: Vec<Value>,
}

#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct VersionInfo {
    #[serde(rename = "cniVersion")]
    pub cni_version: &'static str,
    #[serde(rename = "supportedVersions")]
    pub supported_versions: &'static [&'static str],
}

/// VERSION's answer: the versions we answer in, upstream's list.
pub fn version_reply() -> Reply {
    Reply::Version(VersionInfo {
        cni_version: "1.1.0",
        supported_versions: SUPPORTED_VERSIONS,
    })
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
) -> Result<Reply, CniError> {
    let dns = dns.cloned().unwrap_or_else(|| json!({}));
    if one_address_per_family(cni_version) {
        return render_per_family(cni_version, ips, routes, dns).map(Reply::PerFamily);
    }
    let legacy = cni_version.starts_with("0.");
    let ips = ips
        .iter()
        .map(|ip| IpEntry {
            address: ip.address,
            gateway: ip.gateway,
            version: legacy.then(|| Family::of(ip.address.addr()).version_str()),
        })
        .collect();
    Ok(Reply::Ips(IpsResult {
        cni_version: cni_version.to_owned(),
        dns,
        ips,
        routes: routes.to_vec(),
    }))
}

/// The 0.1.0/0.2.0 shape. Loading refuses a config or CNI_ARGS `IP=` that would give two
/// addresses of one family; refusing it here too keeps a result from silently dropping one.
fn render_per_family(
    cni_version: &str,
    ips: &[IpResult],
    routes: &[Value],
    dns: Value,
) -> Result<PerFamilyResult, CniError> {
    let entry = |family: Family| -> Result<Option<FamilyEntry>, CniError> {
        let mine: Vec<&IpResult> = ips
            .iter()
            .filter(|ip| Family::of(ip.address.addr()) == family)
            .collect();
        let ip = match mine.as_slice() {
            [] => return Ok(None),
            [ip] => ip,
            _ => return Err(two_of_a_family(cni_version, family, &mine)),
        };
        let routes = routes
            .iter()
            .filter(|r| route_family(r) == Some(family))
            .cloned()
            .collect();
        Ok(Some(FamilyEntry {
            gateway: ip.gateway,
            ip: ip.address,
            routes,
        }))
    };
    Ok(PerFamilyResult {
        cni_version: cni_version.to_owned(),
        dns,
        ip4: entry(Family::V4)?,
        ip6: entry(Family::V6)?,
    })
}

fn two_of_a_family(cni_version: &str, family: Family, mine: &[&IpResult]) -> CniError {
    let list: Vec<String> = mine.iter().map(|ip| ip.address.to_string()).collect();
    CniError::new(
        Code::InvalidConfig,
        format!(
            "cniVersion {cni_version:?} results hold one {} address, this ADD has {} ({}): use cniVersion 0.3.0 or later",
            family.name(),
            mine.len(),
            list.join(", ")
        ),
    )
}

/// The family of a route's `dst` (validated to parse when the config was read).
fn route_family(route: &Value) -> Option<Family> {
    let dst: IpNet = route.get("dst")?.as_str()?.parse().ok()?;
    Some(Family::of(dst.addr()))
}

#[cfg(test)]
mod tests {
    use super::*;

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
        let render = |v: &str, ips: &[IpResult], routes: &[Value]| {
            render_result(v, ips, routes, None).map(|r| r.to_value())
        };
        let old = render("0.3.1", &ips, &[]).unwrap();
        assert_eq!(old["ips"][0]["version"], "4");
        assert_eq!(old["ips"][1]["version"], "6");
        let routes = [
            json!({"dst": "0.0.0.0/0"}),
            json!({"dst": "::/0", "gw": "2001::1"}),
        ];
        let new = render("1.0.0", &ips, &routes).unwrap();
        assert!(new["ips"][0].get("version").is_none());
        assert_eq!(new["ips"][0]["gateway"], "10.0.0.1");
        assert_eq!(new["routes"][0]["dst"], "0.0.0.0/0");
        // 0.1.0 and 0.2.0: one object per family, each with its own routes.
        for v in ["0.1.0", "0.2.0"] {
            let r = render(v, &ips, &routes).unwrap();
            assert_eq!(
                r,
                json!({"cniVersion": v,
                       "ip4": {"ip": "10.0.0.5/24", "gateway": "10.0.0.1", "routes": [{"dst": "0.0.0.0/0"}]},
                       "ip6": {"ip": "2001::5/64", "routes": [{"dst": "::/0", "gw": "2001::1"}]},
                       "dns": {}})
            );
        }
        let v4_only = render("0.2.0", &ips[..1], &[]).unwrap();
        assert!(v4_only.get("ip6").is_none() && v4_only.get("ips").is_none());
        let two_v4 = [
            ips[0].clone(),
            IpResult {
                address: "10.0.0.6/24".parse().unwrap(),
                gateway: None,
            },
        ];
        let e = render_result("0.2.0", &two_v4, &[], None).unwrap_err();
        assert_eq!(e.code, Code::InvalidConfig);
        assert!(
            e.msg
                .contains("one IPv4 address, this ADD has 2 (10.0.0.5/24, 10.0.0.6/24)"),
            "{}",
            e.msg
        );
    }

    /// The typed replies print exactly what the untyped objects they replaced printed.
    #[test]
    fn replies_print_as_before() {
        let ips = [IpResult {
            address: "10.0.0.5/24".parse().unwrap(),
            gateway: Some("10.0.0.1".parse().unwrap()),
        }];
        let r = render_result("0.4.0", &ips, &[json!({"dst": "0.0.0.0/0"})], None).unwrap();
        assert_eq!(
            r.to_string(),
            r#"{"cniVersion":"0.4.0","dns":{},"ips":[{"address":"10.0.0.5/24","gateway":"10.0.0.1","version":"4"}],"routes":[{"dst":"0.0.0.0/0"}]}"#
        );
        assert_eq!(
            version_reply().to_string(),
            r#"{"cniVersion":"1.1.0","supportedVersions":["0.1.0","0.2.0","0.3.0","0.3.1","0.4.0","1.0.0","1.1.0"]}"#
        );
    }
}
