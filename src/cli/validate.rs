//! `whereabouts-operator validate FILE... | - | --cluster`: the webhook's checks, offline.
//!
//! Exit status: 0 when every NAD is valid (warnings allowed), 1 when any is invalid, 2 on usage or
//! read errors. Text output is one line per problem; `--output json` prints one JSON document.

use std::io::Read as _;
use std::path::PathBuf;

use kube::{Api, Client};
use serde_json::json;

use crate::crd::NetworkAttachmentDefinition;
use crate::nad_check::{CheckedNad, Severity, check_object, check_text, findings};

pub const EXIT_VALID: u8 = 0;
pub const EXIT_INVALID: u8 = 1;
pub const EXIT_USAGE: u8 = 2;

#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum Output {
    Text,
    Json,
}

#[derive(Debug, Clone, clap::Args)]
pub struct ValidateArgs {
    /// YAML (multi-document) or JSON files; `-` reads standard input. Non-NAD documents are skipped.
    #[arg(value_name = "FILE")]
    pub files: Vec<PathBuf>,
    /// Validate every NetworkAttachmentDefinition in the cluster of the current kubeconfig.
    #[arg(long)]
    pub cluster: bool,
    #[arg(long, short, value_enum, default_value = "text")]
    pub output: Output,
}

/// Runs the command and returns the exit status.
pub async fn validate(args: ValidateArgs) -> u8 {
    if args.files.is_empty() && !args.cluster {
        eprintln!("validate: give one or more FILEs, `-` for standard input, or --cluster");
        return EXIT_USAGE;
    }
    let mut nads = Vec::new();
    let mut read_failed = false;
    for path in &args.files {
        match read(path) {
            Ok((name, text)) => match check_text(&name, &text) {
                Ok(found) => nads.extend(found),
                Err(e) => {
                    eprintln!("validate: {e}");
                    read_failed = true;
                }
            },
            Err(e) => {
                eprintln!("validate: {e}");
                read_failed = true;
            }
        }
    }
    if args.cluster {
        match cluster_nads().await {
            Ok(found) => nads.extend(found),
            Err(e) => {
                eprintln!("validate --cluster: {e:#}");
                read_failed = true;
            }
        }
    }
    let code = report(&nads, args.output);
    if read_failed { EXIT_USAGE } else { code }
}

fn read(path: &PathBuf) -> Result<(String, String), String> {
    if path.as_os_str() == "-" {
        let mut text = String::new();
        std::io::stdin()
            .read_to_string(&mut text)
            .map_err(|e| format!("standard input: {e}"))?;
        return Ok(("-".to_owned(), text));
    }
    let name = path.display().to_string();
    std::fs::read_to_string(path)
        .map(|text| (name.clone(), text))
        .map_err(|e| format!("{name}: {e}"))
}

async fn cluster_nads() -> anyhow::Result<Vec<CheckedNad>> {
    let (config, _) = crate::kubeconfig::load(None).await?;
    let client = Client::try_from(config)?;
    let api: Api<NetworkAttachmentDefinition> = Api::all(client);
    let mut out = Vec::new();
    for nad in super::list_all(&api).await? {
        if let Some(c) = check_object("cluster", out.len() + 1, &serde_json::to_value(&nad)?) {
            out.push(c);
        }
    }
    Ok(out)
}

/// Prints the findings and returns 0 or 1.
pub fn report(nads: &[CheckedNad], output: Output) -> u8 {
    let all = findings(nads);
    let invalid = nads.iter().filter(|n| !n.check.is_valid()).count();
    match output {
        Output::Text => {
            use std::io::Write as _;
            let mut out = std::io::BufWriter::new(std::io::stdout().lock());
            for f in &all {
                let _ = writeln!(out, "{f}");
            }
            let _ = out.flush();
            eprintln!(
                "{} NetworkAttachmentDefinition(s) checked: {invalid} invalid, {} warning(s)",
                nads.len(),
                all.iter()
                    .filter(|f| f.severity == Severity::Warning)
                    .count()
            );
        }
        Output::Json => {
            let doc = json!({"checked": nads.len(), "invalid": invalid, "findings": all});
            println!("{doc}");
        }
    }
    if invalid == 0 {
        EXIT_VALID
    } else {
        EXIT_INVALID
    }
}
