//! Node slices end to end: Node objects, the operator assigning slices, one node agent and one
//! plugin configuration per simulated node (its flat file, and the `nodename` file next to it as
//! the installer writes it), and upstream's v0.9.2 plugin on the same NodeSlicePool.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};

use serde_json::{Value, json};

use crate::agent::Agent;
use crate::harness::{Cni, Ns, OperatorProcess, eventually, repo, whereabouts_bin};

/// A simulated node: a Node object (deleted when dropped), and its own flat file and `nodename`.
pub(crate) struct SimNode {
    pub(crate) name: String,
    dir: PathBuf,
    kubeconfig: PathBuf,
    agent: Option<Agent>,
}

impl SimNode {
    pub(crate) fn new(ns: &Ns, suffix: &str, with_agent: bool) -> SimNode {
        let name = format!("{}-{suffix}", ns.name);
        let node = json!({"apiVersion": "v1", "kind": "Node", "metadata": {"name": name}});
        let out = ns.kubectl(&["create", "-f", "-"], Some(&node.to_string()));
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
        let dir = ns.dir.path().join(&name);
        std::fs::create_dir_all(&dir).unwrap();
        let kubeconfig = ns.kubeconfig.clone();
        let agent =
            with_agent.then(|| Agent::start_with(&kubeconfig, &dir, kubeconfig.to_str().unwrap()));
        write_flat_file(&dir, &kubeconfig, agent.as_ref());
        std::fs::write(dir.join("nodename"), format!("{name}\n")).unwrap();
        SimNode {
            name,
            dir,
            kubeconfig,
            agent,
        }
    }

    /// The plugin of this node (without an agent) talks to the API server with `kubeconfig`'s
    /// credentials (a token bound to this node, say), as the installer's kubeconfig makes it.
    pub(crate) fn use_credentials(&self, kubeconfig: &Path) {
        assert!(
            self.agent.is_none(),
            "the agent keeps the credentials it started with"
        );
        write_flat_file(&self.dir, kubeconfig, None);
    }

    /// The network config as this node's runtime passes it: the NAD's ipam, the node's flat file.
    pub(crate) fn conf(&self, ipam: &Value) -> Value {
        let mut ipam = ipam.clone();
        ipam["type"] = "whereabouts".into();
        ipam["configuration_path"] = self.dir.join("whereabouts.conf").to_str().unwrap().into();
        json!({"cniVersion": "1.0.0", "name": "slices", "type": "macvlan", "ipam": ipam})
    }

    /// Starts our plugin (or `bin`) on this node; upstream learns the node from `NODENAME`.
    pub(crate) fn spawn(
        &self,
        bin: &Path,
        ns: &Ns,
        command: &str,
        ipam: &Value,
        pod: &str,
    ) -> std::process::Child {
        use std::io::Write;
        let mut child = Command::new(bin)
            .env_clear()
            .env("PATH", std::env::var("PATH").unwrap_or_default())
            .env("CNI_COMMAND", command)
            .env("CNI_CONTAINERID", format!("c-{pod}"))
            .env("CNI_NETNS", "/var/run/netns/none")
            .env("CNI_IFNAME", "net1")
            .env("CNI_PATH", "/opt/cni/bin")
            .env(
                "CNI_ARGS",
                format!(
                    "IgnoreUnknown=1;K8S_POD_NAMESPACE={};K8S_POD_NAME={pod};K8S_POD_UID=uid-{pod}",
                    ns.name
                ),
            )
            .envs((bin != whereabouts_bin()).then(|| ("NODENAME", self.name.clone())))
            .env(whereabouts::config::trust::CONF_DIR_ENV, &self.dir)
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .expect("spawn plugin");
        let _ = child
            .stdin
            .take()
            .unwrap()
            .write_all(self.conf(ipam).to_string().as_bytes());
        child
    }

    pub(crate) fn run(&self, ns: &Ns, command: &str, ipam: &Value, pods: &[String]) -> Vec<Cni> {
        self.run_with(&whereabouts_bin(), ns, command, ipam, pods)
    }

