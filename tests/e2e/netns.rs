//! Our plugin as the IPAM of Debian's bridge plugin, inside a real network namespace.

use std::process::Command;

use serde_json::json;

use crate::harness::{Cni, CniCall, Ns, whereabouts_bin};

struct NetNs(String);

impl NetNs {
    fn new() -> NetNs {
        let name = format!("wa-e2e-{}", fastrand::u32(..1_000_000));
        let ok = Command::new("ip")
            .args(["netns", "add", &name])
            .status()
            .expect("ip netns (run as root with iproute2)");
        assert!(ok.success(), "ip netns add {name}");
        NetNs(name)
    }
}

impl Drop for NetNs {
    fn drop(&mut self) {
        let _ = Command::new("ip")
            .args(["netns", "delete", &self.0])
            .status();
    }
}

/// ADD through Debian's bridge plugin with our plugin as its IPAM, in a fresh network namespace,
/// with a config of `cni_version` for `ipam`: the bridge plugin's stdout and what `ip addr` shows
/// on the interface. Then DEL, which must succeed and leave `pool` empty.
fn bridge_add_then_del(cni_version: &str, ipam: serde_json::Value, pool: &str) -> (Cni, String) {
    let plugins = std::path::Path::new("/usr/lib/cni");
    assert!(
        plugins.join("bridge").exists(),
        "Debian's containernetworking-plugins must be installed (e2e/install-deps.sh)"
    );
    // CNI_PATH holds the bridge plugin and ours.
    let cni_path = tempfile::tempdir().unwrap();
    std::os::unix::fs::symlink(plugins.join("bridge"), cni_path.path().join("bridge")).unwrap();
    std::os::unix::fs::symlink(whereabouts_bin(), cni_path.path().join("whereabouts")).unwrap();
    let ns = Ns::new("bridge");
    let netns = NetNs::new();
    let bridge = format!("wabt{}", fastrand::u16(..10000));
    let mut conf = ns.netconf(cni_version, ipam);
    conf["bridge"] = json!(bridge);
    let netns_path = format!("/var/run/netns/{}", netns.0);
    let args = format!(
        "IgnoreUnknown=1;K8S_POD_NAMESPACE={};K8S_POD_NAME=p1;K8S_POD_UID=u1",
        ns.name
    );
    let call = |command| CniCall {
        command,
        conf: &conf,
        container: "c1",
        ifname: "net1",
        netns: &netns_path,
        args: &args,
        path: Some(cni_path.path()),
    };
    let add = Cni::from(
        call("ADD")
            .spawn(plugins.join("bridge"))
            .wait_with_output()
            .unwrap(),
    );
    let shown = String::from_utf8(
        Command::new("ip")
            .args(["-n", &netns.0, "addr", "show", "net1"])
            .output()
            .unwrap()
            .stdout,
    )
    .unwrap();
    let del = Cni::from(
        call("DEL")
            .spawn(plugins.join("bridge"))
            .wait_with_output()
            .unwrap(),
    );
    assert!(del.ok, "{del:?}");
    assert!(ns.allocations(pool).is_empty());
    let _ = Command::new("ip")
        .args(["link", "delete", &bridge])
        .status();
    (add, shown)
}

#[test]
fn bridge_plugin_puts_both_dual_stack_addresses_on_the_interface() {
    let (add, shown) = bridge_add_then_del(
        "1.0.0",
        json!({"ipRanges": [{"range": "10.60.0.0/24", "range_start": "10.60.0.10"}, {"range": "fd00:60::/64", "range_start": "fd00:60::10"}]}),
        "10.60.0.0-24",
    );
    assert_eq!(add.addresses(), ["10.60.0.10/24", "fd00:60::10/64"]);
    assert!(shown.contains("inet 10.60.0.10/24"), "{shown}");
    assert!(shown.contains("inet6 fd00:60::10/64"), "{shown}");
}

/// A NAD on cniVersion 0.2.0 works with upstream (its VERSION lists it), so it works here: our
/// result has the 0.2.0 shape (`ip4`, `ip6`), which the bridge plugin reads and applies.
#[test]
fn a_0_2_0_config_works_through_the_bridge_plugin() {
    let (add, shown) = bridge_add_then_del(
        "0.2.0",
        json!({"range": "10.61.0.0/24", "range_start": "10.61.0.10", "ipRanges": [{"range": "fd00:61::/64", "range_start": "fd00:61::10"}]}),
        "10.61.0.0-24",
    );
    assert!(add.ok, "{add:?}");
    assert_eq!(add.stdout["cniVersion"], "0.2.0", "{:?}", add.stdout);
    assert_eq!(add.stdout["ip4"]["ip"], "10.61.0.10/24", "{:?}", add.stdout);
    assert_eq!(
        add.stdout["ip6"]["ip"], "fd00:61::10/64",
        "{:?}",
        add.stdout
    );
    assert!(shown.contains("inet 10.61.0.10/24"), "{shown}");
    assert!(shown.contains("inet6 fd00:61::10/64"), "{shown}");
}
