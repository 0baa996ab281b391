//! The node's flat file: a bare ipam object that fills what a NAD leaves empty.
//!
//! Looked up at `configuration_path` first, then at the three well-known paths; the first that
//! exists wins and none is required. A non-empty NAD value always wins, objects merge key by key,
//! lists are taken whole, and `enable_overlapping_ranges` comes from the NAD only.

use std::path::{Path, PathBuf};

use serde_json::{Map, Value};

use super::problem::Problem;

/// Upstream's three, then the CNI config folders of k3s and MicroK8s (where the installer writes
/// with the chart's or kustomize's layout for them; OpenShift's is the first).
pub const WELL_KNOWN_PATHS: [&str; 5] = [
    "/etc/kubernetes/cni/net.d/whereabouts.d/whereabouts.conf",
    "/etc/cni/net.d/whereabouts.d/whereabouts.conf",
    "/host/etc/cni/net.d/whereabouts.d/whereabouts.conf",
    "/var/lib/rancher/k3s/agent/etc/cni/net.d/whereabouts.d/whereabouts.conf",
    "/var/snap/microk8s/current/args/cni-network/whereabouts.d/whereabouts.conf",
];

/// Keys the flat file may never supply.
const NAD_ONLY: &[&str] = &["enable_overlapping_ranges"];

/// The flat file's name inside a whereabouts directory.
pub const FILE_NAME: &str = "whereabouts.conf";

/// Where the flat file is looked for: the node's own directory first (see
/// [`super::trust::CONF_DIR_ENV`]), then the well-known paths. A network config's
/// `configuration_path` goes in front once it has passed the trust checks.
pub fn candidates(node_dir: Option<&Path>) -> Vec<PathBuf> {
    node_dir
        .map(|d| d.join(FILE_NAME))
        .into_iter()
        .chain(WELL_KNOWN_PATHS.map(PathBuf::from))
        .collect()
}

/// A flat file found on disk: where, and its ipam object.
pub type FlatFile = (PathBuf, Map<String, Value>);

/// Largest flat file read: it is a few hundred bytes of JSON.
pub const MAX_FLAT_FILE_BYTES: u64 = 1 << 20;

/// Reads the first flat file that exists. A file that exists but cannot be read or parsed is an
/// error: silently ignoring it would lose the kubeconfig and fail later with a vaguer message.
pub fn load(candidates: &[PathBuf]) -> Result<Option<FlatFile>, Problem> {
    for path in candidates {
        match read(path) {
            Ok(text) => return parse(path, &text).map(|m| Some((path.clone(), m))),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => continue,
            Err(e) => {
                return Err(Problem::with_value(
                    "flat file",
                    path.display(),
                    format!("cannot be read: {e}"),
                ));
            }
        }
    }
    Ok(None)
}

/// Reads a regular file of at most [`MAX_FLAT_FILE_BYTES`]. Defence in depth (a network config's
/// `configuration_path` must pass the trust checks before it gets here): `/dev/zero` must not
/// exhaust the node's memory at every ADD, nor a FIFO block it (opening one waits for a writer),
/// so anything but a regular file is refused before it is opened.
fn read(path: &Path) -> std::io::Result<String> {
    use std::io::Read as _;
    let meta = std::fs::metadata(path)?;
    if !meta.is_file() {
        return Err(std::io::Error::other("not a regular file"));
    }
    let mut text = String::new();
    std::fs::File::open(path)?
        .take(MAX_FLAT_FILE_BYTES + 1)
        .read_to_string(&mut text)?;
    if text.len() as u64 > MAX_FLAT_FILE_BYTES {
        return Err(std::io::Error::other(format!(
            "larger than {MAX_FLAT_FILE_BYTES} bytes"
        )));
    }
    Ok(text)
}

fn parse(path: &Path, text: &str) -> Result<Map<String, Value>, Problem> {
    match serde_json::from_str::<Value>(text) {
        Ok(Value::Object(m)) => Ok(m),
        Ok(_) => Err(Problem::with_value(
            "flat file",
            path.display(),
            "must hold a JSON object (a bare ipam config)",
        )),
        Err(e) => Err(Problem::with_value(
            "flat file",
            path.display(),
            format!("is not valid JSON: {e}"),
        )),
    }
}

