//! The pod-cleanup decisions against a scripted mock API server (tower-test): each scenario lists
//! exactly the requests the operator must make, in order, and what the API server answers.

mod mock;

use http::{Method, StatusCode};
use mock::{Call, Handle, any, context_with, event_answer, serve};
use serde_json::{Value, json};
use whereabouts::controller::Context;
use whereabouts::controller::cleanup::{Trigger, release_pod, release_pods};
use whereabouts::crd::{IPAllocation, IPPool, IPPoolSpec};
use whereabouts::ownership::PodIdentity;

const POOLS: &str = "/apis/whereabouts.cni.cncf.io/v1alpha1/namespaces/kube-system/ippools";
const RESERVATIONS: &str =
    "/apis/whereabouts.cni.cncf.io/v1alpha1/namespaces/kube-system/overlappingrangeipreservations";

/// A context whose pool cache holds `pools` and whose API server is the returned mock.
fn context(pools: Vec<IPPool>, dry_run: bool) -> (Context, Handle) {
    context_with(pools, vec![], dry_run)
}

fn pool(entries: &[(u128, &str, &str)]) -> IPPool {
    let mut p = IPPool::new(
        "10.0.0.0-24",
        IPPoolSpec {
            range: "10.0.0.0/24".into(),
            allocations: Default::default(),
        },
    );
    p.metadata.namespace = Some("kube-system".into());
    p.metadata.resource_version = Some("7".into());
    for (offset, podref, uid) in entries {
        p.spec.allocations.insert(
            offset.to_string(),
            IPAllocation {
                id: format!("c{offset}"),
                podref: (*podref).into(),
                poduid: (*uid).into(),
                ..Default::default()
            },
        );
    }
    p
}

fn pod(uid: &str) -> PodIdentity {
    PodIdentity {
        podref: "ns/a".into(),
        uid: uid.into(),
        addresses: vec![],
    }
}

fn reservation(podref: &str) -> Value {
    reservation_of(5, podref)
}

fn reservation_of(offset: u128, podref: &str) -> Value {
    json!({"apiVersion": "whereabouts.cni.cncf.io/v1alpha1", "kind": "OverlappingRangeIPReservation",
           "metadata": {"name": format!("10.0.0.{offset}"), "namespace": "kube-system", "uid": format!("r-{offset}"), "resourceVersion": format!("{offset}00")},
           "spec": {"podref": podref, "containerid": format!("c{offset}")}})
}

fn get_pool(answer: IPPool) -> Call {
    Call {
        method: Method::GET,
        path: format!("{POOLS}/10.0.0.0-24"),
        body: any,
        status: StatusCode::OK,
        answer: serde_json::to_value(answer).unwrap(),
    }
}

fn get_reservation(status: StatusCode, answer: Value) -> Call {
    Call {
        method: Method::GET,
        path: format!("{RESERVATIONS}/10.0.0.5"),
        body: any,
        status,
        answer,
    }
}

fn not_found() -> Value {
    json!({"kind": "Status", "apiVersion": "v1", "status": "Failure", "code": 404, "reason": "NotFound", "message": "not found", "details": {"name": "10.0.0.5"}})
}

fn event_call() -> Call {
    Call {
        method: Method::POST,
        path: "/apis/events.k8s.io/v1/namespaces/ns/events".into(),
        body: any,
        status: StatusCode::CREATED,
        answer: event_answer(),
    }
}

#[tokio::test]
async fn a_deleted_pods_entry_is_removed_conditionally_then_its_reservation() {
    let (ctx, handle) = context(vec![pool(&[(5, "ns/a", "ua"), (6, "ns/b", "ub")])], false);
    let calls = vec![
        // Not in the reservation cache: read it before the entry goes (a recent claim's release
        // is announced first; this one is not recent).
        get_reservation(StatusCode::OK, reservation("ns/a")),
        // A fresh read: owners are checked in the version the write is conditional on.
        get_pool(pool(&[(5, "ns/a", "ua"), (6, "ns/b", "ub")])),
        Call {
            method: Method::PATCH,
            path: format!("{POOLS}/10.0.0.0-24"),
            body: |b| {
                assert_eq!(
                    b,
                    &json!({"metadata": {"resourceVersion": "7"}, "spec": {"allocations": {"5": null}}})
                )
            },
            status: StatusCode::OK,
            answer: serde_json::to_value(pool(&[(6, "ns/b", "ub")])).unwrap(),
        },
        Call {
            method: Method::DELETE,
            path: format!("{RESERVATIONS}/10.0.0.5"),
            body: |b| {
                assert_eq!(
                    b["preconditions"]["uid"], "r-5",
                    "deleted only if still the reservation we read"
                )
            },
            status: StatusCode::OK,
            answer: reservation("ns/a"),
        },
        Call {
            method: Method::POST,
            path: "/apis/events.k8s.io/v1/namespaces/ns/events".into(),
            body: |b| {
                assert!(
                    b["note"]
                        .as_str()
                        .unwrap()
                        .contains("released 10.0.0.5 (10.0.0.0-24)"),
                    "{b}"
                )
            },
            status: StatusCode::CREATED,
            answer: event_answer(),
        },
    ];
    let server = tokio::spawn(serve(handle, calls));
    let outcome = release_pod(&ctx, &pod("ua"), Trigger::Deleted)
        .await
        .unwrap();
    assert_eq!(
        outcome.released["10.0.0.0-24"],
        vec!["10.0.0.5".parse::<std::net::IpAddr>().unwrap()]
    );
    server.await.unwrap();
}

