//! Self-managed webhook certificates: with no certificate given, the operator makes its own CA and
//! a serving certificate for its Service, keeps both in a Secret (so replicas agree and restarts
//! keep them), writes the serving pair to the files [`super::tls`] serves and follows, puts the CA
//! into the ValidatingWebhookConfiguration's `caBundle`, and renews before expiry.
//!
//! Renewal drops no request: a serving certificate is re-issued by the same CA 30 days before it
//! expires, and the CA bundle does not change. A CA is replaced a year before its ten years are
//! up; the new CA is added to the bundle in front of the old one, and only a later serving
//! certificate is signed by it, once every API server trusts both.
//!
//! Every replica runs the loop. Writes of the Secret are conditional on the resourceVersion read,
//! so two replicas never replace each other's certificates: the loser reads the winner's. The
//! decision is pure ([`plan`]); what a Secret says about its certificates (validity, names) is
//! kept in its annotations, so nothing needs to parse X.509.

use std::collections::BTreeMap;
use std::time::Duration;

use k8s_openapi::ByteString;
use k8s_openapi::api::admissionregistration::v1::ValidatingWebhookConfiguration;
use k8s_openapi::api::core::v1::Secret;
use k8s_openapi::jiff::civil::Date;
use kube::api::{Api, PostParams};
use kube::{Client, ResourceExt};
use rcgen::{
    BasicConstraints, CertificateParams, DistinguishedName, DnType, ExtendedKeyUsagePurpose, IsCa,
    Issuer, KeyPair, KeyUsagePurpose,
};

use super::tls::CertFiles;

/// How long a serving certificate is valid, and how long before its end it is renewed.
pub const SERVING_DAYS: i64 = 365;
pub const RENEW_BEFORE_DAYS: i64 = 30;
/// How long a CA is valid, and how long before its end it is replaced.
pub const CA_DAYS: i64 = 3650;
pub const CA_RENEW_BEFORE_DAYS: i64 = 365;
/// How often the Secret and the webhook configuration are checked (a GET of each): a re-applied
/// install, which puts back the shipped failure policy, is corrected within this.
pub const CHECK: Duration = Duration::from_secs(10);

const ANNOTATION_PREFIX: &str = "whereabouts.cni.cncf.io/";
const SERVING_NOT_AFTER: &str = "whereabouts.cni.cncf.io/serving-not-after";
const CA_NOT_AFTER: &str = "whereabouts.cni.cncf.io/ca-not-after";
const CA_SINCE: &str = "whereabouts.cni.cncf.io/ca-rotated";
const DNS_NAMES: &str = "whereabouts.cni.cncf.io/dns-names";

/// What the operator manages: the Secret, the Service the certificate names, the webhook
/// configuration it injects the CA into, and the files the webhook serves from.
#[derive(Debug, Clone)]
pub struct SelfManaged {
    pub namespace: String,
    pub secret: String,
    pub service: String,
    pub webhook_configuration: String,
    /// Set on every webhook of the configuration once this replica serves (`Fail`): the install
    /// ships `Ignore`, so that no NAD change is refused before there is a certificate.
    pub failure_policy: Option<String>,
    pub files: CertFiles,
}

impl SelfManaged {
    /// The names the serving certificate holds: the Service's, as the API server calls it.
    pub fn dns_names(&self) -> Vec<String> {
        let (s, ns) = (&self.service, &self.namespace);
        vec![
            s.clone(),
            format!("{s}.{ns}"),
            format!("{s}.{ns}.svc"),
            format!("{s}.{ns}.svc.cluster.local"),
        ]
    }
}

/// The Secret's contents: `tls.crt`, `tls.key`, `ca.crt` (the bundle), `ca.key`, and the
/// annotations that describe them.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Material {
    pub data: BTreeMap<String, String>,
    pub annotations: BTreeMap<String, String>,
}

impl Material {
    fn of(secret: &Secret) -> Material {
        let data = secret
            .data
            .iter()
            .flatten()
            .filter_map(|(k, v)| Some((k.clone(), String::from_utf8(v.0.clone()).ok()?)))
            .collect();
        let annotations = secret
            .annotations()
            .iter()
            .filter(|(k, _)| k.starts_with(ANNOTATION_PREFIX))
            .map(|(k, v)| (k.clone(), v.clone()))
            .collect();
        Material { data, annotations }
    }

