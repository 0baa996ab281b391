//! The node misbehaving: a kubelet that dies with its pods force-deleted, the agent and containerd
//! restarted under load, the DaemonSet rolled while pods start, the API server paused and the
//! agent frozen mid-burst.

use std::collections::{BTreeMap, BTreeSet};
use std::time::{Duration, Instant};

use crate::addresses::distinct_pod_ips;
use crate::cluster::{
    NET2_POOL, POD_POOL, POD_POOL6, SYSTEM_NS, Workload, agent_log, entries_of, get_json,
    kubectl_ok, node, reservations_of, wait_until,
};

/// The pool entries of `ns` and its reservations match `pods` exactly (one per pod per network).
fn converged(w: &Workload, pods: usize) -> Result<(), String> {
    let state = (
        entries_of(POD_POOL, &w.ns).len(),
        entries_of(POD_POOL6, &w.ns).len(),
        entries_of(NET2_POOL, &w.ns).len(),
        reservations_of(&w.ns),
    );
    if state == (pods, pods, pods, 3 * pods) {
        Ok(())
    } else {
        Err(format!(
            "eth0 IPv4 and IPv6 entries, net1 entries, reservations: {state:?}, want {pods} each"
        ))
    }
}

/// podIP by pod name.
fn ips(pods: &[serde_json::Value]) -> BTreeMap<String, String> {
    pods.iter()
        .map(|p| {
            (
                p["metadata"]["name"].as_str().unwrap().to_string(),
                p["status"]["podIP"]
                    .as_str()
                    .unwrap_or_default()
                    .to_string(),
            )
        })
        .collect()
}

fn bare_pod(w: &Workload, name: &str) -> String {
    format!(
        "apiVersion: v1\nkind: Pod\nmetadata: {{name: {name}, labels: {{app: bare}}}}\nspec:\n{}\n",
        w.pod_spec(2)
    )
}

#[test]
fn a_dead_kubelets_force_deleted_pods_keep_their_addresses_until_its_dels() {
    let node = node();
    let w = Workload::new("nodefail");
    w.deployment("keep", 3);
    for i in 0..4 {
        w.apply(&bare_pod(&w, &format!("doomed-{i}")));
    }
    let keep = ips(&w.wait_running("app=keep", 3, 180));
    let doomed = w.wait_running("app=bare", 4, 180);
    let doomed_containers: BTreeSet<String> = entries_of(POD_POOL, &w.ns)
        .into_iter()
        .filter(|e| e.0.contains("/doomed-"))
        .map(|e| e.2)
        .collect();
    assert_eq!(doomed_containers.len(), 4);
    distinct_pod_ips(&doomed);
    assert_eq!(
        ready_sandboxes(node)
            .intersection(&doomed_containers)
            .count(),
        4,
        "the pool's container ids are the runtime's ready sandboxes"
    );

    // The kubelet dies; its containers keep running. The pods are force-deleted from the API.
    node.script("stop", "kubelet");
    let stopped = Instant::now();
    kubectl_ok(&[
        "-n",
        &w.ns,
        "delete",
        "pod",
        "-l",
        "app=bare",
        "--force",
        "--grace-period=0",
    ]);
    // Their containers still run: the operator leaves their addresses to the kubelet's DEL (for
    // --deleted-pod-grace on a Ready node, and for as long as the node is NotReady), so no
    // pending pod can take an address a running container uses. They were freed at once.
    std::thread::sleep(Duration::from_secs(8));
    let doomed_entries = || -> Vec<(String, String, String)> {
        entries_of(POD_POOL, &w.ns)
            .into_iter()
            .chain(entries_of(NET2_POOL, &w.ns))
            .filter(|e| e.0.contains("/doomed-"))
            .collect()
    };
    assert_eq!(
        doomed_entries().len(),
        8,
        "a force-deleted pod's address was freed while its container ran"
    );
    // New pods, created while the kubelet is down, wait for it.
    for i in 0..4 {
        w.apply(&bare_pod(&w, &format!("fresh-{i}")));
    }
    assert!(
        stopped.elapsed() < Duration::from_secs(35),
        "the kubelet was down for {:?}: the node would go NotReady and evict",
        stopped.elapsed()
    );
    node.script("start", "kubelet");
    // The kubelet kills the dead pods' sandboxes (CNI DEL with their container ids, which frees
    // their entries) and starts the fresh pods (CNI ADD), in whatever order.
    let fresh = w.wait_running("app=bare", 4, 180);
    let fresh_ips = distinct_pod_ips(&fresh);
    let keep_now = ips(&w.wait_running("app=keep", 3, 60));
    assert_eq!(keep, keep_now, "a live pod's address changed");
    assert!(
        fresh_ips.is_disjoint(&keep.values().cloned().collect()),
        "a fresh pod got a live pod's address"
    );
    wait_until(90, "the dead pods' entries freed", || {
        let left = doomed_entries();
        if left.is_empty() {
            Ok(())
        } else {
            Err(format!("{left:?}"))
        }
    });
    // Stopped, in the runtime's view (the kubelet's garbage collection removes them later).
    wait_until(90, "the dead sandboxes stopped by the kubelet", || {
        let left: Vec<_> = ready_sandboxes(node)
            .intersection(&doomed_containers)
            .cloned()
            .collect();
        if left.is_empty() {
            Ok(())
        } else {
            Err(format!("{left:?}"))
        }
    });
    // The runtime's DELs of the dead sandboxes reached our plugin (through the agent)...
    wait_until(60, "a DEL served for each dead sandbox", || {
        let log = agent_log();
        let missing: Vec<_> = doomed_containers
            .iter()
            .filter(|c| {
                !log.lines()
                    .any(|l| l.contains("command=Del") && l.contains(c.as_str()))
            })
            .collect();
        if missing.is_empty() {
            Ok(())
        } else {
            Err(format!("no DEL served for {missing:?}"))
        }
    });
    // ... and took nothing from the live pods, old or fresh.
    wait_until(60, "pools hold exactly the live pods", || converged(&w, 7));
    let held: BTreeSet<String> = entries_of(POD_POOL, &w.ns)
        .into_iter()
        .map(|e| e.2)
        .collect();
    assert!(held.is_disjoint(&doomed_containers), "{held:?}");
}