    pub(crate) fn run_with(
        &self,
        bin: &Path,
        ns: &Ns,
        command: &str,
        ipam: &Value,
        pods: &[String],
    ) -> Vec<Cni> {
        let children: Vec<_> = pods
            .iter()
            .map(|p| self.spawn(bin, ns, command, ipam, p))
            .collect();
        children
            .into_iter()
            .map(|c| Cni::from(c.wait_with_output().unwrap()))
            .collect()
    }
}

/// The node's flat file in `dir`: the plugin's kubeconfig, its slots, and its agent (none: `""`).
fn write_flat_file(dir: &Path, kubeconfig: &Path, agent: Option<&Agent>) {
    let slots = dir.join("plugin-slots");
    let mut flat = json!({"kubernetes": {"kubeconfig": kubeconfig}, "plugin_slots_dir": slots});
    flat["agent_socket"] = match agent {
        Some(a) => a.socket.to_str().unwrap().into(),
        None => "".into(),
    };
    std::fs::write(dir.join("whereabouts.conf"), flat.to_string()).unwrap();
}

impl Drop for SimNode {
    fn drop(&mut self) {
        let _ = crate::harness::kubectl_raw(
            &self.kubeconfig,
            &["delete", "node", &self.name, "--wait=false"],
            None,
        );
    }
}

fn pods(prefix: &str, n: usize) -> Vec<String> {
    (0..n).map(|i| format!("{prefix}{i}")).collect()
}

fn apply_nad(ns: &Ns, name: &str, ipam: &Value) {
    let mut ipam = ipam.clone();
    ipam["type"] = "whereabouts".into();
    let config = json!({"cniVersion": "1.0.0", "name": "slices", "type": "macvlan", "master": "br0", "ipam": ipam});
    let nad = json!({"apiVersion": "k8s.cni.cncf.io/v1", "kind": "NetworkAttachmentDefinition",
        "metadata": {"name": name, "namespace": ns.name}, "spec": {"config": config.to_string()}});
    let out = ns.apply(&nad.to_string());
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
}

/// The NodeSlicePool's slices by node.
fn slices_of(ns: &Ns, name: &str) -> BTreeMap<String, Vec<String>> {
    let mut by_node: BTreeMap<String, Vec<String>> = BTreeMap::new();
    if let Some(p) = ns.get_json(&["nodeslicepool", name]) {
        for a in p["status"]["allocations"].as_array().into_iter().flatten() {
            by_node
                .entry(a["nodeName"].as_str().unwrap().to_owned())
                .or_default()
                .push(a["sliceRange"].as_str().unwrap().to_owned());
        }
    }
    by_node
}

fn wait_for_slices(
    ns: &Ns,
    op: &OperatorProcess,
    name: &str,
    nodes: &[&SimNode],
) -> BTreeMap<String, Vec<String>> {
    assert!(
        eventually(20, || {
            let s = slices_of(ns, name);
            nodes.iter().all(|n| s.contains_key(&n.name))
        }),
        "no slices in {name} for every node: {:?}\n{}",
        slices_of(ns, name),
        op.log()
    );
    slices_of(ns, name)
}

fn inside(addr: &str, slice: &str) -> bool {
    let ip: std::net::IpAddr = addr.split('/').next().unwrap().parse().unwrap();
    slice.parse::<ipnet::IpNet>().unwrap().contains(&ip)
}

pub(crate) fn upstream_bin() -> PathBuf {
    let bin = repo().join("bench/bin/whereabouts-upstream");
    assert!(
        bin.exists(),
        "{} is missing: bench/build.sh --upstream-only builds it (e2e/run-tests.sh does)",
        bin.display()
    );
    bin
}

