//! The operator binary's subcommands, kept in the library so they are testable; the binary only
//! parses arguments and calls these.

pub mod agent;
pub mod audit;
pub mod install_cni;
pub mod run;
pub mod validate;

use kube::Api;
use kube::api::{ListParams, ObjectList};

/// Every object of a kind, page by page.
pub(crate) async fn list_all<K>(api: &Api<K>) -> kube::Result<Vec<K>>
where
    K: kube::Resource + Clone + serde::de::DeserializeOwned + std::fmt::Debug,
{
    let mut out = Vec::new();
    let mut params = ListParams::default().limit(500);
    loop {
        let page: ObjectList<K> = api.list(&params).await?;
        out.extend(page.items);
        match page.metadata.continue_.filter(|c| !c.is_empty()) {
            Some(token) => params = params.continue_token(&token),
            None => return Ok(out),
        }
    }
}
