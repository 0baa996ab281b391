//! The CNI handlers over the in-memory store: the allocation rules without a cluster.

use std::collections::BTreeSet;
use std::sync::Arc;

use serde_json::{Value, json};
use whereabouts::alloc::Allocate;
use whereabouts::alloc::Target;
use whereabouts::cni::protocol::{Code, Command};
use whereabouts::cni::{FlatSource, Invocation};
use whereabouts::crd::IPAllocation;
use whereabouts::store::Datastore;
use whereabouts::store::memory::MemoryStore;

mod cni_support;
use cni_support::*;

/// `n` ADDs of pods p0.. (containers c0..) at once; every one must succeed with an address no
/// other got. Returns the addresses.
async fn concurrent_adds(store: &Arc<MemoryStore>, ipam: &Value, n: usize) -> BTreeSet<String> {
    let tasks: Vec<_> = (0..n)
        .map(|i| {
            let (store, ipam) = (store.clone(), ipam.clone());
            tokio::spawn(async move {
                let (c, p) = (format!("c{i}"), format!("p{i}"));
                let out = run(&store, Command::Add, &ipam, &c, &p).await;
                addresses(&out.unwrap().unwrap())[0].clone()
            })
        })
        .collect();
    let mut seen = BTreeSet::new();
    for t in tasks {
        let ip = t.await.unwrap();
        assert!(seen.insert(ip.clone()), "{ip} given twice");
    }
    seen
}

fn dual() -> Value {
    json!({"type": "whereabouts", "range": "12.12.12.12/24", "gateway": "12.12.12.1", "ipRanges": [
        {"range": "10.10.10.10/24", "range_start": "10.10.10.20", "range_end": "10.10.10.200"},
        {"range": "2001::1/64", "range_start": "2001::16", "range_end": "2001::64"}],
        "addresses": [{"address": "192.168.9.5/24"}]})
}

#[tokio::test]
async fn add_gives_one_address_per_range_in_order_then_static() {
    let store = MemoryStore::new();
    let out = run(&store, Command::Add, &dual(), "c1", "p1")
        .await
        .unwrap()
        .unwrap();
    assert_eq!(
        addresses(&out),
        [
            "12.12.12.1/24",
            "10.10.10.20/24",
            "2001::16/64",
            "192.168.9.5/24"
        ]
    );
    assert_eq!(out["ips"][0]["gateway"], "12.12.12.1");
    assert!(
        out["ips"][2].get("gateway").is_none(),
        "an IPv4 gateway is not put on an IPv6 address"
    );
    let out2 = run(&store, Command::Add, &dual(), "c2", "p2")
        .await
        .unwrap()
        .unwrap();
    assert_eq!(
        addresses(&out2)[..3],
        ["12.12.12.2/24", "10.10.10.21/24", "2001::17/64"]
    );
    let pool = store.get_pool("2001---64").await.unwrap().unwrap();
    assert_eq!(pool.allocations[&0x16].podref, "ns/p1");
    assert_eq!(pool.allocations[&0x16].poduid, "uid-p1");
    assert_eq!(store.reservation_names().len(), 6);
    assert!(store.reservation_names().contains(&"2001--16".to_owned()));
}

#[tokio::test]
async fn add_is_idempotent_and_refreshes_the_container() {
    let store = MemoryStore::new();
    let ipam = json!({"type": "whereabouts", "range": "10.0.0.0/24"});
    let a = run(&store, Command::Add, &ipam, "c1", "p1")
        .await
        .unwrap()
        .unwrap();
    let b = run(&store, Command::Add, &ipam, "c1", "p1")
        .await
        .unwrap()
        .unwrap();
    assert_eq!(addresses(&a), addresses(&b));
    // Same pod name, new container (StatefulSet replacement): same address, new container id.
    let c = run(&store, Command::Add, &ipam, "c9", "p1")
        .await
        .unwrap()
        .unwrap();
    assert_eq!(addresses(&a), addresses(&c));
    let pool = store.get_pool("10.0.0.0-24").await.unwrap().unwrap();
    assert_eq!(pool.allocations.len(), 1);
    assert_eq!(pool.allocations[&1].id, "c9");
    // The old container's DEL must not free the address now bound to c9.
    run(&store, Command::Del, &ipam, "c1", "p1").await.unwrap();
    assert_eq!(
        store
            .get_pool("10.0.0.0-24")
            .await
            .unwrap()
            .unwrap()
            .allocations
            .len(),
        1
    );
    assert_eq!(store.reservation_names(), ["10.0.0.1"]);
    run(&store, Command::Del, &ipam, "c9", "p1").await.unwrap();
    assert!(
        store
            .get_pool("10.0.0.0-24")
            .await
            .unwrap()
            .unwrap()
            .allocations
            .is_empty()
    );
    assert!(store.reservation_names().is_empty());
    // DEL again is harmless.
    run(&store, Command::Del, &ipam, "c9", "p1").await.unwrap();
}

#[tokio::test]
async fn concurrent_adds_never_duplicate() {
    let store = Arc::new(MemoryStore::new());
    let ipam = json!({"type": "whereabouts", "range": "10.0.0.0/24"});
    let seen = concurrent_adds(&store, &ipam, 100).await;
    assert_eq!(seen.len(), 100);
    assert_eq!(
        store
            .get_pool("10.0.0.0-24")
            .await
            .unwrap()
            .unwrap()
            .allocations
            .len(),
        100
    );
}

/// Concurrent claimants of one pool take turns writing it, and each turn records every pending
/// claim: far fewer pool writes than ADDs, and no turn left behind.
#[tokio::test]
async fn concurrent_adds_share_pool_writes() {
    let store = Arc::new(MemoryStore::new().interleaved());
    let ipam = json!({"type": "whereabouts", "range": "10.0.0.0/24"});
    assert_eq!(concurrent_adds(&store, &ipam, 100).await.len(), 100);
    let pool = store.get_pool("10.0.0.0-24").await.unwrap().unwrap();
    assert_eq!(pool.allocations.len(), 100);
    assert_eq!(store.reservation_names().len(), 100);
    let writes = store.count("patch");
    assert!(writes < 50, "{writes} pool writes for 100 ADDs");
    assert!(store.count("take_turn") > 0, "contention went unnoticed");
    assert!(!store.turn_held("10.0.0.0-24"));
}

