//! Finding the whereabouts `ipam` objects in a network configuration.
//!
//! A configuration is either one plugin config (`{"type": "macvlan", "ipam": {...}}`) or a conflist
//! (`{"plugins": [...]}`) whose whereabouts block may sit in any plugin. The CNI plugin receives the
//! whole configuration on stdin; a NAD carries it as the JSON string `spec.config`.

use serde_json::Value;

use super::problem::Problem;

pub const IPAM_TYPE: &str = "whereabouts";

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
        Ok(NetConf {
            cni_version: text_of("cniVersion"),
            name: text_of("name"),
            value,
        })
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
    fn bad_json_names_the_path() {
        let e = NetConf::parse("{nope", "spec.config").unwrap_err();
        assert!(
            e.to_string().starts_with("spec.config is not valid JSON"),
            "{e}"
        );
        assert!(NetConf::parse("[1]", "spec.config").is_err());
    }
}