    fn date(&self, key: &str) -> Option<Date> {
        self.annotations.get(key)?.parse().ok()
    }

    fn get(&self, key: &str) -> Option<&str> {
        self.data
            .get(key)
            .map(String::as_str)
            .filter(|v| !v.is_empty())
    }

    /// The CA bundle, as the webhook configuration carries it.
    pub fn ca_bundle(&self) -> &str {
        self.get("ca.crt").unwrap_or_default()
    }
}

/// What a check decided.
#[derive(Debug, PartialEq, Eq)]
pub enum Plan {
    Keep,
    /// No usable CA: everything new.
    Create,
    /// A new CA in front of the bundle; the serving pair stays.
    RotateCa,
    /// A new serving pair from the current CA.
    Renew,
}

/// What to do with the Secret's `current` material `today` for `names`.
pub fn plan(current: Option<&Material>, today: Date, names: &[String]) -> Plan {
    let Some(m) = current else {
        return Plan::Create;
    };
    let has = |k: &str| m.get(k).is_some();
    let (Some(ca_end), true) = (m.date(CA_NOT_AFTER), has("ca.crt") && has("ca.key")) else {
        return Plan::Create;
    };
    let days_to = |end: Date| today.until(end).map_or(0, |s| s.get_days() as i64);
    if days_to(ca_end) <= 0 {
        return Plan::Create;
    }
    let serving_end = m.date(SERVING_NOT_AFTER);
    let serving_ok = has("tls.crt")
        && has("tls.key")
        && serving_end.is_some_and(|end| days_to(end) > RENEW_BEFORE_DAYS)
        && m.annotations.get(DNS_NAMES).map(String::as_str) == Some(names.join(",").as_str());
    // A new CA signs nothing on the day it joins the bundle, so that every API server trusts it
    // before a certificate it signed is served (unless the serving pair cannot wait).
    let ca_new = m.date(CA_SINCE).is_some_and(|since| since >= today);
    if days_to(ca_end) <= CA_RENEW_BEFORE_DAYS {
        return if ca_new { Plan::Keep } else { Plan::RotateCa };
    }
    let serving_expired = serving_end.is_none_or(|end| days_to(end) <= 0);
    match (serving_ok, ca_new && !serving_expired) {
        (true, _) | (false, true) => Plan::Keep,
        (false, false) => Plan::Renew,
    }
}

/// The CA's parameters: always the same name, so a stored key signs as the stored CA.
fn ca_params(today: Date, days: i64) -> CertificateParams {
    let mut params = CertificateParams::default();
    let mut dn = DistinguishedName::new();
    dn.push(DnType::CommonName, "whereabouts webhook CA");
    params.distinguished_name = dn;
    params.is_ca = IsCa::Ca(BasicConstraints::Constrained(0));
    params.key_usages = vec![KeyUsagePurpose::KeyCertSign, KeyUsagePurpose::CrlSign];
    set_validity(&mut params, today, days);
    params
}

fn set_validity(params: &mut CertificateParams, today: Date, days: i64) {
    let ymd = |d: Date| rcgen::date_time_ymd(i32::from(d.year()), d.month() as u8, d.day() as u8);
    let start = today.yesterday().unwrap_or(today);
    params.not_before = ymd(start);
    params.not_after = ymd(end_of(today, days));
}

fn end_of(today: Date, days: i64) -> Date {
    today
        .checked_add(k8s_openapi::jiff::Span::new().days(days))
        .unwrap_or(today)
}

