use super::*;

#[test]
fn a_mirror_pod_answers_for_its_static_pod() {
    use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;
    let meta = ObjectMeta {
        uid: Some("mirror-uid".into()),
        annotations: Some([(MIRROR_ANNOTATION.to_owned(), "6f1c2a".to_owned())].into()),
        ..Default::default()
    };
    let live = HashMap::from([("kube-system/etcd-n1".to_owned(), runtime_uid(&meta))]);
    assert!(!is_stale(&entry("kube-system/etcd-n1", "6f1c2a"), &live));
    assert!(is_stale(&entry("kube-system/etcd-n1", "mirror-uid"), &live));
}

fn entry(podref: &str, uid: &str) -> IPAllocation {
    IPAllocation {
        id: "c".into(),
        podref: podref.into(),
        poduid: uid.into(),
        ..Default::default()
    }
}

#[test]
fn uid_decides_when_recorded() {
    let old = PodIdentity {
        podref: "ns/web-0".into(),
        uid: "old".into(),
        addresses: vec![],
    };
    let ip: IpAddr = "10.0.0.5".parse().unwrap();
    assert!(belongs_to(&entry("ns/web-0", "old"), ip, &old));
    // The StatefulSet replacement's entry is never the old pod's.
    assert!(!belongs_to(&entry("ns/web-0", "new"), ip, &old));
    assert!(!belongs_to(&entry("ns/web-1", "old"), ip, &old));
}

#[test]
fn without_uid_the_network_status_decides() {
    let statuses = parse_network_status(
        r#"[{"name":"kindnet","interface":"eth0","ips":["10.244.0.5"],"default":true},
        {"name":"ns/macvlan","interface":"net1","ips":["10.0.0.5","fd00::5"],"mac":"aa:bb"}]"#,
    )
    .unwrap();
    let pod = PodIdentity {
        podref: "ns/p".into(),
        uid: "u".into(),
        addresses: secondary_addresses(&statuses),
    };
    assert_eq!(pod.addresses.len(), 2);
    assert!(belongs_to(
        &entry("ns/p", ""),
        "10.0.0.5".parse().unwrap(),
        &pod
    ));
    assert!(belongs_to(
        &entry("ns/p", ""),
        "fd00::5".parse().unwrap(),
        &pod
    ));
    assert!(!belongs_to(
        &entry("ns/p", ""),
        "10.0.0.6".parse().unwrap(),
        &pod
    ));
    assert!(
        !belongs_to(&entry("ns/p", ""), "10.244.0.5".parse().unwrap(), &pod),
        "default network addresses are not ours"
    );
}

#[test]
fn held_entries_are_never_a_pods() {
    let live = HashMap::new();
    let claimed = IPAllocation {
        ipamclaimref: "vms/vm1.net".into(),
        ..entry("ns/gone", "x")
    };
    let sticky = IPAllocation {
        statefulset: "web".into(),
        ..entry("ns/web-0", "x")
    };
    for held in [&claimed, &sticky] {
        assert!(!is_stale(held, &live));
        assert!(is_pod_gone(held, &live));
        let pod = PodIdentity {
            podref: held.podref.clone(),
            uid: "x".into(),
            addresses: vec![],
        };
        assert!(!belongs_to(held, "10.0.0.5".parse().unwrap(), &pod));
    }
}

#[test]
fn staleness() {
    let live = HashMap::from([("ns/a".to_owned(), "ua".to_owned())]);
    assert!(!is_stale(&entry("ns/a", "ua"), &live));
    assert!(!is_stale(&entry("ns/a", ""), &live));
    assert!(is_stale(&entry("ns/a", "older"), &live));
    assert!(is_stale(&entry("ns/gone", "x"), &live));
}

