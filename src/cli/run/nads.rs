//! The NAD watch cache of `run`, shared by the webhook (overlap warnings) and the NAD
//! controller.

use std::sync::Arc;
use std::sync::atomic::{AtomicU8, AtomicU64, Ordering};

use futures::StreamExt;
use kube::runtime::{WatchStreamExt, reflector, watcher};
use kube::{Api, Client};

use super::{CRD_ABSENT, SYNCED, Shutdown};
use crate::crd::NetworkAttachmentDefinition;

/// Who hears of a change of the NAD store: the NAD controller (woken) and the webhook's index
/// (a generation it compares with the one it was built at).
pub(super) struct NadChanged {
    pub notify: Arc<tokio::sync::Notify>,
    pub generation: Arc<AtomicU64>,
}

impl NadChanged {
    fn notify_one(&self) {
        // The reflector applied the event to the store before yielding it: bump after.
        self.generation.fetch_add(1, Ordering::SeqCst);
        self.notify.notify_one();
    }
}

/// Watches NADs in every namespace into the reflector store the webhook reads. A missing CRD is
/// not fatal: the webhook then works without overlap warnings, and the watch keeps retrying.
pub(super) async fn nad_cache(
    client: Client,
    writer: reflector::store::Writer<NetworkAttachmentDefinition>,
    state: Arc<AtomicU8>,
    changed: NadChanged,
    shutdown: Shutdown,
) -> anyhow::Result<()> {
    let api: Api<NetworkAttachmentDefinition> = Api::all(client);
    let stream = reflector(writer, watcher(api, watcher::Config::default())).default_backoff();
    let mut stream = std::pin::pin!(stream);
    let mut stop = std::pin::pin!(shutdown.wait());
    loop {
        let event = tokio::select! {
            () = &mut stop => return Ok(()),
            e = stream.next() => e,
        };
        match event {
            None => anyhow::bail!("NAD watch ended"),
            Some(Ok(watcher::Event::InitDone)) => {
                if state.swap(SYNCED, Ordering::SeqCst) != SYNCED {
                    tracing::info!("NAD cache synced");
                }
                changed.notify_one();
            }
            Some(Ok(_)) => changed.notify_one(),
            Some(Err(e)) if is_not_found(&e) => {
                if state.swap(CRD_ABSENT, Ordering::SeqCst) != CRD_ABSENT {
                    tracing::warn!(
                        "the NetworkAttachmentDefinition CRD is not installed; the webhook runs without overlap warnings"
                    );
                }
            }
            Some(Err(e)) => tracing::warn!(error = %e, "NAD watch failed; retrying"),
        }
    }
}

fn is_not_found(e: &watcher::Error) -> bool {
    match e {
        watcher::Error::InitialListFailed(kube::Error::Api(s))
        | watcher::Error::WatchStartFailed(kube::Error::Api(s))
        | watcher::Error::WatchFailed(kube::Error::Api(s)) => s.code == 404,
        watcher::Error::WatchError(s) => s.code == 404,
        _ => false,
    }
}
