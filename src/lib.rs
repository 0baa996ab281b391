//! Cluster-wide IP address management for Kubernetes secondary networks.
//!
//! Data flows one way: binaries -> `cni` / `controller` / `webhook` -> `store` / `config` -> `ipam`.
//! `ipam` is pure (no I/O); `config` holds the one parser and validator shared by the CNI plugin,
//! the admission webhook and the offline `validate` command; `crd` holds the wire types only.

pub mod admin;
pub mod agent;
pub mod alloc;
pub mod cli;
pub mod cni;
pub mod config;
pub mod controller;
pub mod crd;
pub mod ipam;
pub mod kubeconfig;
pub mod metrics;
pub mod nad_check;
pub mod ownership;
pub mod retry;
pub mod store;
pub mod webhook;
