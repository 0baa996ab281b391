use super::*;
use rustls::client::WebPkiServerVerifier;
use rustls::client::danger::ServerCertVerifier;
use rustls_pki_types::pem::PemObject;
use rustls_pki_types::{CertificateDer, ServerName, UnixTime};
use std::sync::Arc;

fn names() -> Vec<String> {
    SelfManaged {
        namespace: "whereabouts-system".into(),
        secret: "s".into(),
        service: "whereabouts-webhook".into(),
        webhook_configuration: "c".into(),
        failure_policy: None,
        files: CertFiles::new("/x", "/y"),
    }
    .dns_names()
}

fn day(s: &str) -> Date {
    s.parse().unwrap()
}

/// Verifies the served certificate against the bundle, as the API server does, for `name`.
fn verifies(m: &Material, name: &str) -> Result<(), rustls::Error> {
    let mut roots = rustls::RootCertStore::empty();
    for ca in CertificateDer::pem_slice_iter(m.ca_bundle().as_bytes()) {
        roots.add(ca.unwrap()).unwrap();
    }
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let verifier = WebPkiServerVerifier::builder_with_provider(Arc::new(roots), provider)
        .build()
        .unwrap();
    let cert = CertificateDer::from_pem_slice(m.get("tls.crt").unwrap().as_bytes()).unwrap();
    verifier
        .verify_server_cert(
            &cert,
            &[],
            &ServerName::try_from(name.to_owned()).unwrap(),
            &[],
            UnixTime::now(),
        )
        .map(|_| ())
}

#[test]
fn a_new_secret_serves_the_service_names_under_its_ca() {
    let today = k8s_openapi::jiff::Zoned::now().date();
    assert_eq!(plan(None, today, &names()), Plan::Create);
    let m = apply(&Plan::Create, None, today, &names()).unwrap();
    for name in names() {
        verifies(&m, &name).unwrap_or_else(|e| panic!("{name}: {e}"));
    }
    assert!(verifies(&m, "other.example").is_err());
    // The pair loads as the webhook loads it.
    let files = CertFiles::new("/tls.crt", "/tls.key");
    files
        .server_config(
            m.get("tls.crt").unwrap().as_bytes(),
            m.get("tls.key").unwrap().as_bytes(),
        )
        .unwrap();
    assert_eq!(plan(Some(&m), today, &names()), Plan::Keep);
    // Another Service name: a new serving certificate, the same CA.
    let mut other = names();
    other[0] = "renamed".into();
    assert_eq!(plan(Some(&m), today, &other), Plan::Renew);
}

#[test]
fn renewal_keeps_the_ca_so_no_request_fails() {
    let start = k8s_openapi::jiff::Zoned::now().date();
    let m = apply(&Plan::Create, None, start, &names()).unwrap();
    let later = end_of(start, SERVING_DAYS - RENEW_BEFORE_DAYS);
    assert_eq!(plan(Some(&m), end_of(later, -1), &names()), Plan::Keep);
    assert_eq!(plan(Some(&m), later, &names()), Plan::Renew);
    let renewed = apply(&Plan::Renew, Some(&m), start, &names()).unwrap();
    assert_eq!(
        renewed.ca_bundle(),
        m.ca_bundle(),
        "the bundle the API server has stays valid"
    );
    assert_ne!(renewed.get("tls.key"), m.get("tls.key"));
    verifies(&renewed, "whereabouts-webhook.whereabouts-system.svc").unwrap();
}

#[test]
fn a_ca_near_its_end_joins_the_bundle_before_it_signs() {
    let start = k8s_openapi::jiff::Zoned::now().date();
    let m = apply(&Plan::Create, None, start, &names()).unwrap();
    let late = end_of(start, CA_DAYS - CA_RENEW_BEFORE_DAYS);
    assert_eq!(plan(Some(&m), late, &names()), Plan::RotateCa);
    let rotated = apply(&Plan::RotateCa, Some(&m), start, &names()).unwrap();
    assert!(
        rotated.ca_bundle().ends_with(m.ca_bundle()),
        "the old CA stays in the bundle"
    );
    assert_eq!(
        rotated.get("tls.crt"),
        m.get("tls.crt"),
        "the served pair stays"
    );
    verifies(&rotated, "whereabouts-webhook").unwrap();
    // The day it joined, it signs nothing; the next serving certificate is its.
    assert_eq!(plan(Some(&rotated), start, &names()), Plan::Keep);
    let renewed = apply(&Plan::Renew, Some(&rotated), start, &names()).unwrap();
    verifies(&renewed, "whereabouts-webhook").unwrap();
}

#[test]
fn broken_material_starts_over() {
    let today = day("2026-12-01");
    let mut m = apply(&Plan::Create, None, today, &names()).unwrap();
    m.data.remove("ca.key");
    assert_eq!(plan(Some(&m), today, &names()), Plan::Create);
    let mut m = apply(&Plan::Create, None, today, &names()).unwrap();
    m.annotations.remove(SERVING_NOT_AFTER);
    assert_eq!(plan(Some(&m), today, &names()), Plan::Renew);
    assert_eq!(
        plan(Some(&m), end_of(today, CA_DAYS + 1), &names()),
        Plan::Create
    );
}