/// Carries out `plan` on `current`, for `names`.
pub fn apply(
    plan: &Plan,
    current: Option<&Material>,
    today: Date,
    names: &[String],
) -> Result<Material, rcgen::Error> {
    let mut m = current.cloned().unwrap_or_default();
    if matches!(plan, Plan::Create | Plan::RotateCa) {
        let key = KeyPair::generate()?;
        let cert = ca_params(today, CA_DAYS).self_signed(&key)?;
        // The old CA stays in the bundle behind the new one (Create starts over).
        let old = match plan {
            Plan::RotateCa => m.ca_bundle().to_owned(),
            _ => String::new(),
        };
        m.data
            .insert("ca.crt".into(), format!("{}{old}", cert.pem()));
        m.data.insert("ca.key".into(), key.serialize_pem());
        m.annotations
            .insert(CA_NOT_AFTER.into(), end_of(today, CA_DAYS).to_string());
        // Only a CA that joins an existing bundle must wait to sign; a new one starts alone.
        match plan {
            Plan::RotateCa => m.annotations.insert(CA_SINCE.into(), today.to_string()),
            _ => m.annotations.remove(CA_SINCE),
        };
    }
    if matches!(plan, Plan::Create | Plan::Renew) {
        let ca_key = KeyPair::from_pem(m.get("ca.key").unwrap_or_default())?;
        let issuer = Issuer::new(ca_params(today, CA_DAYS), ca_key);
        let mut params = CertificateParams::new(names.to_vec())?;
        params.distinguished_name = DistinguishedName::new();
        params
            .distinguished_name
            .push(DnType::CommonName, names[0].clone());
        params.extended_key_usages = vec![ExtendedKeyUsagePurpose::ServerAuth];
        params.key_usages = vec![
            KeyUsagePurpose::DigitalSignature,
            KeyUsagePurpose::KeyEncipherment,
        ];
        set_validity(&mut params, today, SERVING_DAYS);
        let key = KeyPair::generate()?;
        let cert = params.signed_by(&key, &issuer)?;
        m.data.insert("tls.crt".into(), cert.pem());
        m.data.insert("tls.key".into(), key.serialize_pem());
        m.annotations.insert(
            SERVING_NOT_AFTER.into(),
            end_of(today, SERVING_DAYS).to_string(),
        );
        m.annotations.insert(DNS_NAMES.into(), names.join(","));
    }
    Ok(m)
}

/// Runs until `shutdown`: keeps the Secret current, the CA in the webhook configuration, and the
/// served files in step with them. Errors are logged and retried. `ready` says whether this
/// replica is ready to answer (certificate loaded, caches synced): only then is the failure
/// policy tightened, so that `Fail` never points at a Service without a ready endpoint.
pub async fn run(
    client: Client,
    cfg: SelfManaged,
    ready: impl Fn() -> bool + Send,
    shutdown: impl std::future::Future<Output = ()>,
) {
    let mut shutdown = std::pin::pin!(shutdown);
    let mut backoff = Duration::from_secs(1);
    loop {
        let wait = match check_once(&client, &cfg, ready()).await {
            Ok(()) => {
                backoff = Duration::from_secs(1);
                // Until this replica is ready, look again soon: the policy waits for it.
                if ready() {
                    CHECK
                } else {
                    Duration::from_secs(2)
                }
            }
            Err(e) => {
                tracing::warn!(error = %format!("{e:#}"), "webhook certificate: not current yet; retrying");
                backoff = (backoff * 2).min(CHECK);
                backoff
            }
        };
        tokio::select! {
            _ = &mut shutdown => return,
            _ = tokio::time::sleep(wait) => {}
        }
    }
}

/// One check. The CA goes into the webhook configuration before a certificate it signed is
/// served, so the API server never sees a serving certificate it cannot verify.
async fn check_once(client: &Client, cfg: &SelfManaged, ready: bool) -> anyhow::Result<()> {
    let material = current_secret(client, cfg).await?;
    inject(client, cfg, ready).await?;
    write_files(&cfg.files, &material)
}

