//! Real pods through the real runtime: a Deployment of 60 and back to 0, and the StatefulSet
//! replacement that upstream's cleanup got wrong, whose net1 address (`sticky_statefulset`)
//! stays with its ordinal until the StatefulSet scales below it.

use std::collections::BTreeSet;

use crate::addresses::check_pods_against_pools;
use crate::cluster::{
    NET2_POOL, POD_POOL, POD_POOL6, Workload, entries_of, reservations_of, wait_until,
};

#[test]
fn a_deployment_of_60_gets_60_distinct_addresses_and_gives_them_back() {
    let w = Workload::new("scale");
    w.deployment("web", 0);
    w.scale("deployment/web", 60);
    let pods = w.wait_running("app=web", 60, 420);
    check_pods_against_pools(&w, &pods);

    w.scale("deployment/web", 0);
    w.wait_gone("app=web", 240);
    // The kubelet's DELs (not the operator: the pods are gone from the API only after them).
    wait_until(60, "pools and reservations empty of the namespace", || {
        let left = (
            entries_of(POD_POOL, &w.ns).len(),
            entries_of(POD_POOL6, &w.ns).len(),
            entries_of(NET2_POOL, &w.ns).len(),
            reservations_of(&w.ns),
        );
        if left == (0, 0, 0, 0) {
            Ok(())
        } else {
            Err(format!(
                "entries eth0 IPv4/IPv6, net1, reservations: {left:?}"
            ))
        }
    });
}

#[test]
fn a_statefulset_replacement_pod_gets_an_address_and_the_old_one_is_freed() {
    let w = Workload::new("sts");
    w.apply(&format!(
        r#"apiVersion: apps/v1
kind: StatefulSet
metadata: {{name: web}}
spec:
  replicas: 3
  serviceName: web
  podManagementPolicy: Parallel
  selector: {{matchLabels: {{app: web}}}}
  template:
    metadata: {{labels: {{app: web}}}}
    spec:
{}
"#,
        w.pod_spec(6)
    ));
    let pods = w.wait_running("app=web", 3, 180);
    check_pods_against_pools(&w, &pods);
    let old = pods
        .iter()
        .find(|p| p["metadata"]["name"] == "web-1")
        .unwrap();
    let old_uid = old["metadata"]["uid"].as_str().unwrap().to_string();
    let old_containers: BTreeSet<String> = entries_of(POD_POOL, &w.ns)
        .into_iter()
        .filter(|e| e.0.ends_with("/web-1"))
        .map(|e| e.2)
        .collect();
    assert_eq!(old_containers.len(), 1);
    let sticky_of = |pod: &str| {
        entries_of(NET2_POOL, &w.ns)
            .into_iter()
            .find(|e| e.0 == format!("{}/{pod}", w.ns))
            .map(|e| e.1)
    };
    let old_net1 = sticky_of("web-1").expect("web-1 has a net1 entry");
    let held = crate::cluster::pool_entries(NET2_POOL);
    assert_eq!(
        held[&old_net1]["statefulset"], "web",
        "{:?}",
        held[&old_net1]
    );

    crate::cluster::kubectl_ok(&["-n", &w.ns, "delete", "pod", "web-1", "--wait=false"]);
    // The replacement has the same name and a new UID.
    wait_until(180, "web-1 replaced and Running", || {
        let pods = w.pods(Some("app=web"));
        let new = pods.iter().find(|p| {
            p["metadata"]["name"] == "web-1" && p["metadata"]["uid"].as_str() != Some(&old_uid)
        });
        match new {
            Some(p) if crate::cluster::is_ready(p) && pods.len() == 3 => Ok(()),
            _ => Err(crate::cluster::summary(&pods)),
        }
    });
    let pods = w.wait_running("app=web", 3, 60);
    check_pods_against_pools(&w, &pods);
    // Nothing of the old container stays allocated.
    let now: BTreeSet<String> = entries_of(POD_POOL, &w.ns)
        .into_iter()
        .chain(entries_of(NET2_POOL, &w.ns))
        .map(|e| e.2)
        .collect();
    assert!(
        now.is_disjoint(&old_containers),
        "the old sandbox {old_containers:?} still holds an entry: {now:?}"
    );
    // On net1 the replacement has its predecessor's address: the ordinal kept it.
    assert_eq!(sticky_of("web-1").as_deref(), Some(old_net1.as_str()));
    // Scaled to two, web-2's net1 address is freed by the operator once the pod is gone.
    let web2 = sticky_of("web-2").expect("web-2 has a net1 entry");
    w.scale("statefulset/web", 2);
    wait_until(
        120,
        "web-2's sticky net1 address freed",
        || match crate::cluster::pool_entries(NET2_POOL).get(&web2) {
            Some(e) if e["podref"] == format!("{}/web-2", w.ns) => Err(format!("held: {e}")),
            _ => Ok(()),
        },
    );
    assert!(
        w.events("HeldAddressReleased")
            .iter()
            .any(|n| n.contains("has 2 replicas")),
        "{:?}",
        w.events("HeldAddressReleased")
    );
    assert_eq!(sticky_of("web-1").as_deref(), Some(old_net1.as_str()));
}