/// A new container of the same pod takes over the reservation at a new version, so a late DEL
/// of the old container, which deletes only the version it saw, cannot remove it from under the
/// new container's entry.
#[tokio::test]
async fn a_reservation_taken_over_by_a_new_container_survives_the_old_dels_delete() {
    let store = MemoryStore::new();
    let ipam = json!({"type": "whereabouts", "range": "10.0.0.0/24"});
    run(&store, Command::Add, &ipam, "c0", "p").await.unwrap();
    let seen_by_old_del = store.get_reservation("10.0.0.1").await.unwrap().unwrap();
    let out = run(&store, Command::Add, &ipam, "c1", "p")
        .await
        .unwrap()
        .unwrap();
    assert_eq!(
        addresses(&out),
        ["10.0.0.1/24"],
        "the pod keeps its address"
    );
    let now = store.get_reservation("10.0.0.1").await.unwrap().unwrap();
    assert_eq!(now.spec.containerid, "c1");
    assert_ne!(now.resource_version, seen_by_old_del.resource_version);
    let late = store
        .delete_reservation(
            "10.0.0.1",
            &seen_by_old_del.uid,
            Some(&seen_by_old_del.resource_version),
        )
        .await
        .unwrap();
    assert_eq!(late, whereabouts::store::Write::Conflict);
    // And the old container's DEL itself finds nothing of its own to release.
    run(&store, Command::Del, &ipam, "c0", "p").await.unwrap();
    let pool = store.get_pool("10.0.0.0-24").await.unwrap().unwrap();
    assert_eq!(pool.allocations[&1].id, "c1");
    assert!(store.get_reservation("10.0.0.1").await.unwrap().is_some());
}

/// Many DELs of one pool at once: they announce their releases, take turns, and one write
/// removes many entries; every address and reservation is gone afterwards.
#[tokio::test]
async fn concurrent_dels_share_pool_writes() {
    let store = Arc::new(MemoryStore::new());
    let ipam = json!({"type": "whereabouts", "range": "10.0.0.0/24"});
    for i in 0..60 {
        run(
            &store,
            Command::Add,
            &ipam,
            &format!("c{i}"),
            &format!("p{i}"),
        )
        .await
        .unwrap();
    }
    let store = Arc::new(Arc::try_unwrap(store).ok().unwrap().interleaved());
    let before = store.count("patch");
    let tasks: Vec<_> = (0..60)
        .map(|i| {
            let (store, ipam) = (store.clone(), ipam.clone());
            tokio::spawn(async move {
                let (c, p) = (format!("c{i}"), format!("p{i}"));
                run(&store, Command::Del, &ipam, &c, &p).await.unwrap();
            })
        })
        .collect();
    for t in tasks {
        t.await.unwrap();
    }
    let pool = store.get_pool("10.0.0.0-24").await.unwrap().unwrap();
    assert!(pool.allocations.is_empty(), "{:?}", pool.allocations.keys());
    assert!(store.reservation_names().is_empty());
    let writes = store.count("patch") - before;
    assert!(writes < 30, "{writes} pool writes for 60 DELs");
    assert!(store.count("mark_releasing") >= 60);
    assert!(!store.turn_held("10.0.0.0-24"));
}

/// A turn whose holder was killed is taken over once it has stood still long enough; the ADDs
/// waiting behind it still succeed.
#[tokio::test(start_paused = true)]
async fn an_abandoned_turn_is_taken_over() {
    let store = Arc::new(MemoryStore::new().interleaved());
    store.abandon_turn("10.0.0.0-24");
    let ipam = json!({"type": "whereabouts", "range": "10.0.0.0/24"});
    let started = tokio::time::Instant::now();
    let seen = concurrent_adds(&store, &ipam, 20).await;
    assert_eq!(seen.len(), 20);
    assert!(store.count("break_turn") >= 1);
    assert!(started.elapsed() >= std::time::Duration::from_secs(5));
    assert!(!store.turn_held("10.0.0.0-24"));
}

/// A claim left by a killed ADD a while ago is not "pending" any more: it still keeps its address
/// from others, but nobody records it in the pool for a pod that never got the address. A fresh
/// one is recorded by the next writer (group commit).
#[tokio::test]
async fn only_recent_claims_are_recorded_for_others() {
    let store = MemoryStore::new();
    let ipam = json!({"type": "whereabouts", "range": "10.0.0.0/24"});
    let claim = |spec, ip: &str| {
        let name = ip.to_owned();
        let ip: std::net::IpAddr = ip.parse().unwrap();
        let store = &store;
        async move {
            store
                .create_reservation(&name, &spec, "10.0.0.0-24", ip)
                .await
                .unwrap()
        }
    };
    claim(claim_spec("dead", "dead"), "10.0.0.1").await;
    store.age_reservations(120);
    let out = run(&store, Command::Add, &ipam, "c1", "p1")
        .await
        .unwrap()
        .unwrap();
    assert_eq!(addresses(&out), ["10.0.0.2/24"]);
    let pool = store.get_pool("10.0.0.0-24").await.unwrap().unwrap();
    assert_eq!(pool.allocations.keys().collect::<Vec<_>>(), [&2]);

    claim(claim_spec("slow", "slow"), "10.0.0.3").await;
    let out = run(&store, Command::Add, &ipam, "c4", "p4")
        .await
        .unwrap()
        .unwrap();
    // With a claim in flight the pick spreads over the lowest free addresses.
    let got: std::net::Ipv4Addr = addresses(&out)[0].trim_end_matches("/24").parse().unwrap();
    let own = u128::from(got.octets()[3]);
    assert!(own >= 4, "{got}");
    let pool = store.get_pool("10.0.0.0-24").await.unwrap().unwrap();
    assert_eq!(pool.allocations.keys().collect::<Vec<_>>(), [&2, &3, &own]);
    assert_eq!(pool.allocations[&3].podref, "ns/slow");
}

async fn listed_claims(store: &MemoryStore) -> Vec<String> {
    let claims = store.claims_of("10.0.0.0-24", whereabouts::store::Listing::Consistent);
    let claims = claims.await.unwrap();
    claims.iter().map(|c| c.ip.to_string()).collect()
}

/// A claim recorded while others claim from the pool leaves the claims lists: each claimant, each
/// turn holder and each DEL lists the pool's recent claims, and in a storm those lists returned
/// every claim of the last minute or so, recorded or not (most of what a storm cost the API
/// server, docs/benchmarks.md). A claim that changed since it was made is left as it is.
#[tokio::test]
async fn a_claim_recorded_among_others_leaves_the_claims_lists() {
    let store = MemoryStore::new();
    let ipam = json!({"type": "whereabouts", "range": "10.0.0.0/24"});
    let spec = claim_spec("slow", "slow");
    let ip: std::net::IpAddr = "10.0.0.1".parse().unwrap();
    let (_, slow) = (store.create_reservation("10.0.0.1", &spec, "10.0.0.0-24", ip))
        .await
        .unwrap();
    let out = run(&store, Command::Add, &ipam, "c4", "p4").await.unwrap();
    let own = addresses(&out.unwrap())[0]
        .trim_end_matches("/24")
        .to_owned();
    let pool = store.get_pool("10.0.0.0-24").await.unwrap().unwrap();
    assert_eq!(pool.allocations.len(), 2, "the slow claim recorded too");
    // The slow claimant has not settled its claim yet; ours is settled.
    assert_eq!(listed_claims(&store).await, ["10.0.0.1"]);
    assert_eq!(store.count("settle_claim"), 1);
    let out = run(&store, Command::Del, &ipam, "c4", "p4").await.unwrap();
    assert!(out.is_none());
    assert!(store.get_reservation(&own).await.unwrap().is_none());
    // A claim renewed since it was made (or announced as released) keeps its label.
    let current = store.get_reservation("10.0.0.1").await.unwrap().unwrap();
    store
        .renew_claim("10.0.0.1", &current.uid, &current.resource_version)
        .await
        .unwrap();
    let settled = store.settle_claim("10.0.0.1", &slow).await.unwrap();
    assert_eq!(settled, whereabouts::store::Write::Conflict);
    assert_eq!(listed_claims(&store).await, ["10.0.0.1"]);
    let current = store.get_reservation("10.0.0.1").await.unwrap().unwrap();
    let made = whereabouts::store::Made {
        uid: current.uid,
        resource_version: current.resource_version,
    };
    let settled = store.settle_claim("10.0.0.1", &made).await.unwrap();
    assert_eq!(settled, whereabouts::store::Write::Done);
    assert!(listed_claims(&store).await.is_empty());
}

