//! The CNI plugin against the real API server.

use std::collections::{BTreeMap, BTreeSet};
use std::time::Duration;

use serde_json::json;

use crate::harness::{Cni, Ns};

fn design_ipranges() -> serde_json::Value {
    json!([{"range": "10.10.10.10/24", "range_start": "10.10.10.20", "range_end": "10.10.10.200"},
           {"range": "11.11.11.11/24", "range_start": "11.11.11.20", "range_end": "11.11.11.200"}])
}

#[test]
fn design_discussion_configs_give_the_expected_addresses_in_order() {
    let ns = Ns::new("design");
    let multi = ns.netconf("0.3.1", json!({"ipRanges": design_ipranges()}));
    let r = ns.cni("ADD", &multi, "c1", "net1", "pod1", "u1");
    assert_eq!(r.addresses(), ["10.10.10.20/24", "11.11.11.20/24"]);
    assert_eq!(
        r.stdout["ips"][0]["version"], "4",
        "0.3.1 results carry the version"
    );
    let dual = ns.netconf("1.0.0", json!({"ipRanges": [{"range": "10.10.10.10/24", "range_start": "10.10.10.20", "range_end": "10.10.10.200"}, {"range": "2001::1/64", "range_start": "2001::16", "range_end": "2001::64"}]}));
    let r = ns.cni("ADD", &dual, "c2", "net1", "pod2", "u2");
    assert_eq!(r.addresses(), ["10.10.10.21/24", "2001::16/64"]);
    assert!(r.stdout["ips"][0].get("version").is_none());
    let top = ns.netconf("1.1.0", json!({"range": "12.12.12.12/24", "ipRanges": [{"range": "10.10.10.10/24", "range_start": "10.10.10.20", "range_end": "10.10.10.200"}, {"range": "2001::1/64", "range_start": "2001::16", "range_end": "2001::64"}]}));
    let r = ns.cni("ADD", &top, "c3", "net1", "pod3", "u3");
    assert_eq!(
        r.addresses(),
        ["12.12.12.1/24", "10.10.10.22/24", "2001::17/64"]
    );
    // Stored objects: upstream names and offset keys, plus the pod UID and the node (the
    // `nodename` file next to the node's flat file, as the installer writes it).
    let v6 = ns.allocations("2001---64");
    assert_eq!(
        v6["22"],
        json!({"id": "c2", "podref": format!("{}/pod2", ns.name), "ifname": "net1", "poduid": "u2", "node": ns.name})
    );
    assert_eq!(v6["23"]["id"], "c3");
    let pool = ns.get_json(&["ippool", "12.12.12.0-24"]).unwrap();
    assert_eq!(pool["spec"]["range"], "12.12.12.0/24");
    // What the pool is, in labels: the unnamed network, its range.
    let labels = &pool["metadata"]["labels"];
    assert_eq!(labels["whereabouts.cni.cncf.io/network"], "");
    assert_eq!(labels["whereabouts.cni.cncf.io/range"], "12.12.12.0-24");
    let res = ns.reservations();
    assert_eq!(res["2001--17"]["podref"], format!("{}/pod3", ns.name));
    assert!(res.contains_key("10.10.10.22"));
}

#[test]
fn add_is_idempotent_and_del_frees_everything() {
    let ns = Ns::new("idem");
    let conf = ns.netconf("1.0.0", json!({"ipRanges": design_ipranges()}));
    let first = ns.cni("ADD", &conf, "c1", "net1", "pod1", "u1").addresses();
    let again = ns.cni("ADD", &conf, "c1", "net1", "pod1", "u1").addresses();
    assert_eq!(first, again);
    assert_eq!(ns.allocations("10.10.10.0-24").len(), 1);
    // The plugin names itself: the API server records it as the pool's writer.
    let pool = ns
        .get_json(&["ippool", "10.10.10.0-24", "--show-managed-fields"])
        .unwrap();
    let managers: Vec<&str> = (pool["metadata"]["managedFields"].as_array().unwrap().iter())
        .filter_map(|m| m["manager"].as_str())
        .collect();
    assert!(managers.contains(&"whereabouts-plugin"), "{managers:?}");
    let del = ns.cni("DEL", &conf, "c1", "net1", "pod1", "u1");
    assert!(del.ok, "{:?}", del);
    assert!(ns.allocations("10.10.10.0-24").is_empty());
    assert!(ns.allocations("11.11.11.0-24").is_empty());
    assert!(ns.reservations().is_empty(), "{:?}", ns.reservations());
    assert!(
        ns.cni("DEL", &conf, "c1", "net1", "pod1", "u1").ok,
        "a repeated DEL is harmless"
    );
}