/// Issue 25: a pod whose claim is recent (claimed within the last buckets) may still be listed by
/// a plugin's writer turn as a claim waiting for its entry; between the entry's removal and the
/// reservation's deletion, that turn would write the entry back. So its release is announced
/// first, on the version read fresh (the cache's may be older than a take-over), and the
/// reservation is deleted at the version the announcement made.
#[tokio::test]
async fn a_recent_claims_release_is_announced_before_its_entry_goes() {
    let now = whereabouts::store::now_secs();
    let mut recent = reservation("ns/a");
    recent["metadata"]["labels"] = json!({whereabouts::store::CLAIMED_LABEL:
        whereabouts::store::claim_bucket(now).to_string()});
    let cached = serde_json::from_value(recent.clone()).unwrap();
    let (ctx, handle) = context_with(vec![pool(&[(5, "ns/a", "ua")])], vec![cached], false);
    let mut announced = recent.clone();
    announced["metadata"]["resourceVersion"] = json!("501");
    let calls = vec![
        get_reservation(StatusCode::OK, recent),
        Call {
            method: Method::PATCH,
            path: format!("{RESERVATIONS}/10.0.0.5"),
            body: |b| {
                assert_eq!(b["metadata"]["uid"], "r-5");
                assert_eq!(
                    b["metadata"]["resourceVersion"], "500",
                    "at the version read"
                );
                assert!(
                    b["metadata"]["labels"][whereabouts::store::RELEASING_LABEL].is_string(),
                    "{b}"
                );
            },
            status: StatusCode::OK,
            answer: announced,
        },
        get_pool(pool(&[(5, "ns/a", "ua")])),
        Call {
            method: Method::PATCH,
            path: format!("{POOLS}/10.0.0.0-24"),
            body: |b| assert_eq!(b["spec"]["allocations"]["5"], Value::Null),
            status: StatusCode::OK,
            answer: serde_json::to_value(pool(&[])).unwrap(),
        },
        Call {
            method: Method::DELETE,
            path: format!("{RESERVATIONS}/10.0.0.5"),
            body: |b| assert_eq!(b["preconditions"]["resourceVersion"], "501"),
            status: StatusCode::OK,
            answer: reservation("ns/a"),
        },
        event_call(),
    ];
    let server = tokio::spawn(serve(handle, calls));
    let outcome = release_pod(&ctx, &pod("ua"), Trigger::Deleted)
        .await
        .unwrap();
    assert_eq!(outcome.released["10.0.0.0-24"].len(), 1);
    server.await.unwrap();
}

/// Many pods at once: one read and one write of the pool for all of them, reservations deleted
/// straight from the cache's UIDs, one event per pod.
#[tokio::test]
async fn a_batch_of_pods_is_released_with_one_pool_write() {
    let entries = [(5, "ns/a", "ua"), (6, "ns/b", "ub"), (7, "ns/c", "uc")];
    let reservations = [(5, "ns/a"), (6, "ns/b")]
        .iter()
        .map(|(o, p)| serde_json::from_value(reservation_of(*o, p)).unwrap())
        .collect();
    let (ctx, handle) = context_with(vec![pool(&entries)], reservations, false);
    let calls = vec![
        get_pool(pool(&entries)),
        Call {
            method: Method::PATCH,
            path: format!("{POOLS}/10.0.0.0-24"),
            body: |b| {
                assert_eq!(
                    b,
                    &json!({"metadata": {"resourceVersion": "7"}, "spec": {"allocations": {"5": null, "6": null}}})
                )
            },
            status: StatusCode::OK,
            answer: serde_json::to_value(pool(&[(7, "ns/c", "uc")])).unwrap(),
        },
        Call {
            method: Method::DELETE,
            path: format!("{RESERVATIONS}/10.0.0.5"),
            // At the version the cache saw: one taken over since by a new container is kept.
            body: |b| {
                assert_eq!(b["preconditions"]["uid"], "r-5");
                assert_eq!(b["preconditions"]["resourceVersion"], "500");
            },
            status: StatusCode::OK,
            answer: reservation_of(5, "ns/a"),
        },
        Call {
            method: Method::DELETE,
            path: format!("{RESERVATIONS}/10.0.0.6"),
            body: |b| assert_eq!(b["preconditions"]["uid"], "r-6"),
            status: StatusCode::OK,
            answer: reservation_of(6, "ns/b"),
        },
        event_call(),
        event_call(),
    ];
    let server = tokio::spawn(serve(handle, calls));
    let pods = [("ns/a", "ua"), ("ns/b", "ub")].map(|(podref, uid)| {
        (
            PodIdentity {
                podref: podref.into(),
                uid: uid.into(),
                addresses: vec![],
            },
            Trigger::Deleted,
        )
    });
    let outcomes = release_pods(&ctx, &pods).await;
    let released: Vec<_> = outcomes
        .iter()
        .map(|o| o.as_ref().unwrap().released["10.0.0.0-24"].clone())
        .collect();
    assert_eq!(
        released,
        [
            ["10.0.0.5".parse::<std::net::IpAddr>().unwrap()],
            ["10.0.0.6".parse().unwrap()]
        ]
    );
    server.await.unwrap();
}

