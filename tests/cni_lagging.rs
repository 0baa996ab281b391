//! The CNI handlers over an in-memory store whose cached reads lag, as the API server's watch
//! cache does: what a GET or LIST served from the cache shows may miss the last writes.

use std::collections::BTreeSet;
use std::sync::Arc;

use serde_json::json;
use whereabouts::cni::protocol::Command;
use whereabouts::store::Datastore;
use whereabouts::store::memory::MemoryStore;

mod cni_support;
use cni_support::*;

/// Issue 25: the API server's watch cache lags, and the claims lists, cached pool reads and
/// release announcements come from it. With a store whose cached reads answer from a state a few
/// calls old: pods attached, half of them detached and new ones attached at the same time, by
/// plugins alone and through an agent. No address twice, every live attachment recorded and
/// claimed, nothing of a detached one left.
#[tokio::test]
async fn churn_with_a_lagging_cache_never_duplicates_or_leaks() {
    use whereabouts::agent::batch::Batcher;
    let store = Arc::new(MemoryStore::new().interleaved().lagging());
    let batcher = Arc::new(Batcher::new(store.clone(), Arc::default()));
    let ipam = json!({"type": "whereabouts", "range": "10.0.0.0/25"});
    let call = |command: Command, i: usize| {
        let (store, batcher, ipam) = (store.clone(), batcher.clone(), ipam.clone());
        tokio::spawn(async move {
            let req = request(command, ipam, &format!("c{i}"), &format!("p{i}")).unwrap();
            let out = if i.is_multiple_of(3) {
                handle(&*store, &req).await
            } else {
                handle_with(&*store, &*batcher, &req).await
            };
            out.unwrap().map(|v| addresses(&v)[0].clone())
        })
    };
    for t in (0..60).map(|i| call(Command::Add, i)).collect::<Vec<_>>() {
        t.await.unwrap().expect("an address");
    }
    let mut churn: Vec<_> = (0..30).map(|i| call(Command::Del, i * 2)).collect();
    churn.extend((60..100).map(|i| call(Command::Add, i)));
    for t in churn {
        t.await.unwrap();
    }
    let live: BTreeSet<String> = (0..100)
        .filter(|i| *i >= 60 || i % 2 == 1)
        .map(|i| format!("ns/p{i}"))
        .collect();
    let pool = store.get_pool("10.0.0.0-25").await.unwrap().unwrap();
    let held: BTreeSet<String> = pool
        .allocations
        .values()
        .map(|e| e.podref.clone())
        .collect();
    assert_eq!(pool.allocations.len(), live.len(), "one entry per live pod");
    assert_eq!(held, live);
    let claims: BTreeSet<String> = store.reservation_names().into_iter().collect();
    let recorded: BTreeSet<String> = pool
        .allocations
        .keys()
        .map(|o| format!("10.0.0.{o}"))
        .collect();
    assert_eq!(
        claims, recorded,
        "every entry claimed, no claim without an entry"
    );
}

/// A runtime may repeat an ADD for the same container after a DEL of it (the CNI spec allows
/// it; a runtime retrying a sandbox whose first result it lost does it). The pool read from the
/// cache may still show the entry the DEL just removed: the ADD must not hand back an address
/// that no entry records (another pod would get it next), with or without reservations.
#[tokio::test]
async fn an_add_repeated_after_its_del_is_recorded_whatever_the_cache_shows() {
    for overlapping in [true, false] {
        let store = MemoryStore::new().lagging();
        let ipam = json!({"type": "whereabouts", "range": "10.0.0.0/24", "enable_overlapping_ranges": overlapping});
        for i in 0..40 {
            let (c, p) = (format!("c{i}"), format!("p{i}"));
            run(&store, Command::Add, &ipam, &c, &p).await.unwrap();
            run(&store, Command::Del, &ipam, &c, &p).await.unwrap();
            let again = run(&store, Command::Add, &ipam, &c, &p)
                .await
                .unwrap()
                .unwrap();
            let ip: std::net::Ipv4Addr = addresses(&again)[0]
                .split('/')
                .next()
                .unwrap()
                .parse()
                .unwrap();
            let pool = store.get_pool("10.0.0.0-24").await.unwrap().unwrap();
            let offset =
                u128::from(u32::from(ip) - u32::from(std::net::Ipv4Addr::new(10, 0, 0, 0)));
            let entry = pool.allocations.get(&offset);
            assert!(
                entry.is_some_and(|e| e.id == c),
                "overlapping={overlapping}, round {i}: the ADD returned {ip}, the pool records {entry:?}"
            );
        }
    }
}

