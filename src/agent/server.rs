//! The agent's socket: accepts the plugin's connections, checks who is calling, runs each
//! request with the agent's one API connection and group allocator, answers.

use std::io;
use std::os::unix::fs::{MetadataExt as _, PermissionsExt as _};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};
use tokio::net::{UnixListener, UnixStream};
use tokio::sync::Semaphore;

use super::batch::Batcher;
use super::protocol::{AgentReply, AgentRequest, MAX_REQUEST_BYTES};
use crate::cni::protocol::{CniError, Command, code};
use crate::cni::{self, FlatSource, Invocation};
use crate::store::Store;

/// A plugin writes its request at once; one that does not within this time is dropped.
const READ_TIMEOUT: Duration = Duration::from_secs(10);
/// Requests run at once; beyond that the plugin is told to run its request itself.
const MAX_IN_FLIGHT: usize = 2048;

pub struct Agent<S> {
    store: Arc<S>,
    batcher: Batcher<S>,
    /// The plugin kubeconfig (`kubernetes.kubeconfig`) whose requests this agent runs: the one
    /// that names the same cluster, credentials and pool namespace as the agent's own client.
    serves_kubeconfig: String,
    /// Callers other than root and this agent's own user run their requests themselves.
    own_uid: u32,
    in_flight: Arc<Semaphore>,
}

impl<S: Store + 'static> Agent<S> {
    pub fn new(store: S, serves_kubeconfig: String, own_uid: u32) -> Self {
        let store = Arc::new(store);
        Agent {
            batcher: Batcher::new(store.clone()),
            store,
            serves_kubeconfig,
            own_uid,
            in_flight: Arc::new(Semaphore::new(MAX_IN_FLIGHT)),
        }
    }

    /// Serves connections until `shutdown` resolves, then waits up to `grace` for requests in
    /// flight.
    pub async fn serve(
        self: Arc<Self>,
        listener: UnixListener,
        shutdown: impl Future<Output = ()>,
        grace: Duration,
    ) {
        tokio::pin!(shutdown);
        loop {
            tokio::select! {
                _ = &mut shutdown => break,
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
        drop(listener);
        let all = MAX_IN_FLIGHT as u32;
        if tokio::time::timeout(grace, self.in_flight.acquire_many(all))
            .await
            .is_err()
        {
            tracing::warn!(
                "requests still in flight at shutdown; their plugins will report a retryable error"
            );
        }
    }

    async fn connection(&self, mut stream: UnixStream) {
        // The request is read before any answer, even one that does not run it: closing a socket
        // with unread data resets it, and the caller would lose the answer.
        let request = read_request(&mut stream).await;
        let reply = match self.in_flight.clone().try_acquire_owned() {
            Ok(_permit) => match (self.caller(&stream), request) {
                (Some(direct), _) => direct,
                (None, Ok(request)) => self.run(request).await,
                (None, Err(e)) => unreadable(&e),
            },
            Err(_) => AgentReply::Direct {
                reason: "agent busy".into(),
            },
        };
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
            Ok(cred) => Some(AgentReply::Direct {
                reason: format!("the agent serves root only, not uid {}", cred.uid()),
            }),
            Err(e) => Some(AgentReply::Direct {
                reason: format!("peer credentials: {e}"),
            }),
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
            return AgentReply::Direct {
                reason: format!(
                    "kubernetes.kubeconfig {kubeconfig:?} is not the one this agent serves ({:?})",
                    self.serves_kubeconfig
                ),
            };
        }
        let result = cni::handle_within(&*self.store, &self.batcher, &req).await;
        tracing::info!(
            command = ?req.command,
            pod = %req.attachment.podref,
            container = %req.attachment.container_id,
            error = result.as_ref().err().map(|e| e.code),
            ms = started.elapsed().as_millis() as u64,
            "served"
        );
        match result {
            Ok(output) => AgentReply::Done { output },
            Err(e) => e.into(),
        }
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
            output: Some(cni::protocol::version_reply()),
        });
    }
    let inv = Invocation {
        env: &env,
        stdin: &request.stdin,
        flat_file: FlatSource::Found(request.flat_file.clone().map(|f| (f.path, f.conf))),
    };
    Ok(cni::load(command, &inv)?)
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
        Ok(Err(e)) => return Err(CniError::new(code::IO_FAILURE, format!("agent read: {e}"))),
        Err(_) => {
            return Err(CniError::new(
                code::IO_FAILURE,
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
            code::DECODE,
            format!("agent request is larger than {MAX_REQUEST_BYTES} bytes"),
        ));
    }
    serde_json::from_slice(buf)
        .map_err(|e| CniError::new(code::DECODE, format!("agent request: {e}")))
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
mod tests {
    use super::*;

    /// What the agent answers for bytes, before running anything: unreadable bytes go back to the
    /// plugin, VERSION is answered, a bad request is the plugin's CNI error.
    #[test]
    fn parse_request_answers_as_a_connection_does() {
        let unreadable = parse_request(b"{\"env\":{},\"stdin\":\"\",\"extra\":1}").unwrap_err();
        let AgentReply::Direct { reason } = unreadable else {
            panic!("{unreadable:?}");
        };
        assert!(
            reason.starts_with(
                "the agent cannot read the request: agent request: unknown field `extra`"
            ),
            "{reason}"
        );
        let version =
            parse_request(br#"{"env":{"CNI_COMMAND":"VERSION"},"stdin":"","flatFile":null}"#);
        assert_eq!(
            version.unwrap_err(),
            AgentReply::Done {
                output: Some(cni::protocol::version_reply())
            }
        );
        let bad = parse_request(br#"{"env":{"CNI_COMMAND":"ADD"},"stdin":"{","flatFile":null}"#);
        let AgentReply::Failed { code: c, msg, .. } = bad.unwrap_err() else {
            panic!("not a CNI error");
        };
        assert_eq!(c, code::DECODE);
        assert!(msg.starts_with("network config is not valid JSON"), "{msg}");
    }
}
