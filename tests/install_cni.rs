//! The node installer: file contents, modes, atomic replacement, rewrite only on change, errors
//! that name the flag and the file.

use std::os::unix::fs::PermissionsExt as _;
use std::path::Path;

use base64::Engine as _;
use whereabouts::cli::install_cni::{
    CA_DATA, InstallCniArgs, Report, TEMP_PREFIX, install_once, remove_host_files,
    remove_stale_temps, write_atomic,
};

const CA: &str = "-----BEGIN CERTIFICATE-----\nMIIBfake\n-----END CERTIFICATE-----\n";

struct Fixture {
    dir: tempfile::TempDir,
    args: InstallCniArgs,
}

/// A plugin the installer accepts: this machine's ELF header (this test's own), then `tag`.
fn fake_plugin(tag: &str) -> Vec<u8> {
    let exe = std::fs::read(std::env::current_exe().unwrap()).unwrap();
    [&exe[..64], tag.as_bytes()].concat()
}

fn fixture() -> Fixture {
    let dir = tempfile::tempdir().unwrap();
    let sa = dir.path().join("sa");
    std::fs::create_dir_all(&sa).unwrap();
    std::fs::write(sa.join("token"), "token-one\n").unwrap();
    std::fs::write(sa.join("ca.crt"), CA).unwrap();
    std::fs::write(sa.join("namespace"), "kube-system").unwrap();
    let bin = dir.path().join("src-whereabouts");
    std::fs::write(&bin, fake_plugin("fake plugin v1")).unwrap();
    let mut args = InstallCniArgs::defaults();
    args.host_root = dir.path().join("host");
    args.source_binary = Some(bin);
    args.token_file = sa.join("token");
    args.ca_file = sa.join("ca.crt");
    args.namespace_file = sa.join("namespace");
    args.api_server = Some("https://10.96.0.1:443".into());
    args.once = true;
    Fixture { dir, args }
}

fn mode(p: &Path) -> u32 {
    std::fs::metadata(p).unwrap().permissions().mode() & 0o7777
}

fn temps(dir: &Path) -> Vec<String> {
    std::fs::read_dir(dir)
        .unwrap()
        .flatten()
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .filter(|n| n.starts_with(TEMP_PREFIX))
        .collect()
}

#[test]
fn installs_binary_flat_file_and_kubeconfig_with_their_modes() {
    let f = fixture();
    let report = install_once(&f.args).unwrap();
    assert_eq!(
        report,
        Report {
            binary: true,
            flat_file: true,
            kubeconfig: true,
            nodename: false
        }
    );
    let t = f.args.targets();
    let host = f.dir.path().join("host");
    assert_eq!(t.binary, host.join("opt/cni/bin/whereabouts"));
    assert_eq!(
        std::fs::read(&t.binary).unwrap(),
        fake_plugin("fake plugin v1")
    );
    assert_eq!(mode(&t.binary), 0o755);

    let flat: serde_json::Value =
        serde_json::from_slice(&std::fs::read(&t.flat_file).unwrap()).unwrap();
    assert_eq!(
        flat,
        serde_json::json!({"kubernetes": {"kubeconfig": "/etc/cni/net.d/whereabouts.d/whereabouts.kubeconfig"}})
    );
    assert_eq!(mode(&t.flat_file), 0o644);

    assert_eq!(
        t.kubeconfig,
        host.join("etc/cni/net.d/whereabouts.d/whereabouts.kubeconfig")
    );
    assert_eq!(mode(&t.kubeconfig), 0o600);
    let kc: serde_json::Value =
        serde_saphyr::from_slice(&std::fs::read(&t.kubeconfig).unwrap()).unwrap();
    assert_eq!(kc["current-context"], "whereabouts");
    assert_eq!(kc["users"][0]["user"]["token"], "token-one");
    assert_eq!(
        kc["clusters"][0]["cluster"]["server"],
        "https://10.96.0.1:443"
    );
    assert_eq!(
        kc["clusters"][0]["cluster"]["certificate-authority-data"],
        CA_DATA.encode(CA.as_bytes()).as_str()
    );
    assert_eq!(kc["contexts"][0]["context"]["namespace"], "kube-system");

    assert!(temps(t.binary.parent().unwrap()).is_empty());
    assert!(temps(t.kubeconfig.parent().unwrap()).is_empty());
}

