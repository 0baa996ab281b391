//! The plugin process: reads the runtime's invocation, hands it to the node agent when one
//! listens at `agent_socket` (it keeps one API connection and allocates concurrent ADDs in
//! groups) or runs it here, and prints the reply or the CNI error on stdout. Logs go to stderr
//! and the configured `log_file`, never to stdout.

use std::io::Read;
use std::path::Path;
use std::process::ExitCode;
use std::time::Duration;

use serde_json::Value;

use super::commands::{ADD_DEADLINE, ROLLBACK_BUDGET, handle_within};
use super::handoff::{AgentReply, AgentRequest, client};
use super::invocation::{FlatSource, Invocation, Logging, Request, invalid_config};
use super::protocol::{CniError, Code, Command, UNAUTHENTICATED};
use super::reply::version_reply;
use super::slots;
use crate::alloc::Direct;
use crate::store::kubernetes::KubeStore;

/// The plugin's `main`.
pub fn run() -> ExitCode {
    let env = |k: &str| std::env::var(k).ok();
    let command = match Command::parse(&env("CNI_COMMAND").unwrap_or_default()) {
        Ok(c) => c,
        Err(e) => return fail(&e, ""),
    };
    if command == Command::Version {
        println!("{}", version_reply());
        return ExitCode::SUCCESS;
    }
    let mut stdin = String::new();
    if let Err(e) = std::io::stdin().read_to_string(&mut stdin) {
        let e = CniError::new(Code::IoFailure, format!("reading stdin: {e}"));
        return fail(&e, "");
    }
    let inv = Invocation::read(&env, &stdin, FlatSource::Lookup);
    init_logging(&inv.logging());
    match execute(command, &inv, &stdin) {
        Ok(output) => {
            if let Some(out) = output {
                println!("{out}");
            }
            ExitCode::SUCCESS
        }
        // A DEL whose credentials are still rejected after waiting for new ones (`run_here`)
        // cannot free anything, and never will: the token died with the DaemonSet's pod (an
        // uninstall left the files because pods still held addresses). Failing would leave the
        // pod Terminating for good; the address stays recorded, so nothing is handed out twice,
        // and the operator frees it once the pod is gone.
        Err(e) if command == Command::Del && e.details == UNAUTHENTICATED => {
            tracing::warn!(error = %e.msg, "DEL: credentials rejected; the entry stays for the operator");
            ExitCode::SUCCESS
        }
        Err(e) => fail(&e, inv.error_version()),
    }
}

/// Runs the command: by the node agent if the node has one that takes it, else here.
fn execute(command: Command, inv: &Invocation, stdin: &str) -> Result<Option<Value>, CniError> {
    // An unreadable flat file is reported first, once logging is set up from the config.
    let flat_file = inv.flat_file()?;
    let req = inv.load(command)?;
    if let Some(socket) = req.ipam.agent_socket.as_deref() {
        // As `env` above: a variable that is not UTF-8 counts as unset (`vars()` would panic).
        let vars = std::env::vars_os()
            .filter_map(|(k, v)| Some((k.into_string().ok()?, v.into_string().ok()?)));
        let mut request = AgentRequest::new(vars, stdin, flat_file);
        // The node's name as found here (the agent's own files may differ): slices are per node.
        if let Some(node) = &req.node {
            request.env.insert("NODENAME".into(), node.clone());
        }
        let wait = ADD_DEADLINE + ROLLBACK_BUDGET + Duration::from_secs(5);
        match client::call(Path::new(socket), &request, wait)? {
            Some(AgentReply::Done { output }) => return Ok(output),
            Some(AgentReply::Failed { code, msg, details }) => {
                return Err(CniError::new(Code::from_number(code), msg).with_details(details));
            }
            Some(AgentReply::Direct { reason }) => {
                tracing::debug!(%reason, "the node agent handed the request back");
            }
            None => {}
        }
    }
    // Here, the request talks to the API server itself: within the node's bound (`slots`),
    // held until the request is done (the kernel frees it too if the process is killed).
    let slot = match &req.ipam.plugin_slots {
        Some(bound) => slots::take_for(bound, command)?,
        None => None,
    };
    let spent = slot.as_ref().map_or(Duration::ZERO, |s| s.waited);
    if let Some(s) = &slot {
        tracing::debug!(
            slot = s.index,
            waited_ms = spent.as_millis() as u64,
            "took a plugin slot"
        );
    }
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("tokio runtime");
    let reply = runtime.block_on(run_here(&req, spent));
    // What its turns saw widens or narrows the node's bound for the requests behind it.
    if let Some(bound) = &req.ipam.plugin_slots {
        slots::note(bound, crate::alloc::neighbours::seen());
    }
    drop(slot);
    Ok(reply?.map(|r| r.to_value()))
}