#[test]
fn each_node_allocates_dual_stack_from_its_own_slices_through_its_agent() {
    let ns = Ns::new("slices");
    let net = ns.name.clone();
    // Every slice's first 16 addresses are excluded, so whichever slices the nodes get (nodes of
    // tests running alongside get slices too), the exclude applies inside them.
    let excludes: Vec<String> = (0..16)
        .map(|i| format!("10.90.{}.{}/28", i / 4, (i % 4) * 64))
        .collect();
    let ipam = json!({"network_name": net, "node_slice_size": "/26", "ipRanges": [
        {"range": "10.90.0.0/22", "exclude": excludes},
        {"range": "fd00:90::/116", "node_slice_size": "/122"}]});
    apply_nad(&ns, "dual", &ipam);
    let op = OperatorProcess::for_namespace(&ns);
    let nodes = [SimNode::new(&ns, "n1", true), SimNode::new(&ns, "n2", true)];
    let v4 = wait_for_slices(&ns, &op, &net, &nodes.iter().collect::<Vec<_>>());
    let v6_name = format!("{net}-fd00-90---116");
    let v6 = wait_for_slices(&ns, &op, &v6_name, &nodes.iter().collect::<Vec<_>>());
    let pool = ns.get_json(&["nodeslicepool", &net]).unwrap();
    assert_eq!(
        pool["spec"],
        json!({"range": "10.90.0.0/22", "sliceSize": "/26"})
    );
    assert_eq!(
        pool["metadata"]["labels"]["whereabouts.cni.cncf.io/network"],
        net.as_str()
    );
    assert_eq!(
        pool["metadata"]["labels"]["whereabouts.cni.cncf.io/range"],
        "10.90.0.0-22"
    );

    let mut seen = BTreeSet::new();
    for (i, node) in nodes.iter().enumerate() {
        let results = node.run(&ns, "ADD", &ipam, &pods(&format!("p{i}-"), 6));
        for r in &results {
            let [a4, a6] = <[String; 2]>::try_from(r.addresses()).unwrap();
            assert!(
                a4.ends_with("/22") && a6.ends_with("/116"),
                "whole-range prefixes: {a4} {a6}"
            );
            assert!(
                inside(&a4, &v4[&node.name][0]),
                "{a4} outside {}'s slice {:?}",
                node.name,
                v4[&node.name]
            );
            assert!(
                inside(&a6, &v6[&node.name][0]),
                "{a6} outside {}'s slice {:?}",
                node.name,
                v6[&node.name]
            );
            assert!(!excludes.iter().any(|x| inside(&a4, x)), "{a4} is excluded");
            assert!(
                seen.insert(a4.clone()) && seen.insert(a6.clone()),
                "duplicate {a4} {a6}"
            );
        }
        let lowest = results
            .iter()
            .map(|r| r.addresses()[0].clone())
            .min_by_key(|a| {
                a.split('/')
                    .next()
                    .unwrap()
                    .parse::<std::net::Ipv4Addr>()
                    .unwrap()
            });
        let base: ipnet::Ipv4Net = v4[&node.name][0].parse().unwrap();
        let expected = std::net::Ipv4Addr::from(u32::from(base.network()) + 16);
        assert_eq!(
            lowest.unwrap(),
            format!("{expected}/22"),
            "the first address after the exclude"
        );
        // Upstream's slice pool: [network-]node-slice, offsets from the slice's network address.
        let slice = &v4[&node.name][0];
        let pool = format!("{net}-{}-{}", node.name, slice.replace([':', '/'], "-"));
        let entries = ns.allocations(&pool);
        assert_eq!(entries.len(), 6, "{pool}: {entries:?}");
        // The agent made it with labels saying whose slice of which network it is.
        let labels = ns.get_json(&["ippool", &pool]).unwrap()["metadata"]["labels"].clone();
        assert_eq!(labels["whereabouts.cni.cncf.io/network"], net.as_str());
        assert_eq!(labels["whereabouts.cni.cncf.io/node"], node.name.as_str());
        assert_eq!(
            labels["whereabouts.cni.cncf.io/range"],
            slice.replace([':', '/'], "-")
        );
        assert!(
            node.agent.as_ref().unwrap().served() >= 6,
            "the node's agent ran them"
        );
    }
    assert!(
        ns.get_json(&["ippool", &format!("{net}-10.90.0.0-22")])
            .is_none(),
        "no whole-range pool"
    );
    for (i, node) in nodes.iter().enumerate() {
        for r in node.run(&ns, "DEL", &ipam, &pods(&format!("p{i}-"), 6)) {
            assert!(r.ok, "{}", r.stderr);
        }
    }
    let pools = ns.get_json(&["ippools"]).unwrap();
    for p in pools["items"].as_array().unwrap() {
        assert!(
            p["spec"]["allocations"]
                .as_object()
                .is_none_or(|a| a.is_empty()),
            "left after DEL: {p}"
        );
    }
    assert!(ns.reservations().is_empty());
}

