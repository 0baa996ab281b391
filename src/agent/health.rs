//! The agent's `/livez` and `/readyz`: live means it still answers on its socket, ready means
//! the socket is bound where the plugin looks for it.
//!
//! An HTTP server that answers says little: the accept loop could have stopped, the runtime be
//! starved, or the socket file be gone. So the agent asks itself, every [`PROBE_EVERY`], the way
//! the plugin does: it connects to its socket path, sends a VERSION request and waits up to
//! [`PROBE_TIMEOUT`] for an answer. `/livez` fails once no self-probe has been answered for
//! [`LIVE_WITHIN`].

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};
use tokio::net::UnixStream;

use crate::cni::handoff::{AgentReply, AgentRequest};

/// How often the agent asks itself whether it answers.
pub const PROBE_EVERY: Duration = Duration::from_secs(5);
/// How long a self-probe waits: a VERSION answer needs no API call, so a second is a dead agent
/// (or one whose runtime is starved), not a busy one; a busy agent still answers at once, with a
/// hand-back.
pub const PROBE_TIMEOUT: Duration = Duration::from_secs(1);
/// `/livez` fails when no self-probe was answered for this long: six probes in a row, so one
/// slow moment is not a restart.
pub const LIVE_WITHIN: Duration = Duration::from_secs(30);

/// What the probes report.
pub struct Health {
    socket: PathBuf,
    started: Instant,
    /// Milliseconds after `started` of the last answered self-probe (0: none yet, which counts
    /// from the start, so the agent has [`LIVE_WITHIN`] to answer its first).
    answered_ms: AtomicU64,
    /// The socket is bound (set after `bind`, cleared when it is removed at shutdown).
    bound: AtomicBool,
}

impl Health {
    pub fn new(socket: &Path) -> Self {
        Health {
            socket: socket.to_owned(),
            started: Instant::now(),
            answered_ms: AtomicU64::new(0),
            bound: AtomicBool::new(false),
        }
    }

    pub fn set_bound(&self, bound: bool) {
        self.bound.store(bound, Ordering::SeqCst);
    }

    fn answered(&self) {
        let ms = self.started.elapsed().as_millis() as u64;
        self.answered_ms.store(ms.max(1), Ordering::SeqCst);
    }

    /// `/livez`: `Err` names how long the agent has not answered itself.
    pub fn live(&self) -> Result<(), String> {
        self.live_within(LIVE_WITHIN)
    }

    fn live_within(&self, window: Duration) -> Result<(), String> {
        let last = Duration::from_millis(self.answered_ms.load(Ordering::SeqCst));
        let silent = self.started.elapsed().saturating_sub(last);
        if silent <= window {
            return Ok(());
        }
        Err(format!(
            "no answer on {} for {}s (limit {}s)",
            self.socket.display(),
            silent.as_secs(),
            window.as_secs()
        ))
    }

    /// `/readyz`: the socket is bound and its file is where the plugin connects.
    pub fn ready(&self) -> Result<(), String> {
        if !self.bound.load(Ordering::SeqCst) {
            return Err(format!("{} is not bound", self.socket.display()));
        }
        if !self.socket.exists() {
            return Err(format!("{} was removed", self.socket.display()));
        }
        Ok(())
    }

    /// Asks the agent at the socket path every [`PROBE_EVERY`], forever (the task ends with the
    /// process).
    pub async fn probe_forever(&self) {
        let mut every = tokio::time::interval(PROBE_EVERY);
        loop {
            every.tick().await;
            match probe(&self.socket).await {
                Ok(()) => self.answered(),
                Err(e) => {
                    tracing::warn!(socket = %self.socket.display(), error = %e, "the agent did not answer its own probe")
                }
            }
        }
    }
}

/// One VERSION request over `socket`, answered within [`PROBE_TIMEOUT`].
pub async fn probe(socket: &Path) -> Result<(), String> {
    let ask = async {
        let mut stream = UnixStream::connect(socket)
            .await
            .map_err(|e| format!("connect: {e}"))?;
        let request =
            AgentRequest::new([("CNI_COMMAND".to_owned(), "VERSION".to_owned())], "", None);
        let body = serde_json::to_vec(&request).expect("requests serialize");
        stream
            .write_all(&body)
            .await
            .map_err(|e| format!("write: {e}"))?;
        stream
            .shutdown()
            .await
            .map_err(|e| format!("shutdown: {e}"))?;
        let mut answer = Vec::new();
        stream
            .take(64 * 1024)
            .read_to_end(&mut answer)
            .await
            .map_err(|e| format!("read: {e}"))?;
        serde_json::from_slice::<AgentReply>(&answer)
            .map(|_| ())
            .map_err(|e| format!("unreadable answer: {e}"))
    };
    tokio::time::timeout(PROBE_TIMEOUT, ask)
        .await
        .map_err(|_| format!("no answer within {PROBE_TIMEOUT:?}"))?
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use super::*;
    use crate::agent::{Agent, bind, unbind};
    use crate::store::memory::MemoryStore;

    /// The self-probe is answered by a serving agent, and not once its accept loop has stopped:
    /// `/livez` then turns to failing, and `/readyz` as soon as the socket is gone.
    #[tokio::test]
    async fn the_probe_follows_the_accept_loop_not_the_process() {
        let dir = tempfile::tempdir().unwrap();
        let socket = dir.path().join("agent.sock");
        let (listener, own_uid) = bind(&socket).await.unwrap();
        let health = Health::new(&socket);
        assert!(health.ready().unwrap_err().contains("is not bound"));
        health.set_bound(true);
        health.ready().unwrap();
        let metrics = Arc::new(crate::metrics::agent::AgentMetrics::new());
        let agent = Arc::new(Agent::new(
            MemoryStore::new(),
            String::new(),
            own_uid,
            metrics,
        ));
        let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
        let serving = tokio::spawn(agent.serve(
            listener,
            async move {
                let _ = stopped.await;
            },
            Duration::from_millis(10),
        ));
        probe(&socket).await.unwrap();
        health.answered();
        health.live_within(Duration::from_secs(5)).unwrap();

        stop.send(()).unwrap();
        serving.await.unwrap();
        let e = probe(&socket).await.unwrap_err();
        assert!(e.starts_with("connect:"), "{e}");
        tokio::time::sleep(Duration::from_millis(30)).await;
        let e = health.live_within(Duration::from_millis(10)).unwrap_err();
        assert!(
            e.contains("no answer on") && e.contains("agent.sock"),
            "{e}"
        );
        unbind(&socket);
        assert!(health.ready().unwrap_err().contains("was removed"));
    }

    /// A listener that accepts but never answers (a stuck agent) fails the probe in time.
    #[tokio::test]
    async fn a_socket_that_never_answers_fails_the_probe_within_its_timeout() {
        let dir = tempfile::tempdir().unwrap();
        let socket = dir.path().join("agent.sock");
        let _listener = tokio::net::UnixListener::bind(&socket).unwrap();
        let e = probe(&socket).await.unwrap_err();
        assert_eq!(e, "no answer within 1s");
    }
}
