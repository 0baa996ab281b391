//! The node agent's one HTTP/2 connection to the API server, against the real API server.
//!
//! Every request of the agent shares one connection, and HTTP/2 flow control is per connection as
//! well as per stream: data that arrived on a stream and was not read yet holds part of the
//! connection's window. A pool watch that its waiter does not read for a moment (it is busy with
//! a write) receives the whole pool object on every write by any node; a handful of such watches
//! of a big pool filled the connection's window, after which no response body could arrive on
//! it: every request of the agent waited for ever, the waiters among them (the re-creation stall
//! of docs/benchmarks.md).

use std::time::Duration;

use whereabouts::crd::IPAllocation;
use whereabouts::store::kubernetes::KubeStore;
use whereabouts::store::{Datastore, PoolWrite};

use crate::harness::Ns;

async fn agent_store(ns: &Ns) -> KubeStore {
    let path = ns.kubeconfig.to_str().unwrap();
    let (config, _) = whereabouts::kubeconfig::load(Some(path)).await.unwrap();
    KubeStore::over_http2(config, &ns.name).unwrap()
}

fn entry(i: u128) -> IPAllocation {
    IPAllocation {
        id: format!("{i:064x}"),
        podref: format!("a-long-namespace-name/a-long-pod-name-{i}"),
        ifname: "net1".into(),
        poduid: format!("{i:08x}-0000-4000-8000-000000000000"),
        ..Default::default()
    }
}

/// Writes `count` entries into `pool` from `from`, a few at a time (each write makes every watch
/// of the pool receive the whole object).
async fn fill(store: &KubeStore, pool: &str, from: u128, count: u128, per_write: u128) {
    let mut next = from;
    while next < from + count {
        let current = store.get_pool(pool).await.unwrap().unwrap();
        let entries: Vec<_> = (next..next + per_write).map(|i| (i, entry(i))).collect();
        match store
            .add_allocations(pool, &entries, &current.resource_version)
            .await
            .unwrap()
        {
            PoolWrite::Done(_) => next += per_write,
            other => panic!("write of a test pool: {other:?}"),
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn unread_pool_watches_never_stall_the_agents_other_requests() {
    let ns = Ns::new("h2window");
    let pool = "10.96.0.0-16";
    let agent = agent_store(&ns).await;
    // Another node: its own client, so its own connection.
    let other = agent_store(&ns).await;
    other
        .create_pool(pool, "10.96.0.0/16", &Default::default())
        .await
        .unwrap();
    // About 400 bytes an entry: a pool object of some 600 KB, as a pool of 1500 pods is.
    fill(&other, pool, 1, 1500, 500).await;
    let start = agent.get_pool(pool).await.unwrap().unwrap();
    // Eight waiters of this agent watch the pool, and are busy elsewhere for a moment.
    let mut watches = Vec::new();
    for _ in 0..8 {
        watches.push(
            agent
                .watch_pool(pool, &start.resource_version)
                .await
                .unwrap(),
        );
    }
    // Other nodes write the pool ten times: 8 x 10 x 600 KB sent to this agent's watches.
    fill(&other, pool, 2000, 10, 1).await;
    let read = tokio::time::timeout(Duration::from_secs(40), agent.get_pool(pool)).await;
    let read = read.expect(
        "the agent's read of the pool did not finish in 40 s: unread watches held its connection",
    );
    assert_eq!(read.unwrap().unwrap().allocations.len(), 1510);
    drop(watches);
}
