//! The node agent (`whereabouts-operator agent`, a container of the node DaemonSet).
//!
//! A CNI plugin is a process per pod interface: each ADD would open its own TLS connection to the
//! API server and make its own pool read, claims list and pool write. The agent keeps one
//! connection for the node and allocates the node's concurrent ADDs of a pool as one group (one
//! read, one claims list, one write; [`crate::alloc::group`]). The plugin hands its request to the
//! agent over a Unix socket when one listens at `agent_socket`, and runs it itself otherwise (no
//! agent deployed, agent restarting, another kubeconfig, caller not root), so the agent is never
//! needed for correctness, only for speed. What it must not do is hand back a request that could
//! overtake its own unfinished work for the same container ([`attachments`]).

pub mod attachments;
pub mod batch;
pub mod health;
pub mod server;

pub use server::{Agent, bind, unbind};