#[test]
fn the_kubeconfig_is_one_the_plugin_can_load() {
    let f = fixture();
    install_once(&f.args).unwrap();
    let kc = kube::config::Kubeconfig::read_from(f.args.targets().kubeconfig).unwrap();
    assert_eq!(
        whereabouts::kubeconfig::context_namespace(&kc),
        "kube-system"
    );
}

#[test]
fn rewrites_only_what_changed() {
    let mut f = fixture();
    install_once(&f.args).unwrap();
    let t = f.args.targets();
    let before = std::fs::metadata(&t.binary).unwrap().modified().unwrap();
    assert_eq!(install_once(&f.args).unwrap(), Report::default());

    // Token rotation: only the kubeconfig is rewritten.
    std::fs::write(&f.args.token_file, "token-two").unwrap();
    assert_eq!(
        install_once(&f.args).unwrap(),
        Report {
            kubeconfig: true,
            ..Report::default()
        }
    );
    let kc: serde_json::Value =
        serde_saphyr::from_str(&std::fs::read_to_string(&t.kubeconfig).unwrap()).unwrap();
    assert_eq!(kc["users"][0]["user"]["token"], "token-two", "{kc}");
    assert_eq!(
        std::fs::metadata(&t.binary).unwrap().modified().unwrap(),
        before
    );

    // A mode someone changed on the host is put back.
    std::fs::set_permissions(&t.kubeconfig, std::fs::Permissions::from_mode(0o644)).unwrap();
    assert!(install_once(&f.args).unwrap().kubeconfig);
    assert_eq!(mode(&t.kubeconfig), 0o600);

    // A new plugin version and a log level.
    std::fs::write(
        f.args.source_binary.as_ref().unwrap(),
        fake_plugin("fake plugin v2"),
    )
    .unwrap();
    f.args.log_level = Some("debug".into());
    let r = install_once(&f.args).unwrap();
    assert!(r.binary && r.flat_file && !r.kubeconfig, "{r:?}");
    let flat: serde_json::Value =
        serde_json::from_slice(&std::fs::read(&t.flat_file).unwrap()).unwrap();
    assert_eq!(flat["log_level"], "debug");
}

#[test]
fn pool_namespace_flag_wins_over_the_namespace_file() {
    let mut f = fixture();
    f.args.pool_namespace = Some("pools".into());
    std::fs::remove_file(&f.args.namespace_file).unwrap();
    install_once(&f.args).unwrap();
    let kc = kube::config::Kubeconfig::read_from(f.args.targets().kubeconfig).unwrap();
    assert_eq!(whereabouts::kubeconfig::context_namespace(&kc), "pools");
}

#[test]
fn errors_name_the_flag_and_the_file() {
    let f = fixture();
    for flag in [
        "--token-file",
        "--ca-file",
        "--namespace-file",
        "--source-binary",
    ] {
        let mut args = f.args.clone();
        let missing = f.dir.path().join("missing");
        match flag {
            "--token-file" => args.token_file = missing.clone(),
            "--ca-file" => args.ca_file = missing.clone(),
            "--namespace-file" => args.namespace_file = missing.clone(),
            _ => args.source_binary = Some(missing.clone()),
        }
        let e = format!("{:#}", install_once(&args).unwrap_err());
        assert!(
            e.contains(flag) && e.contains(missing.to_str().unwrap()),
            "{flag}: {e}"
        );
    }
    // Nothing is half-installed when a source is missing: nothing was written at all.
    assert!(!f.args.targets().kubeconfig.exists());

    let mut args = f.args.clone();
    std::fs::write(&args.ca_file, "not a certificate").unwrap();
    let e = format!("{:#}", install_once(&args).unwrap_err());
    assert!(
        e.contains("--ca-file") && e.contains("no PEM certificate"),
        "{e}"
    );

    std::fs::write(&args.ca_file, CA).unwrap();
    std::fs::write(&args.token_file, "\n").unwrap();
    let e = format!("{:#}", install_once(&args).unwrap_err());
    assert!(e.contains("--token-file") && e.contains("is empty"), "{e}");

    args.host_root = f.dir.path().join("sa/token"); // a file, not a directory
    std::fs::write(&args.token_file, "t").unwrap();
    let e = format!("{:#}", install_once(&args).unwrap_err());
    assert!(e.contains("--cni-bin-dir"), "{e}");
}

