//! End-to-end tier: the real binaries against the real local control plane (e2e/cluster.sh).
//! Run with `make test` (or `cargo test --test e2e`); every test makes its own namespace.

mod agent;
mod arm64;
mod audit;
mod certs;
mod claim_records;
mod claims;
mod cni;
mod connection;
mod harness;
mod install;
mod keep;
mod metrics;
mod netns;
mod node_account;
mod node_entries;
mod node_limits;
mod operator;
mod relist;
mod slices;
mod status;
mod supply;
mod token;
mod trust;
mod webhook;
