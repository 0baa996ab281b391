//! The agent's socket: accepts the plugin's connections, checks who is calling, runs each
//! request with the agent's one API connection and group allocator, answers.

use std::io;
use std::os::unix::fs::{MetadataExt as _, PermissionsExt as _};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};
use tokio::net::{UnixListener, UnixStream};
use tokio::sync::Semaphore;

use super::attachments::Attachments;
use super::batch::{Batcher, Limits};
use crate::cni::handoff::{AgentReply, AgentRequest, MAX_REQUEST_BYTES};
use crate::cni::protocol::{CniError, Code, Command};
use crate::cni::{self, FlatSource, Invocation};
use crate::metrics::agent::AgentMetrics;
use crate::store::Datastore;

/// A plugin writes its request at once; one that does not within this time is dropped.
const READ_TIMEOUT: Duration = Duration::from_secs(10);
/// Connections served at once (requests being read, queued, in a group, or run directly);
/// beyond that the plugin is told to run its request itself. The queues hold at most half of
/// this ([`super::batch::MAX_QUEUED`]).
pub const MAX_IN_FLIGHT: usize = 2048;

/// Why a request was handed back to the plugin: the `reason` label of
/// `whereabouts_agent_handbacks_total`, a fixed set.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum HandBack {
    /// The request's pool queue holds [`super::batch::MAX_POOL_QUEUE`] requests.
    PoolQueueFull,
    /// All queues together hold [`super::batch::MAX_QUEUED`] requests.
    TotalQueueFull,
    /// [`MAX_IN_FLIGHT`] connections are being served.
    Busy,
    /// The config names another `kubernetes.kubeconfig` than the one this agent serves.
    OtherKubeconfig,
    /// The caller is neither root nor the agent's own user.
    CallerNotServed,
    /// A request this agent cannot read (a plugin of another version).
    UnreadableRequest,
    /// The agent is draining after SIGTERM.
    ShuttingDown,
}

impl HandBack {
    pub const ALL: [HandBack; 7] = [
        HandBack::PoolQueueFull,
        HandBack::TotalQueueFull,
        HandBack::Busy,
        HandBack::OtherKubeconfig,
        HandBack::CallerNotServed,
        HandBack::UnreadableRequest,
        HandBack::ShuttingDown,
    ];

    pub fn label(self) -> &'static str {
        match self {
            HandBack::PoolQueueFull => "pool_queue_full",
            HandBack::TotalQueueFull => "total_queue_full",
            HandBack::Busy => "busy",
            HandBack::OtherKubeconfig => "other_kubeconfig",
            HandBack::CallerNotServed => "caller_not_served",
            HandBack::UnreadableRequest => "unreadable_request",
            HandBack::ShuttingDown => "shutting_down",
        }
    }
}

pub struct Agent<S> {
    store: Arc<S>,
    batcher: Batcher<S>,
    /// The plugin kubeconfig (`kubernetes.kubeconfig`) whose requests this agent runs: the one
    /// that names the same cluster, credentials and pool namespace as the agent's own client.
    serves_kubeconfig: String,
    /// Callers other than root and this agent's own user run their requests themselves.
    own_uid: u32,
    in_flight: Arc<Semaphore>,
    /// Containers with ADD or DEL work here: never handed back while it runs.
    attachments: Attachments,
    /// Set once shutdown began: new requests are handed back ([`Agent::serve`]).
    draining: AtomicBool,
    metrics: Arc<AgentMetrics>,
}

