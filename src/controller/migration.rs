//! Two dangers of a migration from upstream whereabouts, said loudly: a CRD that prunes our
//! fields ([`schema`]), and upstream's own components still running next to ours ([`upstream`]).
//!
//! Checked at start and again every `--audit-interval`, on every replica (one GET per CRD and per
//! known object; nothing is listed). Each danger is an error log line that says what to do, a
//! gauge, a Warning Event (from the leader) and a finding of `whereabouts-operator audit`.
//! Nothing here stops the operator: pools must still be cleaned while someone fixes it.

pub mod schema;
pub mod upstream;

use std::sync::Arc;
use std::time::Duration;

use k8s_openapi::api::apps::v1::{DaemonSet, Deployment};
use k8s_openapi::api::batch::v1::CronJob;
use k8s_openapi::api::core::v1::{ObjectReference, PodSpec};
use k8s_openapi::apiextensions_apiserver::pkg::apis::apiextensions::v1::CustomResourceDefinition;
use kube::{Api, Client, Resource};
use tokio::sync::watch;

use super::Context;
use super::findings::Finding;
use upstream::{Kind, Known, NAMESPACE};

/// How an old CRD is replaced; Helm installs `crds/` once and never again.
pub const CRD_FIX: &str = "kubectl apply -f crds/ (or kubectl apply -k config/crd); installed \
     with Helm, which never upgrades CRDs: kubectl apply -f charts/whereabouts/crds/";

/// Event reasons.
pub const CRD_REASON: &str = "CrdMissingFields";
pub const UPSTREAM_REASON: &str = "UpstreamComponentRunning";

/// A check that could not be made (the operator's RBAC of an older install, an API error).
#[derive(Debug, thiserror::Error)]
#[error("cannot check {object}: {message}{}", if *code == 403 {
    " (the operator's RBAC must name it: config/rbac/operator.yaml, or the chart's)"
} else {
    ""
})]
pub struct CheckError {
    pub object: String,
    pub code: u16,
    pub message: String,
}

impl CheckError {
    fn of(object: String, e: kube::Error) -> CheckError {
        let code = match &e {
            kube::Error::Api(status) => status.code,
            _ => 0,
        };
        CheckError {
            object,
            code,
            message: e.to_string(),
        }
    }
}

/// One of upstream's components, found running.
#[derive(Debug, Clone)]
pub struct Sighting {
    pub known: &'static Known,
    /// Why it is upstream's (`container whereabouts runs /ip-control-loop`).
    pub evidence: String,
    /// The object, for the Event.
    pub reference: ObjectReference,
}

/// What one pass of the checks saw.
#[derive(Debug, Default)]
pub struct Observation {
    /// Every CRD of ours that could be read, and the installed object (for the Event).
    pub crds: Vec<(schema::Gap, Option<ObjectReference>)>,
    /// The known components that could be read (whether or not they exist).
    pub checked: Vec<&'static Known>,
    /// Those of them that are upstream's and exist.
    pub running: Vec<Sighting>,
    pub unreadable: Vec<CheckError>,
}

impl Observation {
    /// The audit's findings: one per CRD that lacks fields, one per upstream component.
    pub fn findings(&self) -> Vec<Finding> {
        let crds = self
            .crds
            .iter()
            .filter(|(gap, _)| !gap.is_fine())
            .map(|(gap, _)| Finding::CrdMissingFields {
                crd: gap.crd.clone(),
                version: gap.version.clone(),
                missing: gap.missing.clone(),
            });
        let running = self.running.iter().map(|s| Finding::UpstreamComponent {
            workload: s.known.kind,
            namespace: NAMESPACE.to_owned(),
            name: s.known.name.to_owned(),
            evidence: s.evidence.clone(),
        });
        crds.chain(running).collect()
    }
}

/// What a CRD lacks and how to fix it: the log line, the Event and the finding say this.
pub fn crd_message(crd: &str, version: Option<&str>, missing: &[String]) -> String {
    let Some(version) = version else {
        return format!(
            "customresourcedefinition {crd} is not installed: whereabouts cannot store its objects. Fix: {CRD_FIX}"
        );
    };
    let lacks = format!(
        "customresourcedefinition {crd} (storage version {version}) lacks {} field(s) whereabouts \
         writes: {}.",
        missing.len(),
        missing.join(", ")
    );
    if crd == schema::OPTIONAL {
        return format!(
            "{lacks} The API server refuses or prunes the addresses the plugin records in an \
             IPAMClaim, so a VM's addresses are not kept: an ipamclaims release that declares \
             status.ownerPod a string? Fix: {CRD_FIX}; whatever else installs it (OVN-Kubernetes, \
             KubeVirt's ipam-extensions) must write status.ownerPod as {{name}}"
        );
    }
    format!(
        "{lacks} The API server drops them from every write, so what they record is lost (pod \
         UIDs, sticky and claimed addresses, pool status): an older CRD, upstream's? Fix: {CRD_FIX}"
    )
}

/// What an upstream component does here and how to remove it.
pub fn upstream_message(kind: Kind, namespace: &str, name: &str, evidence: &str) -> String {
    let (source, harm) = upstream::known(kind, name)
        .map_or(("upstream whereabouts", "it competes with ours"), |k| {
            (k.source, k.harm)
        });
    format!(
        "{kind} {namespace}/{name} is upstream whereabouts' ({evidence}; {source}) and runs next \
         to ours: {harm}. Remove it: kubectl -n {namespace} delete {kind} {name} (README, \
         \"Migration from upstream\")"
    )
}

