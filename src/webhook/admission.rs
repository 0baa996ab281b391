//! AdmissionReview v1 in, AdmissionReview v1 out, in kube's types.
//!
//! The envelope (type, request, uid, resource, operation) is checked on the JSON first: a request
//! that is not an AdmissionReview for NADs is a caller's mistake (a misconfigured webhook
//! registration) and gets an error naming what is wrong, never a silent "allowed"; kube's own
//! reading would only say which field is missing. Operations other than CREATE and UPDATE are
//! answered from the envelope alone. A CREATE or UPDATE is then read into kube's
//! [`AdmissionRequest`], which skips the fields it does not name, so the check does not depend on
//! the exact shape of fields the API server adds over time.

use kube::core::admission::{
    AdmissionRequest, AdmissionResponse, AdmissionReview, META_API_VERSION_V1, META_KIND,
};
use kube::core::{DynamicObject, Status};
use serde_json::Value;

use super::index::NadIndex;
use crate::nad_check::{check_spec_config, message, overlap_warnings};

pub const API_VERSION: &str = META_API_VERSION_V1;
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
    /// A field the API server always sends is missing or of the wrong type.
    #[error("AdmissionReview request is malformed: {0}")]
    Malformed(String),
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
            BadReview::Malformed(_) => "malformed",
            BadReview::NoObject(_) => "no_object",
        }
    }
}

/// One review answered: the operation asked about (the metric's label) and the response.
pub struct Answer {
    pub operation: String,
    pub response: AdmissionResponse,
}

impl Answer {
    pub fn allowed(&self) -> bool {
        self.response.allowed
    }

    /// The AdmissionReview to send back.
    pub fn into_review(self) -> AdmissionReview<DynamicObject> {
        self.response.into_review()
    }
}

/// The string at `pointer`, or "" when it is absent or not a string.
fn text_at<'v>(value: &'v Value, pointer: &str) -> &'v str {
    value
        .pointer(pointer)
        .and_then(Value::as_str)
        .unwrap_or_default()
}

/// Answers one AdmissionReview request body.
pub fn review(body: &[u8], nads: &NadIndex) -> Result<Answer, BadReview> {
    // serde_json checks the UTF-8 of strings it keeps only, so a body that is not JSON at all
    // (found by fuzz/admission_review) could otherwise get a verdict.
    let text =
        std::str::from_utf8(body).map_err(|e| BadReview::NotJson(format!("not UTF-8: {e}")))?;
    let value: Value = serde_json::from_str(text).map_err(|e| BadReview::NotJson(e.to_string()))?;
    let (kind, api_version) = (text_at(&value, "/kind"), text_at(&value, "/apiVersion"));
    if kind != META_KIND || api_version != API_VERSION {
        return Err(BadReview::WrongType {
            kind: kind.to_owned(),
            api_version: api_version.to_owned(),
        });
    }
    if value.get("request").is_none_or(Value::is_null) {
        return Err(BadReview::NoRequest);
    }
    let uid = text_at(&value, "/request/uid").to_owned();
    if uid.is_empty() {
        return Err(BadReview::NoUid);
    }
    let group = text_at(&value, "/request/kind/group");
    let resource = text_at(&value, "/request/kind/kind");
    if group != NAD_GROUP || resource != NAD_KIND {
        let group = if group.is_empty() { "core" } else { group };
        let version = text_at(&value, "/request/kind/version");
        return Err(BadReview::WrongResource(format!(
            "{resource} ({group}/{version})"
        )));
    }
    let operation = text_at(&value, "/request/operation").to_owned();
    // DELETE and CONNECT never make a config worse.
    if !matches!(operation.as_str(), "CREATE" | "UPDATE") {
        return Ok(Answer {
            operation,
            response: response(&uid, Verdict::default()),
        });
    }
    let review: AdmissionReview<DynamicObject> =
        serde_json::from_value(value).map_err(|e| BadReview::Malformed(e.to_string()))?;
    let req: AdmissionRequest<DynamicObject> =
        review.try_into().map_err(|_| BadReview::NoRequest)?;
    let object = req
        .object
        .as_ref()
        .ok_or_else(|| BadReview::NoObject(format!("{operation} {}", req.name)))?;
    let verdict = judge(&req, object, nads);
    Ok(Answer {
        operation,
        response: response(&uid, verdict),
    })
}