/// Runs the request with the node's credentials. When the API server rejects them (401), the
/// token usually died with the DaemonSet's pod it is bound to: a rolling update of the DaemonSet
/// deletes that pod, and the new pod's installer writes the next token within seconds of
/// starting. So the request waits for the kubeconfig to change (at most [`token_wait`]) and runs
/// once more with it, rather than fail the sandbox into the runtime's back-off (up to 21 of 30
/// pods starting during a rolling update retried before). Past the wait the error stands: after
/// an uninstall no token comes again.
async fn run_here(req: &Request, spent: Duration) -> Result<Option<super::Reply>, CniError> {
    let path = kubeconfig_path(req)?;
    let before = std::fs::read(&path).ok();
    let started = std::time::Instant::now();
    let first = handle_within(&connect(&path).await?, &Direct, req, spent).await;
    match first {
        Err(e) if e.details == UNAUTHENTICATED => {
            if !renewed(&path, before.as_deref(), token_wait(req.command)).await {
                return Err(e);
            }
            tracing::info!(kubeconfig = %path.display(), "the node's token was renewed while the request waited: running it again");
            let spent = spent + started.elapsed();
            handle_within(&connect(&path).await?, &Direct, req, spent).await
        }
        other => other,
    }
}

/// How long a request whose credentials were rejected waits for new ones: half its patience for a
/// plugin slot (20 s for an ADD, 10 s for the others), well within its deadline.
fn token_wait(command: Command) -> Duration {
    slots::patience(command) / 2
}

/// Whether the file at `path` holds something other than `before` within `wait` (read every
/// 250 ms; the installer replaces it whole, by a rename).
async fn renewed(path: &Path, before: Option<&[u8]>, wait: Duration) -> bool {
    let until = tokio::time::Instant::now() + wait;
    loop {
        if std::fs::read(path).is_ok_and(|now| Some(now.as_slice()) != before) {
            return true;
        }
        if tokio::time::Instant::now() >= until {
            return false;
        }
        tokio::time::sleep(Duration::from_millis(250)).await;
    }
}

/// The plugin's own credentials: the kubeconfig the node's flat file names (or one a network
/// config names inside the node's directories, once the file has passed the trust checks). Never
/// the ambient ones (`KUBECONFIG`, `~/.kube/config`): on a control-plane node those are often
/// cluster-admin, and a config that forgot its kubeconfig must not borrow them.
fn kubeconfig_path(req: &Request) -> Result<std::path::PathBuf, CniError> {
    let Some(path) = req.ipam.kubeconfig.as_deref() else {
        return Err(CniError::new(
            Code::InvalidConfig,
            "no kubeconfig: the node's flat file (whereabouts.d/whereabouts.conf) must name one in kubernetes.kubeconfig; the plugin never uses ambient credentials",
        ));
    };
    let path = std::path::PathBuf::from(path);
    match &req.kubeconfig_check {
        Some(check) => check.check(&path).map_err(|p| invalid_config(&p)),
        None => Ok(path),
    }
}

/// A client of the API server with the kubeconfig at `path` (see [`kubeconfig_path`]).
async fn connect(path: &Path) -> Result<KubeStore, CniError> {
    let invalid = |what: String| CniError::new(Code::InvalidConfig, what);
    let unavailable = |what: String| CniError::new(Code::TryAgainLater, what);
    let (mut config, namespace) =
        crate::kubeconfig::load_node(path)
            .await
            .map_err(|e| match e {
                crate::kubeconfig::KubeconfigError::RunsCommand { .. } => invalid(e.to_string()),
                _ => unavailable(e.to_string()),
            })?;
    config.connect_timeout = Some(Duration::from_secs(10));
    config.read_timeout = Some(Duration::from_secs(30));
    crate::kubeconfig::identify(&mut config, "plugin");
    let client = kube::Client::try_from(config)
        .map_err(|e| unavailable(format!("kubernetes client: {e}")))?;
    Ok(KubeStore::new(client, &namespace))
}

/// Logging follows `log_file`/`log_level` of the (merged) config; before the config is known, and
/// when it is invalid, errors still reach stderr.
fn init_logging(settings: &Logging) {
    // The config's level applies to our own crate; libraries stay at warn (their debug output
    // would bury ours).
    let level = match settings.level.as_deref() {
        Some("debug") => "debug",
        Some("verbose") => "info",
        _ => "error",
    };
    let filter = tracing_subscriber::EnvFilter::new(format!("warn,whereabouts={level}"));
    let file = settings.file.as_ref().and_then(|path| {
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
    tracing::error!(code = e.code.number(), "{}", e.msg);
    println!("{}", e.to_json(version));
    ExitCode::FAILURE
}