/// A retried ADD finds the claim its earlier attempt made and did not record: it writes the claim
/// afresh before it records it, so that the audit, which spares claims by their last write, never
/// sweeps a claim that is being recorded.
#[tokio::test]
async fn an_earlier_attempts_claim_is_renewed_before_it_is_recorded() {
    let store = MemoryStore::new();
    let ipam = json!({"type": "whereabouts", "range": "10.0.0.0/24"});
    let spec = claim_spec("c0", "p0");
    let ip: std::net::IpAddr = "10.0.0.1".parse().unwrap();
    store
        .create_reservation("10.0.0.1", &spec, "10.0.0.0-24", ip)
        .await
        .unwrap();
    let before = store.get_reservation("10.0.0.1").await.unwrap().unwrap();
    let out = run(&store, Command::Add, &ipam, "c0", "p0").await.unwrap();
    assert_eq!(addresses(&out.unwrap()), ["10.0.0.1/24"]);
    assert_eq!(store.count("renew_claim"), 1);
    let after = store.get_reservation("10.0.0.1").await.unwrap().unwrap();
    assert_eq!(after.uid, before.uid, "the same claim");
    assert_ne!(
        after.resource_version, before.resource_version,
        "written afresh"
    );
    let pool = store.get_pool("10.0.0.0-24").await.unwrap().unwrap();
    assert_eq!(pool.allocations[&1].id, "c0");
}

#[tokio::test]
async fn overlapping_pools_share_addresses_through_reservations() {
    let store = MemoryStore::new();
    let a = json!({"type": "whereabouts", "range": "10.0.0.0/24"});
    let b = json!({"type": "whereabouts", "range": "10.0.0.0/25"});
    let x = run(&store, Command::Add, &a, "c1", "p1")
        .await
        .unwrap()
        .unwrap();
    store.age_reservations(60);
    let y = run(&store, Command::Add, &b, "c2", "p2")
        .await
        .unwrap()
        .unwrap();
    assert_eq!(addresses(&x), ["10.0.0.1/24"]);
    assert_eq!(addresses(&y), ["10.0.0.2/25"]);
    // Without overlap protection the second pool knows nothing of the first.
    let c =
        json!({"type": "whereabouts", "range": "10.0.0.0/26", "enable_overlapping_ranges": false});
    assert_eq!(
        addresses(
            &run(&store, Command::Add, &c, "c3", "p3")
                .await
                .unwrap()
                .unwrap()
        ),
        ["10.0.0.1/26"]
    );
}

/// The pool an ADD creates says what it is, so that the operator never parses its name.
#[tokio::test]
async fn a_pool_made_by_an_add_is_labelled_with_its_network_and_range() {
    let store = MemoryStore::new();
    let named = json!({"type": "whereabouts", "range": "fd00:7::/64", "network_name": "red-net"});
    run(&store, Command::Add, &named, "c1", "p1").await.unwrap();
    let labels = store.pool_labels("red-net-fd00-7---64").unwrap();
    assert_eq!(labels["whereabouts.cni.cncf.io/network"], "red-net");
    assert_eq!(labels["whereabouts.cni.cncf.io/range"], "fd00-7---64");
    assert!(!labels.contains_key("whereabouts.cni.cncf.io/node"));
    let unnamed = json!({"type": "whereabouts", "range": "10.0.0.0/24"});
    run(&store, Command::Add, &unnamed, "c2", "p2")
        .await
        .unwrap();
    let labels = store.pool_labels("10.0.0.0-24").unwrap();
    assert_eq!(
        labels["whereabouts.cni.cncf.io/network"], "",
        "the unnamed network"
    );
}

#[tokio::test]
async fn an_entry_written_by_another_writer_is_respected() {
    let store = MemoryStore::new();
    // An upstream plugin took .1 without a reservation.
    store.put_entry(
        "10.0.0.0-24",
        "10.0.0.0/24",
        1,
        IPAllocation {
            id: "up".into(),
            podref: "ns/up".into(),
            ..Default::default()
        },
    );
    let ipam = json!({"type": "whereabouts", "range": "10.0.0.0/24"});
    assert_eq!(
        addresses(
            &run(&store, Command::Add, &ipam, "c1", "p1")
                .await
                .unwrap()
                .unwrap()
        ),
        ["10.0.0.2/24"]
    );
}

#[tokio::test]
async fn exhaustion_names_the_range_and_rolls_back_earlier_ranges() {
    let store = MemoryStore::new();
    let ipam = json!({"type": "whereabouts", "ipRanges": [{"range": "10.0.0.0/24"}, {"range": "10.0.1.0/30", "exclude": ["10.0.1.2/32"]}]});
    run(&store, Command::Add, &ipam, "c1", "p1").await.unwrap();
    let e = run(&store, Command::Add, &ipam, "c2", "p2")
        .await
        .unwrap_err();
    assert_eq!(e.code, Code::Exhausted);
    assert_eq!(
        e.msg,
        "no free address in range 10.0.1.0/30 (window 10.0.1.1 to 10.0.1.2, exclude 10.0.1.2/32): all 1 addresses are allocated"
    );
    let pool = store.get_pool("10.0.0.0-24").await.unwrap().unwrap();
    assert_eq!(
        pool.allocations.len(),
        1,
        "the first range's address of the failed ADD was released"
    );
    assert_eq!(store.reservation_names().len(), 2);
}

#[tokio::test]
async fn datastore_failures_are_reported_for_retry() {
    let store = MemoryStore::new();
    let ipam = json!({"type": "whereabouts", "range": "10.0.0.0/24"});
    run(&store, Command::Add, &ipam, "c1", "p1").await.unwrap();
    *store.fail.lock().unwrap() = Some("etcd is down".into());
    let e = run(&store, Command::Del, &ipam, "c1", "p1")
        .await
        .unwrap_err();
    assert_eq!(e.code, Code::TryAgainLater);
    assert!(e.msg.contains("etcd is down"), "{}", e.msg);
    let e = run(&store, Command::Status, &ipam, "", "")
        .await
        .unwrap_err();
    assert_eq!(e.code, Code::NotAvailable);
}

