//! Finding the whereabouts `ipam` objects in a network configuration.
//!
//! A configuration is either one plugin config (`{"type": "macvlan", "ipam": {...}}`) or a conflist
//! (`{"plugins": [...]}`) whose whereabouts block may sit in any plugin. The CNI plugin receives the
//! whole configuration on stdin; a NAD carries it as the JSON string `spec.config`.

use serde_json::Value;

use super::problem::Problem;

pub const IPAM_TYPE: &str = "whereabouts";

/// The CNI versions the plugin answers in, as its VERSION reply lists them: upstream's list, so a
/// NAD written for upstream on any of them keeps working.
pub const SUPPORTED_VERSIONS: &[&str] = &[
    "0.1.0", "0.2.0", "0.3.0", "0.3.1", "0.4.0", "1.0.0", "1.1.0",
];

/// The version of a config that names none: libcni's `DecodeVersion` (which upstream's plugin
/// uses) reads a missing, null or empty `cniVersion` as 0.1.0, so a NAD without one works there.
pub const VERSION_WHEN_MISSING: &str = "0.1.0";

/// Results of these versions have one `ip4` and one `ip6` object: one address per family at most.
pub fn one_address_per_family(cni_version: &str) -> bool {
    matches!(cni_version, "0.1.0" | "0.2.0")
}

/// The parts of a network configuration the plugin and the operator need.
#[derive(Debug, Clone)]
pub struct NetConf {
    pub value: Value,
    pub cni_version: String,
    pub name: String,
}

impl NetConf {
    /// Parses JSON text; the problem names `path` (for example `spec.config`) and the parse error.
    pub fn parse(text: &str, path: &str) -> Result<NetConf, Problem> {
        let value: Value = serde_json::from_str(text)
            .map_err(|e| Problem::at(path, format!("is not valid JSON: {e}")))?;
        if !value.is_object() {
            return Err(Problem::at(
                path,
                "must be a JSON object (a plugin config or a conflist)",
            ));
        }
        let text_of = |key: &str| {
            value
                .get(key)
                .and_then(Value::as_str)
                .unwrap_or_default()
                .to_owned()
        };
        let cni_version = match value.get("cniVersion") {
            // Go reads null as "", as it reads a missing key.
            None | Some(Value::Null) => VERSION_WHEN_MISSING.to_owned(),
            Some(Value::String(v)) if v.is_empty() => VERSION_WHEN_MISSING.to_owned(),
            Some(Value::String(v)) => v.clone(),
            // Not a string: refused by `version_problem`.
            Some(_) => String::new(),
        };
        Ok(NetConf {
            cni_version,
            name: text_of("name"),
            value,
        })
    }

    /// What is wrong with the top-level `cniVersion`, if anything: it must be one of
    /// [`SUPPORTED_VERSIONS`], as a string, or be missing (then [`VERSION_WHEN_MISSING`]). The
    /// plugin refuses such a config at every ADD and the validator refuses the NAD, with this same
    /// problem.
    pub fn version_problem(&self) -> Option<Problem> {
        if SUPPORTED_VERSIONS.contains(&self.cni_version.as_str()) {
            return None;
        }
        let supported = format!("supported: {}", SUPPORTED_VERSIONS.join(", "));
        // `parse` left `cni_version` empty for a value that is not a string.
        Some(match self.value.get("cniVersion") {
            Some(Value::String(v)) => {
                Problem::with_value("cniVersion", v, format!("is not supported; {supported}"))
            }
            other => Problem::with_value(
                "cniVersion",
                other.cloned().unwrap_or_default(),
                format!("must be a string; {supported}"),
            ),
        })
    }

    /// The top-level `allowPersistentIPs` (KubeVirt's switch for IPAMClaims); a value that is not
    /// a boolean is a problem naming it. Only a single-plugin config carries it to the plugin:
    /// libcni hands each plugin of a conflist its own object.
    pub fn allow_persistent_ips(&self) -> Result<bool, Problem> {
        match self.value.get("allowPersistentIPs") {
            None | Some(Value::Null) => Ok(false),
            Some(Value::Bool(b)) => Ok(*b),
            Some(Value::String(s)) => Err(Problem::with_value(
                "allowPersistentIPs",
                s,
                "must be true or false",
            )),
            Some(other) => Err(Problem::with_value(
                "allowPersistentIPs",
                other,
                "must be true or false",
            )),
        }
    }

    /// What is wrong with a conflist's `plugins`, if anything: as soon as the key is there, libcni
    /// (and Multus) read the config as a conflist, which needs a non-empty list of plugin
    /// objects; any other shape cannot be loaded at all. `None` for a single plugin's config.
    /// Only a config that uses whereabouts (see [`NetConf::mentions_whereabouts`]) is ours to
    /// refuse for it.
    pub fn plugins_problem(&self) -> Option<Problem> {
        let plugins = self.value.get("plugins")?;
        let why = "libcni reads a config with a plugins key as a conflist and cannot load this one";
        let Some(list) = plugins.as_array() else {
            return Some(Problem::with_value(
                "plugins",
                plugins,
                format!("must be a list of plugin configs: {why}"),
            ));
        };
        if list.is_empty() {
            return Some(Problem::at("plugins", format!("is empty: {why}")));
        }
        let (i, p) = list.iter().enumerate().find(|(_, p)| !p.is_object())?;
        Some(Problem::with_value(
            format!("plugins[{i}]"),
            p,
            format!("must be a JSON object (a plugin config): {why}"),
        ))
    }

