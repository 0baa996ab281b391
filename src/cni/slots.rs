//! The node's bound on plugin processes at work: `plugin_slots` lock files in
//! `plugin_slots_dir` (the node's flat file sets both, like `agent_socket`).
//!
//! A storm starts one plugin process per attachment (a node rebooting with 100 pods, a scale-up
//! with no agent, or an agent whose queues are full and hand requests back), and each process
//! opens its own connection and makes its own writes. A thousand of them against one pool made
//! the API server answer 5xx until most ADDs ran out of time (docs/benchmarks.md). So a plugin
//! that runs a request itself first takes one of the node's slots: an exclusive `flock` on one of
//! the lock files. The kernel drops the lock with the process's last file descriptor, so a killed
//! plugin never keeps a slot. Waiters poll the slots with jittered pauses; one that finds none
//! free within its patience answers "try again later" (code 11) before it has sent a single
//! request, so it leaves nothing behind, and the runtime retries it.
//!
//! Why polling and not a blocking `flock`: a waiter blocked on one lock file would wait for that
//! slot alone while another stood free. Polling every few tens of milliseconds costs a few
//! failing `flock` calls per round, and a burst drains in the order of its slots' work either way.

use std::fs::{DirBuilder, File, OpenOptions};
use std::os::unix::fs::{DirBuilderExt, OpenOptionsExt};
use std::path::Path;
use std::time::{Duration, Instant};

use rustix::fs::{FlockOperation, OFlags, flock};

use super::protocol::{CniError, Code, Command};
use crate::config::PluginSlots;

/// How long an ADD waits for a slot: the rest of its deadline stays for the work.
pub const ADD_PATIENCE: Duration = Duration::from_secs(40);
/// How long any other command waits (their deadline is shorter).
pub const OTHER_PATIENCE: Duration = Duration::from_secs(20);
/// Pauses between polls are drawn from this range: wide enough that waiters fall out of step.
const PAUSE_MS: std::ops::RangeInclusive<u64> = 10..=40;

/// A slot held by this process until it is dropped (or the process ends).
#[derive(Debug)]
pub struct Slot {
    _file: File,
    pub index: u32,
    /// How long it took to get.
    pub waited: Duration,
}

/// How long `command` may wait for a slot.
pub fn patience(command: Command) -> Duration {
    match command {
        Command::Add => ADD_PATIENCE,
        _ => OTHER_PATIENCE,
    }
}

/// Takes a slot of the node's bound. `Ok(None)`: the bound could not be set up (its directory
/// cannot be created or opened): the request runs unbounded, with a warning, rather than fail
/// every pod of the node. `Err`: every slot stayed busy for `patience`.
pub fn take(slots: &PluginSlots, patience: Duration) -> Result<Option<Slot>, CniError> {
    let files = match open_all(slots) {
        Ok(files) => files,
        Err(e) => {
            tracing::warn!(dir = %slots.dir, error = %e, "the node's plugin slots cannot be used: running unbounded");
            return Ok(None);
        }
    };
    let started = Instant::now();
    let mut files: Vec<Option<File>> = files.into_iter().map(Some).collect();
    loop {
        if let Some(index) = try_any(&files) {
            let file = files[index].take().expect("a slot is taken once");
            return Ok(Some(Slot {
                _file: file,
                index: index as u32,
                waited: started.elapsed(),
            }));
        }
        let waited = started.elapsed();
        if waited >= patience {
            return Err(busy(slots, patience));
        }
        let pause = Duration::from_millis(fastrand::u64(PAUSE_MS));
        std::thread::sleep(pause.min(patience - waited));
    }
}

fn busy(slots: &PluginSlots, patience: Duration) -> CniError {
    CniError::new(
        Code::TryAgainLater,
        format!(
            "all {} plugin slots of this node ({}) stayed busy for {}s: nothing was allocated, try again later (plugin_slots in the node's flat file sets the bound)",
            slots.count,
            slots.dir,
            patience.as_secs()
        ),
    )
}

/// Opens (creating) the directory's lock files `slot-0` .. `slot-<count-1>`. The directory is
/// root's (0700): the flat file that names it is the node's.
fn open_all(slots: &PluginSlots) -> std::io::Result<Vec<File>> {
    let dir = Path::new(&slots.dir);
    DirBuilder::new().recursive(true).mode(0o700).create(dir)?;
    (0..slots.count)
        .map(|i| {
            OpenOptions::new()
                .read(true)
                .write(true)
                .create(true)
                .truncate(false)
                .mode(0o600)
                .custom_flags(OFlags::NOFOLLOW.bits() as i32)
                .open(dir.join(format!("slot-{i}")))
        })
        .collect()
}

/// Tries every slot once without blocking, from a random one on (so that waiters do not all
/// queue at slot 0): the index of the one locked.
fn try_any(files: &[Option<File>]) -> Option<usize> {
    let n = files.len();
    let start = fastrand::usize(..n.max(1));
    (0..n).map(|k| (start + k) % n).find(|&i| {
        files[i]
            .as_ref()
            .is_some_and(|f| flock(f, FlockOperation::NonBlockingLockExclusive).is_ok())
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn bound(dir: &Path, count: u32) -> PluginSlots {
        PluginSlots {
            count,
            dir: dir.join("slots").display().to_string(),
        }
    }

    #[test]
    fn slots_are_taken_until_none_is_left_and_come_back_when_dropped() {
        let tmp = tempfile::tempdir().unwrap();
        let slots = bound(tmp.path(), 2);
        let a = take(&slots, Duration::ZERO).unwrap().unwrap();
        let b = take(&slots, Duration::ZERO).unwrap().unwrap();
        assert_ne!(a.index, b.index);
        let e = take(&slots, Duration::from_millis(50)).unwrap_err();
        assert_eq!(e.code, Code::TryAgainLater);
        assert!(e.msg.contains("all 2 plugin slots"), "{}", e.msg);
        drop(a);
        let c = take(&slots, Duration::ZERO).unwrap().unwrap();
        assert_eq!(c.index, 1 - b.index);
    }

    #[test]
    fn a_waiter_gets_the_slot_another_lets_go_of() {
        let tmp = tempfile::tempdir().unwrap();
        let slots = bound(tmp.path(), 1);
        let held = take(&slots, Duration::ZERO).unwrap().unwrap();
        let release = std::thread::spawn(move || {
            std::thread::sleep(Duration::from_millis(150));
            drop(held);
        });
        let got = take(&slots, Duration::from_secs(5)).unwrap().unwrap();
        assert!(got.waited >= Duration::from_millis(100), "{:?}", got.waited);
        release.join().unwrap();
    }

    #[test]
    fn an_unusable_directory_leaves_the_request_unbounded() {
        let tmp = tempfile::tempdir().unwrap();
        let file = tmp.path().join("not-a-dir");
        std::fs::write(&file, "").unwrap();
        let slots = PluginSlots {
            count: 1,
            dir: file.join("slots").display().to_string(),
        };
        assert!(take(&slots, Duration::ZERO).unwrap().is_none());
    }
}