impl<S: Datastore + 'static> Agent<S> {
    /// An agent counting into `metrics` (the agent's registry, see `cli::agent`).
    pub fn new(
        store: S,
        serves_kubeconfig: String,
        own_uid: u32,
        metrics: Arc<AgentMetrics>,
    ) -> Self {
        Self::with_limits(
            store,
            serves_kubeconfig,
            own_uid,
            Limits::default(),
            metrics,
        )
    }

    /// [`Agent::new`] with other queue bounds (tests fill small ones).
    pub fn with_limits(
        store: S,
        serves_kubeconfig: String,
        own_uid: u32,
        limits: Limits,
        metrics: Arc<AgentMetrics>,
    ) -> Self {
        for why in HandBack::ALL {
            metrics.declare_handback(why.label());
        }
        let store = Arc::new(store);
        Agent {
            batcher: Batcher::with_limits(store.clone(), limits, metrics.clone()),
            store,
            serves_kubeconfig,
            own_uid,
            in_flight: Arc::new(Semaphore::new(MAX_IN_FLIGHT)),
            attachments: Attachments::default(),
            draining: AtomicBool::new(false),
            metrics,
        }
    }

    /// The metrics this agent counts into.
    pub fn metrics(&self) -> &AgentMetrics {
        &self.metrics
    }

    /// The answer that makes the plugin run its request itself, counted by reason.
    fn hand_back(&self, why: HandBack, reason: String) -> AgentReply {
        self.metrics.record_handback(why.label());
        AgentReply::Direct { reason }
    }

    /// [`Agent::hand_back`], unless earlier work of `container` is still here: run in the
    /// plugin, the request could overtake it (see [`super::attachments`]), so it is answered
    /// "try again later", and the runtime's retry finds the agent done or queues behind it.
    fn hand_back_or_hold(&self, container: &str, why: HandBack, reason: String) -> AgentReply {
        if !self.attachments.busy(container) {
            return self.hand_back(why, reason);
        }
        self.metrics.held_back.inc();
        tracing::info!(%container, %reason, "not handed back: earlier work of its container is still here");
        CniError::new(
            Code::TryAgainLater,
            format!(
                "the node agent still works on an earlier request of container {container}, \
                 and cannot take this one now ({reason}); try again later"
            ),
        )
        .into()
    }

    /// Containers with ADD or DEL work in this agent.
    pub fn attachments(&self) -> &Attachments {
        &self.attachments
    }

    /// The allocator, for its queue depths (`whereabouts_agent_queue_depth`).
    pub fn batcher(&self) -> &Batcher<S> {
        &self.batcher
    }

    /// Serves connections until `shutdown` resolves, then drains for up to `grace`: every new
    /// request is handed back, except one of a container whose earlier work is still here
    /// (code 11, [`super::attachments`]), until that work and the requests in flight are done.
    /// The caller removes the socket after that, not before: with no socket, a retry would run
    /// in the plugin beside the work still here.
    pub async fn serve(
        self: Arc<Self>,
        listener: UnixListener,
        shutdown: impl Future<Output = ()>,
        grace: Duration,
    ) {
        self.accept_until(&listener, shutdown).await;
        self.draining.store(true, Ordering::SeqCst);
        let drained = async {
            while !self.drained() {
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
        };
        if tokio::time::timeout(grace, self.accept_until(&listener, drained))
            .await
            .is_err()
        {
            tracing::warn!(
                containers = self.attachments.len(),
                "work still in flight at shutdown; its plugins will report a retryable error"
            );
        }
    }

    /// Accepts connections, each served on a task of its own, until `until` resolves.
    async fn accept_until(
        self: &Arc<Self>,
        listener: &UnixListener,
        until: impl Future<Output = ()>,
    ) {
        tokio::pin!(until);
        loop {
            tokio::select! {
                _ = &mut until => return,
                accepted = listener.accept() => match accepted {
                    Ok((stream, _)) => {
                        let agent = self.clone();
                        tokio::spawn(async move { agent.connection(stream).await });
                    }
                    Err(e) => {
                        tracing::warn!(error = %e, "accept failed");
                        tokio::time::sleep(Duration::from_millis(50)).await;
                    }
                },
            }
        }
    }

    /// Whether nothing is at work: no request being served, no queued or grouped work (the
    /// work of requesters that gave up included).
    fn drained(&self) -> bool {
        self.in_flight.available_permits() == MAX_IN_FLIGHT && self.attachments.is_empty()
    }

    async fn connection(&self, mut stream: UnixStream) {
        // The request is read before any answer, even one that does not run it: closing a socket
        // with unread data resets it, and the caller would lose the answer.
        let request = read_request(&mut stream).await;
        let started = Instant::now();
        let command = request.as_ref().map_or("unknown", command_label);
        // Owned: the request itself moves on to run.
        let container = request.as_ref().map_or("", container_of).to_owned();
        let reply = match self.in_flight.clone().try_acquire_owned() {
            Ok(_permit) if self.draining.load(Ordering::SeqCst) => self.hand_back_or_hold(
                &container,
                HandBack::ShuttingDown,
                "the node agent is shutting down".into(),
            ),
            Ok(_permit) => match (self.caller(&stream), request) {
                (Some(direct), _) => direct,
                (None, Ok(request)) => self.run(request).await,
                // Not all of it arrived in time (a plugin starved of CPU in a storm): whose it
                // is cannot be told, so it may have work here, and it must not run in the plugin.
                (None, Err(e)) if e.code == Code::IoFailure => {
                    CniError::new(Code::TryAgainLater, format!("{}; try again later", e.msg)).into()
                }
                (None, Err(e)) => {
                    self.metrics
                        .record_handback(HandBack::UnreadableRequest.label());
                    unreadable(&e)
                }
            },
            Err(_) => self.hand_back_or_hold(
                &container,
                HandBack::Busy,
                format!("agent busy: {MAX_IN_FLIGHT} requests in flight"),
            ),
        };
        let result = match reply {
            AgentReply::Done { .. } => "ok",
            AgentReply::Failed { .. } => "error",
            AgentReply::Direct { .. } => "handback",
        };
        self.metrics
            .record_request(command, result, started.elapsed());
        let mut text = serde_json::to_vec(&reply).expect("replies serialize");
        text.push(b'\n');
        if let Err(e) = stream.write_all(&text).await {
            tracing::warn!(error = %e, "could not answer the plugin");
        }
        let _ = stream.shutdown().await;
    }

    /// `Some(answer)` for a caller this agent does not serve: only root (the container runtime)
    /// and the agent's own user may have requests run with the agent's credentials.
    fn caller(&self, stream: &UnixStream) -> Option<AgentReply> {
        match stream.peer_cred() {
            Ok(cred) if cred.uid() == 0 || cred.uid() == self.own_uid => None,
            Ok(cred) => Some(self.hand_back(
                HandBack::CallerNotServed,
                format!("the agent serves root only, not uid {}", cred.uid()),
            )),
            Err(e) => {
                Some(self.hand_back(HandBack::CallerNotServed, format!("peer credentials: {e}")))
            }
        }
    }

    /// Validates and runs one request, exactly as the plugin would.
    pub async fn run(&self, request: AgentRequest) -> AgentReply {
        let started = Instant::now();
        let req = match load(request) {
            Ok(req) => req,
            Err(reply) => return reply,
        };
        let kubeconfig = req.ipam.kubeconfig.as_deref().unwrap_or_default();
        if kubeconfig != self.serves_kubeconfig {
            return self.hand_back(
                HandBack::OtherKubeconfig,
                format!(
                    "kubernetes.kubeconfig {kubeconfig:?} is not the one this agent serves ({:?})",
                    self.serves_kubeconfig
                ),
            );
        }
        // ADD and DEL wait in their pools' queues: admitted to all of them now, or handed back
        // whole before anything ran. CHECK, GC and STATUS read the store directly.
        let queued = matches!(req.command, Command::Add | Command::Del);
        let pools = req.ipam.ranges.iter().filter(|_| queued);
        let ticket = match self.batcher.admit(pools.map(|r| r.pool_name.as_str())) {
            Ok(ticket) => ticket,
            Err(full) => {
                let why = match full {
                    super::batch::QueueFull::Pool { .. } => HandBack::PoolQueueFull,
                    super::batch::QueueFull::Total { .. } => HandBack::TotalQueueFull,
                };
                let container = &req.attachment.container_id;
                return self.hand_back_or_hold(container, why, full.to_string());
            }
        };
        // Marked while this request runs (its rollback included), and by the worker while its
        // work is in a group (orphan releases included).
        let container = &req.attachment.container_id;
        let _mark = self.attachments.hold(container);
        let alloc = self
            .batcher
            .admitted(ticket, self.attachments.marker(container));
        let result = cni::handle_within(&*self.store, &alloc, &req, Duration::ZERO).await;
        tracing::info!(
            command = ?req.command,
            pod = %req.attachment.podref,
            container = %req.attachment.container_id,
            error = result.as_ref().err().map(|e| e.code.number()),
            ms = started.elapsed().as_millis() as u64,
            "served"
        );
        match result {
            Ok(output) => AgentReply::Done {
                output: output.map(|r| r.to_value()),
            },
            Err(e) => e.into(),
        }
    }
}

