//! The CNI IPAM plugin binary (`"ipam": {"type": "whereabouts"}`).
//!
//! Reads the CNI environment and the network config on stdin, runs one command against the
//! Kubernetes datastore, prints the result or a CNI error on stdout. Logs go to stderr and the
//! configured `log_file`, never to stdout.

use std::io::Read;
use std::process::ExitCode;
use std::time::Duration;

use serde_json::Value;
use whereabouts::cni::protocol::{CniError, Command, code};
use whereabouts::cni::{self, Invocation, Request};
use whereabouts::store::kube::KubeStore;

/// Overall deadlines, as upstream: the kubelet allows a sandbox four minutes.
const ADD_DEADLINE: Duration = Duration::from_secs(110);
/// After an ADD runs out of time, what it took is released within this budget (the total stays
/// within upstream's two minutes), so a timed-out ADD leaves no claim behind.
const ROLLBACK_BUDGET: Duration = Duration::from_secs(10);
const OTHER_DEADLINE: Duration = Duration::from_secs(60);

fn main() -> ExitCode {
    let env = |k: &str| std::env::var(k).ok();
    let command = match Command::parse(&env("CNI_COMMAND").unwrap_or_default()) {
        Ok(c) => c,
        Err(e) => return fail(&e, ""),
    };
    if command == Command::Version {
        println!("{}", cni::protocol::version_reply());
        return ExitCode::SUCCESS;
    }
    let mut stdin = String::new();
    if let Err(e) = std::io::stdin().read_to_string(&mut stdin) {
        return fail(
            &CniError::new(code::IO_FAILURE, format!("reading stdin: {e}")),
            "",
        );
    }
    let version = serde_json::from_str::<Value>(&stdin)
        .ok()
        .and_then(|v| v.get("cniVersion")?.as_str().map(str::to_owned))
        .unwrap_or_default();
    let inv = Invocation {
        env: &env,
        stdin: &stdin,
        flat_file_paths: None,
    };
    init_logging(&inv);
    let req = match cni::load(command, &inv) {
        Ok(r) => r,
        Err(e) => return fail(&e, &version),
    };
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("tokio runtime");
    match runtime.block_on(run(&req)) {
        Ok(Some(out)) => {
            println!("{out}");
            ExitCode::SUCCESS
        }
        Ok(None) => ExitCode::SUCCESS,
        Err(e) => fail(&e, &version),
    }
}

async fn run(req: &Request) -> Result<Option<Value>, CniError> {
    let store = connect(req.ipam.kubeconfig.as_deref()).await?;
    let deadline = if req.command == Command::Add {
        ADD_DEADLINE
    } else {
        OTHER_DEADLINE
    };
    match tokio::time::timeout(deadline, cni::handle(&store, req)).await {
        Ok(result) => result,
        Err(_) => {
            if req.command == Command::Add {
                // The ADD was cut off mid-way, before its own all-or-nothing rollback: release
                // whatever this attachment holds, as a DEL would.
                let del = Request {
                    command: Command::Del,
                    ..req.clone()
                };
                if let Err(e) | Ok(Err(e)) =
                    tokio::time::timeout(ROLLBACK_BUDGET, cni::handle(&store, &del))
                        .await
                        .map_err(|_| CniError::new(code::TRY_AGAIN_LATER, "rollback timed out"))
                {
                    tracing::error!(error = %e.msg, "could not roll back a timed-out ADD; the operator's audit will release it");
                }
            }
            Err(CniError::new(
                code::TRY_AGAIN_LATER,
                format!(
                    "{:?} did not finish within {}s",
                    req.command,
                    deadline.as_secs()
                ),
            ))
        }
    }
}

async fn connect(kubeconfig: Option<&str>) -> Result<KubeStore, CniError> {
    let unavailable = |what: String| CniError::new(code::TRY_AGAIN_LATER, what);
    let (mut config, namespace) = whereabouts::kubeconfig::load(kubeconfig)
        .await
        .map_err(|e| unavailable(e.to_string()))?;
    config.connect_timeout = Some(Duration::from_secs(10));
    config.read_timeout = Some(Duration::from_secs(30));
    let client = kube::Client::try_from(config)
        .map_err(|e| unavailable(format!("kubernetes client: {e}")))?;
    Ok(KubeStore::new(client, &namespace))
}

/// Logging follows `log_file`/`log_level` of the (merged) config; before the config is known, and
/// when it is invalid, errors still reach stderr.
fn init_logging(inv: &Invocation<'_>) {
    let ipam = cni::logging_settings(inv);
    // The config's level applies to our own crate; libraries stay at warn (their debug output
    // would bury ours).
    let level = match ipam.1.as_deref() {
        Some("debug") => "debug",
        Some("verbose") => "info",
        _ => "error",
    };
    let filter = tracing_subscriber::EnvFilter::new(format!("warn,whereabouts={level}"));
    let file = ipam.0.and_then(|path| {
        std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(path)
            .ok()
    });
    let builder = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_ansi(false)
        .with_target(false);
    match file {
        Some(f) => {
            use tracing_subscriber::fmt::writer::MakeWriterExt;
            builder
                .with_writer(std::io::stderr.and(std::sync::Mutex::new(f)))
                .init();
        }
        None => builder.with_writer(std::io::stderr).init(),
    }
}

fn fail(e: &CniError, version: &str) -> ExitCode {
    tracing::error!(code = e.code, "{}", e.msg);
    println!("{}", e.to_json(version));
    ExitCode::FAILURE
}