/// `n` ADD processes for pods pod0.. (containers c0..) started at once; each must get an address
/// no other got. Returns the addresses.
fn concurrent_adds(ns: &Ns, conf: &serde_json::Value, n: usize) -> BTreeSet<String> {
    let mut seen = BTreeSet::new();
    for r in ns.cni_pods("ADD", conf, 0..n) {
        assert!(seen.insert(r.addresses()[0].clone()), "duplicate address");
    }
    seen
}

#[test]
fn a_hundred_concurrent_adds_give_a_hundred_distinct_addresses() {
    let ns = Ns::new("conc");
    let conf = ns.netconf("1.0.0", json!({"range": "10.20.0.0/24"}));
    let seen = concurrent_adds(&ns, &conf, 100);
    assert_eq!(seen.len(), 100);
    assert_eq!(ns.allocations("10.20.0.0-24").len(), 100);
    assert_eq!(ns.reservations().len(), 100);
    // Claimants took turns writing the pool (Lease whereabouts-<pool>) and gave every turn back.
    let leases = ns.kubectl_ok(&["get", "leases", "-o", "name"]);
    assert!(!leases.contains("whereabouts-"), "{leases}");
    // A claim recorded among others leaves the claims lists (its claim-time label goes): what
    // the pool's claimants list is what is still waiting, not the whole burst. Those recorded
    // with nobody else claiming keep it: 3 and 4 of a burst of 100 in two runs (all 100 before).
    let listed = ns.kubectl_ok(&[
        "get",
        "overlappingrangeipreservations",
        "-l",
        "whereabouts.cni.cncf.io/claimed",
        "-o",
        "name",
    ]);
    assert!(listed.lines().count() < 25, "{listed}");

    // And 100 concurrent DELs free everything, entries and reservations.
    for r in ns.cni_pods("DEL", &conf, 0..100) {
        assert!(r.ok, "{:?}", r);
    }
    assert!(ns.allocations("10.20.0.0-24").is_empty());
    assert!(ns.reservations().is_empty());
    let leases = ns.kubectl_ok(&["get", "leases", "-o", "name"]);
    assert!(!leases.contains("whereabouts-"), "{leases}");
}

/// A writer turn left behind by a killed plugin (here: a Lease made by hand) delays the claimants
/// that find it, for about its length, and is then taken over: every ADD succeeds, none twice.
#[test]
fn an_abandoned_writer_turn_is_taken_over() {
    let ns = Ns::new("turn");
    let conf = ns.netconf("1.0.0", json!({"range": "10.21.0.0/24"}));
    let lease = json!({"apiVersion": "coordination.k8s.io/v1", "kind": "Lease",
        "metadata": {"name": "whereabouts-10.21.0.0-24"},
        "spec": {"holderIdentity": "killed-plugin", "leaseDurationSeconds": 5}});
    let out = ns.apply(&lease.to_string());
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let started = std::time::Instant::now();
    assert_eq!(concurrent_adds(&ns, &conf, 40).len(), 40);
    assert_eq!(ns.allocations("10.21.0.0-24").len(), 40);
    assert!(
        started.elapsed() < Duration::from_secs(60),
        "took {:?}",
        started.elapsed()
    );
    // Taken over: deleted, and maybe taken again and given back since.
    let holder = ns.kubectl(
        &[
            "get",
            "lease",
            "whereabouts-10.21.0.0-24",
            "-o",
            "jsonpath={.spec.holderIdentity}",
        ],
        None,
    );
    assert_ne!(String::from_utf8_lossy(&holder.stdout), "killed-plugin");
}