/// The Secret's material, made or renewed first when [`plan`] says so.
async fn current_secret(client: &Client, cfg: &SelfManaged) -> anyhow::Result<Material> {
    let api: Api<Secret> = Api::namespaced(client.clone(), &cfg.namespace);
    let names = cfg.dns_names();
    let today = k8s_openapi::jiff::Zoned::now().date();
    let found = api.get_opt(&cfg.secret).await?;
    let current = found.as_ref().map(Material::of);
    let decided = plan(current.as_ref(), today, &names);
    if decided == Plan::Keep {
        return Ok(current.expect("kept material exists"));
    }
    let next = apply(&decided, current.as_ref(), today, &names)?;
    let mut secret = found.clone().unwrap_or_default();
    secret.metadata.name = Some(cfg.secret.clone());
    secret.metadata.namespace = Some(cfg.namespace.clone());
    let annotations = secret.metadata.annotations.get_or_insert_default();
    annotations.retain(|k, _| !k.starts_with(ANNOTATION_PREFIX));
    annotations.extend(next.annotations.clone());
    secret.type_ = Some("kubernetes.io/tls".into());
    secret.data = Some(
        next.data
            .iter()
            .map(|(k, v)| (k.clone(), ByteString(v.clone().into_bytes())))
            .collect(),
    );
    let written = match &found {
        // At the resourceVersion read: another replica's write in between wins.
        Some(_) => {
            api.replace(&cfg.secret, &PostParams::default(), &secret)
                .await
        }
        None => api.create(&PostParams::default(), &secret).await,
    };
    match written {
        Ok(_) => {
            tracing::info!(secret = %cfg.secret, plan = ?decided, "webhook certificate written");
            Ok(next)
        }
        Err(kube::Error::Api(s)) if s.code == 409 => {
            anyhow::bail!(
                "secret {} was written by another replica; reading it again",
                cfg.secret
            )
        }
        Err(e) => Err(e.into()),
    }
}

/// Writes the serving pair where the webhook reads it, when it differs (the key first, each file
/// replaced whole, so the poll never sees half a file).
fn write_files(files: &CertFiles, m: &Material) -> anyhow::Result<()> {
    let cert = m.get("tls.crt").unwrap_or_default().as_bytes();
    let key = m.get("tls.key").unwrap_or_default().as_bytes();
    if files.read().is_ok_and(|(c, k)| c == cert && k == key) {
        return Ok(());
    }
    for (path, bytes) in [(&files.key, key), (&files.cert, cert)] {
        if let Some(dir) = path.parent() {
            std::fs::create_dir_all(dir)?;
        }
        let tmp = path.with_extension("tmp");
        std::fs::write(&tmp, bytes)?;
        std::fs::rename(&tmp, path)?;
    }
    Ok(())
}

/// Puts the Secret's CA bundle into every webhook of the configuration, and the failure policy
/// once this replica is ready. The Secret is read again right before, so that a replica that
/// read it a while ago never puts back a bundle another replica has since replaced. One PUT at
/// the resourceVersion read, only when something differs.
async fn inject(client: &Client, cfg: &SelfManaged, ready: bool) -> anyhow::Result<()> {
    let api: Api<ValidatingWebhookConfiguration> = Api::all(client.clone());
    let Some(mut config) = api.get_opt(&cfg.webhook_configuration).await? else {
        anyhow::bail!(
            "validatingwebhookconfiguration {} does not exist",
            cfg.webhook_configuration
        );
    };
    let secrets: Api<Secret> = Api::namespaced(client.clone(), &cfg.namespace);
    let Some(secret) = secrets.get_opt(&cfg.secret).await? else {
        anyhow::bail!("secret {} is gone; making it again", cfg.secret);
    };
    let bundle = ByteString(Material::of(&secret).ca_bundle().as_bytes().to_vec());
    let mut changed = false;
    for w in config.webhooks.iter_mut().flatten() {
        if w.client_config.ca_bundle.as_ref() != Some(&bundle) {
            w.client_config.ca_bundle = Some(bundle.clone());
            changed = true;
        }
        if let (Some(policy), true) = (&cfg.failure_policy, ready)
            && w.failure_policy.as_ref() != Some(policy)
        {
            w.failure_policy = Some(policy.clone());
            changed = true;
        }
    }
    if changed {
        api.replace(&cfg.webhook_configuration, &PostParams::default(), &config)
            .await?;
        tracing::info!(configuration = %cfg.webhook_configuration, "webhook configuration updated (CA bundle, failure policy)");
    }
    Ok(())
}

#[cfg(test)]
mod tests;
