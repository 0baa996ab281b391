//! Keys that name host files: the node's to set, never a network config's.
//!
//! The runtime runs the plugin as root in the host's namespaces, with the network config on stdin,
//! and anyone who may create a NetworkAttachmentDefinition writes that config. A kubeconfig read
//! from a path of their choosing runs its `exec` command as root; a flat file of their choosing
//! names such a kubeconfig; a log file of their choosing is created or appended to as root. So:
//!
//! - `kubernetes.kubeconfig` and `configuration_path` are honoured from the node's flat file as
//!   they are. From a network config only when they name a file inside one of the node's
//!   [`TrustedDirs`] (where the installer writes): refused otherwise, by the validator on the text
//!   alone and by the plugin before it opens anything. On the node the plugin also checks the file
//!   itself ([`check_file`]): no symlink out of the directory, and nobody but root (or the plugin's
//!   own user) could have written it or any directory above it.
//! - `log_file` and `agent_socket` from a network config are ignored (the node's flat file decides
//!   where the plugin logs and which agent it trusts); the validator warns, because upstream's own
//!   example NADs set `log_file` and refusing them would break existing NADs.

use std::path::{Component, Path, PathBuf};

use serde_json::{Map, Value};

use super::flat::WELL_KNOWN_PATHS;
use super::problem::Problem;

/// The node's whereabouts directory when it is not one of the well-known ones (a test node, an
/// unusual layout). It is read from the plugin's environment, which is the runtime's: the node's,
/// never a tenant's. Its `whereabouts.conf` is the flat file looked up first.
pub const CONF_DIR_ENV: &str = "WHEREABOUTS_CONF_DIR";

/// Keys of a network config that the plugin ignores, as only the node may set them.
pub const IGNORED_NODE_KEYS: [&str; 4] = [
    "agent_socket",
    "log_file",
    "plugin_slots",
    "plugin_slots_dir",
];

/// The directories a network config may name files in: the node's whereabouts directories.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TrustedDirs(Vec<PathBuf>);

impl TrustedDirs {
    /// The directories of the well-known flat-file paths, where installers write.
    pub fn well_known() -> Self {
        TrustedDirs(
            WELL_KNOWN_PATHS
                .iter()
                .filter_map(|p| Some(Path::new(p).parent()?.to_path_buf()))
                .collect(),
        )
    }

    /// [`CONF_DIR_ENV`] when it is set to a clean absolute path, then the well-known ones.
    pub fn from_env(env: &dyn Fn(&str) -> Option<String>) -> Self {
        let mut dirs = Self::well_known();
        match env(CONF_DIR_ENV) {
            Some(dir) if is_clean_absolute(&dir) => dirs.0.insert(0, PathBuf::from(dir)),
            Some(dir) if !dir.is_empty() => {
                tracing::warn!(%dir, "{CONF_DIR_ENV} is not a clean absolute path: ignored");
            }
            _ => {}
        }
        dirs
    }

    /// The directory from the environment, if any: its flat file comes first.
    pub fn node_dir(&self) -> Option<&Path> {
        let well_known = Self::well_known();
        self.0
            .first()
            .filter(|d| !well_known.0.contains(d))
            .map(PathBuf::as_path)
    }

    /// The trusted directory that holds `path`, judged on the text alone: a clean absolute path
    /// (no `.`, `..` or empty component) strictly below it.
    pub fn holding(&self, path: &str) -> Option<&Path> {
        if !is_clean_absolute(path) {
            return None;
        }
        let path = Path::new(path);
        self.0
            .iter()
            .find(|d| path.starts_with(d) && path != d.as_path())
            .map(PathBuf::as_path)
    }

    fn listed(&self) -> String {
        let dirs: Vec<String> = self.0.iter().map(|d| d.display().to_string()).collect();
        dirs.join(", ")
    }
}

/// True for `/a/b`: absolute, and written the way [`Path::components`] would write it again (so
/// no `.`, `..`, `//` or trailing `/` can make the text say one place and the kernel another).
pub fn is_clean_absolute(path: &str) -> bool {
    let p = Path::new(path);
    p.is_absolute()
        && p.components()
            .all(|c| matches!(c, Component::RootDir | Component::Normal(_)))
        && p.components().collect::<PathBuf>().as_os_str() == p.as_os_str()
}

/// What a network config's node keys get: errors for the files it may not name, warnings for the
/// keys the plugin ignores. `prefix` is where the ipam object sits (`ipam`, `plugins[1].ipam`).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct NodeKeyProblems {
    pub errors: Vec<Problem>,
    pub warnings: Vec<Problem>,
}

