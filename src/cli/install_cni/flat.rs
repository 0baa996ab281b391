//! The flat file the installer writes: its own keys merged into what the node already has.

use super::InstallCniArgs;

/// The flat file: points the plugin at the kubeconfig by its host path. The installer owns
/// `kubernetes.kubeconfig`, and `log_level` when --log-level is set; every other key of the
/// `current` file (an admin's `log_level`, `plugin_slots`, `agent_socket`, upstream's
/// `reconciler_cron_expression`, ...) is kept as it is. A current file that is not a JSON object
/// is an error naming what is wrong: overwriting it would lose what the admin wrote.
pub fn flat_file(args: &InstallCniArgs, current: Option<&[u8]>) -> anyhow::Result<String> {
    let mut flat = match current {
        None => serde_json::Map::new(),
        Some(bytes) => match serde_json::from_slice::<serde_json::Value>(bytes) {
            Ok(serde_json::Value::Object(map)) => map,
            Ok(other) => anyhow::bail!(
                "the flat file is not a JSON object but {}; fix or remove it, and the installer writes its keys into it",
                kind_of(&other)
            ),
            Err(e) => anyhow::bail!(
                "the flat file is not valid JSON ({e}); fix or remove it, and the installer writes its keys into it"
            ),
        },
    };
    let kubernetes = flat
        .entry("kubernetes")
        .or_insert_with(|| serde_json::json!({}));
    if !kubernetes.is_object() {
        *kubernetes = serde_json::json!({});
    }
    kubernetes["kubeconfig"] = args
        .host_kubeconfig_path()
        .to_string_lossy()
        .as_ref()
        .into();
    if let Some(level) = &args.log_level {
        flat.insert("log_level".into(), level.as_str().into());
    }
    Ok(format!("{}\n", serde_json::Value::Object(flat)))
}

/// The flat file `current` without the installer's keys (an uninstall): `None` when nothing
/// else is left, so the file can go. A file that is not a JSON object is kept as it is.
pub fn without_installer_keys(args: &InstallCniArgs, current: &[u8]) -> Option<String> {
    let Ok(serde_json::Value::Object(mut flat)) = serde_json::from_slice(current) else {
        return Some(String::from_utf8_lossy(current).into_owned());
    };
    let ours = args.host_kubeconfig_path();
    if let Some(serde_json::Value::Object(k)) = flat.get_mut("kubernetes") {
        if k.get("kubeconfig").and_then(|v| v.as_str()) == ours.to_str() {
            k.remove("kubeconfig");
        }
        if k.is_empty() {
            flat.remove("kubernetes");
        }
    }
    if args.log_level.is_some()
        && flat.get("log_level").and_then(|v| v.as_str()) == args.log_level.as_deref()
    {
        flat.remove("log_level");
    }
    (!flat.is_empty()).then(|| format!("{}\n", serde_json::Value::Object(flat)))
}

fn kind_of(v: &serde_json::Value) -> &'static str {
    match v {
        serde_json::Value::Null => "null",
        serde_json::Value::Bool(_) => "a boolean",
        serde_json::Value::Number(_) => "a number",
        serde_json::Value::String(_) => "a string",
        serde_json::Value::Array(_) => "a list",
        serde_json::Value::Object(_) => "an object",
    }
}