#[test]
fn killed_adds_never_leave_a_duplicate() {
    let ns = Ns::new("kill");
    let conf = ns.netconf("1.0.0", json!({"range": "10.30.0.0/24"}));
    let mut children = ns.cni_spawn_pods("ADD", &conf, 0..30);
    // Kill a third of them at staggered moments, mid-flight.
    for (i, child) in children.iter_mut().enumerate().filter(|(i, _)| i % 3 == 0) {
        std::thread::sleep(Duration::from_millis(5 * i as u64));
        let _ = child.kill();
    }
    for child in children {
        let _ = child.wait_with_output();
    }
    // The runtime retries every ADD; each pod must end with its own address.
    let mut by_pod = BTreeMap::new();
    for i in 0..30 {
        let r = ns.cni_pod("ADD", &conf, i);
        by_pod.insert(format!("{}/pod{i}", ns.name), r.addresses()[0].clone());
    }
    let distinct: BTreeSet<_> = by_pod.values().collect();
    assert_eq!(distinct.len(), 30, "{by_pod:?}");
    let pool = ns.allocations("10.30.0.0-24");
    assert_eq!(pool.len(), 30);
    // Every pool entry is backed by a reservation naming the same pod; orphan claims are allowed.
    let res = ns.reservations();
    for (offset, entry) in &pool {
        let ip = format!("10.30.0.{offset}");
        assert_eq!(res[&ip]["podref"], entry["podref"], "reservation of {ip}");
        assert_eq!(
            by_pod[entry["podref"].as_str().unwrap()],
            format!("{ip}/24")
        );
    }
}

#[test]
fn an_upstream_written_pool_is_read_and_respected() {
    let ns = Ns::new("upstream");
    // Offsets as upstream writes them, including an IPv6 offset beyond 2^64.
    let pool = format!(
        r#"{{"apiVersion": "whereabouts.cni.cncf.io/v1alpha1", "kind": "IPPool", "metadata": {{"name": "fd00-0-10---48", "namespace": "{ns}"}},
        "spec": {{"range": "fd00:0:10::/48", "allocations": {{"1": {{"id": "up1", "podref": "{ns}/old1"}}, "2": {{"id": "up2", "podref": "{ns}/old2", "ifname": "net1"}}, "18446744073709551617": {{"id": "up3", "podref": "{ns}/old3"}}}}}}}}"#,
        ns = ns.name
    );
    let out = ns.apply(&pool);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let conf = ns.netconf("1.0.0", json!({"range": "fd00:0:10::/48"}));
    assert_eq!(
        ns.cni("ADD", &conf, "c1", "net1", "new1", "u1").addresses(),
        ["fd00:0:10::3/48"]
    );
    // upstream's DEL key is container id + ifname: releasing up2 frees offset 2 only.
    assert!(ns.cni("DEL", &conf, "up2", "net1", "old2", "").ok);
    let after = ns.allocations("fd00-0-10---48");
    assert_eq!(
        after.keys().collect::<Vec<_>>(),
        ["1", "18446744073709551617", "3"]
    );
    assert_eq!(
        ns.cni("ADD", &conf, "c2", "net1", "new2", "u2").addresses(),
        ["fd00:0:10::2/48"]
    );
}

#[test]
fn errors_are_cni_json_with_the_right_code() {
    let ns = Ns::new("errors");
    let bad = ns.netconf(
        "1.0.0",
        json!({"range": "10.0.0.0/24", "range_start": "10.0.1.5"}),
    );
    let r = ns.cni("ADD", &bad, "c1", "net1", "pod1", "u1");
    assert!(!r.ok);
    assert_eq!(r.stdout["code"], 7);
    assert_eq!(
        r.stdout["msg"],
        r#"invalid whereabouts config: ipam.range_start "10.0.1.5" is outside range 10.0.0.0/24"#
    );
    // A flat file that does not parse: the error names it, and logging (set up from the network
    // config alone) still reports it on stderr.
    let broken = ns.dir.path().join("broken.conf");
    std::fs::write(&broken, "{not json").unwrap();
    let mut conf = ns.netconf("1.0.0", json!({"range": "10.0.0.0/24"}));
    conf["ipam"]["configuration_path"] = broken.to_str().unwrap().into();
    let r = ns.cni("ADD", &conf, "c1", "net1", "pod1", "u1");
    assert_eq!(r.stdout["code"], 7, "{}", r.stdout);
    let msg = r.stdout["msg"].as_str().unwrap();
    assert!(
        msg.starts_with(&format!(
            "flat file \"{}\" is not valid JSON",
            broken.display()
        )),
        "{msg}"
    );
    assert!(r.stderr.contains("is not valid JSON"), "{}", r.stderr);
    let tiny = ns.netconf("1.0.0", json!({"range": "10.40.0.0/30"}));
    ns.cni("ADD", &tiny, "c1", "net1", "pod1", "u1").addresses();
    ns.cni("ADD", &tiny, "c2", "net1", "pod2", "u2").addresses();
    let full = ns.cni("ADD", &tiny, "c3", "net1", "pod3", "u3");
    assert_eq!(full.stdout["code"], 100);
    assert!(
        full.stdout["msg"]
            .as_str()
            .unwrap()
            .contains("no free address in range 10.40.0.0/30")
    );
    // Upstream's list: a NAD on 0.1.0 or 0.2.0 that works there works here.
    let v = ns.cni("VERSION", &json!({"cniVersion": "1.1.0"}), "", "", "", "");
    assert_eq!(
        v.stdout["supportedVersions"],
        json!([
            "0.1.0", "0.2.0", "0.3.0", "0.3.1", "0.4.0", "1.0.0", "1.1.0"
        ])
    );
    let status = ns.cni("STATUS", &tiny, "", "", "", "");
    assert!(status.ok, "{status:?}");
}

