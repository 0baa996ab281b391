use std::collections::BTreeMap;

use serde_json::json;

use super::*;
use crate::agent::batch::Limits;
use crate::store::memory::MemoryStore;

fn add(container: &str, range: &str) -> AgentRequest {
    request("ADD", container, range)
}

fn request(command: &str, container: &str, range: &str) -> AgentRequest {
    let env = BTreeMap::from([
        ("CNI_COMMAND".to_owned(), command.to_owned()),
        ("CNI_CONTAINERID".to_owned(), container.to_owned()),
        ("CNI_IFNAME".to_owned(), "net1".to_owned()),
        (
            "CNI_ARGS".to_owned(),
            format!("K8S_POD_NAMESPACE=ns;K8S_POD_NAME=p-{container}"),
        ),
    ]);
    let conf = json!({"cniVersion": "1.0.0", "name": "net", "type": "macvlan",
        "ipam": {"type": "whereabouts", "range": range}});
    AgentRequest {
        env,
        stdin: conf.to_string(),
        flat_file: None,
    }
}

fn direct_reason(reply: &AgentReply) -> &str {
    match reply {
        AgentReply::Direct { reason } => reason,
        other => panic!("expected a hand-back, got {other:?}"),
    }
}

/// Yields until `done` holds (the workers run on this test's runtime).
async fn until(what: &str, done: impl Fn() -> bool) {
    for _ in 0..100_000 {
        if done() {
            return;
        }
        tokio::task::yield_now().await;
    }
    panic!("never: {what}");
}

const A: &str = "10.0.0.0-24";
const B: &str = "10.0.1.0-24";

/// Pool A's write is held while its queue fills to its bound: the next ADD for A is handed
/// back at once, naming the bound; B still queues until the total bound is reached; once the
/// write goes through, every queued ADD gets its own address and the queues are empty.
#[tokio::test]
async fn full_queues_hand_requests_back_and_lose_nothing_queued() {
    let limits = Limits {
        per_pool: 2,
        total: 3,
    };
    let agent = Arc::new(Agent::with_limits(
        MemoryStore::new(),
        String::new(),
        0,
        limits,
        Arc::new(AgentMetrics::new()),
    ));
    let handbacks = |why: HandBack| {
        agent
            .metrics()
            .handbacks
            .with_label_values(&[why.label()])
            .get()
    };
    let store = agent.store.clone();
    let spawn = |container: &str, range: &str| {
        let (agent, request) = (agent.clone(), add(container, range));
        tokio::spawn(async move { agent.run(request).await })
    };
    store.hold(true);
    // One ADD per pool is taken into a group and waits at the held store; it holds no place.
    let mut admitted = vec![spawn("a0", "10.0.0.0/24"), spawn("b0", "10.0.1.0/24")];
    until("both groups wait at the store", || store.waiting() == 2).await;
    assert_eq!(agent.batcher().waiting_total(), 0);
    admitted.push(spawn("a1", "10.0.0.0/24"));
    admitted.push(spawn("a2", "10.0.0.0/24"));
    until("A's queue is full", || agent.batcher().waiting(A) == 2).await;

    let before = (
        handbacks(HandBack::PoolQueueFull),
        handbacks(HandBack::TotalQueueFull),
    );
    let full = agent.run(add("a3", "10.0.0.0/24")).await;
    assert_eq!(
        direct_reason(&full),
        "the node agent's queue for pool 10.0.0.0-24 is full (2 requests waiting, the per-pool bound)"
    );
    // Another pool is not held up by A's bound.
    admitted.push(spawn("b1", "10.0.1.0/24"));
    until("B queued one", || agent.batcher().waiting(B) == 1).await;
    assert_eq!(agent.batcher().waiting_total(), 3);
    let total = agent.run(add("c0", "10.0.2.0/24")).await;
    assert_eq!(
        direct_reason(&total),
        "the node agent's queues are full (3 requests waiting across pools, the total bound)"
    );
    assert!(handbacks(HandBack::PoolQueueFull) > before.0);
    assert!(handbacks(HandBack::TotalQueueFull) > before.1);
    assert_eq!(
        agent.batcher().waiting_total(),
        3,
        "hand-backs take no place"
    );

    store.hold(false);
    let mut ips = Vec::new();
    for task in admitted {
        match task.await.unwrap() {
            AgentReply::Done { output: Some(out) } => {
                ips.push(out["ips"][0]["address"].as_str().unwrap().to_owned())
            }
            other => panic!("a queued ADD was lost: {other:?}"),
        }
    }
    ips.sort();
    assert_eq!(
        ips,
        [
            "10.0.0.1/24",
            "10.0.0.2/24",
            "10.0.0.3/24",
            "10.0.1.1/24",
            "10.0.1.2/24"
        ]
    );
    assert_eq!(agent.batcher().waiting_total(), 0);
    assert_eq!(
        (agent.batcher().waiting(A), agent.batcher().waiting(B)),
        (0, 0)
    );
    let pool = store.get_pool(A).await.unwrap().unwrap();
    assert_eq!(
        pool.allocations.len(),
        3,
        "the handed-back ADD took nothing"
    );
}