/// What a DEL does before it removes its entry of `address` (CIDR notation): announce the
/// release on the address's reservation.
async fn announce_release(store: &MemoryStore, address: &str) {
    let ip = address.split('/').next().unwrap();
    let name = store
        .reservation_names()
        .into_iter()
        .find(|n| n.ends_with(ip))
        .unwrap();
    let r = store.get_reservation(&name).await.unwrap().unwrap();
    store.mark_releasing(&name, &r.uid).await.unwrap();
}

/// Seen in the 10-node storm (issue 28): a DEL announced its container's release, then ran out of
/// time before removing the entry; the runtime's next ADD of that container reused the entry and
/// succeeded, but the announcement stayed, so a later DEL of another pod of the node swept the
/// entry with its own: an address handed out and recorded nowhere. Taking the entry again
/// withdraws the announcement.
#[tokio::test]
async fn an_entry_taken_again_after_a_cut_off_del_survives_another_release() {
    for lagging in [false, true] {
        let store = if lagging {
            MemoryStore::new().lagging()
        } else {
            MemoryStore::new()
        };
        let ipam = json!({"type": "whereabouts", "range": "10.0.0.0/24"});
        let first = run(&store, Command::Add, &ipam, "c1", "p1").await.unwrap();
        let first = addresses(&first.unwrap())[0].clone();
        run(&store, Command::Add, &ipam, "c2", "p2").await.unwrap();
        announce_release(&store, &first).await;
        let again = run(&store, Command::Add, &ipam, "c1", "p1").await.unwrap();
        assert_eq!(addresses(&again.unwrap())[0], first, "the entry is reused");
        run(&store, Command::Del, &ipam, "c2", "p2").await.unwrap();
        let pool = store.get_pool("10.0.0.0-24").await.unwrap().unwrap();
        assert!(
            pool.allocations.values().any(|e| e.id == "c1"),
            "lagging={lagging}: c1 was handed {first} again, the pool holds {:?}",
            pool.allocations
        );
    }
}

/// The same, with the sweep already under way: another DEL's sweep read the pool and listed the
/// announced releases (c1's among them) before c1's ADD took its entry again, and writes after
/// it. Taking the same entry again changes nothing in the pool, so the sweep's write, conditional
/// on the version it read, would remove the entry the ADD just handed out. The ADD moves the pool
/// on, and that write fails (the sweep then reads the announcements again: c1's is withdrawn).
#[tokio::test]
async fn a_sweep_that_listed_a_release_before_its_entry_was_taken_again_cannot_remove_it() {
    let store = MemoryStore::new();
    let ipam = json!({"type": "whereabouts", "range": "10.0.0.0/24"});
    let first = run(&store, Command::Add, &ipam, "c1", "p1").await.unwrap();
    let first = addresses(&first.unwrap())[0].clone();
    announce_release(&store, &first).await;
    // The sweep's reads: the pool, then the announcements.
    let seen = store.get_pool("10.0.0.0-24").await.unwrap().unwrap();
    let releases = store.releases_of("10.0.0.0-24").await.unwrap();
    assert_eq!(releases.len(), 1, "c1's release is announced");
    let offset = *seen.allocations.keys().next().unwrap();

    let again = run(&store, Command::Add, &ipam, "c1", "p1").await.unwrap();
    assert_eq!(addresses(&again.unwrap())[0], first, "the entry is reused");
    // The sweep's write, from what it read.
    let written = store
        .remove_allocations("10.0.0.0-24", &[offset], &seen.resource_version)
        .await
        .unwrap();
    let pool = store.get_pool("10.0.0.0-24").await.unwrap().unwrap();
    assert!(
        pool.allocations.values().any(|e| e.id == "c1"),
        "c1 was handed {first} again, and the sweep removed it ({written:?}): the pool holds {:?}",
        pool.allocations
    );
    assert!(
        store.releases_of("10.0.0.0-24").await.unwrap().is_empty(),
        "the ADD withdrew c1's announcement"
    );
}
