//! Helpers shared by the CNI library's integration tests: requests as a runtime sends them,
//! answered by the library's handler over a store.
#![allow(dead_code)] // each test crate uses its own share of them

use std::collections::HashMap;

use serde_json::{Value, json};
use whereabouts::alloc::Allocate;
use whereabouts::cni::protocol::{CniError, Command};
use whereabouts::cni::{FlatSource, Invocation, Request};
use whereabouts::crd::OverlappingRangeIPReservationSpec;
use whereabouts::store::Datastore;
use whereabouts::store::memory::MemoryStore;

pub fn request(
    command: Command,
    ipam: Value,
    container: &str,
    pod: &str,
) -> Result<Request, CniError> {
    let conf = json!({"cniVersion": "1.0.0", "name": "net", "type": "macvlan", "ipam": ipam});
    request_conf(command, conf, container, pod)
}

pub fn request_conf(
    command: Command,
    conf: Value,
    container: &str,
    pod: &str,
) -> Result<Request, CniError> {
    request_on("node-a", command, conf, container, pod)
}

/// A request of the runtime of node `node`.
pub fn request_on(
    node: &str,
    command: Command,
    conf: Value,
    container: &str,
    pod: &str,
) -> Result<Request, CniError> {
    let stdin = conf.to_string();
    let vars: HashMap<&str, String> = HashMap::from([
        ("NODENAME", node.to_owned()),
        ("CNI_CONTAINERID", container.to_owned()),
        ("CNI_IFNAME", "net1".to_owned()),
        (
            "CNI_ARGS",
            format!(
                "IgnoreUnknown=1;K8S_POD_NAMESPACE=ns;K8S_POD_NAME={pod};K8S_POD_UID=uid-{pod}"
            ),
        ),
    ]);
    let env = move |k: &str| vars.get(k).cloned();
    Invocation::read(&env, &stdin, FlatSource::Paths(vec![])).load(command)
}

/// The library's handler, with the reply as the JSON the plugin prints.
pub async fn handle<S: Datastore>(store: &S, req: &Request) -> Result<Option<Value>, CniError> {
    let reply = whereabouts::cni::handle(store, req).await?;
    Ok(reply.map(|r| r.to_value()))
}

/// [`handle`] with addresses claimed by `alloc` (the node agent's batcher).
pub async fn handle_with<S: Datastore, A: Allocate<S>>(
    store: &S,
    alloc: &A,
    req: &Request,
) -> Result<Option<Value>, CniError> {
    let reply = whereabouts::cni::handle_with(store, alloc, req).await?;
    Ok(reply.map(|r| r.to_value()))
}

pub async fn run(
    store: &MemoryStore,
    command: Command,
    ipam: &Value,
    container: &str,
    pod: &str,
) -> Result<Option<Value>, CniError> {
    handle(store, &request(command, ipam.clone(), container, pod)?).await
}

/// The reservation spec a claim of pod `ns/<pod>`'s net1 under `container` carries (as the
/// plugin makes it, less the pod UID and node).
pub fn claim_spec(container: &str, pod: &str) -> OverlappingRangeIPReservationSpec {
    OverlappingRangeIPReservationSpec {
        containerid: container.into(),
        podref: format!("ns/{pod}"),
        ifname: "net1".into(),
        ..Default::default()
    }
}

pub fn addresses(result: &Value) -> Vec<String> {
    result["ips"]
        .as_array()
        .unwrap()
        .iter()
        .map(|ip| ip["address"].as_str().unwrap().to_owned())
        .collect()
}