/// Fills every empty key of `nad` from `flat`.
pub fn merge(nad: &mut Map<String, Value>, flat: &Map<String, Value>) {
    for (key, flat_value) in flat {
        if NAD_ONLY.contains(&key.as_str()) {
            continue;
        }
        match (nad.get_mut(key), flat_value) {
            (Some(Value::Object(ours)), Value::Object(theirs)) => merge(ours, theirs),
            (Some(ours), _) if !is_empty(ours) => {}
            _ => {
                nad.insert(key.clone(), flat_value.clone());
            }
        }
    }
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

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn obj(v: Value) -> Map<String, Value> {
        v.as_object().unwrap().clone()
    }

    #[test]
    fn nad_wins_flat_fills_lists_whole() {
        let mut nad = obj(
            json!({"range": "10.0.0.0/24", "exclude": ["10.0.0.1"], "kubernetes": {"k8s_api_root": "x"}, "log_level": "", "enable_overlapping_ranges": false}),
        );
        let flat = obj(
            json!({"range": "192.168.0.0/16", "exclude": ["10.0.0.2", "10.0.0.3"], "kubernetes": {"kubeconfig": "/k"}, "log_level": "debug", "enable_overlapping_ranges": true, "network_name": "n"}),
        );
        merge(&mut nad, &flat);
        assert_eq!(
            Value::Object(nad),
            json!({"range": "10.0.0.0/24", "exclude": ["10.0.0.1"], "kubernetes": {"k8s_api_root": "x", "kubeconfig": "/k"}, "log_level": "debug", "enable_overlapping_ranges": false, "network_name": "n"})
        );
    }

    #[test]
    fn overlapping_ranges_never_from_flat_file() {
        let mut nad = Map::new();
        merge(&mut nad, &obj(json!({"enable_overlapping_ranges": false})));
        assert!(nad.is_empty());
    }

    #[test]
    fn lookup_order_and_errors() {
        let dir = tempfile::tempdir().unwrap();
        let (a, b) = (dir.path().join("a.conf"), dir.path().join("b.conf"));
        std::fs::write(&b, r#"{"kubernetes":{"kubeconfig":"/b"}}"#).unwrap();
        let found = load(&[a.clone(), b.clone()]).unwrap().unwrap();
        assert_eq!(found.0, b);
        std::fs::write(&a, "not json").unwrap();
        let e = load(&[a.clone(), b]).unwrap_err();
        assert!(e.to_string().contains("is not valid JSON"), "{e}");
        assert!(load(&[dir.path().join("none")]).unwrap().is_none());
        assert_eq!(
            candidates(Some(Path::new("/x")))[0],
            PathBuf::from("/x/whereabouts.conf")
        );
        // Upstream's three first, in upstream's order, then k3s's and MicroK8s's.
        let paths = candidates(None);
        assert_eq!(paths.len(), 5);
        assert_eq!(
            paths[1],
            PathBuf::from("/etc/cni/net.d/whereabouts.d/whereabouts.conf")
        );
        assert!(paths[3].starts_with("/var/lib/rancher/k3s/agent/etc/cni/net.d"));
    }

    /// `configuration_path` is the NAD author's: a device, a FIFO or a huge file is a problem
    /// naming the path, never an endless read or a blocked ADD.
    #[test]
    fn only_bounded_regular_files_are_read() {
        let e = load(&[PathBuf::from("/dev/zero")]).unwrap_err();
        assert_eq!(
            e.to_string(),
            r#"flat file "/dev/zero" cannot be read: not a regular file"#
        );
        let dir = tempfile::tempdir().unwrap();
        let fifo = dir.path().join("fifo");
        let made = std::process::Command::new("mkfifo")
            .arg(&fifo)
            .status()
            .unwrap();
        assert!(made.success());
        let e = load(std::slice::from_ref(&fifo)).unwrap_err();
        assert!(e.to_string().ends_with("not a regular file"), "{e}");
        let big = dir.path().join("big.conf");
        let mut text = format!(
            r#"{{"range": "10.0.0.0/24", "pad": "{}"}}"#,
            " ".repeat(1 << 20)
        );
        std::fs::write(&big, &text).unwrap();
        let e = load(std::slice::from_ref(&big)).unwrap_err();
        assert!(e.to_string().ends_with("larger than 1048576 bytes"), "{e}");
        text.truncate(1000);
        text.push_str(r#""}"#);
        std::fs::write(&big, &text).unwrap();
        assert!(load(&[big]).unwrap().is_some());
    }
}
