//! The layers of docs/architecture.md, checked: every `crate::<module>` a file of `src/` names
//! must be of a lower layer than the file's own module. A new arrow that points up or sideways
//! (the controller reaching into the CNI plugin, the engine into a config type) fails here, with
//! the file and the line.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

/// Each top-level module's layer: a module may use only modules of lower layers. The callers
/// (`cni`, `controller`, `webhook`) share a layer, so none of them uses another; the node agent
/// stands on `cni` because it runs the plugin's commands for it.
const LAYERS: &[(&str, u8)] = &[
    ("ipam", 0),
    ("crd", 0),
    ("retry", 0),
    ("kubeconfig", 0),
    ("metrics", 0),
    ("config", 1),
    ("store", 1),
    ("ownership", 2),
    ("alloc", 3),
    ("nad_check", 3),
    ("admin", 3),
    ("cni", 4),
    ("controller", 4),
    ("webhook", 4),
    ("agent", 5),
    ("cli", 6),
];

fn layer(module: &str) -> Option<u8> {
    LAYERS.iter().find(|(m, _)| *m == module).map(|(_, l)| *l)
}

fn rust_files(dir: &Path, out: &mut Vec<PathBuf>) {
    for entry in std::fs::read_dir(dir).unwrap() {
        let path = entry.unwrap().path();
        if path.is_dir() {
            rust_files(&path, out);
        } else if path.extension().is_some_and(|e| e == "rs") {
            out.push(path);
        }
    }
}

/// The top-level module a file of `src/` belongs to (`None` for `lib.rs` and the binaries).
fn module_of(src: &Path, file: &Path) -> Option<String> {
    let first = file.strip_prefix(src).ok()?.components().next()?;
    let name = first.as_os_str().to_str()?.trim_end_matches(".rs");
    (name != "lib" && name != "bin").then(|| name.to_owned())
}

/// The modules a line of code names as `crate::<module>` (comments left out: a doc link is not a
/// dependency).
fn named_modules(line: &str) -> Vec<String> {
    let code = line.split("//").next().unwrap_or_default();
    code.match_indices("crate::")
        .map(|(i, _)| {
            code[i + "crate::".len()..]
                .chars()
                .take_while(|c| c.is_ascii_alphanumeric() || *c == '_')
                .collect()
        })
        .collect()
}

#[test]
fn every_arrow_points_down() {
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
    let mut files = Vec::new();
    rust_files(&src, &mut files);
    let mut wrong = Vec::new();
    let mut unknown = BTreeMap::new();
    for file in &files {
        let Some(module) = module_of(&src, file) else {
            continue;
        };
        let Some(own) = layer(&module) else {
            unknown.insert(module, file.display().to_string());
            continue;
        };
        let text = std::fs::read_to_string(file).unwrap();
        for (n, line) in text.lines().enumerate() {
            for used in named_modules(line) {
                if used == module {
                    continue;
                }
                match layer(&used) {
                    Some(l) if l < own => {}
                    Some(_) => wrong.push(format!(
                        "{}:{}: {module} uses {used}: {}",
                        file.display(),
                        n + 1,
                        line.trim()
                    )),
                    None => {
                        unknown.insert(used, file.display().to_string());
                    }
                }
            }
        }
    }
    assert!(
        unknown.is_empty(),
        "modules without a layer in LAYERS (add them, and to docs/architecture.md): {unknown:?}"
    );
    assert!(
        wrong.is_empty(),
        "arrows that do not point down:\n{}",
        wrong.join("\n")
    );
}

#[test]
fn the_check_sees_what_it_must() {
    assert_eq!(
        named_modules("use crate::alloc::{Engine, Target}; // crate::cni"),
        ["alloc"]
    );
    assert_eq!(
        named_modules("    let x = crate::store::now_secs() + crate::retry::X;"),
        ["store", "retry"]
    );
    assert!(named_modules("/// [`crate::controller`]").is_empty());
    let src = Path::new("/r/src");
    assert_eq!(
        module_of(src, Path::new("/r/src/alloc/group/mod.rs")).as_deref(),
        Some("alloc")
    );
    assert_eq!(module_of(src, Path::new("/r/src/lib.rs")), None);
    assert!(layer("cni") < layer("agent") && layer("alloc") < layer("cni"));
}