/// A DEL whose credentials are refused (401: the token died with an uninstalled DaemonSet's
/// pod) reports it as such, so the plugin answers success and the pod is not kept Terminating;
/// the entry stays. Any other failure among the ranges keeps the DEL failing.
#[tokio::test]
async fn a_del_refused_for_its_credentials_says_so() {
    let store = MemoryStore::new();
    let ipam = json!({"type": "whereabouts", "ipRanges": [{"range": "10.0.0.0/24"}, {"range": "fd00::/120"}]});
    run(&store, Command::Add, &ipam, "c1", "p1").await.unwrap();
    *store.fail.lock().unwrap() = Some("Unauthorized".into());
    store
        .fail_code
        .store(401, std::sync::atomic::Ordering::Relaxed);
    let e = run(&store, Command::Del, &ipam, "c1", "p1")
        .await
        .unwrap_err();
    assert_eq!(
        e.details,
        whereabouts::cni::protocol::UNAUTHENTICATED,
        "{}",
        e.msg
    );
    store
        .fail_code
        .store(403, std::sync::atomic::Ordering::Relaxed);
    let e = run(&store, Command::Del, &ipam, "c1", "p1")
        .await
        .unwrap_err();
    assert_ne!(
        e.details,
        whereabouts::cni::protocol::UNAUTHENTICATED,
        "a 403 is not forgiven"
    );
    *store.fail.lock().unwrap() = None;
    assert_eq!(
        store
            .get_pool("10.0.0.0-24")
            .await
            .unwrap()
            .unwrap()
            .allocations
            .len(),
        1
    );
}

#[tokio::test]
async fn del_processes_every_range_even_when_one_has_no_entry() {
    let store = MemoryStore::new();
    let one = json!({"type": "whereabouts", "ipRanges": [{"range": "10.0.1.0/24"}]});
    let two = json!({"type": "whereabouts", "ipRanges": [{"range": "10.0.0.0/24"}, {"range": "10.0.1.0/24"}]});
    run(&store, Command::Add, &one, "c1", "p1").await.unwrap();
    run(&store, Command::Del, &two, "c1", "p1").await.unwrap();
    assert!(
        store
            .get_pool("10.0.1.0-24")
            .await
            .unwrap()
            .unwrap()
            .allocations
            .is_empty()
    );
}

#[tokio::test]
async fn check_compares_with_prev_result() {
    let store = MemoryStore::new();
    let ipam = json!({"type": "whereabouts", "range": "10.0.0.0/24"});
    let out = run(&store, Command::Add, &ipam, "c1", "p1")
        .await
        .unwrap()
        .unwrap();
    let conf = |prev: Value| json!({"cniVersion": "1.0.0", "name": "net", "ipam": ipam, "prevResult": prev});
    assert!(
        handle(
            &store,
            &request_conf(Command::Check, conf(out.clone()), "c1", "p1").unwrap()
        )
        .await
        .is_ok()
    );
    let wrong = json!({"ips": [{"address": "10.0.0.99/24"}]});
    assert_eq!(
        handle(
            &store,
            &request_conf(Command::Check, conf(wrong), "c1", "p1").unwrap()
        )
        .await
        .unwrap_err()
        .code,
        Code::CheckMismatch
    );
    assert!(
        handle(
            &store,
            &request_conf(Command::Check, conf(out), "c2", "p2").unwrap()
        )
        .await
        .is_err()
    );
}

#[tokio::test]
async fn gc_releases_only_unknown_attachments_of_gone_pods() {
    let store = MemoryStore::new();
    let ipam = json!({"type": "whereabouts", "range": "10.0.0.0/24"});
    for i in 1..=3 {
        run(
            &store,
            Command::Add,
            &ipam,
            &format!("c{i}"),
            &format!("p{i}"),
        )
        .await
        .unwrap();
    }
    // Gone pods of another node, and of no known node (upstream's entry): never this node's GC's.
    let conf_of = |c: &str, p: &str, node: &str| {
        request_on(
            node,
            Command::Add,
            json!({"cniVersion": "1.0.0", "name": "net", "ipam": ipam}),
            c,
            p,
        )
        .unwrap()
    };
    handle(&store, &conf_of("c4", "p4", "node-b"))
        .await
        .unwrap();
    handle(&store, &conf_of("c5", "p5", "node-b"))
        .await
        .unwrap();
    let mut pool = store.get_pool("10.0.0.0-24").await.unwrap().unwrap();
    let (offset, upstream) = pool.allocations.pop_last().unwrap();
    let node_less = whereabouts::crd::IPAllocation {
        node: String::new(),
        ..upstream.clone()
    };
    assert!(
        store
            .replace_allocation(&pool.name, offset, &upstream, &node_less)
            .await
            .is_ok()
    );
    store.set_pod("ns/p2", "uid-p2"); // alive (elsewhere): not in this runtime's list
    store.set_pod("ns/p3", "uid-other"); // same name, a newer pod: p3's entry is stale
    let conf = json!({"cniVersion": "1.1.0", "name": "net", "ipam": ipam, "cni.dev/valid-attachments": [{"containerID": "c1", "ifname": "net1"}]});
    handle(&store, &request_conf(Command::Gc, conf, "", "").unwrap())
        .await
        .unwrap();
    let pool = store.get_pool("10.0.0.0-24").await.unwrap().unwrap();
    let left: Vec<_> = pool.allocations.values().map(|e| e.id.as_str()).collect();
    assert_eq!(left, ["c1", "c2", "c4", "c5"]);
    let nodes: Vec<_> = pool.allocations.values().map(|e| e.node.as_str()).collect();
    assert_eq!(nodes, ["node-a", "node-a", "node-b", ""]);
    assert_eq!(
        store.reservation_names(),
        ["10.0.0.1", "10.0.0.2", "10.0.0.4", "10.0.0.5"]
    );
    let bad = json!({"cniVersion": "1.1.0", "name": "net", "ipam": {"type": "whereabouts", "range": "10.0.0.0/24"}});
    assert_eq!(
        handle(&store, &request_conf(Command::Gc, bad, "", "").unwrap())
            .await
            .unwrap_err()
            .code,
        Code::InvalidConfig
    );
}

#[test]
fn invalid_inputs_are_cni_errors() {
    let e = request(
        Command::Add,
        json!({"type": "whereabouts", "range": "abc.169.1.0/24"}),
        "c",
        "p",
    )
    .unwrap_err();
    assert_eq!(e.code, Code::InvalidConfig);
    assert_eq!(
        e.msg,
        r#"invalid whereabouts config: ipam.range "abc.169.1.0/24" is not a CIDR (expected for example 10.0.0.0/24 or fd00::/64)"#
    );
    // 0.2.0 is answered since upstream answers it (tests/cni_memory.rs: legacy results); not this.
    let e = request_conf(Command::Add, json!({"cniVersion": "1.2.3.4", "name": "n", "ipam": {"type": "whereabouts", "range": "10.0.0.0/24"}}), "c", "p").unwrap_err();
    assert_eq!(e.code, Code::IncompatibleVersion);
    let e = request(
        Command::Add,
        json!({"type": "whereabouts", "range": "10.0.0.0/24"}),
        "",
        "p",
    )
    .unwrap_err();
    assert_eq!(
        (e.code, e.msg.as_str()),
        (Code::InvalidEnv, "CNI_CONTAINERID is not set")
    );
    let e = request(
        Command::Add,
        json!({"type": "whereabouts", "range": "10.0.0.0/24"}),
        "c",
        "",
    )
    .unwrap_err();
    assert_eq!(e.code, Code::InvalidEnv);
}

