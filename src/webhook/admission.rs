//! AdmissionReview v1 in, AdmissionReview v1 out.
//!
//! Only the fields we use are read, so the check does not depend on the exact shape of fields the
//! API server adds over time. A request that is not an AdmissionReview for NADs is a caller's
//! mistake (a misconfigured webhook registration) and gets an error, never a silent "allowed".

use serde::Deserialize;
use serde_json::{Value, json};

use super::index::NadIndex;
use crate::nad_check::{check_spec_config, message, overlap_warnings};

pub const API_VERSION: &str = "admission.k8s.io/v1";
pub const NAD_GROUP: &str = "k8s.cni.cncf.io";
pub const NAD_KIND: &str = "NetworkAttachmentDefinition";

/// Why a request could not be answered with a verdict (HTTP 400).
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum BadReview {
    #[error("request body is not an AdmissionReview in JSON: {0}")]
    NotJson(String),
    #[error(
        "expects kind AdmissionReview of apiVersion {API_VERSION}, got kind {kind:?} of apiVersion {api_version:?}"
    )]
    WrongType { kind: String, api_version: String },
    #[error("AdmissionReview has no request")]
    NoRequest,
    #[error("AdmissionReview request has no uid")]
    NoUid,
    #[error("expects NetworkAttachmentDefinition ({NAD_GROUP}/v1), got {0}")]
    WrongResource(String),
    #[error("AdmissionReview request for {0} has no object")]
    NoObject(String),
}

impl BadReview {
    /// A stable label for logs and (later) metrics.
    pub fn kind(&self) -> &'static str {
        match self {
            BadReview::NotJson(_) => "not_json",
            BadReview::WrongType { .. } => "wrong_type",
            BadReview::NoRequest => "no_request",
            BadReview::NoUid => "no_uid",
            BadReview::WrongResource(_) => "wrong_resource",
            BadReview::NoObject(_) => "no_object",
        }
    }
}

#[derive(Deserialize)]
#[serde(rename_all = "camelCase")]
struct Review {
    #[serde(default)]
    api_version: String,
    #[serde(default)]
    kind: String,
    request: Option<Request>,
}

#[derive(Deserialize)]
#[serde(rename_all = "camelCase")]
struct Request {
    #[serde(default)]
    uid: String,
    #[serde(default)]
    kind: Gvk,
    #[serde(default)]
    namespace: String,
    #[serde(default)]
    name: String,
    #[serde(default)]
    operation: String,
    object: Option<Value>,
}

#[derive(Deserialize, Default)]
struct Gvk {
    #[serde(default)]
    group: String,
    #[serde(default)]
    version: String,
    #[serde(default)]
    kind: String,
}

/// The verdict on one AdmissionReview request body, as the response AdmissionReview.
/// Answers one review; returns the operation (for metrics) and the AdmissionReview to send back.
pub fn review(body: &[u8], nads: &NadIndex) -> Result<(String, Value), BadReview> {
    // serde skips the fields `Review` does not name without checking their UTF-8, so a body
    // that is not JSON at all (found by fuzz/admission_review) would otherwise get a verdict.
    let text =
        std::str::from_utf8(body).map_err(|e| BadReview::NotJson(format!("not UTF-8: {e}")))?;
    let review: Review =
        serde_json::from_str(text).map_err(|e| BadReview::NotJson(e.to_string()))?;
    if review.kind != "AdmissionReview" || review.api_version != API_VERSION {
        return Err(BadReview::WrongType {
            kind: review.kind,
            api_version: review.api_version,
        });
    }
    let req = review.request.ok_or(BadReview::NoRequest)?;
    if req.uid.is_empty() {
        return Err(BadReview::NoUid);
    }
    if req.kind.group != NAD_GROUP || req.kind.kind != NAD_KIND {
        let k = &req.kind;
        let group = if k.group.is_empty() { "core" } else { &k.group };
        return Err(BadReview::WrongResource(format!(
            "{} ({group}/{})",
            k.kind, k.version
        )));
    }
    // DELETE and CONNECT never make a config worse.
    if !matches!(req.operation.as_str(), "CREATE" | "UPDATE") {
        return Ok((
            req.operation.clone(),
            response(&req.uid, Verdict::default()),
        ));
    }
    let object = req
        .object
        .as_ref()
        .ok_or_else(|| BadReview::NoObject(format!("{} {}", req.operation, req.name)))?;
    Ok((
        req.operation.clone(),
        response(&req.uid, judge(&req, object, nads)),
    ))
}

#[derive(Default)]
struct Verdict {
    denial: Option<String>,
    warnings: Vec<String>,
}

fn judge(req: &Request, object: &Value, nads: &NadIndex) -> Verdict {
    let config = match object.get("spec").and_then(|s| s.get("config")) {
        None | Some(Value::Null) => return Verdict::default(),
        Some(Value::String(s)) => s.as_str(),
        // The CRD's schema makes this a string; a server without the schema could still send one.
        Some(other) => {
            return Verdict {
                denial: Some(format!(
                    "spec.config {other} must be a string holding the JSON network config"
                )),
                warnings: Vec::new(),
            };
        }
    };
    let check = check_spec_config(config);
    if !check.whereabouts {
        return Verdict::default();
    }
    let mut warnings: Vec<String> = check.warnings.iter().map(message).collect();
    if !check.errors.is_empty() {
        let all: Vec<String> = check.errors.iter().map(message).collect();
        return Verdict {
            denial: Some(all.join("; ")),
            warnings,
        };
    }
    // The request's own namespace/name: for generateName creates the name is still empty, and
    // such a NAD cannot collide with itself in the cache.
    let name = if req.name.is_empty() {
        object
            .pointer("/metadata/name")
            .and_then(Value::as_str)
            .unwrap_or_default()
    } else {
        &req.name
    };
    let me = format!("{}/{name}", req.namespace);
    let overlaps = overlap_warnings(&check.ranges, &me, &nads.index());
    warnings.extend(overlaps.iter().map(message));
    Verdict {
        denial: None,
        warnings,
    }
}

fn response(uid: &str, v: Verdict) -> Value {
    let mut resp = json!({"uid": uid, "allowed": v.denial.is_none()});
    if let Some(msg) = v.denial {
        resp["status"] = json!({"code": 422, "reason": "Invalid", "message": msg});
    }
    if !v.warnings.is_empty() {
        resp["warnings"] = v.warnings.into();
    }
    json!({"apiVersion": API_VERSION, "kind": "AdmissionReview", "response": resp})
}
