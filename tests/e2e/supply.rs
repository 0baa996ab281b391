//! A verifiable image (issue 27): each platform's image carries the SBOM of its build, and the
//! multi-arch image is signed and verified offline with cosign, a tampered copy failing. The image
//! is that of e2e/multiarch-image.sh (the README's commands, on `make release`'s binaries), built
//! once per test run for these tests and arm64.rs's. No control plane needed.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::OnceLock;

use serde_json::Value;

use crate::harness::repo;

const PLATFORMS: [(&str, &str); 2] = [
    ("amd64", "x86_64-unknown-linux-musl"),
    ("arm64", "aarch64-unknown-linux-musl"),
];

/// The folder of the multi-arch image: `whereabouts-multiarch.tar` and each platform's SBOM
/// beside it. Built on first use; the script has checked that each platform's image holds its
/// binaries and, at /usr/share/doc/whereabouts/sbom.cdx.json, the SBOM beside the archive.
pub fn multiarch_image() -> &'static Path {
    static DIR: OnceLock<PathBuf> = OnceLock::new();
    DIR.get_or_init(|| {
        // Under target/, not a temporary folder: a static is never dropped, so nothing would
        // remove it; the next run starts it afresh.
        let dir = repo().join("target/e2e-multiarch");
        let _ = std::fs::remove_dir_all(&dir);
        let status = Command::new(repo().join("e2e/multiarch-image.sh"))
            .arg(&dir)
            .status()
            .expect("run e2e/multiarch-image.sh");
        assert!(status.success(), "e2e/multiarch-image.sh failed");
        dir
    })
}

/// (name, version) -> checksum of every registry crate in Cargo.lock.
fn cargo_lock() -> BTreeMap<(String, String), String> {
    let text = std::fs::read_to_string(repo().join("Cargo.lock")).unwrap();
    let mut crates = BTreeMap::new();
    for package in text.split("[[package]]").skip(1) {
        let field = |key: &str| {
            package.lines().find_map(|line| {
                let value = line.strip_prefix(key)?.strip_prefix(" = ")?;
                Some(value.trim_matches('"').to_string())
            })
        };
        if let (Some(name), Some(version), Some(checksum)) =
            (field("name"), field("version"), field("checksum"))
        {
            crates.insert((name, version), checksum);
        }
    }
    crates
}

/// The crates compiled for `target` and linked into our binaries, as cargo resolves them:
/// normal dependencies, not dev- or build-dependencies, not what proc macros use on the host.
fn linked_crates(target: &str) -> BTreeSet<(String, String)> {
    let out = Command::new(env!("CARGO"))
        .current_dir(repo())
        .args(["tree", "--locked", "--offline", "--target", target])
        .args([
            "-e",
            "normal,no-proc-macro",
            "--prefix",
            "none",
            "--format",
            "{p}",
        ])
        .output()
        .expect("run cargo tree");
    assert!(out.status.success(), "cargo tree: {out:?}");
    String::from_utf8(out.stdout)
        .unwrap()
        .lines()
        .filter_map(|line| {
            let mut words = line.split_whitespace();
            let name = words.next()?.to_string();
            let version = words.next()?.strip_prefix('v')?.to_string();
            Some((name, version))
        })
        .filter(|(name, _)| name != env!("CARGO_PKG_NAME"))
        .collect()
}

/// The SBOM's components: (name, version) -> SHA-256.
fn components(sbom: &Value) -> BTreeMap<(String, String), String> {
    let text = |v: &Value| v.as_str().unwrap().to_string();
    sbom["components"]
        .as_array()
        .expect("components")
        .iter()
        .map(|c| {
            let sha256 = c["hashes"]
                .as_array()
                .and_then(|h| h.iter().find(|h| h["alg"] == "SHA-256"))
                .map(|h| text(&h["content"]))
                .unwrap_or_default();
            ((text(&c["name"]), text(&c["version"])), sha256)
        })
        .collect()
}

/// The SBOM in each platform's image names every crate linked into that platform's binaries, at
/// Cargo.lock's version and checksum, and nothing Cargo.lock does not hold. (cargo-cyclonedx
/// also names a few crates that Cargo.lock records as optional dependencies no feature turns on,
/// such as rcgen's x509-parser: the SBOM errs on the side of more, never less.)
#[test]
fn each_platforms_image_carries_the_sbom_of_its_build() {
    let dir = multiarch_image();
    let lock = cargo_lock();
    for (arch, target) in PLATFORMS {
        let path = dir.join(format!("whereabouts-multiarch-{arch}.cdx.json"));
        let sbom: Value = serde_json::from_slice(&std::fs::read(&path).unwrap()).unwrap();
        assert_eq!(sbom["bomFormat"], "CycloneDX", "{arch}");
        let ours = &sbom["metadata"]["component"];
        assert_eq!(ours["name"], env!("CARGO_PKG_NAME"), "{arch}");
        assert_eq!(ours["version"], env!("CARGO_PKG_VERSION"), "{arch}");
        let listed = components(&sbom);
        for (krate, sha256) in &listed {
            assert_eq!(
                lock.get(krate),
                Some(sha256),
                "{arch}: {krate:?} is not Cargo.lock's (version or checksum)"
            );
        }
        let linked = linked_crates(target);
        let linked_names: BTreeSet<&str> = linked.iter().map(|(name, _)| name.as_str()).collect();
        let names: BTreeSet<&str> = listed.keys().map(|(name, _)| name.as_str()).collect();
        for name in ["kube", "k8s-openapi", "rustls", "ring", "tokio"] {
            // (In what cargo tree printed too: an empty or misread tree would prove nothing.)
            assert!(linked_names.contains(name), "{arch}: cargo tree: no {name}");
            assert!(names.contains(name), "{arch}: {name} is not in the SBOM");
        }
        let missing: Vec<_> = linked.iter().filter(|k| !listed.contains_key(*k)).collect();
        assert!(missing.is_empty(), "{arch}: not in the SBOM: {missing:?}");
        // Test-only crates and another platform's are not in an image's build.
        for name in ["proptest", "tower-test", "windows-sys"] {
            assert!(!names.contains(name), "{arch}: {name} is in the SBOM");
        }
    }
}

/// e2e/sign-image.sh's round, offline (cosign in a network namespace of its own): a key pair
/// made for this test, the image index signed, the archive verified; then a well-formed copy
/// whose index sends amd64 nodes to the arm64 image, a copy with one byte of a layer changed,
/// and the image against another key are each rejected.
#[test]
fn the_signed_image_verifies_and_tampered_copies_do_not() {
    let archive = multiarch_image().join("whereabouts-multiarch.tar");
    let out = Command::new(repo().join("e2e/sign-image.sh"))
        .arg("check")
        .arg(&archive)
        .env("COSIGN_PASSWORD", "e2e-only")
        .output()
        .expect("run e2e/sign-image.sh");
    let log = String::from_utf8_lossy(&out.stderr);
    assert!(
        out.status.success(),
        "e2e/sign-image.sh check failed:\n{log}"
    );
    assert!(log.contains("ok: the signed image verifies"), "{log}");
    assert_eq!(log.matches(": rejected").count(), 3, "{log}");
    assert!(log.contains("NOT verified"), "{log}");
}