/// Another writer got in between the read and the write: read again, check owners again, write.
#[tokio::test]
async fn a_lost_pool_write_is_read_again_and_retried() {
    let (ctx, handle) = context(vec![pool(&[(5, "ns/a", "ua")])], false);
    let mut moved_on = pool(&[(5, "ns/a", "ua"), (9, "ns/new", "un")]);
    moved_on.metadata.resource_version = Some("8".into());
    let calls = vec![
        get_reservation(StatusCode::NOT_FOUND, not_found()),
        get_pool(pool(&[(5, "ns/a", "ua")])),
        Call {
            method: Method::PATCH,
            path: format!("{POOLS}/10.0.0.0-24"),
            body: any,
            status: StatusCode::CONFLICT,
            answer: json!({"kind": "Status", "apiVersion": "v1", "status": "Failure", "code": 409, "reason": "Conflict", "message": "the object has been modified"}),
        },
        get_pool(moved_on),
        Call {
            method: Method::PATCH,
            path: format!("{POOLS}/10.0.0.0-24"),
            body: |b| {
                assert_eq!(
                    b,
                    &json!({"metadata": {"resourceVersion": "8"}, "spec": {"allocations": {"5": null}}})
                )
            },
            status: StatusCode::OK,
            answer: serde_json::to_value(pool(&[(9, "ns/new", "un")])).unwrap(),
        },
        event_call(),
    ];
    let server = tokio::spawn(serve(handle, calls));
    let outcome = release_pod(&ctx, &pod("ua"), Trigger::Deleted)
        .await
        .unwrap();
    assert_eq!(outcome.released["10.0.0.0-24"].len(), 1);
    server.await.unwrap();
}

#[tokio::test]
async fn a_statefulset_replacements_entry_causes_no_request() {
    // Same name, newer pod: the entry carries the new UID.
    let (ctx, handle) = context(vec![pool(&[(5, "ns/a", "new-uid")])], false);
    let server = tokio::spawn(serve(handle, vec![]));
    let outcome = release_pod(&ctx, &pod("old-uid"), Trigger::Deleted)
        .await
        .unwrap();
    assert_eq!(outcome.found, 0);
    server.await.unwrap();
}

#[tokio::test]
async fn an_entry_rebound_after_the_cache_was_read_is_left_alone() {
    let (ctx, handle) = context(vec![pool(&[(5, "ns/a", "ua")])], false);
    // The pool changed since the cache saw it: the fresh read shows the address held by a newer
    // container of the same pod name, so nothing is written.
    let mut rebound = pool(&[(5, "ns/a", "ua")]);
    rebound.spec.allocations.get_mut("5").unwrap().id = "c-new".into();
    let calls = vec![
        get_reservation(StatusCode::OK, reservation("ns/a")),
        get_pool(rebound),
    ];
    let server = tokio::spawn(serve(handle, calls));
    let outcome = release_pod(&ctx, &pod("ua"), Trigger::Deleted)
        .await
        .unwrap();
    assert!(outcome.released.values().all(Vec::is_empty), "{outcome:?}");
    server.await.unwrap();
}

#[tokio::test]
async fn a_reservation_held_by_another_pod_is_kept() {
    let (ctx, handle) = context(vec![pool(&[(5, "ns/a", "ua")])], false);
    let calls = vec![
        get_reservation(StatusCode::OK, reservation("ns/other")),
        get_pool(pool(&[(5, "ns/a", "ua")])),
        Call {
            method: Method::PATCH,
            path: format!("{POOLS}/10.0.0.0-24"),
            body: any,
            status: StatusCode::OK,
            answer: serde_json::to_value(pool(&[])).unwrap(),
        },
        Call {
            method: Method::POST,
            path: "/apis/events.k8s.io/v1/namespaces/ns/events".into(),
            body: any,
            status: StatusCode::CREATED,
            answer: event_answer(),
        },
    ];
    let server = tokio::spawn(serve(handle, calls));
    release_pod(&ctx, &pod("ua"), Trigger::Deleted)
        .await
        .unwrap();
    server.await.unwrap();
}

