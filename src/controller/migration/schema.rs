//! Whether an installed CRD keeps the fields ours write.
//!
//! The API server prunes every field a CRD's structural schema does not declare, silently, on
//! every write. Helm never upgrades a CRD that exists, so a cluster that had upstream's CRDs keeps
//! them after an install of ours: `poduid`, `statefulset`, `ipamclaimref`, `node` and the pool
//! status are dropped, and UID ownership, sticky and claimed addresses quietly stop working.
//!
//! "Our fields" are read from the CRDs this crate generates (`crd::all`, what `crds/` holds), not
//! from a list kept by hand: a field added later is checked without anyone remembering to.
//!
//! The `ipamclaims` CRD is another project's (KubeVirt's persistent IPs, OVN-Kubernetes), checked
//! only when it is installed: without it no VM keeps its address, which is no fault. Some of its
//! releases declare `status.ownerPod` a string where ours writes `{name}`: the API server then
//! refuses every record the plugin makes, and a VM's address is not kept.

use k8s_openapi::apiextensions_apiserver::pkg::apis::apiextensions::v1::{
    CustomResourceDefinition, CustomResourceDefinitionVersion, JSONSchemaProps,
    JSONSchemaPropsOrArray, JSONSchemaPropsOrBool,
};

/// The API group whose CRDs upstream installs too, and so the ones an install over upstream's
/// may have left old. (IPAMClaims and NADs are other projects' CRDs.)
pub const GROUP: &str = "whereabouts.cni.cncf.io";

/// The name `subresources.status` is reported by: without it the operator's pool status writes
/// (`ippools/status`) are refused, and `status` is pruned from the object besides.
pub const STATUS_SUBRESOURCE: &str = "subresources.status";

/// The CRD checked only when installed (see the module's comment).
pub const OPTIONAL: &str = "ipamclaims.k8s.cni.cncf.io";

/// The CRDs checked, as `crds/` ships them, in its order: ours of [`GROUP`], then [`OPTIONAL`].
pub fn ours() -> Vec<CustomResourceDefinition> {
    crate::crd::all()
        .into_iter()
        .map(|(_, crd)| crd)
        .filter(|crd| crd.spec.group == GROUP || name_of(crd) == OPTIONAL)
        .collect()
}

/// The name of a CRD object (`ippools.whereabouts.cni.cncf.io`).
pub fn name_of(crd: &CustomResourceDefinition) -> String {
    crd.metadata.name.clone().unwrap_or_default()
}

/// What an installed CRD lacks of ours.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Gap {
    pub crd: String,
    /// The installed storage version compared with ours; `None` when the CRD is not installed.
    pub version: Option<String>,
    /// The topmost missing path of each missing subtree (`spec.allocations.*.poduid`, `status`;
    /// `*` is a map's values, `[]` a list's items), and [`STATUS_SUBRESOURCE`]. A field declared
    /// with no properties where ours has them (a string) is missing each of ours.
    pub missing: Vec<String>,
}

impl Gap {
    /// Nothing missing, and installed unless it is [`OPTIONAL`].
    pub fn is_fine(&self) -> bool {
        self.missing.is_empty() && (self.version.is_some() || self.crd == OPTIONAL)
    }
}

/// Compares our CRD with the installed one (`None`: not installed, everything is missing).
pub fn gap(ours: &CustomResourceDefinition, installed: Option<&CustomResourceDefinition>) -> Gap {
    if installed.is_none() && name_of(ours) == OPTIONAL {
        return Gap {
            crd: name_of(ours),
            version: None,
            missing: Vec::new(),
        };
    }
    let empty = JSONSchemaProps::default();
    let mut missing = Vec::new();
    // Objects are stored in the storage version's schema: what it does not declare is dropped,
    // whichever version a client writes.
    let theirs = installed.and_then(|crd| crd.spec.versions.iter().find(|v| v.storage));
    for our_version in ours.spec.versions.iter().filter(|v| v.storage) {
        let their_schema = theirs.and_then(schema_of).unwrap_or(&empty);
        if let Some(our_schema) = schema_of(our_version) {
            walk(our_schema, their_schema, "", &mut missing);
        }
        let wants_status = our_version
            .subresources
            .as_ref()
            .is_some_and(|s| s.status.is_some());
        let has_status = theirs
            .and_then(|v| v.subresources.as_ref())
            .is_some_and(|s| s.status.is_some());
        if wants_status && !has_status {
            missing.push(STATUS_SUBRESOURCE.to_owned());
        }
    }
    Gap {
        crd: name_of(ours),
        version: installed.map(|_| theirs.map(|v| v.name.clone()).unwrap_or_default()),
        missing,
    }
}

fn schema_of(version: &CustomResourceDefinitionVersion) -> Option<&JSONSchemaProps> {
    version
        .schema
        .as_ref()
        .and_then(|s| s.open_api_v3_schema.as_ref())
}

fn join(path: &str, name: &str) -> String {
    if path.is_empty() {
        name.to_owned()
    } else {
        format!("{path}.{name}")
    }
}

/// Adds to `out` every field of `ours` that `theirs` would prune, the topmost of each subtree.
fn walk(ours: &JSONSchemaProps, theirs: &JSONSchemaProps, path: &str, out: &mut Vec<String>) {
    if theirs.x_kubernetes_preserve_unknown_fields == Some(true) {
        return; // kept as written, whatever it holds
    }
    for (name, child) in ours.properties.iter().flatten() {
        let at = join(path, name);
        match theirs.properties.as_ref().and_then(|p| p.get(name)) {
            Some(their_child) => walk(child, their_child, &at, out),
            None => out.push(at),
        }
    }
    if let Some(JSONSchemaPropsOrBool::Schema(child)) = &ours.additional_properties {
        let at = join(path, "*");
        match &theirs.additional_properties {
            Some(JSONSchemaPropsOrBool::Schema(their_child)) => walk(child, their_child, &at, out),
            // The API server prunes nothing under `additionalProperties: true`.
            Some(JSONSchemaPropsOrBool::Bool(true)) => {}
            _ => out.push(at),
        }
    }
    if let Some(JSONSchemaPropsOrArray::Schema(child)) = &ours.items {
        let at = format!("{path}[]");
        match &theirs.items {
            Some(JSONSchemaPropsOrArray::Schema(their_child)) => walk(child, their_child, &at, out),
            _ => out.push(at),
        }
    }
}
