//! The plugin's side of the agent socket: plain blocking I/O, no runtime needed.

use std::io::{Read as _, Write as _};
use std::os::unix::net::UnixStream;
use std::path::Path;
use std::time::Duration;

use super::{AgentReply, AgentRequest, MAX_REQUEST_BYTES};
use crate::cni::protocol::{CniError, Code};

/// How long connecting may take: an agent that does not accept by then is busy (code 11).
const CONNECT_TIMEOUT: Duration = Duration::from_secs(2);
/// How long writing the request may take (it is a few kilobytes into a local socket).
const WRITE_TIMEOUT: Duration = Duration::from_secs(10);

/// Hands `request` to the agent listening at `socket` and waits up to `timeout` for its answer.
///
/// `Ok(None)` when no agent took the request (nothing listens there, or the request could not
/// be written): the plugin runs it itself, which is safe because the agent runs only complete
/// requests. Once the request is sent, only the agent's answer counts: a lost answer is an
/// error the runtime retries, never a second run of the request by the plugin.
pub fn call(
    socket: &Path,
    request: &AgentRequest,
    timeout: Duration,
) -> Result<Option<AgentReply>, CniError> {
    let mut stream = match connect(socket) {
        Ok(s) => s,
        Err(e) if e.kind() == std::io::ErrorKind::PermissionDenied => {
            tracing::warn!(socket = %socket.display(), error = %e, "not a node agent; running the request here");
            return Ok(None);
        }
        Err(e) if busy(&e) => {
            // An agent listens but has not accepted: it may still hold work of this container
            // (an earlier attempt whose requester gave up), which a run here could overtake.
            return Err(CniError::new(
                Code::TryAgainLater,
                format!(
                    "node agent at {}: does not accept connections ({e}); try again later",
                    socket.display()
                ),
            ));
        }
        Err(e) => {
            tracing::debug!(socket = %socket.display(), error = %e, "no node agent; running the request here");
            return Ok(None);
        }
    };
    let lost = |what: String| {
        CniError::new(
            Code::TryAgainLater,
            format!("node agent at {}: {what}", socket.display()),
        )
    };
    let body = serde_json::to_vec(request).expect("requests serialize");
    let written = stream
        .set_write_timeout(Some(WRITE_TIMEOUT))
        .and_then(|_| stream.write_all(&body));
    if let Err(e) = written {
        // The agent runs only a complete request, and this one is not: safe to run it here.
        tracing::warn!(socket = %socket.display(), error = %e, "could not send the request to the node agent; running it here");
        return Ok(None);
    }
    // From here the agent may have the whole request: never run it here as well.
    stream
        .shutdown(std::net::Shutdown::Write)
        .map_err(|e| lost(format!("could not finish the request: {e}")))?;
    let mut answer = Vec::new();
    stream
        .set_read_timeout(Some(timeout))
        .and_then(|_| {
            (&mut stream)
                .take(MAX_REQUEST_BYTES as u64)
                .read_to_end(&mut answer)
        })
        .map_err(|e| lost(format!("no answer: {e}")))?;
    if answer.is_empty() {
        return Err(lost("closed the connection without an answer".into()));
    }
    serde_json::from_slice(&answer)
        .map(Some)
        .map_err(|e| lost(format!("unreadable answer: {e}")))
}

/// The agent's answer becomes the plugin's result, so only root's (or the plugin's own user's)
/// process may give it: a socket that someone else bound (a stale path taken over, a wrong
/// mount) is not an agent, and the plugin runs the request itself.
fn check_peer(peer: u32, own: u32) -> std::io::Result<()> {
    if peer == 0 || peer == own {
        return Ok(());
    }
    Err(std::io::Error::new(
        std::io::ErrorKind::PermissionDenied,
        format!("the process listening there runs as uid {peer}, not root: not trusted"),
    ))
}

/// Whether connecting failed because an agent listens but does not accept: its backlog is full
/// (`EAGAIN`) or the connection did not complete in [`CONNECT_TIMEOUT`]. Anything else (no
/// socket, a socket nobody listens on) means no agent.
fn busy(e: &std::io::Error) -> bool {
    matches!(
        e.kind(),
        std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut
    )
}

/// Connects without blocking on an agent that does not accept (a full backlog would block a
/// plain connect for good): such an agent is told apart by [`busy`].
fn connect(socket: &Path) -> std::io::Result<UnixStream> {
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_io()
        .enable_time()
        .build()?;
    let stream = runtime.block_on(async {
        tokio::time::timeout(CONNECT_TIMEOUT, tokio::net::UnixStream::connect(socket))
            .await
            .map_err(|_| std::io::Error::from(std::io::ErrorKind::TimedOut))?
    })?;
    check_peer(stream.peer_cred()?.uid(), crate::config::trust::own_uid())?;
    let stream = stream.into_std()?;
    stream.set_nonblocking(false)?;
    Ok(stream)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// An agent whose backlog is full is busy, not absent: the plugin must not run the request
    /// itself beside work the agent may still hold for the same container.
    #[test]
    fn an_agent_that_does_not_accept_is_not_taken_for_no_agent() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("agent.sock");
        let request = AgentRequest {
            env: Default::default(),
            stdin: "{}".into(),
            flat_file: None,
        };
        // Nothing there: run here.
        assert_eq!(call(&path, &request, Duration::from_secs(1)).unwrap(), None);
        // A listener that never accepts, its backlog of one filled.
        let listener = rustix_listen(&path);
        let mut queued = 0;
        let refused = loop {
            match call(&path, &request, Duration::from_millis(10)) {
                Err(e) if e.msg.contains("does not accept connections") => break e,
                // Queued, never answered ("no answer"): it fills the backlog.
                Err(_) => queued += 1,
                Ok(other) => panic!("ran here beside a listening agent: {other:?}"),
            }
            assert!(queued < 64, "the backlog never filled");
        };
        assert_eq!(refused.code, Code::TryAgainLater);
        drop(listener);
    }

    /// A Unix listener that accepts nothing and queues at most one connection.
    fn rustix_listen(path: &Path) -> rustix::fd::OwnedFd {
        use rustix::net::{AddressFamily, SocketAddrUnix, SocketType, bind, listen, socket};
        let fd = socket(AddressFamily::UNIX, SocketType::STREAM, None).unwrap();
        bind(&fd, &SocketAddrUnix::new(path).unwrap()).unwrap();
        listen(&fd, 0).unwrap();
        fd
    }

    #[test]
    fn only_root_or_ourselves_is_an_agent() {
        assert!(check_peer(0, 1000).is_ok());
        assert!(check_peer(1000, 1000).is_ok());
        let e = check_peer(1000, 0).unwrap_err();
        assert_eq!(e.kind(), std::io::ErrorKind::PermissionDenied);
        assert!(e.to_string().contains("uid 1000, not root"), "{e}");
    }
}
