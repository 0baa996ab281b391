//! What a real cluster does every day, on the real kubelet (issue 25):
//! - an eviction (what `kubectl drain` and the cluster autoscaler call) and a scheduler preemption
//!   of a pod whose preStop hook keeps its container running. The API server marks the pod
//!   (`DisruptionTarget`) at the start of its termination; its address must stay with it until
//!   the kubelet has torn its sandbox down, and a pod started meanwhile must get another;
//! - a static pod, which the kubelet runs under one UID (the one the plugin records) and mirrors
//!   into the API under another: the operator's audits must keep its address.

use std::path::PathBuf;
use std::time::Duration;

use serde_json::Value;

use crate::cluster::{
    POD_POOL, Workload, entries_of, get_json, indented, kubectl, kubectl_ok, node, wait_until,
};

/// A pod spec whose termination takes `stop_secs` (a preStop hook that sleeps), within a grace
/// period of twice that; `extra` is added to its container (indented by 4).
fn slow_to_stop_spec(stop_secs: u32, extra: &str) -> String {
    let image = node().get("BUSYBOX_IMAGE");
    let command = crate::cluster::POD_COMMAND;
    format!(
        r#"terminationGracePeriodSeconds: {grace}
automountServiceAccountToken: false
enableServiceLinks: false
containers:
  - name: main
    image: {image}
    imagePullPolicy: Never
    command: ["/bin/sh", "-c", "{command}"]
    lifecycle:
      preStop:
        exec: {{command: ["/bin/sh", "-c", "sleep {stop_secs}"]}}
{extra}"#,
        grace = 2 * stop_secs
    )
}

/// A Deployment of one pod whose termination takes `stop_secs`.
fn slow_to_stop(w: &Workload, stop_secs: u32) {
    w.deployment_of("slow", 1, &indented(&slow_to_stop_spec(stop_secs, ""), 6));
}

/// Whether `pod` is terminating, marked as a disruption for `reason`.
fn marked(pod: Option<&Value>, reason: &str) -> bool {
    pod.is_some_and(|p| {
        !p["metadata"]["deletionTimestamp"].is_null()
            && p["status"]["conditions"].as_array().is_some_and(|c| {
                c.iter()
                    .any(|c| c["type"] == "DisruptionTarget" && c["reason"] == reason)
            })
    })
}

#[test]
fn an_evicted_pod_keeps_its_address_until_its_container_is_gone() {
    let w = Workload::new("evict");
    slow_to_stop(&w, 30);
    let pods = w.wait_running("app=slow", 1, 180);
    let old = pods[0]["metadata"]["name"].as_str().unwrap().to_owned();
    let old_ip = pods[0]["status"]["podIP"].as_str().unwrap().to_owned();
    let old_ref = format!("{}/{old}", w.ns);
    let eviction = format!(
        r#"{{"apiVersion": "policy/v1", "kind": "Eviction", "metadata": {{"name": "{old}", "namespace": "{}"}}}}"#,
        w.ns
    );
    let path = format!("/api/v1/namespaces/{}/pods/{old}/eviction", w.ns);
    let out = kubectl(&["create", "--raw", &path, "-f", "-"], Some(&eviction));
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );

    // The replacement runs while the evicted pod still stops (its preStop sleeps 30 s).
    let mut new_ip = String::new();
    wait_until(90, "the replacement Running", || {
        let ready = w
            .pods(Some("app=slow"))
            .into_iter()
            .find(|p| p["metadata"]["name"] != old.as_str() && crate::cluster::is_ready(p));
        match ready {
            Some(p) => {
                new_ip = p["status"]["podIP"].as_str().unwrap_or_default().to_owned();
                Ok(())
            }
            None => Err("not yet".into()),
        }
    });
    let terminating = get_json(&["-n", &w.ns, "get", "pod", &old]);
    assert!(
        marked(terminating.as_ref(), "EvictionByEvictionAPI"),
        "the evicted pod is not terminating now: {terminating:?}"
    );
    assert_ne!(
        new_ip, old_ip,
        "the replacement got the evicted pod's address while it runs"
    );
    assert!(
        entries_of(POD_POOL, &w.ns).iter().any(|e| e.0 == old_ref),
        "the evicted pod's entry went while it still runs: {:?}",
        entries_of(POD_POOL, &w.ns)
    );

    // Once its container has stopped, the kubelet's DEL frees it.
    wait_until(120, "the evicted pod gone, and its entry", || {
        let entries = entries_of(POD_POOL, &w.ns);
        let gone = get_json(&["-n", &w.ns, "get", "pod", &old]).is_none();
        if gone && entries.len() == 1 && entries[0].0 != old_ref {
            Ok(())
        } else {
            Err(format!("pod gone: {gone}; entries {entries:?}"))
        }
    });
}

/// The node's allocatable CPU in millicores.
fn allocatable_millicores() -> u64 {
    let node = get_json(&["get", "node", node().get("NODE_NAME")]).expect("the node");
    let cpu = node["status"]["allocatable"]["cpu"].as_str().unwrap();
    match cpu.strip_suffix('m') {
        Some(m) => m.parse().unwrap(),
        None => cpu.parse::<u64>().unwrap() * 1000,
    }
}

/// A bare pod `name` (label app=`name`) of `spec` (indented by 2).
fn pod(w: &Workload, name: &str, spec: &str) {
    w.apply(&format!(
        "apiVersion: v1\nkind: Pod\nmetadata: {{name: {name}, labels: {{app: {name}}}}}\nspec:\n{spec}\n"
    ));
}