/// The ids of the pod sandboxes the runtime reports ready (`crictl pods --state ready`).
fn ready_sandboxes(node: &crate::cluster::Node) -> BTreeSet<String> {
    let out = node.crictl(&["pods", "--state", "ready", "-q", "--no-trunc"]);
    assert!(out.status.success(), "crictl pods: {out:?}");
    String::from_utf8_lossy(&out.stdout)
        .split_whitespace()
        .map(str::to_string)
        .collect()
}

/// The agent container's task ids on the node (the runtime's view).
fn agent_tasks() -> Vec<String> {
    let pod = get_json(&[
        "-n",
        SYSTEM_NS,
        "get",
        "pods",
        "-l",
        "app.kubernetes.io/name=whereabouts-node",
    ])
    .unwrap();
    pod["items"]
        .as_array()
        .unwrap()
        .iter()
        .flat_map(|p| {
            p["status"]["containerStatuses"]
                .as_array()
                .cloned()
                .unwrap_or_default()
        })
        .filter(|c| c["name"] == "agent")
        .filter_map(|c| {
            c["containerID"]
                .as_str()
                .and_then(|id| id.strip_prefix("containerd://"))
                .map(str::to_string)
        })
        .collect()
}

#[test]
fn killing_the_agent_and_restarting_containerd_under_load_loses_nothing() {
    let node = node();
    let w = Workload::new("restarts");
    w.deployment("web", 0);
    w.scale("deployment/web", 40);
    // Let the burst get going, then kill the agent mid-burst.
    wait_until(60, "the first pods running", || {
        let n = w.ready("app=web");
        if n >= 3 { Ok(()) } else { Err(format!("{n}")) }
    });
    let agents = agent_tasks();
    assert_eq!(agents.len(), 1, "one agent container: {agents:?}");
    let kill = node.ctr(&["tasks", "kill", "-s", "SIGKILL", &agents[0]]);
    assert!(
        kill.status.success(),
        "ctr tasks kill: {}",
        String::from_utf8_lossy(&kill.stderr)
    );
    node.script("restart", "containerd");

    let pods = w.wait_running("app=web", 40, 420);
    distinct_pod_ips(&pods);
    wait_until(120, "pools hold exactly the 40 pods", || converged(&w, 40));
    // The agent was really restarted by the kubelet.
    wait_until(60, "a new agent container", || {
        let now = agent_tasks();
        if now.len() == 1 && now[0] != agents[0] {
            Ok(())
        } else {
            Err(format!("{now:?}"))
        }
    });
    w.scale("deployment/web", 0);
    w.wait_gone("app=web", 240);
    wait_until(60, "nothing left in the pools", || converged(&w, 0));
}