/// Reads our CRDs and upstream's known objects, each by name.
pub async fn observe(client: &Client) -> Observation {
    let mut seen = Observation::default();
    let crds: Api<CustomResourceDefinition> = Api::all(client.clone());
    for ours in schema::ours() {
        let name = schema::name_of(&ours);
        match crds.get_opt(&name).await {
            Ok(installed) => {
                let about = installed.as_ref().map(|c| c.object_ref(&()));
                seen.crds
                    .push((schema::gap(&ours, installed.as_ref()), about));
            }
            Err(e) => seen.unreadable.push(CheckError::of(
                format!("customresourcedefinition {name}"),
                e,
            )),
        }
    }
    for known in &upstream::KNOWN {
        match read_component(client, known).await {
            Ok(sighting) => {
                seen.checked.push(known);
                seen.running.extend(sighting);
            }
            Err(e) => seen.unreadable.push(CheckError::of(
                format!("{} {NAMESPACE}/{}", known.kind, known.name),
                e,
            )),
        }
    }
    seen
}

/// The known object, when it exists and is upstream's.
async fn read_component(
    client: &Client,
    known: &'static Known,
) -> Result<Option<Sighting>, kube::Error> {
    let found = match known.kind {
        Kind::DaemonSet => {
            template_of::<DaemonSet>(client, known.name, |d| {
                d.spec.as_ref()?.template.spec.as_ref()
            })
            .await?
        }
        Kind::Deployment => {
            template_of::<Deployment>(client, known.name, |d| {
                d.spec.as_ref()?.template.spec.as_ref()
            })
            .await?
        }
        Kind::CronJob => {
            template_of::<CronJob>(client, known.name, |c| {
                c.spec
                    .as_ref()?
                    .job_template
                    .spec
                    .as_ref()?
                    .template
                    .spec
                    .as_ref()
            })
            .await?
        }
    };
    Ok(found.and_then(|(spec, reference)| {
        Some(Sighting {
            known,
            evidence: upstream::evidence(&spec)?,
            reference,
        })
    }))
}

/// The pod template of the object `name` in upstream's namespace, and a reference to it.
async fn template_of<K>(
    client: &Client,
    name: &str,
    template: impl Fn(&K) -> Option<&PodSpec>,
) -> Result<Option<(PodSpec, ObjectReference)>, kube::Error>
where
    K: Resource<Scope = k8s_openapi::NamespaceResourceScope, DynamicType = ()>
        + Clone
        + serde::de::DeserializeOwned
        + std::fmt::Debug,
{
    let api: Api<K> = Api::namespaced(client.clone(), NAMESPACE);
    let Some(object) = api.get_opt(name).await? else {
        return Ok(None);
    };
    Ok(template(&object).map(|spec| (spec.clone(), object.object_ref(&()))))
}

/// Logs what `seen` shows, sets the gauges and, when `publish`, writes the Warning Events.
pub async fn report(ctx: &Context, seen: &Observation, publish: bool) {
    for (gap, about) in &seen.crds {
        ctx.metrics
            .set_crd_fields_missing(&gap.crd, gap.missing.len());
        if gap.is_fine() {
            continue;
        }
        let message = crd_message(&gap.crd, gap.version.as_deref(), &gap.missing);
        tracing::error!(crd = %gap.crd, missing = ?gap.missing, "{message}");
        if let (true, Some(about)) = (publish, about) {
            ctx.event(about, true, CRD_REASON, &message).await;
        }
    }
    for known in &seen.checked {
        let running = seen.running.iter().any(|s| std::ptr::eq(s.known, *known));
        ctx.metrics
            .set_upstream_component(known.kind.resource(), NAMESPACE, known.name, running);
    }
    for s in &seen.running {
        let message = upstream_message(s.known.kind, NAMESPACE, s.known.name, &s.evidence);
        tracing::error!(kind = %s.known.kind, namespace = NAMESPACE, name = s.known.name, "{message}");
        if publish {
            ctx.event(&s.reference, true, UPSTREAM_REASON, &message)
                .await;
        }
    }
    for e in &seen.unreadable {
        tracing::warn!(error = %e, "migration check skipped");
    }
}

/// One pass: read, then report (Events only from the leader, and never in a dry run).
pub async fn check_once(ctx: &Context) -> Observation {
    let seen = observe(&ctx.client).await;
    report(ctx, &seen, ctx.is_leader() && !ctx.opts.dry_run).await;
    seen
}

/// Checks at start, then every audit interval, and at once when this replica becomes the
/// leader (so that its Events do not wait a whole interval). Never returns.
pub async fn run(ctx: Arc<Context>) {
    let mut leader = ctx.leader.clone();
    loop {
        let leading = *leader.borrow_and_update();
        check_once(&ctx).await;
        next_pass(&mut leader, ctx.opts.audit_interval, leading).await;
    }
}

async fn next_pass(leader: &mut watch::Receiver<bool>, period: Duration, was_leading: bool) {
    let promoted = async {
        while leader.changed().await.is_ok() {
            if *leader.borrow_and_update() && !was_leading {
                return;
            }
        }
        std::future::pending::<()>().await
    };
    tokio::select! {
        () = tokio::time::sleep(period) => {}
        () = promoted => {}
    }
}

#[cfg(test)]
mod tests;