#[tokio::test]
async fn legacy_result_versions() {
    let store = MemoryStore::new();
    for v in ["0.3.0", "0.3.1", "0.4.0", "1.0.0", "1.1.0"] {
        let conf = json!({"cniVersion": v, "name": "n", "ipam": {"type": "whereabouts", "range": "10.0.0.0/24"}});
        let out = handle(
            &store,
            &request_conf(Command::Add, conf, &format!("c{v}"), &format!("p{v}")).unwrap(),
        )
        .await
        .unwrap()
        .unwrap();
        assert_eq!(out["cniVersion"], v);
        assert_eq!(out["ips"][0].get("version").is_some(), v.starts_with("0."));
    }
}

// ---- The node agent's group allocation (alloc::group, agent::batch) ----

fn job(target: &Target, i: usize) -> whereabouts::alloc::Job {
    let mut who = attachment(&format!("c{i}"), &format!("p{i}"));
    who.pod_uid = format!("uid-p{i}");
    whereabouts::alloc::Job::new(target, &who)
}

/// The first range of a config, as the engine's target with overlapping ranges on.
fn range_of(ipam: Value) -> Target {
    let validated =
        whereabouts::config::validate_ipam(&ipam, "ipam", whereabouts::config::Source::Runtime);
    let config = validated.config.expect("valid config");
    Target {
        overlapping: true,
        ..whereabouts::cni::target(&config.ranges[0], &config)
    }
}

#[tokio::test]
async fn a_group_takes_the_lowest_addresses_with_one_pool_write() {
    let store = MemoryStore::new();
    let range = range_of(json!({"range": "10.0.0.0/24"}));
    let jobs = (0..50).map(|i| job(&range, i)).collect();
    let results = whereabouts::alloc::group::allocate_group(&store, jobs).await;
    let ips: Vec<String> = results
        .into_iter()
        .map(|r| r.unwrap().ip.to_string())
        .collect();
    let expected: Vec<String> = (1..=50).map(|i| format!("10.0.0.{i}")).collect();
    assert_eq!(ips, expected, "job order, lowest free first");
    assert_eq!(store.count("patch"), 1, "one write records the whole group");
    assert_eq!(store.reservation_names().len(), 50);
    let pool = store.get_pool("10.0.0.0-24").await.unwrap().unwrap();
    assert_eq!(pool.allocations[&7].podref, "ns/p6");
}

#[tokio::test]
async fn a_group_reuses_held_entries_and_reports_exhaustion_per_job() {
    let store = MemoryStore::new();
    let ipam = json!({"type": "whereabouts", "range": "10.0.0.0/24", "range_start": "10.0.0.10", "range_end": "10.0.0.13"});
    let first = run(&store, Command::Add, &ipam, "c0", "p0").await.unwrap();
    assert_eq!(addresses(&first.unwrap()), ["10.0.0.10/24"]);
    let range = range_of(ipam);
    let jobs = (0..6).map(|i| job(&range, i)).collect();
    let results = whereabouts::alloc::group::allocate_group(&store, jobs).await;
    let shown: Vec<String> = results
        .into_iter()
        .map(|r| match r {
            Ok(a) => a.ip.to_string(),
            Err(e) => e.to_string(),
        })
        .collect();
    let full = "no free address in range 10.0.0.0/24 (window 10.0.0.10 to 10.0.0.13): all 4 addresses are allocated";
    assert_eq!(
        shown,
        [
            "10.0.0.10", // p0's entry, reused
            "10.0.0.11",
            "10.0.0.12",
            "10.0.0.13",
            full,
            full
        ]
    );
}

/// ADDs through the agent's batcher, with plain one-by-one ADDs of other processes writing the
/// same pool at the same time: every address distinct, and the batcher needs far fewer writes.
#[tokio::test]
async fn batched_and_direct_adds_share_a_pool_without_duplicates() {
    use whereabouts::agent::batch::Batcher;
    let store = Arc::new(MemoryStore::new().interleaved());
    let batcher = Arc::new(Batcher::new(store.clone(), Arc::default()));
    let ipam = json!({"type": "whereabouts", "range": "10.0.0.0/24"});
    let tasks: Vec<_> = (0..120)
        .map(|i| {
            let (store, batcher, ipam) = (store.clone(), batcher.clone(), ipam.clone());
            tokio::spawn(async move {
                let req = request(Command::Add, ipam, &format!("c{i}"), &format!("p{i}")).unwrap();
                let out = if i % 4 == 0 {
                    handle(&*store, &req).await
                } else {
                    handle_with(&*store, &*batcher, &req).await
                };
                addresses(&out.unwrap().unwrap())[0].clone()
            })
        })
        .collect();
    let mut seen = BTreeSet::new();
    for t in tasks {
        let ip = t.await.unwrap();
        assert!(seen.insert(ip.clone()), "{ip} given twice");
    }
    let pool = store.get_pool("10.0.0.0-24").await.unwrap().unwrap();
    assert_eq!(pool.allocations.len(), 120);
    assert_eq!(store.reservation_names().len(), 120);
    let writes = store.count("patch");
    assert!(
        writes < 60,
        "{writes} pool writes for 90 batched and 30 direct ADDs"
    );
}

/// A dual-stack ADD through the batcher goes through two pools' groups, in range order.
#[tokio::test]
async fn batched_dual_stack_adds_get_one_address_per_range() {
    use whereabouts::agent::batch::Batcher;
    let store = Arc::new(MemoryStore::new());
    let batcher = Arc::new(Batcher::new(store.clone(), Arc::default()));
    let tasks: Vec<_> = (0..40)
        .map(|i| {
            let (store, batcher) = (store.clone(), batcher.clone());
            tokio::spawn(async move {
                let req =
                    request(Command::Add, dual(), &format!("c{i}"), &format!("p{i}")).unwrap();
                let out = handle_with(&*store, &*batcher, &req).await;
                addresses(&out.unwrap().unwrap())
            })
        })
        .collect();
    let mut seen = BTreeSet::new();
    for t in tasks {
        let ips = t.await.unwrap();
        assert_eq!(ips.len(), 4);
        assert!(
            ips[1].starts_with("10.10.10.") && ips[2].starts_with("2001::"),
            "{ips:?}"
        );
        for ip in &ips[..3] {
            assert!(seen.insert(ip.clone()), "{ip} given twice");
        }
    }
    for pool in ["12.12.12.0-24", "10.10.10.0-24", "2001---64"] {
        let p = store.get_pool(pool).await.unwrap().unwrap();
        assert_eq!(p.allocations.len(), 40, "{pool}");
    }
}