#[test]
fn a_rolling_update_of_the_daemonset_while_pods_start_fails_no_pod_for_good() {
    let node = node();
    let w = Workload::new("rollout");
    // A new tag of the same image, as a release would bring.
    let image = node.get("WHEREABOUTS_IMAGE").to_string();
    let next = format!("{image}-next");
    let tag = node.ctr(&["images", "tag", "--force", &image, &next]);
    assert!(
        tag.status.success(),
        "ctr images tag: {}",
        String::from_utf8_lossy(&tag.stderr)
    );
    w.deployment("web", 0);
    w.scale("deployment/web", 30);
    roll_node_daemonset(&next);
    let pods = w.wait_running("app=web", 30, 420);
    distinct_pod_ips(&pods);
    wait_until(60, "pools hold exactly the 30 pods", || converged(&w, 30));
    // Every failed sandbox was retried into a running pod. While the node's pod is replaced, a
    // plugin may only be told to try again later (code 11), never fail otherwise, and at most
    // twice per pod (the gap outlasting one retry of the kubelet's on a loaded machine): the agent
    // went away with its request, or the node's slots stayed busy. Never for its credentials: the
    // host's token dies with the old pod (it is bound to it: docs/security.md), and a plugin that
    // meets the gap waits for the new pod's installer to write the next token (before that wait,
    // runs of this test saw 0, 12 and 21 of 30 pods fail once for it, none twice).
    let failed = w.events("FailedCreatePodSandBox");
    eprintln!(
        "rolling update: {} sandbox creations failed and were retried: {failed:?}",
        failed.len()
    );
    // Multus's own lookup of the pod, before it runs any delegate, gives the API server 250 ms
    // (multus-cni#1461, #1453): on this loaded 2-core machine it sometimes runs out during the
    // rollout (6 of 30 pods in one run). That is not the plugin's failure, so it is counted
    // apart; the kubelet retries those sandboxes like any other.
    let (multus, ours): (Vec<&String>, Vec<&String>) = (failed.iter())
        .partition(|m| m.contains("Multus: [") && m.contains("error waiting for pod"));
    eprintln!("of which Multus's own pod lookup: {}", multus.len());
    let try_again = ["node agent at /run/whereabouts/", "try again later"];
    let other: Vec<&&String> = (ours.iter())
        .filter(|m| !try_again.iter().any(|t| m.contains(t)))
        .collect();
    assert!(
        other.is_empty(),
        "sandboxes failed for another reason than 'try again later': {other:?}"
    );
    let mut per_pod: BTreeMap<&str, usize> = BTreeMap::new();
    for m in &ours {
        *per_pod.entry(m.split(':').next().unwrap()).or_default() += 1;
    }
    assert!(
        per_pod.values().all(|n| *n <= 2),
        "a pod's sandbox failed more than twice: {per_pod:?}"
    );
    // Back to the installed image, for the tests that follow.
    roll_node_daemonset(&image);
}

/// Sets both containers of the node DaemonSet to `image` and waits for the rollout.
fn roll_node_daemonset(image: &str) {
    kubectl_ok(&[
        "-n",
        SYSTEM_NS,
        "set",
        "image",
        "daemonset/whereabouts-node",
        &format!("install-cni={image}"),
        &format!("agent={image}"),
    ]);
    kubectl_ok(&[
        "-n",
        SYSTEM_NS,
        "rollout",
        "status",
        "daemonset/whereabouts-node",
        "--timeout=180s",
    ]);
}

/// An ADD slowed past the sweep's age (issue 25): the API server paused for longer than the
/// operator's orphan-claim age (40 s in this tier) while a burst of pods starts, so that claims
/// made before the pause are older than that age when it resumes, their entries not yet
/// recorded, and the operator, the agent and the kubelet all resume at once. Whatever each ADD
/// does then (records its entry, or runs out of time and is retried by the kubelet with a new
/// sandbox), no two pods share an address, and the pools end with exactly the pods' entries and
/// claims, through later audits too.
#[test]
fn an_api_server_paused_past_the_sweeps_age_mid_burst_ends_in_no_duplicate() {
    let _node = node();
    let w = Workload::new("paused");
    w.deployment("web", 0);
    w.scale("deployment/web", 30);
    wait_until(60, "the first pod running", || {
        let n = w.ready("app=web");
        if n >= 1 { Ok(()) } else { Err(format!("{n}")) }
    });
    // Claims without their entries yet: ADDs at work as the server stops.
    let at_work = reservations_of(&w.ns) as i64 - 3 * entries_of(NET2_POOL, &w.ns).len() as i64;
    let pause = std::process::Command::new(crate::harness::repo().join("e2e/cluster.sh"))
        .args(["pause", "kube-apiserver", "50"])
        .status()
        .expect("run e2e/cluster.sh pause");
    assert!(
        pause.success(),
        "e2e/cluster.sh pause kube-apiserver failed"
    );
    eprintln!("claims beyond the recorded entries as the API server paused: {at_work}");
    let pods = w.wait_running("app=web", 30, 480);
    distinct_pod_ips(&pods);
    wait_until(180, "pools hold exactly the 30 pods", || converged(&w, 30));
    // Two more audits (every 10 s, a 10 s grace): nothing is swept from under a running pod.
    std::thread::sleep(Duration::from_secs(25));
    converged(&w, 30).expect("after two more audits");
    distinct_pod_ips(&w.wait_running("app=web", 30, 60));
    w.scale("deployment/web", 0);
    w.wait_gone("app=web", 240);
    wait_until(60, "nothing left in the pools", || converged(&w, 0));
}