#[test]
fn an_earlier_sandbox_entry_is_superseded_by_the_listed_address() {
    let statuses = parse_network_status(
        r#"[{"name":"kindnet","interface":"eth0","ips":["10.244.0.5"],"default":true},
        {"name":"ns/macvlan","interface":"net1","ips":["10.0.0.7","fd00::7"]}]"#,
    )
    .unwrap();
    let by_if = addresses_by_interface(&statuses);
    let on = |ifname: &str| IPAllocation {
        ifname: ifname.into(),
        ..entry("ns/p", "u")
    };
    let ip = |s: &str| -> IpAddr { s.parse().unwrap() };
    // The sandbox that lives holds .7; an entry of the same interface at .5 is left over.
    assert!(is_superseded(&on("net1"), ip("10.0.0.5"), &by_if));
    assert!(is_superseded(&on("net1"), ip("fd00::5"), &by_if));
    assert!(!is_superseded(&on("net1"), ip("10.0.0.7"), &by_if));
    // Another interface, an entry without an interface, a family the status does not list:
    // nothing to compare with, so never superseded.
    assert!(!is_superseded(&on("net2"), ip("10.0.0.5"), &by_if));
    assert!(!is_superseded(&on(""), ip("10.0.0.5"), &by_if));
    let v4_only = addresses_by_interface(
        &parse_network_status(r#"[{"name":"ns/m","interface":"net1","ips":["10.0.0.7"]}]"#)
            .unwrap(),
    );
    assert!(!is_superseded(&on("net1"), ip("fd00::5"), &v4_only));
    // The default network's interface is not ours to judge.
    assert!(!is_superseded(&on("eth0"), ip("10.244.0.6"), &by_if));
}