/// Two ADDs of the same pod interface in one group (a runtime retry while the first is queued):
/// one address, one entry.
#[tokio::test]
async fn a_group_gives_a_repeated_attachment_one_address() {
    let store = MemoryStore::new();
    let range = range_of(json!({"range": "10.0.0.0/24"}));
    let jobs = vec![job(&range, 0), job(&range, 1), job(&range, 0)];
    let results = whereabouts::alloc::group::allocate_group(&store, jobs).await;
    let ips: Vec<String> = results
        .into_iter()
        .map(|r| r.unwrap().ip.to_string())
        .collect();
    assert_eq!(ips, ["10.0.0.1", "10.0.0.2", "10.0.0.1"]);
    let pool = store.get_pool("10.0.0.0-24").await.unwrap().unwrap();
    assert_eq!(pool.allocations.len(), 2);
    assert_eq!(store.reservation_names().len(), 2);
}

/// A group may start from the pool version its worker wrote last; when another writer has written
/// since, the stale start costs a lost write, never a duplicate.
#[tokio::test]
async fn a_group_started_from_a_stale_pool_version_still_gives_distinct_addresses() {
    use whereabouts::alloc::group::allocate_group_from;
    let store = MemoryStore::new();
    let ipam = json!({"type": "whereabouts", "range": "10.0.0.0/24"});
    let range = range_of(ipam.clone());
    let (first, known) =
        allocate_group_from(&store, (0..10).map(|i| job(&range, i)).collect(), None).await;
    assert!(first.iter().all(Result::is_ok));
    let known = known.expect("the group knows the version it wrote");
    assert_eq!(known.allocations.len(), 10);
    // Another writer takes the next address meanwhile.
    let other = run(&store, Command::Add, &ipam, "x", "other")
        .await
        .unwrap();
    assert_eq!(addresses(&other.unwrap()), ["10.0.0.11/24"]);
    let (second, last) = allocate_group_from(
        &store,
        (10..20).map(|i| job(&range, i)).collect(),
        Some(known),
    )
    .await;
    let mut seen: BTreeSet<String> = first
        .iter()
        .chain(&second)
        .map(|r| r.as_ref().unwrap().ip.to_string())
        .collect();
    assert!(
        seen.insert("10.0.0.11".into()),
        "the other writer's address was given out again"
    );
    assert_eq!(seen.len(), 21);
    assert_eq!(last.unwrap().allocations.len(), 21);
    let pool = store.get_pool("10.0.0.0-24").await.unwrap().unwrap();
    assert_eq!(pool.allocations.len(), 21);
}

/// DELs through the agent's batcher: released together, each only its own container's entries;
/// an address re-bound to a newer container of the pod keeps its entry and reservation.
#[tokio::test]
async fn batched_dels_release_together_and_spare_re_bound_addresses() {
    use whereabouts::agent::batch::Batcher;
    let store = Arc::new(MemoryStore::new().interleaved());
    let batcher = Arc::new(Batcher::new(store.clone(), Arc::default()));
    let ipam = json!({"type": "whereabouts", "range": "10.0.0.0/24"});
    concurrent_adds(&store, &ipam, 60).await;
    // Pod p0's interface was re-created under container n0 and took its address over.
    let again = run(&store, Command::Add, &ipam, "n0", "p0").await.unwrap();
    let kept = addresses(&again.unwrap())[0].clone();
    let before = store.count("patch");
    let tasks: Vec<_> = (0..60)
        .map(|i| {
            let (store, batcher, ipam) = (store.clone(), batcher.clone(), ipam.clone());
            tokio::spawn(async move {
                let req = request(Command::Del, ipam, &format!("c{i}"), &format!("p{i}")).unwrap();
                handle_with(&*store, &*batcher, &req).await
            })
        })
        .collect();
    for t in tasks {
        t.await.unwrap().unwrap();
    }
    let writes = store.count("patch") - before;
    assert!(writes <= 10, "{writes} pool writes for 60 DELs");
    let pool = store.get_pool("10.0.0.0-24").await.unwrap().unwrap();
    let left: Vec<String> = pool.allocations.values().map(|e| e.id.clone()).collect();
    assert_eq!(left, ["n0"], "only the re-bound entry is left");
    assert_eq!(store.reservation_names().len(), 1);
    assert_eq!(format!("{}/24", store.reservation_names()[0]), kept);
}

fn attachment(container: &str, pod: &str) -> whereabouts::alloc::Owner {
    whereabouts::alloc::Owner {
        container_id: container.into(),
        ifname: "net1".into(),
        podref: format!("ns/{pod}"),
        pod_uid: String::new(),
        node: String::new(),
        holder: Default::default(),
    }
}

/// An ADD and then a DEL of the same interface reaching a pool's worker together (the runtime
/// gave up on the ADD and cleans up): the DEL is not run before the ADD, so nothing is left.
#[tokio::test]
async fn a_del_queued_behind_an_add_of_the_same_interface_runs_after_it() {
    use whereabouts::agent::batch::Batcher;
    let store = Arc::new(MemoryStore::new());
    let batcher = Batcher::new(store.clone(), Arc::default());
    let range = range_of(json!({"range": "10.0.0.0/24"}));
    let who = attachment("c1", "p1");
    let add = batcher.allocate(&store, &range, &who);
    let del = batcher.release(&store, &range, &who);
    let (added, released) = tokio::join!(add, del);
    let ip = added.unwrap().ip;
    assert_eq!(
        released.unwrap(),
        [ip],
        "the DEL released what the ADD took"
    );
    let pool = store.get_pool("10.0.0.0-24").await.unwrap().unwrap();
    assert!(pool.allocations.is_empty(), "{:?}", pool.allocations);
    assert!(store.reservation_names().is_empty());
}

/// An ADD that gives up (its deadline) while its group is being written: the worker releases the
/// address it recorded, instead of leaving it to the runtime's DEL or the audit.
#[tokio::test]
async fn an_add_abandoned_mid_group_leaves_nothing_behind() {
    use whereabouts::agent::batch::Batcher;
    let store = Arc::new(MemoryStore::new().interleaved());
    let batcher = Arc::new(Batcher::new(store.clone(), Arc::default()));
    let range = range_of(json!({"range": "10.0.0.0/24"}));
    let task = {
        let (store, batcher, range) = (store.clone(), batcher.clone(), range.clone());
        tokio::spawn(async move {
            let who = attachment("c1", "p1");
            batcher.allocate(&store, &range, &who).await
        })
    };
    // Give up once the group is at work (it has read the pool).
    while store.count("get_pool") == 0 {
        tokio::task::yield_now().await;
    }
    task.abort();
    let mut left = usize::MAX;
    for _ in 0..10_000 {
        tokio::task::yield_now().await;
        let pool = store.get_pool("10.0.0.0-24").await.unwrap();
        left = pool.map_or(0, |p| p.allocations.len()) + store.reservation_names().len();
        if left == 0 && store.count("patch") >= 2 {
            break;
        }
    }
    assert_eq!(store.count("patch"), 2, "recorded, then released");
    assert_eq!(left, 0, "entry or reservation left behind");
}

