//! Deleted pods whose containers may still run.
//!
//! A force delete (`--grace-period=0`, or a controller recovering a StatefulSet pod) removes the
//! pod object while its node's kubelet is still stopping the containers: seconds on a Ready node,
//! for as long as a partition lasts on a NotReady one. Freeing the addresses at that moment lets a
//! pending pod take an address a running container still uses. So the release of a deleted pod
//! of a node is left to the kubelet's DEL (which frees its entries when the sandbox goes) and
//! done by the operator only when that DEL has not come:
//!
//! - node Ready: after `--deleted-pod-grace` (longer than the node lifecycle controller takes to
//!   notice a dead kubelet, so a kubelet that died with the pod turns the node NotReady first);
//! - node NotReady or Unknown: not while it stays so; once it is Ready again, the grace counts
//!   from then (its kubelet kills the sandboxes it finds without a pod, and DELs them);
//! - node gone, or a pod that was never scheduled: at once (nothing of it runs anywhere).
//!
//! A normal graceful delete ends with the kubelet's DEL before the object goes, so nothing is left
//! to wait for. The waiting pods are also live to the audit, which otherwise would free them
//! after two audits. They are kept in this replica's memory: a new leader's audit does not know
//! them and frees them after two audits, as before.

use std::collections::HashMap;
use std::sync::Mutex;
use std::time::{Duration, Instant};

use super::cleanup::NodeHealth;

/// How often a release waiting for a NotReady node looks at the node again.
pub const RECHECK: Duration = Duration::from_secs(10);

/// What a deleted pod's release waits for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Wait {
    /// Nothing: release now.
    No,
    /// The kubelet's DEL, until this moment.
    Kubelet(Instant),
    /// The node to be Ready again (or gone).
    NodeNotReady,
}

impl Wait {
    /// The label of the waiting-releases gauge.
    pub fn reason(self) -> &'static str {
        match self {
            Wait::No => "none",
            Wait::Kubelet(_) => "kubelet_grace",
            Wait::NodeNotReady => "node_not_ready",
        }
    }

    /// When to look again.
    pub fn recheck_at(self, now: Instant) -> Instant {
        match self {
            Wait::Kubelet(until) => until.min(now + RECHECK).max(now),
            _ => now + RECHECK,
        }
    }
}

/// The wait of a pod deleted at `since` (or since its node was last seen NotReady) from a node
/// of health `node`.
pub fn wait(node: NodeHealth, since: Instant, grace: Duration, now: Instant) -> Wait {
    match node {
        NodeHealth::Gone => Wait::No,
        NodeHealth::NotReady => Wait::NodeNotReady,
        NodeHealth::Ready if now >= since + grace => Wait::No,
        NodeHealth::Ready => Wait::Kubelet(since + grace),
    }
}

/// A waiting pod: its UID, what it waits for, and whether it holds an address of ours (every
/// deleted pod of a node waits, since an entry may not be in the cache yet; the gauge counts only
/// those known to hold one).
#[derive(Debug, Clone)]
struct Waiter {
    uid: String,
    wait: Wait,
    holds: bool,
}

/// The deleted pods whose release waits, by podref.
#[derive(Debug, Default)]
pub struct Waiting {
    pods: Mutex<HashMap<String, Waiter>>,
}

impl Waiting {
    /// Records what `podref`'s release waits for; `holds`: it has an entry or a network-status
    /// address of ours.
    pub fn set(&self, podref: &str, uid: &str, wait: Wait, holds: bool) {
        let mut pods = self.pods.lock().expect("not poisoned");
        match wait {
            Wait::No => pods.remove(podref),
            wait => pods.insert(
                podref.to_owned(),
                Waiter {
                    uid: uid.to_owned(),
                    wait,
                    holds,
                },
            ),
        };
    }

    /// The waiting pods as `podref -> UID`, for the audit's live set (all of them).
    pub fn pods(&self) -> Vec<(String, String)> {
        let pods = self.pods.lock().expect("not poisoned");
        pods.iter()
            .map(|(p, w)| (p.clone(), w.uid.clone()))
            .collect()
    }

    /// How many that hold addresses wait, by reason.
    pub fn counts(&self) -> [(&'static str, usize); 2] {
        let pods = self.pods.lock().expect("not poisoned");
        let of = |r: &str| {
            pods.values()
                .filter(|w| w.holds && w.wait.reason() == r)
                .count()
        };
        [
            ("kubelet_grace", of("kubelet_grace")),
            ("node_not_ready", of("node_not_ready")),
        ]
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_deleted_pod_waits_for_its_nodes_kubelet() {
        let t0 = Instant::now();
        let grace = Duration::from_secs(60);
        assert_eq!(wait(NodeHealth::Gone, t0, grace, t0), Wait::No);
        assert_eq!(
            wait(NodeHealth::NotReady, t0, grace, t0 + grace * 10),
            Wait::NodeNotReady
        );
        assert_eq!(
            wait(NodeHealth::Ready, t0, grace, t0),
            Wait::Kubelet(t0 + grace)
        );
        assert_eq!(wait(NodeHealth::Ready, t0, grace, t0 + grace), Wait::No);
        assert_eq!(Wait::Kubelet(t0 + grace).recheck_at(t0), t0 + RECHECK);
        assert_eq!(
            Wait::Kubelet(t0 + Duration::from_secs(3)).recheck_at(t0),
            t0 + Duration::from_secs(3)
        );
        let waiting = Waiting::default();
        waiting.set("ns/a", "u1", Wait::NodeNotReady, true);
        waiting.set("ns/b", "u2", Wait::Kubelet(t0), true);
        // A pod of no whereabouts network waits too, but is not counted.
        waiting.set("ns/c", "u3", Wait::NodeNotReady, false);
        assert_eq!(
            waiting.counts(),
            [("kubelet_grace", 1), ("node_not_ready", 1)]
        );
        waiting.set("ns/a", "u1", Wait::No, true);
        let mut pods = waiting.pods();
        pods.sort();
        assert_eq!(
            pods,
            [
                ("ns/b".to_owned(), "u2".to_owned()),
                ("ns/c".to_owned(), "u3".to_owned())
            ]
        );
    }
}
