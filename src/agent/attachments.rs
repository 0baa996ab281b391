//! The containers whose ADD or DEL work the agent has taken, until the last of that work is done,
//! whether its requester still waits or not.
//!
//! Why: an ADD's group can outlive its requester (the deadline passed while the pool write ran).
//! The worker then releases what the group recorded for it (`worker::release_orphans`), matched by
//! container and interface, as a DEL would. If the runtime retried the ADD under the same
//! container ID meanwhile and that retry ran in the plugin (handed back because the queues were
//! full), the retry's entry is the one that release removes while the retry's pod keeps the
//! address: the next ADD gets it too (docs/benchmarks.md, "a duplicate-address defect"). A DEL
//! taken into a group whose requester left does the same to a later ADD. Inside the agent the
//! pool's one worker keeps such requests in order; only a request run elsewhere can overtake. So
//! a request for a container with work here is never handed back: it queues like any other, and
//! when it cannot, it is answered "try again later" (code 11).
//!
//! Who holds the mark: the request while it runs (its rollback included), and the pool's worker
//! for each piece of work from the moment it takes it into a group until the group, orphan
//! releases included, is done. Work still queued holds none: if its requester has gone, the
//! worker drops it unrun, so it cannot overtake anything. The worker takes its hold before it
//! looks whether the requester has gone, and the requester lets go of the reply before its
//! hold, so the container never goes unmarked while the work may still run.
//!
//! Keyed by container alone: a release matches an entry without an interface to any interface of
//! its container (`Owned::same_attachment`), and a runtime runs one container's interfaces one
//! after the other, so nothing waits that would not have waited anyway.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, MutexGuard};

/// The containers with work in the agent, each with how many requests hold it.
#[derive(Clone, Default)]
pub struct Attachments(Arc<Mutex<HashMap<String, usize>>>);

impl Attachments {
    fn lock(&self) -> MutexGuard<'_, HashMap<String, usize>> {
        self.0.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Marks `container` as having work here until the returned hold is dropped.
    pub fn hold(&self, container: &str) -> Held {
        *self.lock().entry(container.to_owned()).or_default() += 1;
        Held {
            set: self.clone(),
            container: container.to_owned(),
        }
    }

    /// What lets the worker mark `container` when it takes a request's work into a group.
    pub fn marker(&self, container: &str) -> Marker {
        Marker {
            set: self.clone(),
            container: container.to_owned(),
        }
    }

    /// Whether work for `container` is in the agent (queued, in a group, or being rolled back).
    pub fn busy(&self, container: &str) -> bool {
        !container.is_empty() && self.lock().contains_key(container)
    }

    /// How many containers have work here.
    pub fn len(&self) -> usize {
        self.lock().len()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// A container's mark for the work of one request, taken by the worker with [`Marker::hold`].
#[derive(Clone)]
pub struct Marker {
    set: Attachments,
    container: String,
}

impl Marker {
    pub fn hold(&self) -> Held {
        self.set.hold(&self.container)
    }
}

/// One mark on a container; the container is free once every mark on it is dropped.
pub struct Held {
    set: Attachments,
    container: String,
}

impl Drop for Held {
    fn drop(&mut self) {
        let mut set = self.set.lock();
        if let Some(count) = set.get_mut(&self.container) {
            *count -= 1;
            if *count == 0 {
                set.remove(&self.container);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_container_is_busy_until_every_hold_of_it_is_dropped() {
        let set = Attachments::default();
        assert!(!set.busy("c1"));
        let first = set.hold("c1");
        let by_worker = set.marker("c1").hold();
        assert!(set.busy("c1") && !set.busy("c2"));
        drop(first);
        assert!(set.busy("c1"), "the worker's hold remains");
        drop(by_worker);
        assert!(!set.busy("c1"));
        assert!(set.is_empty());
        let _empty = set.hold("");
        assert!(
            !set.busy(""),
            "a request without a container matches nothing"
        );
    }
}