/// Upstream answers 0.1.0 and 0.2.0 (and reads a missing cniVersion as 0.1.0): one `ip4` and one
/// `ip6` object. A config that would give two addresses of one family is refused before anything
/// is allocated (upstream would allocate both and report one).
#[tokio::test]
async fn legacy_versions_get_ip4_and_ip6_results() {
    let store = MemoryStore::new();
    let conf = |version: Option<&str>, ipam: Value| {
        let mut c = json!({"name": "n", "type": "bridge", "ipam": ipam});
        if let Some(v) = version {
            c["cniVersion"] = v.into();
        }
        c
    };
    let dual_stack = json!({"type": "whereabouts", "range": "10.0.0.0/24", "gateway": "10.0.0.1",
        "ipRanges": [{"range": "fd00::/64"}], "routes": [{"dst": "0.0.0.0/0"}]});
    for (i, version) in [Some("0.2.0"), Some("0.1.0"), None].into_iter().enumerate() {
        let req = request_conf(
            Command::Add,
            conf(version, dual_stack.clone()),
            &format!("c{i}"),
            &format!("p{i}"),
        )
        .unwrap();
        let out = handle(&store, &req).await.unwrap().unwrap();
        assert_eq!(out["cniVersion"], version.unwrap_or("0.1.0"));
        assert_eq!(
            out["ip4"],
            json!({"ip": format!("10.0.0.{}/24", i + 1), "gateway": "10.0.0.1", "routes": [{"dst": "0.0.0.0/0"}]})
        );
        assert_eq!(out["ip6"], json!({"ip": format!("fd00::{}/64", i + 1)}));
        assert!(out.get("ips").is_none(), "{out}");
    }
    // Two IPv4 ranges: refused with the validator's words, and nothing is allocated.
    let two_v4 = json!({"type": "whereabouts", "range": "10.1.0.0/24", "ipRanges": [{"range": "10.2.0.0/24"}]});
    let e = request_conf(Command::Add, conf(Some("0.2.0"), two_v4), "c9", "p9").unwrap_err();
    assert_eq!(e.code, Code::InvalidConfig);
    assert_eq!(
        e.msg,
        r#"invalid whereabouts config: cniVersion "0.2.0" results hold one address per family, but 2 IPv4 addresses are configured (ipam.range, ipam.ipRanges[0]): use cniVersion 0.3.0 or later"#
    );
    // CNI_ARGS IP= adding a second IPv4 address: refused as an environment problem.
    let mut req_conf = conf(
        Some("0.2.0"),
        json!({"type": "whereabouts", "range": "10.3.0.0/24"}),
    );
    req_conf["args"] = json!({});
    let stdin = req_conf.to_string();
    let env = |k: &str| match k {
        "CNI_CONTAINERID" => Some("c10".to_owned()),
        "CNI_IFNAME" => Some("net1".to_owned()),
        "CNI_ARGS" => {
            Some("IgnoreUnknown=1;K8S_POD_NAMESPACE=ns;K8S_POD_NAME=p10;IP=10.9.9.9/24".to_owned())
        }
        _ => None,
    };
    let e = Invocation::read(&env, &stdin, FlatSource::Paths(vec![]))
        .load(Command::Add)
        .unwrap_err();
    assert_eq!(e.code, Code::InvalidEnv, "{}", e.msg);
    assert!(
        e.msg.starts_with(
            r#"CNI_ARGS IP: cniVersion "0.2.0" results hold one address per family, but 2 IPv4"#
        ),
        "{}",
        e.msg
    );
    assert!(store.get_pool("10.1.0.0-24").await.unwrap().is_none());
    assert!(store.get_pool("10.3.0.0-24").await.unwrap().is_none());
}

/// Fills pool 10.128.0.0-16 so that the entry of ADD c-new (pod ns/new) is one byte too many
/// for the pool object; returns the number of entries.
async fn fill_pool_object(store: &MemoryStore) -> u128 {
    use whereabouts::crd::size::{POOL_OBJECT_BUDGET, entry_bytes};
    let filler = |o: u128| IPAllocation {
        id: format!("{o:064x}"),
        podref: format!("tenant-namespace/app-deployment-7d9f8c6b5-{o:06}"),
        ifname: "net1".into(),
        poduid: format!("5f0c6a2e-1d3b-4c1e-9a4f-{o:012}"),
        ..Default::default()
    };
    // Fill to just under the budget, then pad with one entry so that the new ADD's entry is one
    // byte too many.
    let pool_bytes = || async {
        store
            .get_pool("10.128.0.0-16")
            .await
            .unwrap()
            .map_or(0, |p| p.stored_bytes())
    };
    let mut offset = 1;
    // In batches while far from the budget (each read of the pool counts every entry).
    while pool_bytes().await + 600 * entry_bytes(offset, &filler(offset)) < POOL_OBJECT_BUDGET {
        for _ in 0..500 {
            store.put_entry("10.128.0.0-16", "10.128.0.0/16", offset, filler(offset));
            offset += 1;
        }
    }
    while pool_bytes().await + 2 * entry_bytes(offset, &filler(offset)) < POOL_OBJECT_BUDGET {
        store.put_entry("10.128.0.0-16", "10.128.0.0/16", offset, filler(offset));
        offset += 1;
    }
    let new_entry = IPAllocation {
        id: "c-new".into(),
        podref: "ns/new".into(),
        ifname: "net1".into(),
        poduid: "uid-new".into(),
        ..Default::default()
    };
    // The plugin counts the widest offset of the range (65,536 addresses) for the new entry.
    let room = POOL_OBJECT_BUDGET - pool_bytes().await - entry_bytes(65_536, &new_entry) + 1;
    let mut pad = IPAllocation {
        podref: "ns/pad".into(),
        ..Default::default()
    };
    pad.id = "p".repeat(room - entry_bytes(offset, &pad));
    store.put_entry("10.128.0.0-16", "10.128.0.0/16", offset, pad);
    assert_eq!(
        pool_bytes().await + entry_bytes(65_536, &new_entry),
        POOL_OBJECT_BUDGET + 1
    );
    offset
}

/// A pool whose object is at the API server's size limit refuses the next ADD for good (code
/// 100, naming the pool, its entries and what to do), and nothing is written; DEL still works,
/// and frees room again.
#[tokio::test]
async fn an_add_that_would_outgrow_the_pool_object_is_refused_for_good() {
    let store = MemoryStore::new();
    let ipam = json!({"type": "whereabouts", "range": "10.128.0.0/16"});
    let offset = fill_pool_object(&store).await;
    let before = store.get_pool("10.128.0.0-16").await.unwrap().unwrap();
    let e = run(&store, Command::Add, &ipam, "c-new", "new")
        .await
        .unwrap_err();
    assert_eq!(e.code, Code::Exhausted, "{e:?}");
    assert!(
        e.msg
            .contains("pool 10.128.0.0-16 cannot hold another entry")
            && e.msg.contains(&format!("its {offset} entries"))
            && e.msg.contains("split the range"),
        "{}",
        e.msg
    );
    let after = store.get_pool("10.128.0.0-16").await.unwrap().unwrap();
    assert_eq!(after.allocations, before.allocations, "nothing written");
    assert!(store.reservation_names().is_empty(), "no claim left behind");
    // A DEL of one filler frees room: the ADD then succeeds.
    let victim = before.allocations[&1].id.clone();
    let del_req = json!({"type": "whereabouts", "range": "10.128.0.0/16"});
    let del = request(Command::Del, del_req, &victim, "x").unwrap();
    handle(&store, &del).await.unwrap();
    run(&store, Command::Add, &ipam, "c-new", "new")
        .await
        .unwrap();
}