/// Deletes a cluster-scoped object when dropped (a failed test leaves nothing behind).
struct ClusterObject(&'static str, String);

impl Drop for ClusterObject {
    fn drop(&mut self) {
        let _ = kubectl(&["delete", self.0, &self.1, "--wait=false"], None);
    }
}

/// A higher-priority pod preempts a running one on a full node. The scheduler marks the victim
/// (`DisruptionTarget: PreemptionByScheduler`) as its graceful termination starts; the victim's
/// preStop hook keeps its container running for 45 s, during which its address stays its own.
#[test]
fn a_preempted_pod_keeps_its_address_until_its_container_is_gone() {
    let w = Workload::new("preempt");
    let class = ClusterObject("priorityclass", format!("{}-high", w.ns));
    kubectl_ok(&["create", "priorityclass", &class.1, "--value=1000000"]);
    // Each asks for 60% of the node: the two cannot run together.
    let cpu = allocatable_millicores() * 6 / 10;
    let requests = format!("    resources: {{requests: {{cpu: {cpu}m}}}}");
    pod(
        &w,
        "victim",
        &indented(&slow_to_stop_spec(45, &requests), 2),
    );
    let victim = w.wait_running("app=victim", 1, 180).remove(0);
    let victim_ip = victim["status"]["podIP"].as_str().unwrap().to_owned();
    let victim_ref = format!("{}/victim", w.ns);

    let preemptor = format!("priorityClassName: {}\n{}", class.1, w.pod_spec(0));
    let preemptor = format!("{preemptor}\n    resources: {{requests: {{cpu: {cpu}m}}}}");
    pod(&w, "preemptor", &indented(&preemptor, 2));
    wait_until(90, "the victim preempted", || {
        let p = get_json(&["-n", &w.ns, "get", "pod", "victim"]);
        match marked(p.as_ref(), "PreemptionByScheduler") {
            true => Ok(()),
            false => Err(format!("{p:?}")),
        }
    });

    // A pod started while the victim stops gets another address, and the victim keeps its own
    // through the operator's audits (every 10 s here).
    pod(&w, "probe", &indented(&w.pod_spec(0), 2));
    let probe = w.wait_running("app=probe", 1, 60).remove(0);
    assert_ne!(
        probe["status"]["podIP"].as_str(),
        Some(victim_ip.as_str()),
        "a pod started meanwhile got the preempted pod's address while it runs"
    );
    std::thread::sleep(Duration::from_secs(12));
    let still = get_json(&["-n", &w.ns, "get", "pod", "victim"]);
    assert!(
        marked(still.as_ref(), "PreemptionByScheduler"),
        "the victim stopped too soon for the check: {still:?}"
    );
    assert!(
        entries_of(POD_POOL, &w.ns)
            .iter()
            .any(|e| e.0 == victim_ref),
        "the preempted pod's entry went while it still runs: {:?}",
        entries_of(POD_POOL, &w.ns)
    );

    // Once its container has stopped, the kubelet's DEL frees it, and the preemptor runs.
    wait_until(150, "the victim gone, and its entry", || {
        let entries = entries_of(POD_POOL, &w.ns);
        match entries.iter().any(|e| e.0 == victim_ref) {
            false => Ok(()),
            true => Err(format!("entries {entries:?}")),
        }
    });
    w.wait_running("app=preemptor", 1, 120);
}

/// Removes a static pod's manifest when dropped: the kubelet then stops the pod.
struct Manifest(PathBuf);

impl Drop for Manifest {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.0);
    }
}

/// A static pod: the kubelet passes the plugin the static pod's UID (its config hash); the API
/// has only its mirror pod, under another UID, carrying that hash in
/// `kubernetes.io/config.mirror`. Audits must match the two and keep the address; removing the
/// manifest stops the pod and its DEL frees it.
#[test]
fn a_static_pod_keeps_its_address_across_audits() {
    let w = Workload::new("static");
    let node = node();
    let mirror = format!("web-{}", node.get("NODE_NAME"));
    let manifest =
        Manifest(PathBuf::from(node.get("STATIC_POD_PATH")).join(format!("{}.yaml", w.ns)));
    let yaml = format!(
        "apiVersion: v1\nkind: Pod\nmetadata: {{name: web, namespace: {}, labels: {{app: static}}}}\nspec:\n{}\n",
        w.ns,
        w.pod_spec(2)
    );
    std::fs::write(&manifest.0, yaml).expect("write the static pod's manifest");
    let pod = w.wait_running("app=static", 1, 180).remove(0);
    assert_eq!(pod["metadata"]["name"], mirror.as_str());
    let hash = pod["metadata"]["annotations"]["kubernetes.io/config.mirror"].clone();
    assert!(
        hash.is_string() && hash != pod["metadata"]["uid"],
        "not a mirror pod with its own UID: {pod}"
    );
    let ip = pod["status"]["podIP"].as_str().unwrap().to_owned();
    let podref = format!("{}/{mirror}", w.ns);

    // Four audits at the tests' pace (every 10 s, stale grace 10 s): the entry stays, the pod
    // keeps its address.
    std::thread::sleep(Duration::from_secs(45));
    let entries = entries_of(POD_POOL, &w.ns);
    assert!(
        entries.iter().any(|e| e.0 == podref),
        "the static pod's entry was freed while it runs: {entries:?}"
    );
    let again = w.wait_running("app=static", 1, 10).remove(0);
    assert_eq!(again["status"]["podIP"].as_str(), Some(ip.as_str()));

    drop(manifest);
    wait_until(120, "the static pod stopped, and its entry freed", || {
        let entries = entries_of(POD_POOL, &w.ns);
        let gone = get_json(&["-n", &w.ns, "get", "pod", &mirror]).is_none();
        match gone && entries.is_empty() {
            true => Ok(()),
            false => Err(format!("mirror gone: {gone}; entries {entries:?}")),
        }
    });
}
