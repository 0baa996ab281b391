//! The host's token dies with the DaemonSet's pod it is bound to, so every rolling update of the
//! DaemonSet leaves a node a few seconds without valid credentials, until the new pod's installer
//! writes the next token. A request of the plugin that meets that gap waits for the new token and
//! succeeds, instead of failing its sandbox into the runtime's back-off. (Past the wait the error
//! stands: `node_limits::a_nodes_credentials_change_only_that_nodes_work`, at its end.)

use std::time::{Duration, Instant};

use serde_json::json;

use crate::harness::Ns;
use crate::node_account::{kill_token, node_token, node_token_in};
use crate::node_limits::node_rights;
use crate::slices::SimNode;

#[test]
fn an_add_that_meets_a_dead_token_waits_for_the_next_one() {
    let ns = Ns::new("tokengap");
    node_rights(&ns);
    let a = SimNode::new(&ns, "a", false);
    let creds = node_token(&ns, &a.name);
    a.use_credentials(&creds);
    let ipam = json!({"range": "10.97.0.0/24"});
    let first = a.run(&ns, "ADD", &ipam, &["p1".into()]);
    assert!(first[0].ok, "{:?}", first[0]);

    kill_token(&a.name, &creds);
    // The new pod's installer writes the next token a while after the ADD met the dead one. It
    // replaces the file whole, as the installer does (a rename).
    let (second, took) = std::thread::scope(|scope| {
        scope.spawn(|| {
            std::thread::sleep(Duration::from_secs(4));
            let next = node_token_in(&ns, &a.name, "next.kubeconfig");
            std::fs::rename(&next, &creds).unwrap();
        });
        let started = Instant::now();
        let second = a.run(&ns, "ADD", &ipam, &["p2".into()]);
        (second, started.elapsed())
    });
    assert!(second[0].ok, "{:?}", second[0]);
    assert!(
        took >= Duration::from_secs(4),
        "the ADD did not wait: {took:?}"
    );
    let entries = ns.allocations("10.97.0.0-24");
    let podref = format!("{}/p2", ns.name);
    let p2 = entries.values().find(|e| e["podref"] == podref.as_str());
    assert_eq!(
        p2.map(|e| e["node"].clone()),
        Some(a.name.clone().into()),
        "{entries:?}"
    );
}