#[test]
fn a_full_slice_takes_another_and_a_departed_node_is_released_after_draining() {
    let ns = Ns::new("slicefull");
    let net = ns.name.clone();
    let ipam = json!({"network_name": net, "range": "10.91.0.0/24", "node_slice_size": "28"});
    apply_nad(&ns, "full", &ipam);
    let op = OperatorProcess::for_namespace(&ns);
    let n1 = SimNode::new(&ns, "n1", false);
    let first = wait_for_slices(&ns, &op, &net, &[&n1])[&n1.name].clone();
    // A /28 slice gives 14 addresses: 20 ADDs at once need a second slice, taken by the node.
    let results = n1.run(&ns, "ADD", &ipam, &pods("p", 20));
    let mut seen = BTreeSet::new();
    for r in &results {
        assert!(seen.insert(r.addresses()[0].clone()), "duplicate");
    }
    let held = slices_of(&ns, &net)[&n1.name].clone();
    assert_eq!(held.len(), 2, "one more slice, not one per ADD: {held:?}");
    assert_eq!(held[0], first[0]);
    for a in &seen {
        assert!(held.iter().any(|s| inside(a, s)), "{a} outside {held:?}");
    }
    // The node goes away: its slices stay while their pools hold addresses.
    ns.kubectl_ok(&["delete", "node", &n1.name]);
    std::thread::sleep(std::time::Duration::from_secs(3));
    assert_eq!(slices_of(&ns, &net)[&n1.name], held, "{}", op.log());
    let _ = n1.run(&ns, "DEL", &ipam, &pods("p", 20));
    assert!(
        eventually(40, || !slices_of(&ns, &net).contains_key(&n1.name)),
        "drained slices not released: {:?}\n{}",
        slices_of(&ns, &net),
        op.log()
    );
    // A new node gets a slice, possibly the one just released.
    let n2 = SimNode::new(&ns, "n2", false);
    let s2 = wait_for_slices(&ns, &op, &net, &[&n2])[&n2.name].clone();
    assert_eq!(s2.len(), 1);
    let a = n2.run(&ns, "ADD", &ipam, &pods("q", 1))[0].addresses()[0].clone();
    assert!(inside(&a, &s2[0]));
}

#[test]
fn hand_edits_and_deletions_are_repaired_without_a_duplicate() {
    let ns = Ns::new("sliceedit");
    let net = ns.name.clone();
    let ipam = json!({"network_name": net, "range": "10.92.0.0/22", "node_slice_size": "/26"});
    apply_nad(&ns, "edit", &ipam);
    let op = OperatorProcess::for_namespace(&ns);
    let (n1, n2) = (
        SimNode::new(&ns, "n1", false),
        SimNode::new(&ns, "n2", false),
    );
    let before = wait_for_slices(&ns, &op, &net, &[&n1, &n2]);
    let mut seen: BTreeSet<String> = n1
        .run(&ns, "ADD", &ipam, &pods("a", 3))
        .iter()
        .map(|r| r.addresses()[0].clone())
        .collect();
    // Deleted by hand: rebuilt, and n1 keeps the slice its live pool is in.
    ns.kubectl_ok(&["delete", "nodeslicepool", &net]);
    assert!(
        eventually(20, || slices_of(&ns, &net).get(&n1.name)
            == before.get(&n1.name)),
        "{:?} vs {before:?}\n{}",
        slices_of(&ns, &net),
        op.log()
    );
    // Edited by hand to give n1's live slice to n2: undone. (The operator may write the object
    // between our read and our write, as it does for nodes of tests alongside: edit again.)
    let edited = (0..10).any(|_| {
        let mut obj = ns.get_json(&["nodeslicepool", &net]).unwrap();
        for a in obj["status"]["allocations"].as_array_mut().unwrap() {
            if a["nodeName"] == n1.name.as_str() {
                a["nodeName"] = n2.name.as_str().into();
            } else if a["nodeName"] == n2.name.as_str() {
                a["nodeName"] = n1.name.as_str().into();
            }
        }
        ns.kubectl(&["replace", "-f", "-"], Some(&obj.to_string()))
            .status
            .success()
    });
    assert!(edited, "the edit never went through");
    // n1 gets its live slice back (and may keep the one the edit gave it: it is empty); n2,
    // whose slice held nothing, has a slice again.
    let live_slice = before[&n1.name][0].clone();
    assert!(
        eventually(20, || {
            let s = slices_of(&ns, &net);
            s.get(&n1.name).is_some_and(|v| v.contains(&live_slice)) && s.contains_key(&n2.name)
        }),
        "{:?}\n{}",
        slices_of(&ns, &net),
        op.log()
    );
    // n1's slice pool deleted by hand: the reservations still guard its addresses.
    let slice = &before[&n1.name][0];
    let pool = format!("{net}-{}-{}", n1.name, slice.replace('/', "-"));
    ns.kubectl_ok(&["delete", "ippool", &pool]);
    for r in n1.run(&ns, "ADD", &ipam, &pods("b", 3)) {
        let a = r.addresses()[0].clone();
        assert!(
            seen.insert(a.clone()),
            "{a} handed out twice after the pool was deleted"
        );
        // From any slice n1 holds now (the edit may have left it a second one).
        let held = slices_of(&ns, &net).remove(&n1.name).unwrap_or_default();
        assert!(held.iter().any(|s| inside(&a, s)), "{a} outside {held:?}");
    }
}

