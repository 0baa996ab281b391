//! A watch of one IPPool, as [`PoolChanges`].

use std::pin::Pin;

use futures::{Stream, StreamExt};
use kube::api::WatchEvent;

use crate::crd::IPPool;
use crate::store::{Pool, PoolChanges, Result};

pub(super) fn to_pool(name: &str, p: IPPool) -> Pool {
    let rv = p.metadata.resource_version.unwrap_or_default();
    let (pool, unparsed) = Pool::from_stored(name.to_owned(), p.spec.range, p.spec.allocations, rv);
    if !unparsed.is_empty() {
        tracing::warn!(pool = name, keys = ?unparsed, "ignoring allocation keys that are not decimal offsets");
    }
    pool
}

type EventStream = Pin<Box<dyn Stream<Item = kube::Result<WatchEvent<IPPool>>> + Send>>;

/// A watch of one IPPool.
pub struct KubeChanges {
    pool: String,
    /// `None` once the watch ended: the caller re-reads and watches again.
    stream: Option<EventStream>,
}

impl KubeChanges {
    pub(super) fn new(pool: &str, stream: EventStream) -> Self {
        KubeChanges {
            pool: pool.to_owned(),
            stream: Some(stream),
        }
    }
}

impl PoolChanges for KubeChanges {
    fn ended(&self) -> bool {
        self.stream.is_none()
    }

    async fn next(&mut self, wait: std::time::Duration) -> Result<Option<Pool>> {
        let deadline = tokio::time::Instant::now() + wait;
        loop {
            let Some(stream) = self.stream.as_mut() else {
                return Ok(None);
            };
            let Ok(event) = tokio::time::timeout_at(deadline, stream.next()).await else {
                return Ok(None);
            };
            match event {
                Some(Ok(WatchEvent::Added(p) | WatchEvent::Modified(p))) => {
                    return Ok(Some(to_pool(&self.pool, p)));
                }
                Some(Ok(WatchEvent::Bookmark(_))) => continue,
                // Deleted, expired (410), or the stream closed or broke: the caller re-reads.
                other => {
                    tracing::debug!(pool = %self.pool, event = ?other.map(|e| e.map(|_| ())), "pool watch ended");
                    self.stream = None;
                    return Ok(None);
                }
            }
        }
    }
}