#[test]
fn gc_releases_gone_pods_only() {
    let ns = Ns::new("gc");
    let conf = ns.netconf("1.1.0", json!({"range": "10.50.0.0/24"}));
    let live_uid = ns.create_pod("live", &BTreeMap::new());
    ns.cni("ADD", &conf, "c-live", "net1", "live", &live_uid)
        .addresses();
    ns.cni("ADD", &conf, "c-gone", "net1", "gone", "uid-gone")
        .addresses();
    let mut gc = conf.clone();
    gc["cni.dev/valid-attachments"] = json!([]);
    let r = ns.cni("GC", &gc, "", "", "", "");
    assert!(r.ok, "{r:?}");
    let left: Vec<_> = ns
        .allocations("10.50.0.0-24")
        .values()
        .map(|e| e["id"].as_str().unwrap().to_owned())
        .collect();
    assert_eq!(left, ["c-live"]);
}

/// A pool grown to the largest object the API server stores (filled here with one write of
/// realistic entries) refuses the next ADD at once with code 100 naming the pool, instead of
/// failing every ADD with "try again later" after etcd's "request is too large"; DEL still works.
#[test]
fn a_full_pool_object_refuses_the_add_for_good() {
    use whereabouts::crd::IPAllocation;
    use whereabouts::crd::size::{POOL_OBJECT_BUDGET, entry_bytes, pool_bytes};
    let ns = Ns::new("pool-full");
    let range = "10.140.0.0/16";
    let entry = |o: u128| IPAllocation {
        id: format!("{o:064x}"),
        podref: format!("{}/app-deployment-7d9f8c6b5-{o:06}", ns.name),
        ifname: "net1".into(),
        poduid: format!("5f0c6a2e-1d3b-4c1e-9a4f-{o:012}"),
        ..Default::default()
    };
    let mut entries = BTreeMap::new();
    let mut o = 1;
    while pool_bytes(range, &entries) + 2 * entry_bytes(o, &entry(o)) < POOL_OBJECT_BUDGET {
        entries.insert(o, entry(o));
        o += 1;
    }
    // Pad with one entry so that the new ADD's entry (counted at the range's widest offset) is
    // one byte too many.
    let new_entry = IPAllocation {
        id: "c-new".into(),
        podref: format!("{}/new", ns.name),
        ifname: "net1".into(),
        poduid: "uid-new".into(),
        ..Default::default()
    };
    let room =
        POOL_OBJECT_BUDGET - pool_bytes(range, &entries) - entry_bytes(65_536, &new_entry) + 1;
    let mut pad = IPAllocation {
        podref: format!("{}/pad", ns.name),
        ..Default::default()
    };
    pad.id = "p".repeat(room - entry_bytes(o, &pad));
    entries.insert(o, pad);
    assert_eq!(
        pool_bytes(range, &entries) + entry_bytes(65_536, &new_entry),
        POOL_OBJECT_BUDGET + 1
    );
    let stored: BTreeMap<String, &IPAllocation> =
        entries.iter().map(|(o, e)| (o.to_string(), e)).collect();
    let pool = json!({"apiVersion": "whereabouts.cni.cncf.io/v1alpha1", "kind": "IPPool",
        "metadata": {"name": "10.140.0.0-16", "namespace": ns.name},
        "spec": {"range": range, "allocations": stored}});
    // `create`, not `apply`: apply would store the whole object again in an annotation.
    let out = ns.kubectl(&["create", "-f", "-"], Some(&pool.to_string()));
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let conf = ns.netconf("1.0.0", json!({"range": range}));
    let add = ns.cni("ADD", &conf, "c-new", "net1", "new", "uid-new");
    assert!(!add.ok);
    assert_eq!(add.stdout["code"], 100, "{}", add.stdout);
    let msg = add.stdout["msg"].as_str().unwrap();
    assert!(
        msg.contains("pool 10.140.0.0-16 cannot hold another entry")
            && msg.contains(&format!("its {} entries", entries.len())),
        "{msg}"
    );
    assert_eq!(ns.allocations("10.140.0.0-16").len(), entries.len());
    assert!(ns.reservations().is_empty(), "no claim left behind");
    // DEL of an existing entry's container works on the full pool, and makes room.
    let first = entry(1);
    let del = ns.cni("DEL", &conf, &first.id, "net1", "app", &first.poduid);
    assert!(del.ok, "{} {}", del.stdout, del.stderr);
    assert_eq!(ns.allocations("10.140.0.0-16").len(), entries.len() - 1);
}

