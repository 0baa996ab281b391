//! The CNI handlers over an in-memory store whose cached reads lag, as the API server's watch
//! cache does: what a GET or LIST served from the cache shows may miss the last writes.

use std::collections::BTreeSet;
use std::sync::Arc;
use std::time::Duration;

use serde_json::json;
use whereabouts::cni::protocol::Command;
use whereabouts::store::memory::MemoryStore;
use whereabouts::store::{Datastore, Listing, PoolWrite, Write};

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
    store
        .mark_releasing(&name, &r.uid, &r.resource_version)
        .await
        .unwrap();
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

/// The other side of the test above: an entry taken again with no release announced for it
/// leaves the pool as it was. In a storm through the agents, writer turns record hundreds of other
/// ADDs' claims, each of which then takes its entry again; when each of those wrote the pool too,
/// every other writer's conditional write lost, and 1000 ADDs on 10 nodes ran past their
/// deadlines (docs/benchmarks.md, "The agents' one-pool storm: the regression since 9391ce0
/// found and fixed").
#[tokio::test]
async fn an_entry_taken_again_with_no_release_announced_does_not_move_its_pool() {
    let store = MemoryStore::new();
    let ipam = json!({"type": "whereabouts", "range": "10.0.0.0/24"});
    let first = run(&store, Command::Add, &ipam, "c1", "p1").await.unwrap();
    let first = addresses(&first.unwrap())[0].clone();
    let before = store.get_pool("10.0.0.0-24").await.unwrap().unwrap();

    let again = run(&store, Command::Add, &ipam, "c1", "p1").await.unwrap();
    assert_eq!(addresses(&again.unwrap())[0], first, "the entry is reused");
    let after = store.get_pool("10.0.0.0-24").await.unwrap().unwrap();
    assert_eq!(
        after.resource_version, before.resource_version,
        "taking the entry again wrote the pool, though no release was announced"
    );
    assert_eq!(after.allocations, before.allocations);
}

/// Seen in chaos runs (issue 25): a DEL through the agent removed its entry, and a plain plugin's
/// writer turn, recording the pool's pending claims from a claims list that still showed the
/// DEL's reservation, wrote the entry back; the DEL then deleted the reservation and succeeded.
/// An entry for a pod whose DEL completed, with no reservation guarding its address. With a
/// lagging cache, and reservation deletes that take a round trip, agent DELs race plain ADDs (turn
/// holders) of new pods, both spread over a few tens of milliseconds: no deleted pod keeps an
/// entry, and every entry is claimed.
#[tokio::test]
async fn a_del_is_not_undone_by_a_turn_holder_that_listed_its_claim() {
    use whereabouts::agent::batch::Batcher;
    for round in 0..8 {
        let store = Arc::new(MemoryStore::new().interleaved().lagging().slow_deletes(3));
        let batcher = Arc::new(Batcher::new(store.clone(), Arc::default()));
        let ipam = json!({"type": "whereabouts", "range": "10.0.0.0/24"});
        let call = |command: Command, i: usize, agent: bool, spread: u64| {
            let (store, batcher, ipam) = (store.clone(), batcher.clone(), ipam.clone());
            tokio::spawn(async move {
                let req = request(command, ipam, &format!("c{i}"), &format!("p{i}")).unwrap();
                tokio::time::sleep(Duration::from_millis(fastrand::u64(0..=spread))).await;
                let out = if agent {
                    handle_with(&*store, &*batcher, &req).await
                } else {
                    handle(&*store, &req).await
                };
                out.expect("no error").is_some()
            })
        };
        for t in (0..40)
            .map(|i| call(Command::Add, i, true, 0))
            .collect::<Vec<_>>()
        {
            assert!(t.await.unwrap(), "an address");
        }
        let mut churn: Vec<_> = (0..20).map(|i| call(Command::Del, i, true, 40)).collect();
        churn.extend((40..80).map(|i| call(Command::Add, i, false, 40)));
        for t in churn {
            t.await.unwrap();
        }
        let pool = store.get_pool("10.0.0.0-24").await.unwrap().unwrap();
        let undone: Vec<_> = (pool.allocations.values())
            .filter(|e| {
                e.podref
                    .trim_start_matches("ns/p")
                    .parse::<usize>()
                    .unwrap()
                    < 20
            })
            .collect();
        assert!(
            undone.is_empty(),
            "round {round}: entries of deleted pods: {undone:?}"
        );
        let claimed: BTreeSet<String> = (store.reservation_names().into_iter())
            .map(|n| n.rsplit('-').next().unwrap().to_owned())
            .collect();
        let recorded: BTreeSet<String> = (pool.allocations.keys())
            .map(|o| format!("10.0.0.{o}"))
            .collect();
        assert_eq!(
            claimed, recorded,
            "round {round}: every entry claimed, no claim left"
        );
    }
}