/// The node agent's group path refuses the same ADD the same way.
#[tokio::test]
async fn a_batched_add_that_would_outgrow_the_pool_object_is_refused_for_good() {
    use whereabouts::agent::batch::Batcher;
    let store = Arc::new(MemoryStore::new());
    let batcher = Batcher::new(store.clone(), Arc::default());
    let entries = fill_pool_object(&store).await;
    let ipam = json!({"type": "whereabouts", "range": "10.128.0.0/16"});
    let req = request(Command::Add, ipam, "c-new", "new").unwrap();
    let e = handle_with(&*store, &batcher, &req).await.unwrap_err();
    assert_eq!(e.code, Code::Exhausted, "{e:?}");
    assert!(
        e.msg.contains(&format!("its {entries} entries")),
        "{}",
        e.msg
    );
    let pool = store.get_pool("10.128.0.0-16").await.unwrap().unwrap();
    assert_eq!(pool.allocations.len() as u128, entries);
}

/// Issue 25: a sandbox re-created while the old one's DEL is still due. The new container has
/// taken over the pod interface's reservation (and is about to record its entry); the old
/// container's DEL removes its own entry but must leave the new container's claim, or the new
/// entry would have no reservation and an overlapping pool could hand the address out again. It
/// was deleted: the release matched the reservation by pod alone.
#[tokio::test]
async fn an_old_containers_del_leaves_the_claim_its_successor_took_over() {
    let store = MemoryStore::new();
    let ipam = json!({"type": "whereabouts", "range": "10.0.0.0/24"});
    let old = IPAllocation {
        id: "c-old".into(),
        podref: "ns/p".into(),
        ifname: "net1".into(),
        ..Default::default()
    };
    store.put_entry("10.0.0.0-24", "10.0.0.0/24", 1, old);
    let taken_over = claim_spec("c-new", "p");
    store
        .create_reservation(
            "10.0.0.1",
            &taken_over,
            "10.0.0.0-24",
            "10.0.0.1".parse().unwrap(),
        )
        .await
        .unwrap();
    run(&store, Command::Del, &ipam, "c-old", "p")
        .await
        .unwrap();
    let pool = store.get_pool("10.0.0.0-24").await.unwrap().unwrap();
    assert!(
        pool.allocations.is_empty(),
        "the old container's entry is released"
    );
    let kept = store.get_reservation("10.0.0.1").await.unwrap();
    assert_eq!(
        kept.map(|r| r.spec.containerid),
        Some("c-new".to_owned()),
        "the successor's claim was deleted"
    );
}

/// Ten agents' groups at once, into a range with exactly as many addresses as jobs: every job gets
/// one, none twice, without any group going the slow one-by-one way for long.
#[tokio::test]
async fn groups_of_many_agents_fill_a_range_exactly() {
    let store = Arc::new(MemoryStore::new().interleaved());
    let range = range_of(
        json!({"range": "10.0.0.0/22", "range_start": "10.0.0.1", "range_end": "10.0.3.232"}),
    );
    let started = std::time::Instant::now();
    let tasks: Vec<_> = (0..10)
        .map(|g| {
            let (store, range) = (store.clone(), range.clone());
            tokio::spawn(async move {
                let jobs = (0..100).map(|i| job(&range, g * 100 + i)).collect();
                whereabouts::alloc::group::allocate_group(&*store, jobs).await
            })
        })
        .collect();
    let mut seen = BTreeSet::new();
    for t in tasks {
        for r in t.await.unwrap() {
            let ip = r.expect("every job has an address").ip;
            assert!(seen.insert(ip), "{ip} given twice");
        }
    }
    assert_eq!(seen.len(), 1000);
    eprintln!("{:?} for 1000 in 10 groups", started.elapsed());
}

/// An ADD cut off between its claim and its record (its plugin or the agent killed) leaves a
/// claim and no entry; the runtime then DELs that sandbox and retries with a new one. The DEL,
/// by the plugin or through an agent's group, withdraws that claim: nothing is left for the
/// audit to sweep, and another pod's claim is never touched. (Had another writer recorded the
/// claim meanwhile, as writers record the pending claims of others, the DEL releases that entry.)
#[tokio::test]
async fn a_del_withdraws_the_claim_its_cut_off_add_left() {
    let store = MemoryStore::new();
    let ipam = json!({"type": "whereabouts", "range": "10.0.0.0/24"});
    for (name, c, p) in [
        ("10.0.0.7", "c0", "p0"),
        ("10.0.0.8", "c1", "p1"),
        ("10.0.0.9", "x", "other"),
    ] {
        let ip: std::net::IpAddr = name.parse().unwrap();
        store
            .create_reservation(name, &claim_spec(c, p), "10.0.0.0-24", ip)
            .await
            .unwrap();
    }
    store
        .create_pool("10.0.0.0-24", "10.0.0.0/24", &Default::default())
        .await
        .unwrap();
    run(&store, Command::Del, &ipam, "c0", "p0").await.unwrap();
    let range = range_of(ipam.clone());
    let released = whereabouts::alloc::group::release_group(&store, &[job(&range, 1)]).await;
    assert!(
        released[0].as_ref().unwrap().is_empty(),
        "nothing was recorded: {released:?}"
    );
    assert_eq!(
        store.reservation_names(),
        ["10.0.0.9"],
        "the other pod's claim is kept"
    );
}

/// A pod of the same name on another node (the first force-deleted, its node partitioned, the
/// pod re-created elsewhere) never takes over the first one's address, which may still be in use
/// there: it gets one of its own, and the first entry waits for the operator. On its own node the
/// new sandbox gets the address back (ADD's idempotency).
#[tokio::test]
async fn a_pod_of_the_same_name_on_another_node_gets_an_address_of_its_own() {
    let store = MemoryStore::new();
    let conf = json!({"cniVersion": "1.0.0", "name": "net", "ipam": {"type": "whereabouts", "range": "10.0.0.0/24"}});
    let add = |node: &str, container: &str| {
        request_on(node, Command::Add, conf.clone(), container, "web-0").unwrap()
    };
    let first = handle(&store, &add("node-a", "c1")).await.unwrap().unwrap();
    let elsewhere = handle(&store, &add("node-b", "c2")).await.unwrap().unwrap();
    assert_ne!(addresses(&first), addresses(&elsewhere));
    let pool = store.get_pool("10.0.0.0-24").await.unwrap().unwrap();
    let held: Vec<_> = pool
        .allocations
        .values()
        .map(|e| (e.id.as_str(), e.node.as_str()))
        .collect();
    assert_eq!(held, [("c1", "node-a"), ("c2", "node-b")]);
    assert_eq!(store.reservation_names(), ["10.0.0.1", "10.0.0.2"]);
    // Back on node b, a new sandbox of the pod takes its node's entry over.
    let again = handle(&store, &add("node-b", "c3")).await.unwrap().unwrap();
    assert_eq!(addresses(&again), addresses(&elsewhere));
}
