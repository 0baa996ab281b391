//! The CNI IPAM plugin binary (`"ipam": {"type": "whereabouts"}`).
//!
//! Reads the CNI environment and the network config on stdin, runs one command against the
//! Kubernetes datastore, prints the result or a CNI error on stdout. Logs go to stderr and the
//! configured `log_file`, never to stdout.
//!
//! When the node agent listens at `agent_socket`, the validated request is handed to it (it keeps
//! one API connection and allocates concurrent ADDs in groups); otherwise the plugin runs it.

use std::io::Read;
use std::path::Path;
use std::process::ExitCode;
use std::time::Duration;

use serde_json::Value;
use whereabouts::agent::client;
use whereabouts::agent::protocol::{AgentReply, AgentRequest};
use whereabouts::cni::protocol::{CniError, Command, code};
use whereabouts::cni::{self, FlatSource, Invocation, Request};
use whereabouts::store::kube::KubeStore;

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
    let lookup = Invocation {
        env: &env,
        stdin: &stdin,
        flat_file: FlatSource::Lookup,
    };
    // The flat file is read once: for the logging settings, the config, and the agent.
    let flat_file = cni::find_flat_file(&lookup);
    let inv = Invocation {
        // An unreadable flat file is reported below, once logging is set up from the config.
        flat_file: FlatSource::Found(flat_file.clone().unwrap_or_default()),
        ..lookup
    };
    init_logging(&inv);
    let flat_file = match flat_file {
        Ok(f) => f,
        Err(e) => return fail(&e, &version),
    };
    let req = match cni::load(command, &inv) {
        Ok(r) => r,
        Err(e) => return fail(&e, &version),
    };
    if let Some(socket) = req.ipam.agent_socket.as_deref() {
        // As `env` above: a variable that is not UTF-8 counts as unset (`vars()` would panic).
        let vars = std::env::vars_os()
            .filter_map(|(k, v)| Some((k.into_string().ok()?, v.into_string().ok()?)));
        let request = AgentRequest::new(vars, &stdin, flat_file);
        let wait = cni::ADD_DEADLINE + cni::ROLLBACK_BUDGET + Duration::from_secs(5);
        match client::call(Path::new(socket), &request, wait) {
            Ok(Some(AgentReply::Done { output })) => return print(output),
            Ok(Some(AgentReply::Failed { code, msg, details })) => {
                return fail(&CniError::new(code, msg).with_details(details), &version);
            }
            Ok(Some(AgentReply::Direct { reason })) => {
                tracing::debug!(%reason, "the node agent handed the request back");
            }
            Ok(None) => {}
            Err(e) => return fail(&e, &version),
        }
    }
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("tokio runtime");
    match runtime.block_on(run(&req)) {
        Ok(output) => print(output),
        Err(e) => fail(&e, &version),
    }
}

fn print(output: Option<Value>) -> ExitCode {
    if let Some(out) = output {
        println!("{out}");
    }
    ExitCode::SUCCESS
}

async fn run(req: &Request) -> Result<Option<Value>, CniError> {
    let store = connect(req.ipam.kubeconfig.as_deref()).await?;
    cni::handle_within(&store, &whereabouts::alloc::Direct, req).await
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