#[derive(Default)]
struct Verdict {
    denial: Option<String>,
    warnings: Vec<String>,
}

fn judge(
    req: &AdmissionRequest<DynamicObject>,
    object: &DynamicObject,
    nads: &NadIndex,
) -> Verdict {
    let config = match object.data.get("spec").and_then(|s| s.get("config")) {
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
        object.metadata.name.as_deref().unwrap_or_default()
    } else {
        &req.name
    };
    let namespace = req.namespace.as_deref().unwrap_or_default();
    let me = format!("{namespace}/{name}");
    let overlaps = overlap_warnings(&check.ranges, &me, &nads.index());
    warnings.extend(overlaps.iter().map(message));
    let old = req
        .old_object
        .as_ref()
        .and_then(|o| o.data.get("spec")?.get("config")?.as_str());
    let (slice_warnings, denial) = match old {
        Some(old) => slice_changes(&check_spec_config(old), &check),
        None => (Vec::new(), None),
    };
    warnings.extend(slice_warnings);
    Verdict { denial, warnings }
}

/// What an UPDATE does to node slices. A new range or size of a sliced range is allowed (the
/// operator keeps the old slices while they hold addresses); switching a range between a pool
/// and slices moves new allocations to other pool objects, and only the overlapping-range
/// reservations then keep an address in use from being handed out again: refused when they are
/// off.
fn slice_changes(
    old: &crate::nad_check::NadCheck,
    new: &crate::nad_check::NadCheck,
) -> (Vec<String>, Option<String>) {
    let mut warnings = Vec::new();
    let mut denial = None;
    for r in &new.ranges {
        let Some(before) = old
            .ranges
            .iter()
            .find(|o| o.network_name == r.network_name && o.range.windows_overlap(&r.range))
        else {
            continue;
        };
        match (&before.slices, &r.slices) {
            (Some((name, a)), Some((_, b))) if a != b || before.range.cidr() != r.range.cidr() => warnings.push(format!(
                "spec.config: {} changes nodeslicepool {name} from range {} in {} slices to range {} in {} slices: the operator keeps the old slices until they hold no address, then re-slices",
                r.path, before.range.cidr(), a.text, r.range.cidr(), b.text
            )),
            (None, Some(_)) | (Some(_), None) => {
                let what = format!(
                    "spec.config: {} switches range {} {} node slices: new addresses come from other pool objects than the addresses in use",
                    r.path,
                    r.range.cidr(),
                    if r.slices.is_some() { "to" } else { "from" }
                );
                if r.overlapping {
                    warnings.push(format!("{what}; the overlapping-range reservations keep those from being handed out twice"));
                } else {
                    denial = Some(format!("{what}, and with enable_overlapping_ranges false nothing would keep them from being handed out twice: turn it on for the switch, or remove the pods of this network first"));
                }
            }
            _ => {}
        }
    }
    (warnings, denial)
}

/// kube's response to request `uid`. kube builds a response from a parsed request or as
/// `invalid`; answers from the envelope alone have no parsed request, so every answer starts from
/// `invalid` (which also sets the review's apiVersion and kind) and is filled in from the verdict.
fn response(uid: &str, v: Verdict) -> AdmissionResponse {
    let mut resp = AdmissionResponse::invalid("");
    resp.uid = uid.to_owned();
    resp.allowed = v.denial.is_none();
    resp.result = match v.denial {
        None => Status::default(),
        Some(message) => Status {
            code: 422,
            reason: "Invalid".into(),
            message,
            ..Status::default()
        },
    };
    resp.warnings = (!v.warnings.is_empty()).then_some(v.warnings);
    resp
}