#[test]
fn bad_annotation_is_a_problem_not_a_panic() {
    let e = parse_network_status("{not json").unwrap_err();
    assert!(
        e.to_string().starts_with(
            "annotation k8s.v1.cni.cncf.io/network-status is not a network-status list"
        )
    );
    assert!(parse_network_status(r#"[{"ips":["x"]}]"#).is_err());
}

/// One row: an owner as some writer records it, and what each comparison answers against the
/// reference attachment (our ADD of `ns/web-0`'s `net1` in container `c1`, UID `u1`).
struct Row {
    writer: &'static str,
    other: Owner,
    attachment: bool,
    container: bool,
    claimant: bool,
    pod_interface: bool,
    rewrite: bool,
    take_over: bool,
    incarnation: Incarnation,
}

fn owner(container: &str, ifname: &str, podref: &str, uid: &str, holder: Holder) -> Owner {
    Owner {
        container_id: container.into(),
        ifname: ifname.into(),
        podref: podref.into(),
        pod_uid: uid.into(),
        node: "n1".into(),
        holder,
    }
}

/// `o` on another node (empty: a record of no known node).
fn on(node: &str, o: Owner) -> Owner {
    Owner {
        node: node.into(),
        ..o
    }
}

#[rustfmt::skip]
fn rows() -> Vec<Row> {
    use Incarnation::*;
    let pod = Holder::Pod;
    let web = || Holder::StatefulSet("web".into());
    let row = |writer, other, [attachment, container, claimant, pod_interface, rewrite, take_over]: [bool; 6], incarnation| Row {
        writer, other, attachment, container, claimant, pod_interface, rewrite, take_over, incarnation,
    };
    vec![
        //                                                                                                      attach container claimant pod-if rewrite take-over
        row("the same ADD again (plugin, agent group, writer turn)", owner("c1", "net1", "ns/web-0", "u1", pod.clone()), [true, true, true, true, true, true], Same),
        row("a new sandbox of the pod (runtime's retry)", owner("c2", "net1", "ns/web-0", "u1", pod.clone()), [false, false, false, true, true, true], Same),
        row("the same container's second network", owner("c1", "net2", "ns/web-0", "u1", pod.clone()), [false, true, true, false, true, false], Same),
        row("the StatefulSet's replacement pod", owner("c3", "net1", "ns/web-0", "u2", pod.clone()), [false, false, false, true, true, true], Other),
        row("upstream's plugin, same container (no UID, no node)", on("", owner("c1", "net1", "ns/web-0", "", pod.clone())), [true, true, true, true, true, true], Unknown),
        row("very old upstream (no interface, no UID)", on("", owner("c1", "", "ns/web-0", "", pod.clone())), [true, true, true, false, true, false], Unknown),
        row("old upstream reservation (the pod alone)", on("", owner("", "net1", "ns/web-0", "", pod.clone())), [false, false, true, true, true, true], Unknown),
        row("a DEL whose runtime passed no pod", owner("c1", "net1", "", "", pod.clone()), [true, false, false, false, true, false], Other),
        row("another pod", owner("c9", "net1", "ns/db-0", "u9", pod.clone()), [false, false, false, false, true, false], Other),
        row("the pod's entry held by its StatefulSet", owner("c1", "net1", "ns/web-0", "u1", web()), [true, true, true, true, true, true], Same),
        row("a pod of the name on another node (force-deleted, re-created)", on("n2", owner("c4", "net1", "ns/web-0", "u4", pod.clone())), [false, false, false, true, false, false], Other),
        row("another pod on another node", on("n2", owner("c9", "net1", "ns/db-0", "u9", pod.clone())), [false, false, false, false, false, false], Other),
        row("the operator (knows no node)", on("", owner("", "", "ns/web-0", "u1", pod.clone())), [false, false, true, false, true, false], Same),
    ]
}

#[test]
fn every_writer_against_every_comparison() {
    let me = owner("c1", "net1", "ns/web-0", "u1", Holder::Pod);
    for r in rows() {
        let o = &r.other;
        let got = (
            o.same_attachment(&me),
            o.same_container(&me),
            o.same_claimant(&me),
            o.same_pod_interface(&me),
            me.may_rewrite(o),
            me.may_take_over(o),
            o.incarnation(&me),
        );
        let want = (
            r.attachment,
            r.container,
            r.claimant,
            r.pod_interface,
            r.rewrite,
            r.take_over,
            r.incarnation,
        );
        assert_eq!(got, want, "{}", r.writer);
        // Every comparison is symmetric: who asks does not change the answer.
        let back = (
            me.same_attachment(o),
            me.same_container(o),
            me.same_claimant(o),
            me.same_pod_interface(o),
            o.may_rewrite(&me),
            o.may_take_over(&me),
            me.incarnation(o),
        );
        assert_eq!(back, want, "{} (asked the other way)", r.writer);
        // An entry and a claim of the same owner read back as that owner.
        let e = o.entry();
        let recorded = (
            e.container_id(),
            e.ifname(),
            e.podref(),
            e.pod_uid(),
            e.node(),
        );
        let own = (
            o.container_id(),
            o.ifname(),
            o.podref(),
            o.pod_uid(),
            o.node(),
        );
        assert_eq!(
            (recorded, Holder::of_entry(&e)),
            (own, o.holder.clone()),
            "{}",
            r.writer
        );
        assert_eq!(Owner::of_claim(&o.claim()), *o, "{}", r.writer);
    }
}

#[test]
fn pods_of_one_ipamclaim_share_its_address_and_nothing_else() {
    let claim = || Holder::Claim("vms/vm1".into());
    let first = owner("c1", "net1", "vms/virt-launcher-a", "ua", claim());
    let next = owner("c7", "net1", "vms/virt-launcher-b", "ub", claim());
    assert!(first.same_claim(&next) && next.may_take_over(&first));
    assert!(!first.same_attachment(&next) && !first.same_container(&next));
    assert!(!first.same_pod_interface(&next));
    assert_eq!(first.incarnation(&next), Incarnation::Other);
    let other_claim = owner("c8", "net1", "vms/x", "ux", Holder::Claim("vms/vm2".into()));
    assert!(!other_claim.same_claim(&first) && !other_claim.may_take_over(&first));
    let plain = owner("c1", "net1", "vms/virt-launcher-a", "ua", Holder::Pod);
    assert!(
        !plain.same_claim(&plain),
        "a pod's own address is held by no claim"
    );
}

#[test]
fn an_empty_container_id_is_no_attachment() {
    let blank = owner("", "net1", "ns/p", "", Holder::Pod);
    assert!(!blank.same_attachment(&blank));
}

#[test]
fn an_address_held_past_its_pod_follows_the_pod_to_any_node() {
    let web = |c: &str, pod: &str| owner(c, "net1", pod, "u", Holder::StatefulSet("web".into()));
    let here = web("c2", "ns/web-0");
    // The ordinal's address, recorded on n2, is taken over by the pod's replacement here ...
    assert!(here.may_take_over(&on("n2", web("c1", "ns/web-0"))));
    // ... but not another ordinal's, nor an unheld entry of the name.
    assert!(!here.may_rewrite(&on("n2", web("c1", "ns/web-1"))));
    let plain = on("n2", owner("c1", "net1", "ns/web-0", "u", Holder::Pod));
    assert!(!here.may_take_over(&plain));
    let claim = |c: &str| {
        owner(
            c,
            "net1",
            "vms/launcher",
            "u",
            Holder::Claim("vms/vm1".into()),
        )
    };
    assert!(claim("c2").may_take_over(&on("n2", claim("c1"))));
}