/// A request whose group outlives its requester (the deadline passed while the pool write was
/// stalled, the rollback too): until the group and its release of the orphaned work are done, a
/// retry of the same container that cannot queue is answered "try again later", not handed back.
/// Run in the plugin, the retry would record an entry that the orphan release then removes while
/// its pod keeps the address, and the next ADD would get that address too (the duplicate seen in
/// a collapsed re-creation run, docs/benchmarks.md). Once the work is done the retry goes through
/// and keeps its address. The same holds when the work is a DEL.
#[tokio::test(start_paused = true)]
async fn a_container_with_work_in_the_agent_is_never_handed_back() {
    for (first, deadline) in [("ADD", cni::ADD_DEADLINE), ("DEL", cni::OTHER_DEADLINE)] {
        let limits = Limits {
            per_pool: 2,
            total: 10,
        };
        let metrics = Arc::new(AgentMetrics::new());
        let agent = Arc::new(Agent::with_limits(
            MemoryStore::new(),
            String::new(),
            0,
            limits,
            metrics.clone(),
        ));
        let store = agent.store.clone();
        let spawn = |request: AgentRequest| {
            let agent = agent.clone();
            tokio::spawn(async move { agent.run(request).await })
        };
        store.hold(true);
        let gave_up = spawn(request(first, "c1", "10.0.0.0/24"));
        until("c1's group waits at the store", || store.waiting() == 1).await;
        tokio::time::advance(deadline + cni::ROLLBACK_BUDGET).await;
        let AgentReply::Failed { code, .. } = gave_up.await.unwrap() else {
            panic!("{first}: the requester did not give up");
        };
        assert_eq!(code, Code::TryAgainLater.number());
        assert!(
            agent.attachments().busy("c1"),
            "{first}: its group still runs"
        );
        let other = spawn(add("c2", "10.0.0.0/24"));
        let queued_then_gone = spawn(add("c4", "10.0.0.0/24"));
        until("the queue is full", || agent.batcher().waiting(A) == 2).await;
        assert!(
            agent.attachments().busy("c4"),
            "marked while its requester waits"
        );
        // Work whose requester left while it was still queued never runs: it marks nothing.
        queued_then_gone.abort();
        let _ = queued_then_gone.await;
        assert!(!agent.attachments().busy("c4"));

        let retry = agent.run(add("c1", "10.0.0.0/24")).await;
        let AgentReply::Failed { code, msg, .. } = &retry else {
            panic!("{first}: a retry was handed back beside the running group: {retry:?}");
        };
        assert_eq!(*code, Code::TryAgainLater.number());
        assert!(
            msg.starts_with("the node agent still works on an earlier request of container c1"),
            "{msg}"
        );
        assert_eq!(metrics.held_back.get(), 1);
        // Another container is handed back as before.
        direct_reason(&agent.run(add("c3", "10.0.0.0/24")).await);

        store.hold(false);
        assert!(matches!(other.await.unwrap(), AgentReply::Done { .. }));
        until("c1's work is done", || !agent.attachments().busy("c1")).await;
        let pool = store.get_pool(A).await.unwrap().unwrap();
        let ids: Vec<&str> = pool.allocations.values().map(|e| e.id.as_str()).collect();
        assert_eq!(ids, ["c2"], "{first}: the orphaned work left nothing");
        let retry = agent.run(add("c1", "10.0.0.0/24")).await;
        assert!(matches!(retry, AgentReply::Done { .. }), "{retry:?}");
        let pool = store.get_pool(A).await.unwrap().unwrap();
        assert_eq!(
            pool.allocations.len(),
            2,
            "{first}: the retry keeps its address"
        );
        assert!(agent.attachments().is_empty());
    }
}

