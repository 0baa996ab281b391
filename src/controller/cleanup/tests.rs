use super::*;
use k8s_openapi::api::core::v1::PodCondition;
use kube::api::ObjectMeta;

fn pod(phase: &str) -> Pod {
    Pod {
        metadata: ObjectMeta {
            name: Some("web-0".into()),
            namespace: Some("ns".into()),
            uid: Some("u1".into()),
            annotations: Some(
                [
                    (
                        NETWORK_STATUS_ANNOTATION.to_owned(),
                        r#"[{"name":"ns/net","ips":["10.0.0.5"]}]"#.to_owned(),
                    ),
                    ("big".to_owned(), "x".repeat(1000)),
                ]
                .into(),
            ),
            ..Default::default()
        },
        spec: Some(Default::default()),
        status: Some(PodStatus {
            phase: Some(phase.into()),
            host_ip: Some("192.0.2.1".into()),
            ..Default::default()
        }),
    }
}

#[test]
fn trimming_keeps_what_cleanup_needs() {
    let mut p = pod("Running");
    p.spec = Some(PodSpec {
        node_name: Some("node-1".into()),
        hostname: Some("web-0".into()),
        ..Default::default()
    });
    trim(&mut p);
    let spec = p.spec.as_ref().unwrap();
    assert_eq!(spec.node_name.as_deref(), Some("node-1"));
    assert_eq!(spec.hostname, None);
    assert!(spec.containers.is_empty());
    assert_eq!(p.annotations().len(), 1);
    assert_eq!(p.status.as_ref().unwrap().host_ip, None);
    assert_eq!(
        identity(&p),
        PodIdentity {
            podref: "ns/web-0".into(),
            uid: "u1".into(),
            addresses: vec!["10.0.0.5".parse().unwrap()]
        }
    );
}

#[test]
fn finished_pods() {
    use NodeHealth::*;
    for node in [Ready, NotReady, Gone] {
        assert_eq!(finished(&pod("Running"), node), None);
        assert_eq!(finished(&pod("Succeeded"), node), Some(Trigger::Finished));
        assert_eq!(finished(&pod("Failed"), node), Some(Trigger::Finished));
    }
    let mut terminating = pod("Running");
    terminating.metadata.deletion_timestamp = Some(
        k8s_openapi::apimachinery::pkg::apis::meta::v1::Time(Default::default()),
    );
    for node in [Ready, NotReady, Gone] {
        assert_eq!(finished(&terminating, node), None, "a graceful deletion");
    }
    // Every graceful termination that Kubernetes marks: never due, whatever the node.
    let marked = |reason: &str| {
        let mut p = terminating.clone();
        p.status.as_mut().unwrap().conditions = Some(vec![PodCondition {
            type_: "DisruptionTarget".into(),
            status: "True".into(),
            reason: Some(reason.into()),
            ..Default::default()
        }]);
        p
    };
    for reason in [
        "EvictionByEvictionAPI",
        "PreemptionByScheduler",
        "DeletionByPodGC",
        "TerminationByKubelet",
    ] {
        for node in [Ready, NotReady, Gone] {
            assert_eq!(
                finished(&marked(reason), node),
                None,
                "{reason} on {node:?}"
            );
        }
    }
    // The taint manager's eviction of a lost node's pod: due, unless the node is Ready again
    // (a NoExecute taint an admin set on a live node evicts gracefully too).
    let evicted = marked(TAINT_MANAGER);
    assert_eq!(finished(&evicted, NotReady), Some(Trigger::NodeLost));
    assert_eq!(finished(&evicted, Gone), Some(Trigger::NodeLost));
    assert_eq!(finished(&evicted, Ready), None);
    let mut node_lost = terminating.clone();
    node_lost.status.as_mut().unwrap().reason = Some("NodeLost".into());
    assert_eq!(finished(&node_lost, NotReady), Some(Trigger::NodeLost));
    assert_eq!(finished(&node_lost, Ready), None);
}

#[test]
fn node_health_reads_the_ready_condition() {
    use k8s_openapi::api::core::v1::{NodeCondition, NodeStatus};
    let (store, mut writer) = kube::runtime::reflector::store::<Node>();
    let node = |name: &str, ready: Option<&str>| {
        let mut n = Node::default();
        n.metadata.name = Some(name.into());
        n.status = Some(NodeStatus {
            conditions: ready.map(|r| {
                vec![NodeCondition {
                    type_: "Ready".into(),
                    status: r.into(),
                    ..Default::default()
                }]
            }),
            ..Default::default()
        });
        n
    };
    for n in [
        node("up", Some("True")),
        node("down", Some("Unknown")),
        node("new", None),
    ] {
        writer.apply_watcher_event(&kube::runtime::watcher::Event::Apply(n));
    }
    let on = |name: Option<&str>| {
        let mut p = pod("Running");
        p.spec = Some(PodSpec {
            node_name: name.map(Into::into),
            ..Default::default()
        });
        node_health(&p, &store)
    };
    assert_eq!(on(Some("up")), NodeHealth::Ready);
    assert_eq!(on(Some("down")), NodeHealth::NotReady);
    assert_eq!(on(Some("new")), NodeHealth::NotReady);
    assert_eq!(on(Some("deleted")), NodeHealth::Gone);
    assert_eq!(on(None), NodeHealth::Gone);
}

#[test]
fn a_bad_annotation_still_gives_an_identity() {
    let mut p = pod("Running");
    p.annotations_mut()
        .insert(NETWORK_STATUS_ANNOTATION.into(), "{oops".into());
    assert!(identity(&p).addresses.is_empty());
}
