//! The operator binary: cluster-side services and command-line tools.

use std::path::PathBuf;

use clap::{Parser, Subcommand};

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
}

fn main() -> anyhow::Result<()> {
    match Cli::parse().command {
        Cmd::Crds { dir } => crds(dir),
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