#[test]
fn upstreams_plugin_and_ours_share_an_upstream_written_node_slice_pool() {
    let ns = Ns::new("sliceup");
    let net = ns.name.clone();
    let ipam = json!({"network_name": net, "range": "10.93.0.0/22", "node_slice_size": "/26"});
    let (n1, n2) = (
        SimNode::new(&ns, "n1", false),
        SimNode::new(&ns, "n2", false),
    );
    // Written exactly as upstream's controller and plugin write them, before our operator runs.
    // Upstream's own controller gives every node in the cluster a slice: enough for the nodes of
    // tests running alongside.
    let mut allocations = vec![
        json!({"nodeName": n2.name, "sliceRange": "10.93.0.0/26"}),
        json!({"nodeName": n1.name, "sliceRange": "10.93.0.64/26"}),
    ];
    allocations.extend((2..16).map(
        |i| json!({"nodeName": "", "sliceRange": format!("10.93.{}.{}/26", i / 4, (i % 4) * 64)}),
    ));
    let nsp = json!({"apiVersion": "whereabouts.cni.cncf.io/v1alpha1", "kind": "NodeSlicePool",
        "metadata": {"name": net, "namespace": ns.name},
        "spec": {"range": "10.93.0.0/22", "sliceSize": "/26"},
        "status": {"allocations": allocations}});
    let out = ns.kubectl(&["create", "-f", "-"], Some(&nsp.to_string()));
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let pool = format!("{net}-{}-10.93.0.64-26", n1.name);
    let upstream_pool = json!({"apiVersion": "whereabouts.cni.cncf.io/v1alpha1", "kind": "IPPool",
        "metadata": {"name": pool, "namespace": ns.name},
        "spec": {"range": "10.93.0.64/26", "allocations": {"1": {"id": "c-old", "podref": format!("{}/old", ns.name), "ifname": "net1"}}}});
    let out = ns.kubectl(&["create", "-f", "-"], Some(&upstream_pool.to_string()));
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );

    // Ours reads them: n1 allocates from 10.93.0.64/26, after upstream's entry at offset 1.
    let first = n1.run(&ns, "ADD", &ipam, &pods("ours-", 1))[0].addresses();
    assert_eq!(first, ["10.93.0.66/22"]);
    // The operator adopts the object as it is (n1 and n2 keep their slices).
    apply_nad(&ns, "up", &ipam);
    let op = OperatorProcess::for_namespace(&ns);
    std::thread::sleep(std::time::Duration::from_secs(2));
    let s = slices_of(&ns, &net);
    assert_eq!(s[&n1.name], ["10.93.0.64/26"], "{}", op.log());
    assert_eq!(s[&n2.name], ["10.93.0.0/26"]);
    // Upstream's pool is labelled once the NodeSlicePool says whose slice it is.
    let labelled = || {
        let labels = ns.get_json(&["ippool", &pool]).unwrap()["metadata"]["labels"].clone();
        labels["whereabouts.cni.cncf.io/network"] == net.as_str()
            && labels["whereabouts.cni.cncf.io/node"] == n1.name.as_str()
            && labels["whereabouts.cni.cncf.io/range"] == "10.93.0.64-26"
    };
    assert!(eventually(20, labelled), "{}", op.log());

    // Upstream's plugin (node-slice mode, NODENAME) and ours at once on n1's slice.
    let up = upstream_bin();
    let children: Vec<_> = (0..6)
        .map(|i| {
            let pod = format!("mix{i}");
            if i % 2 == 0 {
                n1.spawn(&up, &ns, "ADD", &ipam, &pod)
            } else {
                n1.spawn(&whereabouts_bin(), &ns, "ADD", &ipam, &pod)
            }
        })
        .collect();
    let mut seen = BTreeSet::from(["10.93.0.65".to_owned(), "10.93.0.66".to_owned()]);
    for (i, c) in children.into_iter().enumerate() {
        let mut r = Cni::from(c.wait_with_output().unwrap());
        // Upstream's ADD that picked an address ours had just claimed fails on the reservation
        // ("already exists": no duplicate), and the runtime retries it, as here once.
        if !r.ok
            && r.stdout["msg"]
                .as_str()
                .is_some_and(|m| m.contains("already exists"))
        {
            let pod = format!("mix{i}");
            r = Cni::from(
                n1.spawn(&up, &ns, "ADD", &ipam, &pod)
                    .wait_with_output()
                    .unwrap(),
            );
        }
        let a = r.addresses()[0].clone();
        assert!(inside(&a, "10.93.0.64/26"), "{a}");
        assert!(
            seen.insert(a.split('/').next().unwrap().to_owned()),
            "{a} handed out twice"
        );
    }
    assert_eq!(
        ns.allocations(&pool).len(),
        8,
        "one pool object for both plugins"
    );
    // Upstream's DEL frees its own entries there.
    for r in n1.run_with(&up, &ns, "DEL", &ipam, &pods("mix", 1)) {
        assert!(r.ok, "{} {}", r.stdout, r.stderr);
    }
    assert_eq!(ns.allocations(&pool).len(), 7);
}

