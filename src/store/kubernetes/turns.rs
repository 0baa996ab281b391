//! Pools' writer turns: a Lease per busy pool, `whereabouts-<pool>` in the pool namespace
//! (see `alloc::turn`).

use k8s_openapi::api::coordination::v1::{Lease, LeaseSpec};
use kube::api::PostParams;
use kube::core::ObjectMeta;

use super::KubeStore;
use super::errors::api_code;
use crate::store::{TURN_LABEL, TURN_SECONDS, Turn, TurnAttempt};

/// The Lease that is `pool`'s writer turn: `whereabouts-<pool>`, in the pool namespace. None when
/// the name would be too long for an object name (that pool is then written without turns).
pub fn turn_name(pool: &str) -> Option<String> {
    let name = format!("whereabouts-{pool}");
    (name.len() <= 253).then_some(name)
}

impl KubeStore {
    /// [`crate::store::Datastore::take_turn`]: creates the pool's turn Lease, once.
    pub(super) async fn create_turn(&self, pool: &str, holder: &str) -> TurnAttempt {
        let Some(name) = turn_name(pool) else {
            return TurnAttempt::Unavailable;
        };
        let lease = Lease {
            metadata: ObjectMeta {
                name: Some(name.clone()),
                labels: Some([(TURN_LABEL.to_owned(), "true".to_owned())].into()),
                ..Default::default()
            },
            spec: Some(LeaseSpec {
                holder_identity: Some(holder.to_owned()),
                lease_duration_seconds: Some(TURN_SECONDS as i32),
                ..Default::default()
            }),
        };
        // One attempt, no retries: a busy API server is a reason to write without a turn.
        match self.leases.create(&PostParams::default(), &lease).await {
            Ok(created) => TurnAttempt::Taken(Turn {
                pool: pool.to_owned(),
                uid: created.metadata.uid.unwrap_or_default(),
            }),
            Err(e) if api_code(&e) == Some(409) => TurnAttempt::Busy,
            Err(e) => {
                tracing::warn!(lease = %name, error = %e, "cannot take the pool's writer turn; writing without it");
                TurnAttempt::Unavailable
            }
        }
    }

    /// [`crate::store::Datastore::turn_holder`]: the turn Lease's UID and resourceVersion, if there is one.
    pub(super) async fn read_turn(&self, pool: &str) -> Option<(String, String)> {
        let name = turn_name(pool)?;
        match self.leases.get_opt(&name).await {
            Ok(found) => found.map(|l| {
                (
                    l.metadata.uid.unwrap_or_default(),
                    l.metadata.resource_version.unwrap_or_default(),
                )
            }),
            Err(e) => {
                tracing::debug!(lease = %name, error = %e, "cannot read the pool's writer turn");
                None
            }
        }
    }
}