/// The keys that name files, as paths into the ipam object, and what the file is.
const FILE_KEYS: [(&str, &str, &str); 2] = [
    ("kubernetes", "kubeconfig", "the plugin's credentials"),
    ("", "configuration_path", "the node's flat file"),
];

/// The text of a file key (`parent` empty: at the top of the ipam object).
fn file_value<'a>(ipam: &'a Map<String, Value>, parent: &str, key: &str) -> Option<&'a str> {
    let holder = match parent {
        "" => ipam,
        _ => ipam.get(parent)?.as_object()?,
    };
    holder.get(key)?.as_str().filter(|s| !s.is_empty())
}

/// Judges the node keys of an ipam object from a network config (a NAD), on the text alone.
pub fn network_config_problems(
    ipam: &Map<String, Value>,
    prefix: &str,
    dirs: &TrustedDirs,
) -> NodeKeyProblems {
    let mut out = NodeKeyProblems::default();
    for (parent, key, what) in FILE_KEYS {
        let Some(path) = file_value(ipam, parent, key) else {
            continue;
        };
        if dirs.holding(path).is_some() {
            continue;
        }
        let at = [prefix, parent, key]
            .into_iter()
            .filter(|k| !k.is_empty())
            .collect::<Vec<_>>();
        out.errors.push(Problem::with_value(
            at.join("."),
            path,
            format!(
                "names {what}, which are node configuration: a network config may only name a file inside the node's whereabouts directory ({}); set it in the node's flat file instead",
                dirs.listed()
            ),
        ));
    }
    for key in IGNORED_NODE_KEYS {
        if ipam.get(key).is_some_and(|v| !v.is_null()) {
            out.warnings.push(Problem::at(
                format!("{prefix}.{key}"),
                "is node configuration, read from the flat file only: ignored in a network config",
            ));
        }
    }
    out
}

/// The check of the kubeconfig a network config's ipam object names, when the node's directories
/// hold it: its file is checked on disk ([`NamedFile::check`]) before it is read.
pub fn kubeconfig_check(
    ipam: &Map<String, Value>,
    prefix: &str,
    dirs: &TrustedDirs,
) -> Option<NamedFile> {
    let path = file_value(ipam, "kubernetes", "kubeconfig")?;
    Some(NamedFile {
        key: format!("{prefix}.kubernetes.kubeconfig"),
        dir: dirs.holding(path)?.to_path_buf(),
    })
}

/// Removes from a network config's ipam object what the plugin never follows: the ignored node
/// keys, and file keys outside the node's directories (so a DEL, which goes on without them,
/// uses the node's own flat file).
pub fn strip_node_keys(ipam: &mut Map<String, Value>, dirs: &TrustedDirs) {
    for key in IGNORED_NODE_KEYS {
        ipam.remove(key);
    }
    for (parent, key, _) in FILE_KEYS {
        let Some(path) = file_value(ipam, parent, key) else {
            continue;
        };
        if dirs.holding(path).is_some() {
            continue;
        }
        match parent {
            "" => ipam.remove(key),
            _ => ipam
                .get_mut(parent)
                .and_then(Value::as_object_mut)
                .and_then(|o| o.remove(key)),
        };
    }
}

/// A file that a network config named inside one of the node's directories: where the key sits
/// (`ipam.kubernetes.kubeconfig`) and the directory; [`NamedFile::check`] runs before it is read.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NamedFile {
    pub key: String,
    pub dir: PathBuf,
}

impl NamedFile {
    /// [`check_file`], with the problem naming the key and the path.
    pub fn check(&self, path: &Path) -> Result<PathBuf, Problem> {
        check_file(path, &self.dir)
            .map_err(|why| Problem::with_value(&self.key, path.display(), why.to_string()))
    }
}

/// Why a file that a network config names is not read.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum Untrusted {
    #[error("does not exist")]
    Missing,
    #[error("{0}")]
    Refused(String),
}