#[test]
fn more_nodes_than_slices_is_a_warning_event_and_a_metric() {
    let ns = Ns::new("slicestarve");
    let net = ns.name.clone();
    // Two slices: the two nodes here and any of tests running alongside cannot all have one.
    let ipam = json!({"network_name": net, "range": "10.94.0.0/24", "node_slice_size": "/25"});
    apply_nad(&ns, "tiny", &ipam);
    let op = OperatorProcess::for_namespace(&ns);
    let _nodes: Vec<SimNode> = ["n1", "n2", "n3"]
        .iter()
        .map(|n| SimNode::new(&ns, n, false))
        .collect();
    let assigned = |m: &str| {
        m.contains(&format!(
            "whereabouts_node_slices{{nodeslicepool=\"{net}\",state=\"assigned\"}} 2"
        ))
    };
    let starved = |m: &str| {
        m.lines().any(|l| {
            l.starts_with(&format!(
                "whereabouts_nodes_without_slice{{nodeslicepool=\"{net}\"}}"
            )) && !l.ends_with(" 0")
        })
    };
    assert!(
        eventually(20, || op
            .get("/metrics")
            .is_some_and(|m| assigned(&m) && starved(&m))),
        "{:?}\n{}",
        op.get("/metrics"),
        op.log()
    );
    let events = || {
        ns.kubectl_ok(&[
            "get",
            "events",
            "--field-selector",
            "reason=NodeSlicesExhausted",
            "-o",
            "jsonpath={.items[*].message}",
        ])
    };
    assert!(
        eventually(20, || events().contains(&format!(
            "nodeslicepool {net}: every one of its 2 slices is taken"
        ))),
        "{}",
        events()
    );
}
