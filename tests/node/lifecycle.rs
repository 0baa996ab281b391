//! What a real cluster does every day, on the real kubelet: an eviction (what `kubectl drain` and
//! the cluster autoscaler call) of a pod whose preStop hook keeps its container running. The API
//! server marks the pod (`DisruptionTarget: EvictionByEvictionAPI`) at the start of its
//! termination; its address must stay with it until the kubelet has torn its sandbox down, and
//! its replacement, running meanwhile, must get another (issue 25).

use crate::cluster::{
    POD_POOL, Workload, entries_of, get_json, indented, kubectl, node, wait_until,
};

/// A Deployment of one pod whose termination takes `stop_secs` (a preStop hook that sleeps),
/// within a grace period of twice that.
fn slow_to_stop(w: &Workload, stop_secs: u32) {
    let image = node().get("BUSYBOX_IMAGE");
    let command = crate::cluster::POD_COMMAND;
    let spec = format!(
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
        exec: {{command: ["/bin/sh", "-c", "sleep {stop_secs}"]}}"#,
        grace = 2 * stop_secs
    );
    w.deployment_of("slow", 1, &indented(&spec, 6));
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
    let marked = terminating.as_ref().is_some_and(|p| {
        !p["metadata"]["deletionTimestamp"].is_null()
            && p["status"]["conditions"].as_array().is_some_and(|c| {
                c.iter().any(|c| {
                    c["type"] == "DisruptionTarget" && c["reason"] == "EvictionByEvictionAPI"
                })
            })
    });
    assert!(
        marked,
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
