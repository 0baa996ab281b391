//! What the kubelet calls a pod: the UID it passes as `K8S_POD_UID`, which for a static pod is
//! not the UID of the pod object the API shows.

use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;

/// The annotation of a static pod's mirror in the API: the static pod's config hash, which is
/// also the UID the kubelet gives the static pod and passes as `K8S_POD_UID`. The mirror pod's
/// own UID is another.
pub const MIRROR_ANNOTATION: &str = "kubernetes.io/config.mirror";

/// The UID the runtime recorded for this pod's sandboxes (`K8S_POD_UID`): a mirror pod's static
/// pod hash, any other pod's own UID. Every live-pod check compares entries against this, so a
/// running static pod's entries are never taken for a gone pod's.
pub fn runtime_uid(meta: &ObjectMeta) -> String {
    meta.annotations
        .as_ref()
        .and_then(|a| a.get(MIRROR_ANNOTATION))
        .filter(|h| !h.is_empty())
        .or(meta.uid.as_ref())
        .cloned()
        .unwrap_or_default()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_mirror_pod_carries_its_static_pods_uid() {
        let mut meta = ObjectMeta {
            uid: Some("mirror-uid".into()),
            ..Default::default()
        };
        assert_eq!(runtime_uid(&meta), "mirror-uid");
        meta.annotations = Some([(MIRROR_ANNOTATION.to_owned(), "6f1c2a".to_owned())].into());
        assert_eq!(runtime_uid(&meta), "6f1c2a");
        meta.annotations = Some([(MIRROR_ANNOTATION.to_owned(), String::new())].into());
        assert_eq!(runtime_uid(&meta), "mirror-uid");
    }
}