/// The container a request is for, as the runtime named it (`CNI_CONTAINERID`), before the
/// request is validated.
fn container_of(request: &AgentRequest) -> &str {
    request
        .env
        .get("CNI_CONTAINERID")
        .map_or("", String::as_str)
}

/// The `command` label of a request: its `CNI_COMMAND`, from a fixed set.
fn command_label(request: &AgentRequest) -> &'static str {
    let text = request.env.get("CNI_COMMAND").map_or("", String::as_str);
    match Command::parse(text) {
        Ok(Command::Add) => "add",
        Ok(Command::Del) => "del",
        Ok(Command::Check) => "check",
        Ok(Command::Gc) => "gc",
        Ok(Command::Status) => "status",
        Ok(Command::Version) => "version",
        Err(_) => "unknown",
    }
}

/// The answer to a request this agent cannot read. The plugin only sends what it built itself:
/// such a request comes from another version of the plugin (an upgrade in progress), which then
/// runs it itself.
fn unreadable(e: &CniError) -> AgentReply {
    AgentReply::Direct {
        reason: format!("the agent cannot read the request: {}", e.msg),
    }
}

/// What the agent makes of the bytes a plugin sent, before it runs anything: exactly what a
/// connection from a served caller does with them ([`decode`], then [`load`]). `Err` is the reply
/// the plugin gets. Public for the fuzz targets (`fuzz/`), which feed it arbitrary bytes.
pub fn parse_request(bytes: &[u8]) -> Result<cni::Request, AgentReply> {
    load(decode(bytes).map_err(|e| unreadable(&e))?)
}

