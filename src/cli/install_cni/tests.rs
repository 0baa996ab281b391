use super::*;

#[test]
fn base64_vectors() {
    for (plain, encoded) in [
        ("", ""),
        ("f", "Zg=="),
        ("fo", "Zm8="),
        ("foo", "Zm9v"),
        ("foob", "Zm9vYg=="),
        ("fooba", "Zm9vYmE="),
        ("foobar", "Zm9vYmFy"),
    ] {
        assert_eq!(CA_DATA.encode(plain.as_bytes()), encoded, "{plain}");
    }
    assert_eq!(CA_DATA.encode([0xff, 0xfe, 0xfd]), "//79");
}

/// The kubeconfig holds exactly what the hand-written one did (kube's types add no nulls or
/// empty fields kubectl would trip on), under the comment that says who writes it.
#[test]
fn kubeconfig_is_the_standard_one_and_nothing_more() {
    let dir = tempfile::tempdir().unwrap();
    let ca = "-----BEGIN CERTIFICATE-----\nMIIBfake\n-----END CERTIFICATE-----\n";
    std::fs::write(dir.path().join("token"), "tok: en\n").unwrap();
    std::fs::write(dir.path().join("ca.crt"), ca).unwrap();
    let mut args = InstallCniArgs::defaults();
    args.token_file = dir.path().join("token");
    args.ca_file = dir.path().join("ca.crt");
    args.api_server = Some("https://[fd00::1]:443".into());
    args.pool_namespace = Some("pools".into());
    let text = kubeconfig(&args).unwrap();
    assert!(
        text.starts_with("# Written by whereabouts-operator install-cni"),
        "{text}"
    );
    assert!(!text.contains("null") && !text.contains("~"), "{text}");
    let parsed: serde_json::Value = serde_saphyr::from_str(&text).unwrap();
    assert_eq!(
        parsed,
        serde_json::json!({
            "apiVersion": "v1",
            "kind": "Config",
            "clusters": [{"name": "whereabouts", "cluster": {
                "server": "https://[fd00::1]:443",
                "certificate-authority-data": CA_DATA.encode(ca),
            }}],
            "users": [{"name": "whereabouts", "user": {"token": "tok: en"}}],
            "contexts": [{"name": "whereabouts", "context": {
                "cluster": "whereabouts", "user": "whereabouts", "namespace": "pools",
            }}],
            "current-context": "whereabouts",
        }),
        "{text}"
    );
}

#[test]
fn targets_are_under_the_host_root() {
    let mut args = InstallCniArgs::defaults();
    args.host_root = "/tmp/h".into();
    let t = args.targets();
    assert_eq!(t.binary, Path::new("/tmp/h/opt/cni/bin/whereabouts"));
    assert_eq!(
        t.flat_file,
        Path::new("/tmp/h/etc/cni/net.d/whereabouts.d/whereabouts.conf")
    );
    assert_eq!(
        args.host_kubeconfig_path(),
        Path::new("/etc/cni/net.d/whereabouts.d/whereabouts.kubeconfig")
    );
}

/// The host folders are clean absolute paths; anything else is refused naming the flag and the
/// value (the chart refuses the same values before anything is applied).
#[test]
fn host_folders_must_be_clean_absolute_paths() {
    #[derive(clap::Parser)]
    struct Cli {
        #[command(flatten)]
        args: InstallCniArgs,
    }
    use clap::Parser as _;
    let ok = Cli::try_parse_from(["i", "--cni-bin-dir=/var/lib/rancher/k3s/data/cni"]).unwrap();
    assert_eq!(
        ok.args.cni_bin_dir,
        Path::new("/var/lib/rancher/k3s/data/cni")
    );
    for (flag, bad) in [
        ("--cni-bin-dir", "opt/cni/bin"),
        ("--cni-conf-dir", "/etc/cni/net.d/"),
        ("--cni-conf-dir", "/etc/../tmp"),
        ("--cni-bin-dir", ""),
    ] {
        let e = Cli::try_parse_from(["i", &format!("{flag}={bad}")])
            .err()
            .unwrap_or_else(|| panic!("{flag}={bad} accepted"))
            .to_string();
        assert!(e.contains(flag) && e.contains(&format!("{bad:?}")), "{e}");
        assert!(e.contains("not a clean absolute path"), "{e}");
    }
}
