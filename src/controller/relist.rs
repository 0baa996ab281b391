//! Pods deleted while the pod watch was down.
//!
//! A watch that fails with "too old resource version" (410 Gone: every API server restart, since a
//! new server's watch cache starts at the current revision) lists again, and the reflector swaps
//! in the new list. A pod deleted in that gap never comes as a Delete event: without this, its
//! addresses would wait for the audit (two sightings a stale grace apart, every audit interval:
//! minutes by default). A consistent list that no longer holds a pod the cache held, or holds
//! another incarnation of its name, proves that pod deleted: it is released as if its Delete
//! event had come.

use std::sync::Arc;

use k8s_openapi::api::core::v1::Pod;
use kube::ResourceExt;
use kube::runtime::reflector::{ObjectRef, Store};
use kube::runtime::watcher;

/// Watches the relists of one pod watch. Fed every event after the reflector applied it.
#[derive(Default)]
pub struct Relist {
    /// The cache as it was when the relist began (the reflector swaps at `InitDone`).
    before: Option<Vec<Arc<Pod>>>,
}

impl Relist {
    /// The pods that `event` proves deleted: at `InitDone`, those of the cache before the relist
    /// that `store` (now the new list) no longer holds, by name and UID. The first list of a
    /// watch starts from an empty cache, so it proves nothing.
    pub fn vanished(&mut self, event: &watcher::Event<Pod>, store: &Store<Pod>) -> Vec<Arc<Pod>> {
        match event {
            watcher::Event::Init => {
                self.before = Some(store.state());
                Vec::new()
            }
            watcher::Event::InitDone => {
                let before = self.before.take().unwrap_or_default();
                before
                    .into_iter()
                    .filter(|old| {
                        store
                            .get(&ObjectRef::from_obj(old.as_ref()))
                            .is_none_or(|now| now.uid() != old.uid())
                    })
                    .collect()
            }
            _ => Vec::new(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use kube::api::ObjectMeta;
    use kube::runtime::reflector::store::Writer;

    fn pod(name: &str, uid: &str) -> Pod {
        Pod {
            metadata: ObjectMeta {
                name: Some(name.into()),
                namespace: Some("ns".into()),
                uid: Some(uid.into()),
                ..Default::default()
            },
            ..Default::default()
        }
    }

    /// Applies `event` to the cache, as the reflector does, then asks `relist`.
    fn feed(
        writer: &mut Writer<Pod>,
        relist: &mut Relist,
        event: watcher::Event<Pod>,
    ) -> Vec<String> {
        writer.apply_watcher_event(&event);
        let store = writer.as_reader();
        let mut gone: Vec<String> = relist
            .vanished(&event, &store)
            .iter()
            .map(|p| format!("{}:{}", p.name_any(), p.uid().unwrap_or_default()))
            .collect();
        gone.sort();
        gone
    }

    fn list(writer: &mut Writer<Pod>, relist: &mut Relist, pods: &[Pod]) -> Vec<String> {
        assert!(feed(writer, relist, watcher::Event::Init).is_empty());
        for p in pods {
            assert!(feed(writer, relist, watcher::Event::InitApply(p.clone())).is_empty());
        }
        feed(writer, relist, watcher::Event::InitDone)
    }

    #[test]
    fn a_relist_releases_the_pods_it_no_longer_lists() {
        let (mut writer, mut relist) = (Writer::default(), Relist::default());
        // The first list proves nothing: the cache was empty.
        let first = [pod("a", "1"), pod("b", "2"), pod("c", "3")];
        assert!(list(&mut writer, &mut relist, &first).is_empty());
        // Events between lists change nothing here.
        assert!(
            feed(
                &mut writer,
                &mut relist,
                watcher::Event::Apply(pod("d", "4"))
            )
            .is_empty()
        );
        assert!(
            feed(
                &mut writer,
                &mut relist,
                watcher::Event::Delete(pod("c", "3"))
            )
            .is_empty()
        );
        // The watch failed; meanwhile a went, and b was replaced under its name (a StatefulSet).
        let second = [pod("b", "5"), pod("d", "4"), pod("e", "6")];
        assert_eq!(list(&mut writer, &mut relist, &second), ["a:1", "b:2"]);
        // A relist that finds everything releases nothing.
        assert!(list(&mut writer, &mut relist, &second).is_empty());
    }
}
