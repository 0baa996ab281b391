//! The operator binary: cluster-side services and command-line tools.

use std::path::PathBuf;
use std::process::ExitCode;

use clap::{Parser, Subcommand};
use whereabouts::cli::agent::AgentArgs;
use whereabouts::cli::audit::{AuditArgs, RepairArgs};
use whereabouts::cli::install_cni::InstallCniArgs;
use whereabouts::cli::run::RunArgs;
use whereabouts::cli::validate::ValidateArgs;

#[derive(Parser)]
#[command(
    name = "whereabouts-operator",
    version,
    about = "Cluster-side companion of the whereabouts IPAM plugin"
)]
struct Cli {
    #[command(subcommand)]
    command: Cmd,
}

#[derive(Subcommand)]
enum Cmd {
    /// Print the CustomResourceDefinitions (multi-document YAML), or write one file each to --dir.
    Crds {
        #[arg(long)]
        dir: Option<PathBuf>,
    },
    /// Run the operator: pod cleanup, pool audit, NAD/pool reconciliation, the admission webhook (when a certificate is given) and the admin port.
    Run(RunArgs),
    /// Check NetworkAttachmentDefinitions in files or in the cluster, as the webhook would.
    /// Exit status: 0 all valid, 1 some invalid, 2 usage or read error.
    Validate(ValidateArgs),
    /// Report every inconsistency of the pools, reservations and NADs, with its evidence
    /// (read-only). Exit status: 0 nothing found, 1 findings, 2 the cluster could not be read.
    Audit(AuditArgs),
    /// Apply the fixes of a saved `audit --output json` report; what changed since is skipped.
    Repair(RepairArgs),
    /// Install the CNI plugin, its flat file and kubeconfig on this node (run by the DaemonSet),
    /// and keep the kubeconfig current as the ServiceAccount token rotates.
    InstallCni(InstallCniArgs),
    /// Run the node agent (a container of the node DaemonSet): serves the node's CNI plugin
    /// calls over a Unix socket with one API connection, allocating concurrent ADDs in groups.
    Agent(AgentArgs),
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info")),
        )
        .with_writer(std::io::stderr)
        // Colour only on a terminal: container logs and files get plain text.
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
        .init();
    let _ = rustls::crypto::ring::default_provider().install_default();
    match cli.command {
        Cmd::Crds { dir } => exit(crds(dir)),
        Cmd::Run(args) => {
            exit(runtime().and_then(|rt| rt.block_on(whereabouts::cli::run::run(args))))
        }
        Cmd::InstallCni(args) => {
            exit(runtime().and_then(|rt| rt.block_on(whereabouts::cli::install_cni::run(args))))
        }
        Cmd::Agent(args) => {
            exit(runtime().and_then(|rt| rt.block_on(whereabouts::cli::agent::run(args))))
        }
        Cmd::Audit(args) => match runtime() {
            Ok(rt) => ExitCode::from(rt.block_on(whereabouts::cli::audit::run_audit(args))),
            Err(e) => exit(Err(e)),
        },
        Cmd::Repair(args) => match runtime() {
            Ok(rt) => ExitCode::from(rt.block_on(whereabouts::cli::audit::run_repair(args))),
            Err(e) => exit(Err(e)),
        },
        Cmd::Validate(args) => match runtime() {
            Ok(rt) => ExitCode::from(rt.block_on(whereabouts::cli::validate::validate(args))),
            Err(e) => exit(Err(e)),
        },
    }
}

fn runtime() -> anyhow::Result<tokio::runtime::Runtime> {
    Ok(tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()?)
}

fn exit(result: anyhow::Result<()>) -> ExitCode {
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("whereabouts-operator: {e:#}");
            ExitCode::FAILURE
        }
    }
}

fn crds(dir: Option<PathBuf>) -> anyhow::Result<()> {
    for (file, crd) in whereabouts::crd::all() {
        let text = whereabouts::crd::to_yaml(&crd);
        match &dir {
            Some(dir) => std::fs::write(dir.join(file), text)?,
            None => print!("---\n{text}"),
        }
    }
    Ok(())
}
