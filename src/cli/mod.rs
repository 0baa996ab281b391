//! The operator binary's subcommands, kept in the library so they are testable; the binary only
//! parses arguments and calls these.

pub mod agent;
pub mod audit;
pub mod install_cni;
pub mod run;
pub mod validate;
