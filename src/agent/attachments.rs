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

    /// Marks `container` as having work here until the returned hold, and every clone of it,
    /// is dropped: the request keeps one, each piece of work it queues keeps another.
    pub fn hold(&self, container: &str) -> Arc<Held> {
        *self.lock().entry(container.to_owned()).or_default() += 1;
        Arc::new(Held {
            set: self.clone(),
            container: container.to_owned(),
        })
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

/// One request's mark on its container; dropping the last clone removes it.
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
        let copy = first.clone();
        let second = set.hold("c1");
        assert!(set.busy("c1") && !set.busy("c2"));
        drop(first);
        drop(second);
        assert!(set.busy("c1"), "a clone still held by queued work");
        drop(copy);
        assert!(!set.busy("c1"));
        assert!(set.is_empty());
        let _empty = set.hold("");
        assert!(
            !set.busy(""),
            "a request without a container matches nothing"
        );
    }
}