/// The node's bound (`plugin_slots`): while every slot is held, plugins wait and send nothing;
/// once the slots come free they all run. The slots are held here as a plugin holds one: an
/// exclusive flock on the slot's lock file; all of them, the wide ones too (a node whose turns
/// saw only its own claims may use those: `slots::WIDE`).
#[test]
fn a_nodes_plugins_wait_for_its_slots_and_send_nothing_meanwhile() {
    use rustix::fs::{FlockOperation, flock};
    let ns = Ns::new("slots");
    let slots = ns.dir.path().join("bound");
    std::fs::write(
        ns.flat_file(),
        json!({"kubernetes": {"kubeconfig": ns.kubeconfig}, "plugin_slots": 2,
               "plugin_slots_dir": slots})
        .to_string(),
    )
    .unwrap();
    std::fs::create_dir_all(&slots).unwrap();
    let all = 2 * whereabouts::cni::slots::WIDE;
    let held: Vec<std::fs::File> = (0..all)
        .map(|i| {
            let f = std::fs::File::create(slots.join(format!("slot-{i}"))).unwrap();
            flock(&f, FlockOperation::NonBlockingLockExclusive).unwrap();
            f
        })
        .collect();
    let conf = ns.netconf("1.0.0", json!({"range": "10.77.0.0/24"}));
    let mut waiting = ns.cni_spawn_pods("ADD", &conf, 0..6);
    std::thread::sleep(Duration::from_secs(2));
    for p in &mut waiting {
        assert!(
            p.try_wait().unwrap().is_none(),
            "a plugin ran without a slot"
        );
    }
    assert!(
        ns.get_json(&["ippool", "10.77.0.0-24"]).is_none(),
        "a waiting plugin wrote to the API server"
    );
    drop(held);
    let results: Vec<Cni> = waiting
        .into_iter()
        .map(|c| Cni::from(c.wait_with_output().unwrap()))
        .collect();
    let addresses: BTreeSet<String> = results
        .iter()
        .map(|r| {
            assert!(r.ok, "{r:?}");
            r.addresses()[0].clone()
        })
        .collect();
    assert_eq!(addresses.len(), 6);
    assert_eq!(ns.allocations("10.77.0.0-24").len(), 6);
    // A DEL frees what a waiting ADD may need: it does not queue behind ADDs holding every slot.
    let held: Vec<std::fs::File> = (0..all)
        .map(|i| {
            let f = std::fs::File::open(slots.join(format!("slot-{i}"))).unwrap();
            flock(&f, FlockOperation::NonBlockingLockExclusive).unwrap();
            f
        })
        .collect();
    let mut adds = ns.cni_spawn_pods("ADD", &conf, 6..9);
    let del = ns.cni_pod("DEL", &conf, 0);
    assert!(del.ok, "{del:?}");
    assert_eq!(ns.allocations("10.77.0.0-24").len(), 5, "the DEL waited");
    for p in &mut adds {
        assert!(p.try_wait().unwrap().is_none(), "an ADD ran without a slot");
    }
    drop(held);
    for p in adds {
        assert!(Cni::from(p.wait_with_output().unwrap()).ok);
    }
    assert_eq!(ns.allocations("10.77.0.0-24").len(), 8);
}
