//! The linux/arm64 binaries of `make release` (target/image/arm64/, issue 27), run on this x86_64
//! machine under qemu-user as an arm64 node would run them: the plugin answers VERSION and runs a
//! real ADD, CHECK and DEL against the API server, and the operator validates NADs. qemu is
//! called directly (a one-line wrapper for the plugin, as a runtime execs it), so nothing depends
//! on the machine's binfmt registrations. And both platforms' binaries make the multi-arch image
//! the README describes (e2e/multiarch-image.sh). e2e/run-tests.sh builds the binaries.

use std::path::{Path, PathBuf};
use std::process::Command;

use serde_json::{Value, json};

use crate::harness::{Cni, CniCall, Ns, repo};
use crate::supply::multiarch_image;

const QEMU: &str = "/usr/bin/qemu-aarch64-static";

/// An arm64 release binary, checked to be one (ELF machine AArch64).
fn arm64(name: &str) -> PathBuf {
    use std::io::Read as _;
    let bin = repo().join("target/image/arm64").join(name);
    let mut header = [0u8; 20];
    std::fs::File::open(&bin)
        .and_then(|mut f| f.read_exact(&mut header))
        .unwrap_or_else(|e| {
            panic!(
                "{}: {e} (make release, or e2e/run-tests.sh, builds it)",
                bin.display()
            )
        });
    assert!(
        header.starts_with(b"\x7fELF") && header[18..20] == 0xb7u16.to_le_bytes(),
        "{} is not an AArch64 ELF",
        bin.display()
    );
    assert!(
        Path::new(QEMU).exists(),
        "{QEMU} missing (e2e/install-deps.sh installs qemu-user-static)"
    );
    bin
}

/// What a runtime on an arm64 node execs as the plugin, here through qemu.
fn plugin(dir: &Path) -> PathBuf {
    use std::os::unix::fs::PermissionsExt as _;
    let wrapper = dir.join("whereabouts-arm64");
    let script = format!(
        "#!/bin/sh\nexec {QEMU} {} \"$@\"\n",
        arm64("whereabouts").display()
    );
    std::fs::write(&wrapper, script).unwrap();
    std::fs::set_permissions(&wrapper, std::fs::Permissions::from_mode(0o755)).unwrap();
    wrapper
}

/// `command` of the arm64 `plugin` (its wrapper) for pod vm0 of `ns`.
fn run(plugin: &Path, ns: &Ns, command: &str, conf: &Value) -> Cni {
    let args = format!(
        "IgnoreUnknown=1;K8S_POD_NAMESPACE={};K8S_POD_NAME=vm0;K8S_POD_UID=uid-vm0",
        ns.name
    );
    let call = CniCall {
        command,
        conf,
        container: "c-arm64",
        ifname: "net1",
        netns: "/var/run/netns/none",
        args: &args,
        path: None,
    };
    Cni::from(call.spawn(plugin.to_path_buf()).wait_with_output().unwrap())
}

#[test]
fn the_arm64_plugin_allocates_checks_and_releases_under_emulation() {
    let ns = Ns::new("arm64");
    let plugin = plugin(ns.dir.path());
    let run = |command: &str, conf: &Value| run(&plugin, &ns, command, conf);
    let version = run("VERSION", &json!({"cniVersion": "1.0.0"}));
    assert!(version.ok, "{version:?}");
    assert!(
        version.stdout["supportedVersions"]
            .as_array()
            .is_some_and(|v| v.contains(&json!("1.1.0"))),
        "{version:?}"
    );

    let conf = ns.netconf("1.0.0", json!({"range": "10.93.0.0/24"}));
    let add = run("ADD", &conf);
    assert_eq!(add.addresses(), ["10.93.0.1/24"], "{add:?}");
    let entries = ns.allocations("10.93.0.0-24");
    let entry = &entries["1"];
    assert_eq!(entry["podref"], format!("{}/vm0", ns.name).as_str());
    assert_eq!(entry["id"], "c-arm64");

    let mut check = conf.clone();
    check["prevResult"] = add.stdout.clone();
    let checked = run("CHECK", &check);
    assert!(checked.ok, "{checked:?}");

    let del = run("DEL", &conf);
    assert!(del.ok, "{del:?}");
    assert!(ns.allocations("10.93.0.0-24").is_empty());
    // A CHECK of what was released now fails, as on any node.
    assert!(!run("CHECK", &check).ok);
}

#[test]
fn the_arm64_operator_validates_nads_under_emulation() {
    let ns = Ns::new("arm64-validate");
    let nad = |name: &str, ipam: Value| {
        let config = json!({"cniVersion": "1.0.0", "name": name, "type": "macvlan", "ipam": ipam});
        json!({"apiVersion": "k8s.cni.cncf.io/v1", "kind": "NetworkAttachmentDefinition",
            "metadata": {"name": name, "namespace": "default"}, "spec": {"config": config.to_string()}})
    };
    let good = ns.dir.path().join("good.json");
    let bad = ns.dir.path().join("bad.json");
    let ipam = |range_start: &str| json!({"type": "whereabouts", "range": "10.93.1.0/24", "range_start": range_start});
    std::fs::write(&good, nad("good", ipam("10.93.1.10")).to_string()).unwrap();
    std::fs::write(&bad, nad("bad", ipam("10.99.0.1")).to_string()).unwrap();
    let validate = |file: &Path| {
        Command::new(QEMU)
            .arg(arm64("whereabouts-operator"))
            .arg("validate")
            .arg(file)
            .output()
            .expect("run the arm64 operator")
    };
    let out = validate(&good);
    assert!(out.status.success(), "{out:?}");
    let out = validate(&bad);
    let text = String::from_utf8_lossy(&out.stdout) + String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{text}");
    assert!(
        text.contains("range_start") && text.contains("10.99.0.1"),
        "{text}"
    );
}

/// The README's multi-arch commands (e2e/multiarch-image.sh): one image index with linux/amd64
/// and linux/arm64, each image holding the static binaries of its platform, byte for byte
/// `make release`'s (the script reads the archive back and checks it), and its SBOM (supply.rs).
#[test]
fn the_multiarch_image_holds_each_platforms_static_binaries() {
    arm64("whereabouts");
    let dir = multiarch_image();
    assert!(dir.join("whereabouts-multiarch.tar").exists());
}
