//! The node-writes policy's rule for pool entries (config/rbac/node-limits.yaml), one case at a
//! time: which entries a node's credentials may remove or rewrite. Each case is one JSON patch of
//! one entry, sent with node a's token, against a pool the admin wrote, so the rule is judged
//! alone (the plugin's engine follows the same rule and would never send the refused ones).
//! Every branch of the rule has a case: a rewrite of the rule (for its cost, docs/benchmarks.md)
//! that gets one wrong fails here.

use serde_json::{Value, json};

use crate::harness::{Ns, kubectl_raw};
use crate::node_account::{node_token, refused_once_loaded};
use crate::node_limits::node_rights;
use crate::slices::SimNode;

const POOL: &str = "10.96.0.0-24";
const REFUSED: &str = "may remove or rewrite only its own node's entries";

/// An entry of `node` (none when `None`) for pod `pod`, with `extra` fields merged in.
fn entry(node: Option<&str>, pod: &str, extra: Value) -> Value {
    let mut e = json!({"id": format!("c-{pod}"), "podref": format!("t/{pod}"), "ifname": "net1"});
    if let Some(node) = node {
        e["node"] = node.into();
    }
    for (k, v) in extra.as_object().unwrap() {
        e[k] = v.clone();
    }
    e
}

/// kubectl's arguments for JSON patch `op` of the pool.
fn patch_args(op: &str) -> [&str; 6] {
    ["patch", "ippool", POOL, "--type=json", "-p", op]
}

#[test]
fn the_node_writes_policy_judges_each_removed_or_rewritten_entry() {
    let ns = Ns::new("nodeentries");
    node_rights(&ns);
    let (a, b) = (SimNode::new(&ns, "a", false), SimNode::new(&ns, "b", false));
    let creds = node_token(&ns, &a.name);
    let (a, b) = (a.name.as_str(), b.name.as_str());
    let sts = |pod: &str| json!({"statefulset": "web", "podref": format!("t/{pod}")});
    let vm = |claim: &str| json!({"ipamclaimref": claim});
    // (offset, the entry the admin writes, what node a writes: an entry, or None to remove it,
    // whether the policy lets it)
    let cases: Vec<(u32, Value, Option<Value>, bool)> = vec![
        // Another node's entry: not removed, not rewritten, not taken.
        (1, entry(Some(b), "b1", json!({})), None, false),
        (
            2,
            entry(Some(b), "b2", json!({})),
            Some(entry(Some(b), "x", json!({}))),
            false,
        ),
        (
            3,
            entry(Some(b), "b3", json!({})),
            Some(entry(Some(a), "b3", json!({}))),
            false,
        ),
        (
            4,
            entry(Some(b), "b4", json!({})),
            Some(entry(None, "b4", json!({}))),
            false,
        ),
        // Unless its holder moved with it: the same StatefulSet pod, or the same IPAMClaim.
        (
            5,
            entry(Some(b), "web-0", sts("web-0")),
            Some(entry(Some(a), "web-0", sts("web-0"))),
            true,
        ),
        (
            6,
            entry(Some(b), "web-1", sts("web-1")),
            Some(entry(Some(a), "web-2", sts("web-2"))),
            false,
        ),
        (
            7,
            entry(Some(b), "web-3", sts("web-3")),
            Some(entry(Some(a), "web-3", json!({}))),
            false,
        ),
        (
            8,
            entry(Some(b), "v1", vm("vm1.net")),
            Some(entry(Some(a), "v2", vm("vm1.net"))),
            true,
        ),
        (
            9,
            entry(Some(b), "v3", vm("vm3.net")),
            Some(entry(Some(a), "v4", vm("vm4.net"))),
            false,
        ),
        (
            10,
            entry(Some(b), "v5", vm("vm5.net")),
            Some(entry(Some(a), "v5", json!({}))),
            false,
        ),
        (11, entry(Some(b), "v6", vm("vm6.net")), None, false),
        // A moved holder's entry must still name this node (or none).
        (
            12,
            entry(Some(b), "v7", vm("vm7.net")),
            Some(entry(Some(b), "v8", vm("vm7.net"))),
            false,
        ),
        // Its own entries and node-less ones: removed or rewritten, to name it or none.
        (13, entry(Some(a), "a1", json!({})), None, true),
        (
            14,
            entry(Some(a), "a2", json!({})),
            Some(entry(Some(a), "a3", json!({}))),
            true,
        ),
        (
            15,
            entry(Some(a), "a4", json!({})),
            Some(entry(None, "a4", json!({}))),
            true,
        ),
        (
            16,
            entry(Some(a), "a5", json!({})),
            Some(entry(Some(b), "a5", json!({}))),
            false,
        ),
        (17, entry(None, "u1", json!({})), None, true),
        (
            18,
            entry(None, "u2", json!({})),
            Some(entry(Some(a), "u3", json!({}))),
            true,
        ),
        (
            19,
            entry(None, "u4", json!({})),
            Some(entry(Some(b), "u4", json!({}))),
            false,
        ),
    ];
    let allocations: serde_json::Map<String, Value> = cases
        .iter()
        .map(|(offset, old, _, _)| (offset.to_string(), old.clone()))
        .collect();
    let pool = json!({"apiVersion": "whereabouts.cni.cncf.io/v1alpha1", "kind": "IPPool",
        "metadata": {"name": POOL}, "spec": {"range": "10.96.0.0/24", "allocations": allocations}});
    ns.kubectl_ok_stdin(&["create", "-f", "-"], &pool.to_string());
    // As kubectl would send it: `add` writes a member whether or not it is there.
    let patch = |offset: u32, new: &Option<Value>| {
        let path = format!("/spec/allocations/{offset}");
        match new {
            Some(new) => json!([{"op": "add", "path": path, "value": new}]),
            None => json!([{"op": "remove", "path": path}]),
        }
        .to_string()
    };
    // The first refusal waits for the API server to load the policy; the rest are then decided.
    let (offset, _, new, allowed) = &cases[0];
    assert!(!allowed);
    refused_once_loaded(&creds, &patch_args(&patch(*offset, new)), None, REFUSED);
    let mut wrong = Vec::new();
    for (offset, _, new, allowed) in &cases {
        let out = kubectl_raw(&creds, &patch_args(&patch(*offset, new)), None);
        let err = String::from_utf8_lossy(&out.stderr);
        let judged = if out.status.success() {
            true
        } else if err.contains(REFUSED) {
            false
        } else {
            panic!("entry {offset}: neither written nor refused by the policy: {err}");
        };
        if judged != *allowed {
            wrong.push(format!(
                "entry {offset}: allowed {judged}, expected {allowed}: {err}"
            ));
        }
    }
    assert!(wrong.is_empty(), "{wrong:#?}");
    // What was allowed is what the pool holds; the refused entries are unchanged.
    let held = ns.allocations(POOL);
    for (offset, old, new, allowed) in &cases {
        let expected = if *allowed { new.as_ref() } else { Some(old) };
        assert_eq!(held.get(&offset.to_string()), expected, "entry {offset}");
    }
    // Entries are added freely (a writer records every pending claim, whichever node made it).
    let add = patch(40, &Some(entry(Some(b), "b9", json!({}))));
    let added = kubectl_raw(&creds, &patch_args(&add), None);
    assert!(
        added.status.success() && ns.allocations(POOL).contains_key("40"),
        "{}",
        String::from_utf8_lossy(&added.stderr)
    );
}