#[test]
fn atomic_write_replaces_and_leaves_no_temporary_file() {
    let dir = tempfile::tempdir().unwrap();
    let target = dir.path().join("f");
    assert!(write_atomic(&target, b"one", 0o600).unwrap());
    assert!(!write_atomic(&target, b"one", 0o600).unwrap());
    // A reader holding the old file keeps reading the old contents: the file was replaced, not
    // rewritten in place.
    let mut held = std::fs::File::open(&target).unwrap();
    assert!(write_atomic(&target, b"two, longer", 0o644).unwrap());
    let mut old = String::new();
    std::io::Read::read_to_string(&mut held, &mut old).unwrap();
    assert_eq!(old, "one");
    assert_eq!(std::fs::read(&target).unwrap(), b"two, longer");
    assert_eq!(mode(&target), 0o644);
    assert!(temps(dir.path()).is_empty());

    // A failing write (the target is a directory) leaves no temporary file either.
    let sub = dir.path().join("sub");
    std::fs::create_dir_all(sub.join("x")).unwrap();
    assert!(write_atomic(&sub, b"x", 0o644).is_err());
    assert!(temps(dir.path()).is_empty());
}

#[test]
fn concurrent_readers_never_see_a_partial_file() {
    let dir = tempfile::tempdir().unwrap();
    let target = dir.path().join("kubeconfig");
    let a = vec![b'a'; 256 * 1024];
    let b = vec![b'b'; 512 * 1024];
    write_atomic(&target, &a, 0o600).unwrap();
    let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let reader = {
        let (target, stop, a, b) = (target.clone(), stop.clone(), a.clone(), b.clone());
        std::thread::spawn(move || {
            let mut reads = 0;
            while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                let got = std::fs::read(&target).unwrap();
                assert!(got == a || got == b, "partial read of {} bytes", got.len());
                reads += 1;
            }
            reads
        })
    };
    for i in 0..200 {
        write_atomic(&target, if i % 2 == 0 { &b } else { &a }, 0o600).unwrap();
    }
    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    assert!(reader.join().unwrap() > 0);
    assert!(temps(dir.path()).is_empty());
}

#[test]
fn leftover_temporary_files_are_removed() {
    let dir = tempfile::tempdir().unwrap();
    let stale = dir.path().join(format!("{TEMP_PREFIX}whereabouts.1.0"));
    std::fs::write(&stale, b"half a bin").unwrap();
    std::fs::write(dir.path().join("bridge"), b"other plugin").unwrap();
    remove_stale_temps(dir.path());
    assert!(!stale.exists());
    assert!(dir.path().join("bridge").exists());
}

#[test]
fn writes_the_node_name_for_node_slices() {
    let mut f = fixture();
    f.args.node_name = Some("worker-1".into());
    assert!(install_once(&f.args).unwrap().nodename);
    let t = f.args.targets();
    assert!(t.nodename.ends_with("etc/cni/net.d/whereabouts.d/nodename"));
    assert_eq!(std::fs::read_to_string(&t.nodename).unwrap(), "worker-1\n");
    assert!(
        !install_once(&f.args).unwrap().nodename,
        "unchanged: not rewritten"
    );
}