/// Checks on the node that `path` (which [`TrustedDirs::holding`] placed in `dir`) is a file only
/// root could have put there: it resolves to a regular file inside `dir` (no symlink leads out),
/// and it, every directory down to it and `dir`'s own ancestors belong to root (or to the plugin's
/// own user) and are not writable by group or others (an ancestor may be a sticky directory such
/// as `/tmp`, where nobody can move another's entries). What it returns is the resolved path:
/// read that one, so a symlink swapped in afterwards (which only root could do) does not count.
pub fn check_file(path: &Path, dir: &Path) -> Result<PathBuf, Untrusted> {
    let refused = |why: String| Untrusted::Refused(why);
    let resolve = |p: &Path| {
        std::fs::canonicalize(p).map_err(|e| match e.kind() {
            std::io::ErrorKind::NotFound => Untrusted::Missing,
            _ => refused(format!("cannot be resolved: {e}")),
        })
    };
    let real_dir = resolve(dir)?;
    let real = resolve(path)?;
    if !real.starts_with(&real_dir) || real == real_dir {
        return Err(refused(format!(
            "resolves to {}, outside {}",
            real.display(),
            dir.display()
        )));
    }
    let own = own_uid();
    let meta = std::fs::metadata(&real).map_err(|e| refused(format!("cannot be read: {e}")))?;
    if !meta.is_file() {
        return Err(refused("is not a regular file".into()));
    }
    for p in real.ancestors() {
        let below = p.starts_with(&real_dir);
        owned_safely(p, own, below).map_err(refused)?;
    }
    Ok(real)
}

/// `p` belongs to root or `own` and nobody else may write it (above the trusted directory, a
/// sticky directory is fine: others may add entries there but not replace ours).
fn owned_safely(p: &Path, own: u32, strict: bool) -> Result<(), String> {
    use std::os::unix::fs::MetadataExt as _;
    let meta = std::fs::symlink_metadata(p).map_err(|e| format!("{}: {e}", p.display()))?;
    if meta.uid() != 0 && meta.uid() != own {
        return Err(format!(
            "{} belongs to uid {}, not root: anyone with that uid could have written it",
            p.display(),
            meta.uid()
        ));
    }
    let sticky = meta.mode() & 0o1000 != 0 && meta.is_dir();
    if meta.mode() & 0o022 != 0 && (strict || !sticky) {
        return Err(format!(
            "{} is writable by group or others (mode {:o})",
            p.display(),
            meta.mode() & 0o7777
        ));
    }
    Ok(())
}