/// The writer turn's half of the above: a watch cache still from before a DEL announced its
/// release shows that reservation as a claim waiting for its entry once the DEL removed the
/// entry. A new pod's ADD, which takes the writer turn because it sees that claim, lists the
/// claims it records consistently after reading the pool: it does not write the entry back.
#[tokio::test]
async fn a_turn_holder_does_not_write_back_a_release_that_its_cache_does_not_show_yet() {
    let store = MemoryStore::new();
    let ipam = json!({"type": "whereabouts", "range": "10.0.0.0/24"});
    let first = run(&store, Command::Add, &ipam, "c1", "p1").await.unwrap();
    let first = addresses(&first.unwrap())[0].clone();
    store.freeze_cache();
    // c1's DEL up to the deletion of its reservation: announced, then its entry removed.
    announce_release(&store, &first).await;
    let pool = store.get_pool("10.0.0.0-24").await.unwrap().unwrap();
    let offset = *pool.allocations.keys().next().unwrap();
    let removed = store
        .remove_allocations("10.0.0.0-24", &[offset], &pool.resource_version)
        .await
        .unwrap();
    assert!(matches!(removed, PoolWrite::Done(_)), "{removed:?}");
    let second = run(&store, Command::Add, &ipam, "c2", "p2").await.unwrap();
    assert_ne!(
        addresses(&second.unwrap())[0],
        first,
        "c1's claim still stands"
    );
    store.thaw_cache();
    let pool = store.get_pool("10.0.0.0-24").await.unwrap().unwrap();
    assert!(
        !pool.allocations.values().any(|e| e.id == "c1"),
        "c1's released entry was written back: {:?}",
        pool.allocations
    );
    assert!(store.count("take_turn") > 0, "c2 took the writer turn");
}

/// The same for an ADD cut off between claiming and recording (killed, or past its deadline):
/// its DEL finds no entry and deletes the claim, while a writer turn that listed the claim before
/// may be about to record it. The turn's write, conditional on the pool it read before the DEL,
/// must fail (it then reads again and sees the claim withdrawn), and nothing of the attachment
/// is left, whichever way the DEL goes (the plugin alone, or through the agent).
#[tokio::test]
async fn a_turn_write_from_before_a_dels_withdrawal_cannot_record_the_withdrawn_claim() {
    use whereabouts::agent::batch::Batcher;
    use whereabouts::crd::IPAllocation;
    for agent in [false, true] {
        let store = Arc::new(MemoryStore::new());
        let batcher = Batcher::new(store.clone(), Arc::default());
        let ipam = json!({"type": "whereabouts", "range": "10.0.0.0/24"});
        run(&store, Command::Add, &ipam, "c0", "p0").await.unwrap();
        // c1's ADD claimed 10.0.0.2 and was cut off before recording it.
        let spec = claim_spec("c1", "p1");
        let ip = "10.0.0.2".parse().unwrap();
        let (created, _) = (store.create_reservation("10.0.0.2", &spec, "10.0.0.0-24", ip))
            .await
            .unwrap();
        assert_eq!(created, Write::Done);
        // A writer turn's reads: the pool, then the claims (c1's among them).
        let seen = store.get_pool("10.0.0.0-24").await.unwrap().unwrap();
        let claims = (store.claims_of("10.0.0.0-24", Listing::Consistent))
            .await
            .unwrap();
        assert!(
            claims.iter().any(|c| c.spec.containerid == "c1"),
            "c1's claim is listed"
        );
        let req = request(Command::Del, ipam.clone(), "c1", "p1").unwrap();
        if agent {
            handle_with(&*store, &batcher, &req).await.unwrap();
        } else {
            handle(&*store, &req).await.unwrap();
        }
        // The turn's write of what it listed.
        let entry = IPAllocation {
            id: "c1".into(),
            podref: "ns/p1".into(),
            ifname: "net1".into(),
            ..Default::default()
        };
        let written = store
            .add_allocations("10.0.0.0-24", &[(2, entry)], &seen.resource_version)
            .await
            .unwrap();
        assert_eq!(written, PoolWrite::Conflict, "agent={agent}");
        let pool = store.get_pool("10.0.0.0-24").await.unwrap().unwrap();
        assert_eq!(
            pool.allocations.len(),
            1,
            "agent={agent}: {:?}",
            pool.allocations
        );
        assert_eq!(
            store.reservation_names().len(),
            1,
            "agent={agent}: c1's claim is gone"
        );
    }
}