/// The installer writes the keys it owns and leaves an admin's (and upstream's) others alone; a
/// flat file it cannot read as a JSON object is an error that names it, and is left as it was.
#[test]
fn the_installer_keeps_an_admins_flat_file_keys() {
    let mut f = fixture();
    let t = f.args.targets();
    std::fs::create_dir_all(t.flat_file.parent().unwrap()).unwrap();
    let admin = serde_json::json!({
        "datastore": "kubernetes",
        "kubernetes": {"kubeconfig": "/etc/cni/net.d/whereabouts.d/old.kubeconfig", "extra": 1},
        "log_level": "verbose",
        "plugin_slots": 8,
        "reconciler_cron_expression": "30 4 * * *"
    });
    std::fs::write(&t.flat_file, admin.to_string()).unwrap();
    assert!(install_once(&f.args).unwrap().flat_file);
    let read = || -> serde_json::Value {
        serde_json::from_slice(&std::fs::read(&t.flat_file).unwrap()).unwrap()
    };
    let mut want = admin.clone();
    want["kubernetes"]["kubeconfig"] = "/etc/cni/net.d/whereabouts.d/whereabouts.kubeconfig".into();
    assert_eq!(read(), want, "only the kubeconfig path is the installer's");
    assert!(
        !install_once(&f.args).unwrap().flat_file,
        "nothing to change the second time"
    );
    f.args.log_level = Some("debug".into());
    install_once(&f.args).unwrap();
    want["log_level"] = "debug".into();
    assert_eq!(
        read(),
        want,
        "--log-level, when set, is the installer's too"
    );

    for (text, why) in [
        ("{\"log_level\": ", "is not valid JSON"),
        ("[1, 2]", "is not a JSON object but a list"),
    ] {
        std::fs::write(&t.flat_file, text).unwrap();
        let e = format!("{:#}", install_once(&f.args).unwrap_err());
        assert!(e.contains("whereabouts.conf") && e.contains(why), "{e}");
        assert_eq!(
            std::fs::read_to_string(&t.flat_file).unwrap(),
            text,
            "left as it was"
        );
    }
}

/// An uninstall removes what the installer wrote and nothing else: an admin's flat-file keys
/// stay (the file with them), a plugin binary that is not ours (upstream's, copied over it)
/// stays; a second run finds nothing to do.
#[test]
fn an_uninstall_removes_the_installers_files_and_only_those() {
    let f = fixture();
    let t = f.args.targets();
    install_once(&f.args).unwrap();
    std::fs::write(t.nodename.clone(), "n1\n").unwrap();
    let removed = remove_host_files(&f.args).unwrap();
    for path in [&t.binary, &t.kubeconfig, &t.nodename, &t.flat_file] {
        assert!(!path.exists(), "{} left: {removed:?}", path.display());
    }
    assert!(
        !t.flat_file.parent().unwrap().exists(),
        "whereabouts.d removed when empty"
    );
    assert!(remove_host_files(&f.args).unwrap().is_empty());

    install_once(&f.args).unwrap();
    let admin = serde_json::json!({"log_level": "verbose",
        "kubernetes": {"kubeconfig": "/etc/cni/net.d/whereabouts.d/whereabouts.kubeconfig"}});
    std::fs::write(&t.flat_file, admin.to_string()).unwrap();
    std::fs::write(&t.binary, b"\x7fELF upstream's plugin").unwrap();
    remove_host_files(&f.args).unwrap();
    let flat: serde_json::Value =
        serde_json::from_slice(&std::fs::read(&t.flat_file).unwrap()).unwrap();
    assert_eq!(flat, serde_json::json!({"log_level": "verbose"}));
    assert_eq!(
        std::fs::read(&t.binary).unwrap(),
        b"\x7fELF upstream's plugin",
        "a binary that is not ours stays"
    );
    assert!(!t.kubeconfig.exists());
}
