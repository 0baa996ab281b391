//! kube's errors as [`StoreError`]s, and which of them a retry can help.

use crate::retry::TRANSIENT_API;
use crate::store::StoreError;

/// Runs one request, again after a transient failure (a dropped connection, an overloaded or
/// restarting API server), as [`TRANSIENT_API`] bounds it. Retrying is safe because every write
/// is conditional: a repeated create answers 409 and is recognised as ours, a repeated patch fails
/// its `test` and is re-read.
pub(super) async fn retrying<T, F, Fut>(call: F) -> Result<T, kube::Error>
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = Result<T, kube::Error>>,
{
    TRANSIENT_API.retry(call, transient).await
}

pub(super) fn transient(e: &kube::Error) -> bool {
    match e {
        // etcd refusing an object over its size limit is a 500 that no retry changes.
        kube::Error::Api(status) if status.message.contains(crate::store::TOO_LARGE) => false,
        kube::Error::Api(status) => matches!(status.code, 429 | 500 | 502 | 503 | 504),
        kube::Error::HyperError(_) | kube::Error::Service(_) => true,
        _ => false,
    }
}

pub(super) fn api_code(e: &kube::Error) -> Option<u16> {
    match e {
        kube::Error::Api(status) => Some(status.code),
        _ => None,
    }
}

/// A 404 without a NotFound Status: the resource type itself is not served (CRDs missing).
pub(super) fn is_unserved(e: &kube::Error) -> bool {
    matches!(e, kube::Error::Api(status) if status.code == 404 && status.details.is_none() && status.reason != "NotFound")
}

pub(super) fn error(op: &'static str, object: String, e: kube::Error) -> StoreError {
    match e {
        // A 404 without a Status body: the resource type itself is not served.
        e if is_unserved(&e) => StoreError::Api {
            op,
            object,
            code: 404,
            message: "the whereabouts.cni.cncf.io API is not served: apply the CRDs (kubectl apply -f crds/)".into(),
        },
        kube::Error::Api(status) => StoreError::Api {
            op,
            object,
            code: status.code,
            message: status.message.clone(),
        },
        kube::Error::SerdeError(e) => StoreError::Malformed {
            op,
            object,
            message: e.to_string(),
        },
        other => StoreError::Transport {
            op,
            object,
            source: std::sync::Arc::new(other),
        },
    }
}