/// Validates a request as the plugin does; VERSION is answered at once.
fn load(request: AgentRequest) -> Result<cni::Request, AgentReply> {
    let env = |k: &str| request.env.get(k).cloned();
    let command = Command::parse(&env("CNI_COMMAND").unwrap_or_default())?;
    if command == Command::Version {
        return Err(AgentReply::Done {
            output: Some(cni::protocol::version_reply().to_value()),
        });
    }
    let flat_file = request.flat_file.map(|f| (f.path, f.conf));
    let inv = Invocation::read(&env, &request.stdin, FlatSource::Found(flat_file));
    Ok(inv.load(command)?)
}

/// Reads one request: the whole stream up to the plugin's shutdown, bounded in size and time.
async fn read_request(stream: &mut UnixStream) -> Result<AgentRequest, CniError> {
    let mut buf = Vec::new();
    let limit = MAX_REQUEST_BYTES as u64 + 1;
    let read = async {
        stream.take(limit).read_to_end(&mut buf).await?;
        if buf.len() > MAX_REQUEST_BYTES {
            // Drain (bounded) what else was sent, so that the answer is not lost to a reset.
            tokio::io::copy(&mut stream.take(16 * limit), &mut tokio::io::sink()).await?;
        }
        Ok::<_, io::Error>(())
    };
    match tokio::time::timeout(READ_TIMEOUT, read).await {
        Ok(Ok(())) => {}
        Ok(Err(e)) => return Err(CniError::new(Code::IoFailure, format!("agent read: {e}"))),
        Err(_) => {
            return Err(CniError::new(
                Code::IoFailure,
                format!("agent read: no complete request within {READ_TIMEOUT:?}"),
            ));
        }
    }
    decode(&buf)
}

/// A request as the plugin wrote it: bounded, JSON, no unknown fields.
fn decode(buf: &[u8]) -> Result<AgentRequest, CniError> {
    if buf.len() > MAX_REQUEST_BYTES {
        return Err(CniError::new(
            Code::Decode,
            format!("agent request is larger than {MAX_REQUEST_BYTES} bytes"),
        ));
    }
    serde_json::from_slice(buf)
        .map_err(|e| CniError::new(Code::Decode, format!("agent request: {e}")))
}

/// Binds the agent's socket, owner-only (0600) from the moment it appears at `path`: it is bound
/// under a temporary name, restricted, then renamed into place. A socket left by a dead agent is
/// replaced; one that still answers means another agent runs, which is an error.
pub async fn bind(path: &Path) -> anyhow::Result<(UnixListener, u32)> {
    use anyhow::Context as _;
    let dir = path
        .parent()
        .filter(|d| !d.as_os_str().is_empty())
        .with_context(|| format!("--socket {}: needs a directory", path.display()))?;
    if !dir.exists() {
        std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
        std::fs::set_permissions(dir, std::fs::Permissions::from_mode(0o700))?;
    }
    if UnixStream::connect(path).await.is_ok() {
        anyhow::bail!(
            "--socket {}: another agent is listening there",
            path.display()
        );
    }
    let temp: PathBuf = dir.join(format!(
        ".{}.{}",
        path.file_name().unwrap_or_default().to_string_lossy(),
        std::process::id()
    ));
    let _ = std::fs::remove_file(&temp);
    let listener =
        UnixListener::bind(&temp).with_context(|| format!("binding {}", temp.display()))?;
    std::fs::set_permissions(&temp, std::fs::Permissions::from_mode(0o600))?;
    let own_uid = std::fs::metadata(&temp)?.uid();
    std::fs::rename(&temp, path)
        .with_context(|| format!("moving the socket to {}", path.display()))?;
    Ok((listener, own_uid))
}

/// Removes the socket at shutdown, so that plugins run their requests themselves at once instead
/// of finding a socket nobody answers.
pub fn unbind(path: &Path) {
    if let Err(e) = std::fs::remove_file(path)
        && e.kind() != io::ErrorKind::NotFound
    {
        tracing::warn!(path = %path.display(), error = %e, "could not remove the socket");
    }
}

#[cfg(test)]
mod tests;
