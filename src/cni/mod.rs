//! The CNI plugin: the runtime's invocation read once ([`Invocation`]), validated into a
//! [`Request`], and run over a [`Datastore`](crate::store::Datastore) ([`handle`]), by this process or
//! handed to the node agent ([`handoff`]). [`run`] is the plugin binary's `main`.
//!
//! | file | concern |
//! |------|---------|
//! | [`protocol`] | the CNI boundary: commands, CNI_ARGS, error codes and the error object |
//! | [`invocation`] | environment, stdin and flat file read once; validation into a `Request` |
//! | [`commands`] | ADD, DEL, CHECK, GC, STATUS over the allocation engine, within deadlines |
//! | [`gc`] | CNI GC: this node's entries that the runtime no longer lists and whose pods are gone |
//! | [`reply`] | the typed results, in the shape of the config's `cniVersion` |
//! | [`slices`] | node slices on the node: its slices of a range, taking a free one, its name |
//! | [`requested`] | requested addresses (`ips`): read, checked, one per range |
//! | [`keep`] | addresses that stay: the attachment's holder, an IPAMClaim's status |
//! | [`slots`] | the node's bound on plugin processes that talk to the API server at once |
//! | [`handoff`] | what the plugin and the node agent say over the agent's socket |
//! | [`plugin`] | the process: logging, hand-off or local run, stdout |

pub mod commands;
pub mod gc;
pub mod handoff;
pub mod invocation;
pub mod keep;
pub mod plugin;
pub mod protocol;
pub mod reply;
pub mod requested;
pub mod slices;
pub mod slots;

pub use commands::{
    ADD_DEADLINE, OTHER_DEADLINE, ROLLBACK_BUDGET, handle, handle_with, handle_within,
};
pub use invocation::{FlatSource, Invocation, Logging, Request, target};
pub use plugin::run;
pub use reply::Reply;