/// The plugin's own user: root on a node; whoever runs the tests elsewhere.
pub fn own_uid() -> u32 {
    rustix::process::geteuid().as_raw()
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;
    use std::os::unix::fs::PermissionsExt as _;

    fn dirs(extra: &str) -> TrustedDirs {
        let extra = extra.to_owned();
        TrustedDirs::from_env(&move |k| (k == CONF_DIR_ENV).then(|| extra.clone()))
    }

    #[test]
    fn holding_is_judged_on_clean_text() {
        let d = TrustedDirs::well_known();
        let inside = "/etc/cni/net.d/whereabouts.d/whereabouts.kubeconfig";
        assert_eq!(
            d.holding(inside),
            Some(Path::new("/etc/cni/net.d/whereabouts.d"))
        );
        // OpenShift's, k3s's and MicroK8s's config folders (the chart's and kustomize's layouts).
        for layout in [
            "/etc/kubernetes/cni/net.d",
            "/var/lib/rancher/k3s/agent/etc/cni/net.d",
            "/var/snap/microk8s/current/args/cni-network",
        ] {
            let file = format!("{layout}/whereabouts.d/whereabouts.kubeconfig");
            assert!(d.holding(&file).is_some(), "{file}");
        }
        for outside in [
            "/etc/cni/net.d/whereabouts.d",
            "/etc/cni/net.d/whereabouts.d/",
            "/etc/cni/net.d/whereabouts.d/../../../tmp/k",
            "/etc/cni/net.d/whereabouts.d/./k",
            "/etc/cni/net.d/whereabouts.d//k",
            "/etc/cni/net.d/whereabouts.dx/k",
            "etc/cni/net.d/whereabouts.d/k",
            "/var/lib/kubelet/pods/u/volumes/kubernetes.io~empty-dir/x/k",
            "/tmp/k",
        ] {
            assert_eq!(d.holding(outside), None, "{outside}");
        }
    }

    #[test]
    fn the_environment_adds_one_clean_dir() {
        let d = dirs("/srv/wa");
        assert_eq!(d.node_dir(), Some(Path::new("/srv/wa")));
        assert!(d.holding("/srv/wa/k").is_some());
        for bad in ["srv/wa", "/srv/../wa", "/srv/wa/", ""] {
            let d = dirs(bad);
            assert_eq!(d, TrustedDirs::well_known(), "{bad}");
            assert_eq!(d.node_dir(), None);
        }
    }

    #[test]
    fn a_network_config_may_not_name_files_outside() {
        let ipam = json!({"kubernetes": {"kubeconfig": "/tmp/evil"}, "configuration_path": "/etc/cni/net.d/whereabouts.d/../x.conf",
                          "log_file": "/tmp/w.log", "agent_socket": "/tmp/s"});
        let p = network_config_problems(
            ipam.as_object().unwrap(),
            "ipam",
            &TrustedDirs::well_known(),
        );
        let errors: Vec<String> = p.errors.iter().map(|p| p.to_string()).collect();
        assert_eq!(errors.len(), 2, "{errors:?}");
        assert!(errors[0].starts_with(r#"ipam.kubernetes.kubeconfig "/tmp/evil" names the plugin's credentials, which are node configuration"#), "{}", errors[0]);
        assert!(errors[1].starts_with(r#"ipam.configuration_path "/etc/cni/net.d/whereabouts.d/../x.conf" names the node's flat file"#), "{}", errors[1]);
        let warned: Vec<&str> = p.warnings.iter().map(|w| w.path.as_str()).collect();
        assert_eq!(warned, ["ipam.agent_socket", "ipam.log_file"]);
        let mut stripped = ipam.as_object().unwrap().clone();
        strip_node_keys(&mut stripped, &TrustedDirs::well_known());
        assert_eq!(Value::Object(stripped), json!({"kubernetes": {}}));
        // Upstream's documented NAD, and nothing at all, are fine.
        let ok = json!({"kubernetes": {"kubeconfig": "/etc/cni/net.d/whereabouts.d/whereabouts.kubeconfig"}, "configuration_path": ""});
        assert_eq!(
            network_config_problems(ok.as_object().unwrap(), "ipam", &TrustedDirs::well_known()),
            NodeKeyProblems::default()
        );
    }

    #[test]
    fn files_are_checked_on_disk() {
        let top = tempfile::tempdir().unwrap();
        let dir = top.path().join("whereabouts.d");
        std::fs::create_dir(&dir).unwrap();
        std::fs::set_permissions(&dir, std::fs::Permissions::from_mode(0o755)).unwrap();
        let good = dir.join("k");
        std::fs::write(&good, "x").unwrap();
        std::fs::set_permissions(&good, std::fs::Permissions::from_mode(0o600)).unwrap();
        assert_eq!(
            check_file(&good, &dir).unwrap(),
            std::fs::canonicalize(&good).unwrap()
        );
        assert_eq!(check_file(&dir.join("none"), &dir), Err(Untrusted::Missing));
        // A symlink inside that leads out: refused, naming where it leads.
        let outside = top.path().join("evil");
        std::fs::write(&outside, "x").unwrap();
        std::os::unix::fs::symlink(&outside, dir.join("link")).unwrap();
        let Err(Untrusted::Refused(why)) = check_file(&dir.join("link"), &dir) else {
            panic!()
        };
        assert!(
            why.starts_with("resolves to ") && why.contains("outside"),
            "{why}"
        );
        // A symlink that stays inside is followed.
        std::os::unix::fs::symlink(&good, dir.join("alias")).unwrap();
        assert!(check_file(&dir.join("alias"), &dir).is_ok());
        // Writable by others, or a directory that is: refused.
        std::fs::set_permissions(&good, std::fs::Permissions::from_mode(0o666)).unwrap();
        let Err(Untrusted::Refused(why)) = check_file(&good, &dir) else {
            panic!()
        };
        assert!(
            why.ends_with("is writable by group or others (mode 666)"),
            "{why}"
        );
        std::fs::set_permissions(&good, std::fs::Permissions::from_mode(0o600)).unwrap();
        std::fs::set_permissions(&dir, std::fs::Permissions::from_mode(0o1777)).unwrap();
        assert!(
            check_file(&good, &dir).is_err(),
            "a sticky trusted dir is still writable by all"
        );
        std::fs::set_permissions(&dir, std::fs::Permissions::from_mode(0o755)).unwrap();
        let sub = dir.join("sub");
        std::fs::create_dir(&sub).unwrap();
        std::fs::set_permissions(&sub, std::fs::Permissions::from_mode(0o777)).unwrap();
        std::fs::write(sub.join("k"), "x").unwrap();
        assert!(check_file(&sub.join("k"), &dir).is_err());
        // Not a regular file.
        let Err(Untrusted::Refused(why)) = check_file(&sub, &dir) else {
            panic!()
        };
        assert_eq!(why, "is not a regular file");
    }
}