/// SIGTERM with an ADD's group stalled at the store: the agent keeps its socket and drains. A
/// new request of another container is handed back at once ("shutting down"); a retry of the
/// stalled one's container gets code 11, since run in the plugin it could overtake that work;
/// `serve` returns only once the work is done, and only then may the socket go.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn shutdown_drains_and_never_hands_back_a_container_with_work_here() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("agent.sock");
    let (listener, _) = bind(&path).await.unwrap();
    let agent = Arc::new(Agent::new(
        MemoryStore::new(),
        String::new(),
        0,
        Arc::new(AgentMetrics::new()),
    ));
    let store = agent.store.clone();
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let served = tokio::spawn(agent.clone().serve(
        listener,
        async move {
            let _ = stopped.await;
        },
        Duration::from_secs(60),
    ));
    let call = |container: &str| {
        let (path, request) = (path.clone(), add(container, "10.0.0.0/24"));
        tokio::task::spawn_blocking(move || {
            cni::handoff::client::call(&path, &request, Duration::from_secs(30))
        })
    };
    store.hold(true);
    let stalled = call("c1");
    until("c1's group waits at the store", || store.waiting() == 1).await;
    stop.send(()).unwrap();
    until("draining", || agent.draining.load(Ordering::SeqCst)).await;

    let other = call("c2").await.unwrap().unwrap();
    assert_eq!(
        other,
        Some(AgentReply::Direct {
            reason: "the node agent is shutting down".into()
        })
    );
    let Some(AgentReply::Failed { code, msg, .. }) = call("c1").await.unwrap().unwrap() else {
        panic!("a retry of a container with work here was not held back");
    };
    assert_eq!(code, Code::TryAgainLater.number());
    assert!(msg.contains("earlier request of container c1"), "{msg}");
    tokio::time::sleep(Duration::from_millis(100)).await;
    assert!(!served.is_finished(), "serve returned with work in flight");

    store.hold(false);
    let done = stalled.await.unwrap().unwrap();
    assert!(matches!(done, Some(AgentReply::Done { .. })), "{done:?}");
    tokio::time::timeout(Duration::from_secs(10), served)
        .await
        .expect("serve returns once drained")
        .unwrap();
    assert!(
        path.exists(),
        "the socket is the caller's to remove, after serve"
    );
}

/// A request that does not arrive whole in time (its plugin starved of CPU in a storm) cannot
/// be told apart: it may be a retry of a container with work here, so it is answered "try again
/// later", never handed back to run in the plugin.
#[tokio::test(start_paused = true)]
async fn a_request_not_read_in_time_is_retried_not_handed_back() {
    let agent = Agent::new(
        MemoryStore::new(),
        String::new(),
        0,
        Arc::new(AgentMetrics::new()),
    );
    let (mut plugin, stream) = UnixStream::pair().unwrap();
    plugin.write_all(b"{\"env\":").await.unwrap();
    agent.connection(stream).await;
    let mut answer = String::new();
    plugin.read_to_string(&mut answer).await.unwrap();
    let reply: AgentReply = serde_json::from_str(&answer).unwrap();
    let AgentReply::Failed { code, msg, .. } = reply else {
        panic!("{reply:?}");
    };
    assert_eq!(code, Code::TryAgainLater.number());
    assert!(
        msg.starts_with("agent read: no complete request within 10s; try again later"),
        "{msg}"
    );
}

/// A request whose second pool is full is handed back before its first range runs.
#[tokio::test]
async fn a_request_is_admitted_to_all_its_pools_or_none() {
    let limits = Limits {
        per_pool: 1,
        total: 10,
    };
    let agent = Agent::with_limits(
        MemoryStore::new(),
        String::new(),
        0,
        limits,
        Arc::new(AgentMetrics::new()),
    );
    let store = agent.store.clone();
    let held = agent.batcher().admit([B]).unwrap();
    let mut dual = add("d0", "10.0.0.0/24");
    dual.stdin = json!({"cniVersion": "1.0.0", "name": "net", "type": "macvlan",
        "ipam": {"type": "whereabouts", "ipRanges": [{"range": "10.0.0.0/24"}, {"range": "10.0.1.0/24"}]}})
    .to_string();
    let reply = agent.run(dual.clone()).await;
    assert!(direct_reason(&reply).contains("pool 10.0.1.0-24 is full"));
    assert_eq!(agent.batcher().waiting(A), 0, "no place kept in A");
    assert!(store.get_pool(A).await.unwrap().is_none(), "nothing ran");
    drop(held);
    assert_eq!(agent.batcher().waiting_total(), 0);
    let reply = agent.run(dual).await;
    assert!(matches!(reply, AgentReply::Done { .. }), "{reply:?}");
    assert_eq!(agent.batcher().waiting_total(), 0);
}

/// What the agent answers for bytes, before running anything: unreadable bytes go back to the
/// plugin, VERSION is answered, a bad request is the plugin's CNI error.
#[test]
fn parse_request_answers_as_a_connection_does() {
    let unreadable = parse_request(b"{\"env\":{},\"stdin\":\"\",\"extra\":1}").unwrap_err();
    let AgentReply::Direct { reason } = unreadable else {
        panic!("{unreadable:?}");
    };
    assert!(
        reason
            .starts_with("the agent cannot read the request: agent request: unknown field `extra`"),
        "{reason}"
    );
    let version = parse_request(br#"{"env":{"CNI_COMMAND":"VERSION"},"stdin":"","flatFile":null}"#);
    assert_eq!(
        version.unwrap_err(),
        AgentReply::Done {
            output: Some(cni::protocol::version_reply().to_value())
        }
    );
    let bad = parse_request(br#"{"env":{"CNI_COMMAND":"ADD"},"stdin":"{","flatFile":null}"#);
    let AgentReply::Failed { code: c, msg, .. } = bad.unwrap_err() else {
        panic!("not a CNI error");
    };
    assert_eq!(c, Code::Decode.number());
    assert!(msg.starts_with("network config is not valid JSON"), "{msg}");
}