#[tokio::test]
async fn a_dry_run_writes_nothing() {
    let (ctx, handle) = context(vec![pool(&[(5, "ns/a", "ua")])], true);
    let server = tokio::spawn(serve(handle, vec![]));
    let outcome = release_pod(&ctx, &pod("ua"), Trigger::Deleted)
        .await
        .unwrap();
    assert_eq!(outcome.found, 1);
    server.await.unwrap();
}

#[tokio::test]
async fn an_api_failure_is_an_error_for_the_retry_queue() {
    let (ctx, handle) = context(vec![pool(&[(5, "ns/a", "ua")])], false);
    // Forbidden is not transient: one attempt, then the error goes back to the worker's backoff.
    let calls = vec![
        get_reservation(StatusCode::NOT_FOUND, not_found()),
        get_pool(pool(&[(5, "ns/a", "ua")])),
        Call {
            method: Method::PATCH,
            path: format!("{POOLS}/10.0.0.0-24"),
            body: any,
            status: StatusCode::FORBIDDEN,
            answer: json!({"kind": "Status", "apiVersion": "v1", "status": "Failure", "code": 403, "reason": "Forbidden", "message": "ippools is forbidden"}),
        },
    ];
    let server = tokio::spawn(serve(handle, calls));
    let err = release_pod(&ctx, &pod("ua"), Trigger::Deleted)
        .await
        .unwrap_err();
    assert_eq!(err.kind(), "forbidden");
    assert!(err.to_string().contains("ippools is forbidden"), "{err}");
    server.await.unwrap();
}

fn get_pod_a(status: StatusCode, uid: &str) -> Call {
    Call {
        method: Method::GET,
        path: "/api/v1/namespaces/ns/pods/a".into(),
        body: any,
        status,
        answer: if status == StatusCode::OK {
            json!({"apiVersion": "meta.k8s.io/v1", "kind": "PartialObjectMetadata",
                   "metadata": {"name": "a", "namespace": "ns", "uid": uid}})
        } else {
            json!({"kind": "Status", "apiVersion": "v1", "status": "Failure", "reason": "NotFound", "code": 404})
        },
    }
}

/// Issue 25: an entry without a pod UID (upstream's plugin wrote it) is matched to a deleted pod
/// by name and network-status address. A delayed or retried cleanup of the old pod must not free
/// it once a replacement of the same name lives: the replacement's ADD refreshed that entry.
#[tokio::test]
async fn a_uidless_entry_is_kept_while_a_pod_of_that_name_lives() {
    let (ctx, handle) = context(vec![pool(&[(5, "ns/a", "")])], false);
    let calls = vec![get_pod_a(StatusCode::OK, "u-replacement")];
    let server = tokio::spawn(serve(handle, calls));
    let old = PodIdentity {
        addresses: vec!["10.0.0.5".parse().unwrap()],
        ..pod("u-old")
    };
    let outcome = release_pod(&ctx, &old, Trigger::Deleted).await.unwrap();
    assert!(outcome.released.is_empty(), "{outcome:?}");
    server.await.unwrap();
}

/// The same entry with no pod of that name left: released as before, conditionally; and a
/// finished pod (the same UID still exists) releases its own.
#[tokio::test]
async fn a_uidless_entry_of_a_gone_or_finished_pod_is_released() {
    for (status, uid) in [(StatusCode::NOT_FOUND, ""), (StatusCode::OK, "u-old")] {
        let (ctx, handle) = context(vec![pool(&[(5, "ns/a", "")])], false);
        let calls = vec![
            get_pod_a(status, uid),
            get_reservation(StatusCode::NOT_FOUND, not_found()),
            get_pool(pool(&[(5, "ns/a", "")])),
            Call {
                method: Method::PATCH,
                path: format!("{POOLS}/10.0.0.0-24"),
                body: |b| assert_eq!(b["spec"]["allocations"]["5"], Value::Null),
                status: StatusCode::OK,
                answer: serde_json::to_value(pool(&[])).unwrap(),
            },
            event_call(),
        ];
        let server = tokio::spawn(serve(handle, calls));
        let old = PodIdentity {
            addresses: vec!["10.0.0.5".parse().unwrap()],
            ..pod("u-old")
        };
        let outcome = release_pod(&ctx, &old, Trigger::Deleted).await.unwrap();
        assert_eq!(outcome.released["10.0.0.0-24"].len(), 1, "{status}");
        server.await.unwrap();
    }
}