/// Claims the pods of `w` hold beyond their recorded entries: ADDs claimed and not recorded yet.
fn unrecorded_claims(w: &Workload) -> i64 {
    let recorded: usize = [POD_POOL, POD_POOL6, NET2_POOL]
        .iter()
        .map(|p| entries_of(p, &w.ns).len())
        .sum();
    reservations_of(&w.ns) as i64 - recorded as i64
}

/// An ADD slowed past two audits (issue 25): the node agent frozen (the cgroup freezer) at a
/// moment its claims are made and not recorded, for 15 s, while the operator audits every 2 s.
/// The sweep judges a claim by the age of its last write and spares it for --orphan-claim-age
/// (40 s here), so the thawed agent records its entries over claims that still exist. Before that
/// fix the sweep took a claim two audits had seen without an entry, and the thawed agent recorded
/// entries whose claims were gone: addresses that every overlapping pool could hand out again.
/// (The paused API server above cannot show this: the audit waits for the server too.)
#[test]
fn an_agent_frozen_mid_burst_past_two_audits_keeps_every_claim_it_records() {
    let node = node();
    crate::cluster::pace_operator_at(node, "2s", "2s", "40s");
    let w = Workload::new("frozen");
    w.deployment("web", 0);
    w.scale("deployment/web", 30);
    let agent = Freezer {
        node,
        task: agent_tasks().remove(0),
    };
    let at_work = agent.freeze_with_claims_at_work(&w, 30);
    eprintln!("claims waiting for their entries as the agent froze: {at_work}");
    std::thread::sleep(Duration::from_secs(15));
    agent.set("resume");
    let pods = w.wait_running("app=web", 30, 480);
    distinct_pod_ips(&pods);
    let done = wait_until_ok(120, || converged(&w, 30));
    crate::cluster::pace_operator(node);
    done.expect("pools hold exactly the 30 pods, each entry with its claim");
    w.scale("deployment/web", 0);
    w.wait_gone("app=web", 240);
    wait_until(60, "nothing left in the pools", || converged(&w, 0));
}

/// The node agent's container, frozen and thawed through the cgroup freezer.
struct Freezer<'a> {
    node: &'a crate::cluster::Node,
    task: String,
}

impl Freezer<'_> {
    fn set(&self, verb: &str) {
        let out = self.node.ctr(&["tasks", verb, &self.task]);
        assert!(
            out.status.success(),
            "ctr tasks {verb}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
    }

    /// Leaves the agent frozen at a moment claims of `w` wait for their entries; returns how
    /// many. Frozen, the pools and claims stand still, so each look is exact. The agent takes
    /// the ADDs queued while it was frozen at once when thawed, so it is frozen again at varied
    /// delays after each thaw; a burst of `pods` that ends without such a moment is run again.
    fn freeze_with_claims_at_work(&self, w: &Workload, pods: usize) -> i64 {
        const DELAYS_MS: [u64; 6] = [10, 25, 50, 100, 200, 400];
        for burst in 0..3 {
            if burst > 0 {
                eprintln!("burst {burst} ended without claims at work: once more");
                w.scale("deployment/web", 0);
                w.wait_gone("app=web", 240);
                w.scale("deployment/web", pods as u32);
            }
            for tick in 0.. {
                self.set("pause");
                let n = unrecorded_claims(w);
                if n > 0 {
                    return n;
                }
                let ready = w.ready("app=web");
                self.set("resume");
                if ready == pods {
                    break;
                }
                std::thread::sleep(Duration::from_millis(DELAYS_MS[tick % DELAYS_MS.len()]));
            }
        }
        panic!("three bursts of {pods} pods without a moment with claims at work");
    }
}

/// `check` until it holds or `secs` pass: its last answer (the caller restores state first).
fn wait_until_ok(secs: u64, mut check: impl FnMut() -> Result<(), String>) -> Result<(), String> {
    let deadline = Instant::now() + Duration::from_secs(secs);
    loop {
        let result = check();
        if result.is_ok() || Instant::now() > deadline {
            return result;
        }
        std::thread::sleep(Duration::from_secs(1));
    }
}