    /// True when any ipam object of the config, at the top or in a plugin, is whereabouts'.
    pub fn mentions_whereabouts(&self) -> bool {
        let top = self.value.get("ipam").is_some_and(is_whereabouts);
        let listed = self
            .value
            .get("plugins")
            .and_then(Value::as_array)
            .is_some_and(|list| {
                list.iter()
                    .any(|p| p.get("ipam").is_some_and(is_whereabouts))
            });
        top || listed
    }

    /// Every whereabouts ipam object, with the path it sits at (`ipam` or `plugins[i].ipam`).
    pub fn whereabouts_ipams(&self) -> Vec<(String, &Value)> {
        match self.value.get("plugins").and_then(Value::as_array) {
            Some(plugins) => plugins
                .iter()
                .enumerate()
                .filter_map(|(i, p)| {
                    p.get("ipam")
                        .filter(|ipam| is_whereabouts(ipam))
                        .map(|ipam| (format!("plugins[{i}].ipam"), ipam))
                })
                .collect(),
            None => self
                .value
                .get("ipam")
                .filter(|ipam| is_whereabouts(ipam))
                .map(|ipam| vec![("ipam".to_owned(), ipam)])
                .unwrap_or_default(),
        }
    }

    /// The ipam object the plugin was called for: the whereabouts one, or the plugin config's own
    /// `ipam` whatever its type (the runtime chose this binary by that type).
    pub fn runtime_ipam(&self) -> Option<(String, &Value)> {
        self.whereabouts_ipams()
            .into_iter()
            .next()
            .or_else(|| self.value.get("ipam").map(|v| ("ipam".to_owned(), v)))
    }
}

fn is_whereabouts(ipam: &Value) -> bool {
    ipam.get("type").and_then(Value::as_str) == Some(IPAM_TYPE)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn finds_ipam_in_single_and_list() {
        let single = NetConf::parse(r#"{"cniVersion":"1.0.0","name":"n","type":"macvlan","ipam":{"type":"whereabouts","range":"10.0.0.0/24"}}"#, "stdin").unwrap();
        assert_eq!(single.whereabouts_ipams()[0].0, "ipam");
        assert_eq!(single.name, "n");
        let list = NetConf::parse(r#"{"cniVersion":"0.4.0","name":"l","plugins":[{"type":"tuning"},{"type":"bridge","ipam":{"type":"whereabouts"}}]}"#, "stdin").unwrap();
        assert_eq!(list.whereabouts_ipams()[0].0, "plugins[1].ipam");
        let other = NetConf::parse(
            r#"{"name":"h","type":"bridge","ipam":{"type":"host-local"}}"#,
            "spec.config",
        )
        .unwrap();
        assert!(other.whereabouts_ipams().is_empty());
    }

    #[test]
    fn versions_are_checked_by_name_and_value() {
        let problem = |v: &str| {
            NetConf::parse(&format!(r#"{{{v}"type":"bridge"}}"#), "stdin")
                .unwrap()
                .version_problem()
                .map(|p| p.to_string())
        };
        for ok in SUPPORTED_VERSIONS {
            assert_eq!(problem(&format!(r#""cniVersion":"{ok}","#)), None);
        }
        let bad = problem(r#""cniVersion":"1.2.3.4","#).unwrap();
        assert!(
            bad.starts_with(r#"cniVersion "1.2.3.4" is not supported; supported: 0.1.0"#),
            "{bad}"
        );
        let bad = problem(r#""cniVersion":-1,"#).unwrap();
        assert!(
            bad.starts_with(r#"cniVersion "-1" must be a string"#),
            "{bad}"
        );
        // Missing or empty: 0.1.0, as libcni reads it.
        for missing in ["", r#""cniVersion":"","#, r#""cniVersion":null,"#] {
            assert_eq!(problem(missing), None);
            let conf =
                NetConf::parse(&format!(r#"{{{missing}"type":"bridge"}}"#), "stdin").unwrap();
            assert_eq!(conf.cni_version, "0.1.0");
        }
    }

    #[test]
    fn conflists_must_hold_plugin_objects() {
        let problem = |c: &str| {
            let conf = NetConf::parse(c, "stdin").unwrap();
            (
                conf.plugins_problem().map(|p| p.to_string()),
                conf.mentions_whereabouts(),
            )
        };
        let wa = r#""ipam":{"type":"whereabouts","range":"10.0.0.0/24"}"#;
        let (p, ours) = problem(&format!(r#"{{{wa},"plugins":[null,{{"type":"tuning"}}]}}"#));
        assert!(
            p.unwrap()
                .starts_with("plugins[0] \"null\" must be a JSON object (a plugin config)")
        );
        assert!(ours);
        let (p, _) = problem(&format!(r#"{{{wa},"plugins":"x"}}"#));
        assert!(
            p.unwrap()
                .starts_with(r#"plugins "\"x\"" must be a list of plugin configs"#)
        );
        let (p, _) = problem(&format!(r#"{{{wa},"plugins":[]}}"#));
        assert!(p.unwrap().starts_with("plugins is empty"));
        let (p, ours) = problem(&format!(r#"{{"plugins":[{{"type":"macvlan",{wa}}}]}}"#));
        assert_eq!(p, None);
        assert!(ours);
        let (p, ours) = problem(r#"{"type":"macvlan","ipam":{"type":"host-local"}}"#);
        assert_eq!(p, None);
        assert!(!ours);
    }

    #[test]
    fn bad_json_names_the_path() {
        let e = NetConf::parse("{nope", "spec.config").unwrap_err();
        assert!(
            e.to_string().starts_with("spec.config is not valid JSON"),
            "{e}"
        );
        assert!(NetConf::parse("[1]", "spec.config").is_err());
    }
}
