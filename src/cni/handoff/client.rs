//! The plugin's side of the agent socket: plain blocking I/O, no runtime needed.

use std::io::{Read as _, Write as _};
use std::os::unix::net::UnixStream;
use std::path::Path;
use std::time::Duration;

use super::{AgentReply, AgentRequest, MAX_REQUEST_BYTES};
use crate::cni::protocol::{CniError, Code};

/// How long connecting may take before the plugin runs the request itself.
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

/// Connects without blocking on an agent that does not accept (a full backlog would block a
/// plain connect for good): an agent that cannot take the connection at once is not used.
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

    #[test]
    fn only_root_or_ourselves_is_an_agent() {
        assert!(check_peer(0, 1000).is_ok());
        assert!(check_peer(1000, 1000).is_ok());
        let e = check_peer(1000, 0).unwrap_err();
        assert_eq!(e.kind(), std::io::ErrorKind::PermissionDenied);
        assert!(e.to_string().contains("uid 1000, not root"), "{e}");
    }
}
