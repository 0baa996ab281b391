//! The node's bound on plugin processes at work: `plugin_slots` lock files in
//! `plugin_slots_dir` (the node's flat file sets both, like `agent_socket`).
//!
//! A storm starts one plugin process per attachment (a node rebooting with 100 pods, a scale-up
//! with no agent, or an agent whose queues are full and hand requests back), and each process
//! opens its own connection and makes its own writes. A thousand of them against one pool made
//! the API server answer 5xx until most ADDs ran out of time (docs/benchmarks.md). So a plugin
//! that runs a request itself first takes one of the node's slots: an exclusive `flock` on one of
//! the lock files. The kernel drops the lock with the process's last file descriptor, so a killed
//! plugin never keeps a slot. One that finds none free queues at the node's `gate` lock file
//! (a blocking `flock`: the kernel queues the waiters and wakes one at a time, so hundreds of
//! them cost no CPU), and the one holding the gate polls the slots every few milliseconds until
//! one comes free. A plugin that gets no slot within its patience answers "try again later"
//! (code 11) before it has sent a single request, so it leaves nothing behind, and the runtime
//! retries it.
//!
//! Why a gate: a waiter blocked on one slot's file would wait for that slot alone while another
//! stood free, and hundreds of waiters polling every slot took the CPU the API server needed
//! (docs/benchmarks.md, "Storms on the plugin alone").
//!
//! Why two lanes: a DEL frees what a waiting ADD may need (every pod of a full pool re-created at
//! once), and behind a queue of ADDs that each wait up to 40 s a DEL, which waits 20 s, could be
//! turned away again and again (the chaos smoke run beside a CPU hog: 44 DELs of one round
//! answered code 11 after 20 s while ADDs held every slot). So releases (DEL, GC) queue at a gate of their own and have a slot of their
//! own (`release-slot`) besides the common ones: at most `plugin_slots` + 1 processes of a node
//! are at work, and a release never waits behind an ADD. And releases go first: while a release
//! waits (it holds `release-gate`), ADDs leave it the first half of the common slots (`slot-0`
//! up to `plugin_slots / 2`), and take only the others: a long stream of DELs never shuts the
//! ADDs out, and DELs no longer race ADDs for every freed slot. Without that, the
//! loaded 20-round chaos run (2026-12-02) had DELs of the plugin alone turned away for 180 s: one
//! release slot and an even race for each freed common slot served fewer DELs than arrived.
//!
//! Why wider when alone: a node bursting on pools no other node claims from is bound by its own
//! round trips, not the API server; 8 processes made its 200 ADDs twice as slow as no bound
//! (docs/benchmarks.md). So each plugin process reports what its writer turns saw ([`note`]):
//! `alone` in the folder if every other claim they recorded was this node's, else `crowded`.
//! While `alone` is fresh and `crowded` is not, ADDs may also take the wide slots (up to [`WIDE`]
//! times `plugin_slots`). A storm of many nodes on one pool sees their claims from its first
//! turns and stays narrow (a congestion window, opened on fast answers, let hundreds in first).

use std::fs::{DirBuilder, File, OpenOptions};
use std::os::unix::fs::{DirBuilderExt, OpenOptionsExt};
use std::path::Path;
use std::time::{Duration, Instant, SystemTime};

use rustix::fs::{FlockOperation, OFlags, flock};

use super::protocol::{CniError, Code, Command};
use crate::alloc::neighbours::Neighbours;
use crate::config::PluginSlots;
use crate::config::ipam::MAX_PLUGIN_SLOTS;

/// How long an ADD waits for a slot: the rest of its deadline stays for the work.
pub const ADD_PATIENCE: Duration = Duration::from_secs(40);
/// How long any other command waits (their deadline is shorter).
pub const OTHER_PATIENCE: Duration = Duration::from_secs(20);
/// Pauses of the gate holder between polls of the slots (it is the only one polling).
const PAUSE_MS: std::ops::RangeInclusive<u64> = 1..=3;
/// How many times `plugin_slots` ADDs a node that bursts alone may have at work: 8 (64 by
/// default) brought a lone node's 200 ADDs to 1.2x the time with no bound, where 4 left 1.3x; ten
/// nodes each alone on their slices (640 at once) took no longer than at 4 (docs/benchmarks.md).
pub const WIDE: u32 = 8;
/// How recent a turn that saw only this node's claims must be to widen the bound.
const ALONE_FRESH: Duration = Duration::from_secs(2);
/// How long one sighting of another node's claim keeps the bound narrow.
const CROWDED_HOLD: Duration = Duration::from_secs(10);

/// A slot held by this process until it is dropped (or the process ends).
#[derive(Debug)]
pub struct Slot {
    _file: File,
    /// Which of its lane's lock files (for logs).
    pub index: u32,
    /// How long it took to get.
    pub waited: Duration,
}

/// Which queue a command waits in (see the module's comment).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Lane {
    /// ADD, CHECK, STATUS: the common slots.
    Common,
    /// DEL and GC, which free addresses: a gate and a slot of their own, then the common slots.
    Release,
}

impl Lane {
    pub fn of(command: Command) -> Lane {
        match command {
            Command::Del | Command::Gc => Lane::Release,
            _ => Lane::Common,
        }
    }
}

/// How long `command` may wait for a slot.
pub fn patience(command: Command) -> Duration {
    match command {
        Command::Add => ADD_PATIENCE,
        _ => OTHER_PATIENCE,
    }
}

/// Takes a slot of the node's bound for `command`, waiting at most its patience.
pub fn take_for(slots: &PluginSlots, command: Command) -> Result<Option<Slot>, CniError> {
    take(slots, Lane::of(command), patience(command))
}

/// Takes a slot of the node's bound. `Ok(None)`: the bound could not be set up (its directory
/// cannot be created or opened): the request runs unbounded, with a warning, rather than fail
/// every pod of the node. `Err`: no slot came free within `patience`.
pub fn take(slots: &PluginSlots, lane: Lane, patience: Duration) -> Result<Option<Slot>, CniError> {
    let (gate, files, releases) = match open_all(slots, lane) {
        Ok(files) => files,
        Err(e) => {
            tracing::warn!(dir = %slots.dir, error = %e, "the node's plugin slots cannot be used: running unbounded");
            return Ok(None);
        }
    };
    let started = Instant::now();
    let mut files: Vec<Option<File>> = files.into_iter().map(Some).collect();
    let taken = |files: &mut Vec<Option<File>>, index: usize| Slot {
        _file: files[index].take().expect("a slot is taken once"),
        index: index as u32,
        waited: started.elapsed(),
    };
    let narrow = files.len() - wide_slots(slots, lane);
    let free = |files: &Vec<Option<File>>| {
        let yielded = if releases.as_ref().is_some_and(release_waits) {
            releases_first(slots.count)
        } else {
            0
        };
        let open = if narrow < files.len() && alone(slots) {
            files.len()
        } else {
            narrow
        };
        try_any(&files[..open], yielded)
    };
    if let Some(index) = free(&files) {
        return Ok(Some(taken(&mut files, index)));
    }
    let Some(_gate) = queue_at(gate, patience) else {
        return Err(busy(slots, lane, patience));
    };
    loop {
        if let Some(index) = free(&files) {
            return Ok(Some(taken(&mut files, index)));
        }
        let waited = started.elapsed();
        if waited >= patience {
            return Err(busy(slots, lane, patience));
        }
        let pause = Duration::from_millis(fastrand::u64(PAUSE_MS));
        std::thread::sleep(pause.min(patience - waited));
    }
}

/// Waits in the kernel's queue of the gate's lock, at most `patience`: the gate, once held.
/// `flock` cannot time out, so a helper thread blocks in it; if the wait is given up, the thread
/// lets go of the gate as soon as it gets it (its send finds nobody waiting).
fn queue_at(gate: File, patience: Duration) -> Option<File> {
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        if flock(&gate, FlockOperation::LockExclusive).is_ok() {
            let _ = tx.send(gate);
        }
    });
    rx.recv_timeout(patience).ok()
}

fn busy(slots: &PluginSlots, lane: Lane, patience: Duration) -> CniError {
    let (which, nothing) = match lane {
        Lane::Common => (format!("all {} plugin slots", slots.count), "allocated"),
        Lane::Release => (
            format!("the release slot and all {} plugin slots", slots.count),
            "released",
        ),
    };
    CniError::new(
        Code::TryAgainLater,
        format!(
            "{which} of this node ({}) stayed busy for {}s: nothing was {nothing}, try again later (plugin_slots in the node's flat file sets the bound)",
            slots.dir,
            patience.as_secs()
        ),
    )
}

/// Whether a release waits for a slot: it holds `release-gate` while it does. (Taking the gate
/// for a moment to tell costs a release arriving just then a few microseconds.)
fn release_waits(release_gate: &File) -> bool {
    if flock(release_gate, FlockOperation::NonBlockingLockExclusive).is_err() {
        return true;
    }
    let _ = flock(release_gate, FlockOperation::Unlock);
    false
}

/// Opens (creating) the lane's gate and the lock files it may take: `slot-0` .. `slot-<count-1>`
/// and the wide slots after them ([`wide_slots`]), and for releases `release-slot` first; for the
/// common lane also the releases' gate, to yield to them. The directory is root's (0700): the
/// flat file that names it is the node's.
fn open_all(slots: &PluginSlots, lane: Lane) -> std::io::Result<(File, Vec<File>, Option<File>)> {
    let dir = Path::new(&slots.dir);
    DirBuilder::new().recursive(true).mode(0o700).create(dir)?;
    let open = |name: String| open_in(dir, &name);
    let (gate, own) = match lane {
        Lane::Common => ("gate", None),
        Lane::Release => ("release-gate", Some("release-slot".to_string())),
    };
    let files = own
        .into_iter()
        .chain((0..slots.count + wide_slots(slots, lane) as u32).map(|i| format!("slot-{i}")))
        .map(open)
        .collect::<std::io::Result<_>>()?;
    let releases = match lane {
        Lane::Common => Some(open("release-gate".into())?),
        Lane::Release => None,
    };
    Ok((open(gate.into())?, files, releases))
}

/// Opens (creating, root's alone, never through a symlink) file `name` of the slots' folder.
fn open_in(dir: &Path, name: &str) -> std::io::Result<File> {
    OpenOptions::new()
        .read(true)
        .write(true)
        .create(true)
        .truncate(false)
        .mode(0o600)
        .custom_flags(OFlags::NOFOLLOW.bits() as i32)
        .open(dir.join(name))
}

/// How many slots past `plugin_slots` the lane may take while its node bursts alone: ADDs only
/// (releases have their own slot and go first anyway), and no more than `plugin_slots`' own
/// maximum in all (each process opens every lock file: 1024 would meet a common fd limit).
fn wide_slots(slots: &PluginSlots, lane: Lane) -> usize {
    match lane {
        Lane::Common => (slots.count * WIDE)
            .min(MAX_PLUGIN_SLOTS as u32)
            .saturating_sub(slots.count) as usize,
        Lane::Release => 0,
    }
}

/// Records what this process's writer turns saw of other nodes (see the module's comment): the
/// time of the sighting, as the modification time of `alone` or `crowded` in the folder.
pub fn note(slots: &PluginSlots, seen: Neighbours) {
    let name = match seen {
        Neighbours::Unknown => return,
        Neighbours::Alone => "alone",
        Neighbours::Crowded => "crowded",
    };
    let touched =
        open_in(Path::new(&slots.dir), name).and_then(|f| f.set_modified(SystemTime::now()));
    if let Err(e) = touched {
        tracing::debug!(dir = %slots.dir, file = name, error = %e, "cannot note what the turns saw");
    }
}

/// Whether the node bursts alone: a turn saw only its claims lately, and none saw another
/// node's for a while.
fn alone(slots: &PluginSlots) -> bool {
    let age = |name: &str| {
        let modified =
            std::fs::metadata(Path::new(&slots.dir).join(name)).and_then(|m| m.modified());
        modified
            .ok()
            .and_then(|t| SystemTime::now().duration_since(t).ok())
    };
    age("alone").is_some_and(|a| a < ALONE_FRESH) && age("crowded").is_none_or(|c| c > CROWDED_HOLD)
}

/// How many of the common slots (`slot-0` on) a waiting release has first: half of them, so that
/// a long stream of DELs never shuts the ADDs out altogether.
fn releases_first(count: u32) -> usize {
    (count / 2) as usize
}

/// Tries every slot from `from` on once without blocking, from a random one on (so that waiters
/// do not all queue at slot 0): the index of the one locked.
fn try_any(files: &[Option<File>], from: usize) -> Option<usize> {
    let n = files.len().saturating_sub(from);
    let start = fastrand::usize(..n.max(1));
    (0..n).map(|k| from + (start + k) % n).find(|&i| {
        files[i]
            .as_ref()
            .is_some_and(|f| flock(f, FlockOperation::NonBlockingLockExclusive).is_ok())
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Waits until another thread holds the lock file `name` of `slots` (a lane's gate: held
    /// while its taker waits), so a test orders its takers by state, not by sleeping.
    fn held_by_another(slots: &PluginSlots, name: &str) {
        let path = Path::new(&slots.dir).join(name);
        for _ in 0..1000 {
            if File::open(&path).is_ok_and(|f| release_waits(&f)) {
                return;
            }
            std::thread::sleep(Duration::from_millis(5));
        }
        panic!("nobody took {} within 5 s", path.display());
    }

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
        let a = take(&slots, Lane::Common, Duration::ZERO).unwrap().unwrap();
        let b = take(&slots, Lane::Common, Duration::ZERO).unwrap().unwrap();
        assert_ne!(a.index, b.index);
        let e = take(&slots, Lane::Common, Duration::from_millis(50)).unwrap_err();
        assert_eq!(e.code, Code::TryAgainLater);
        assert!(e.msg.contains("all 2 plugin slots"), "{}", e.msg);
        drop(a);
        let c = take(&slots, Lane::Common, Duration::ZERO).unwrap().unwrap();
        assert_eq!(c.index, 1 - b.index);
    }

    #[test]
    fn a_node_alone_on_its_pools_takes_the_wide_slots_until_another_node_shows() {
        let tmp = tempfile::tempdir().unwrap();
        let slots = bound(tmp.path(), 2);
        let at_once = |lane| {
            let held: Vec<Slot> = std::iter::from_fn(|| take(&slots, lane, Duration::ZERO).ok()?)
                .take(100)
                .collect();
            held.len()
        };
        let narrow = 2;
        let wide = 2 * WIDE as usize;
        assert_eq!(at_once(Lane::Common), narrow, "nothing noted yet");
        note(&slots, Neighbours::Alone);
        assert_eq!(at_once(Lane::Common), wide);
        assert_eq!(
            at_once(Lane::Release),
            narrow + 1,
            "releases are not widened"
        );
        // A sighting that is no longer fresh does not widen.
        let stale = SystemTime::now() - ALONE_FRESH - Duration::from_millis(100);
        let alone = File::options()
            .write(true)
            .open(tmp.path().join("slots/alone"));
        alone.unwrap().set_modified(stale).unwrap();
        assert_eq!(at_once(Lane::Common), narrow);
        // Another node's claim keeps it narrow, whatever the turns see after it.
        note(&slots, Neighbours::Crowded);
        note(&slots, Neighbours::Alone);
        assert_eq!(at_once(Lane::Common), narrow);
        note(&slots, Neighbours::Unknown);
        assert_eq!(at_once(Lane::Common), narrow);
        // Never more than plugin_slots' maximum in all.
        let big = |count| wide_slots(&bound(tmp.path(), count), Lane::Common) as u32 + count;
        assert_eq!((big(8), big(32), big(64), big(256)), (64, 256, 256, 256));
    }

    #[test]
    fn a_waiter_gets_the_slot_another_lets_go_of() {
        let tmp = tempfile::tempdir().unwrap();
        let slots = bound(tmp.path(), 1);
        let held = take(&slots, Lane::Common, Duration::ZERO).unwrap().unwrap();
        let release = std::thread::spawn(move || {
            std::thread::sleep(Duration::from_millis(150));
            drop(held);
        });
        let got = take(&slots, Lane::Common, Duration::from_secs(5))
            .unwrap()
            .unwrap();
        assert!(got.waited >= Duration::from_millis(100), "{:?}", got.waited);
        release.join().unwrap();
    }

    #[test]
    fn queued_waiters_are_served_one_slot_at_a_time() {
        let tmp = tempfile::tempdir().unwrap();
        let slots = bound(tmp.path(), 2);
        let busy = std::sync::Arc::new(std::sync::atomic::AtomicUsize::new(0));
        let waiters: Vec<_> = (0..12)
            .map(|_| {
                let (slots, busy) = (slots.clone(), busy.clone());
                std::thread::spawn(move || {
                    use std::sync::atomic::Ordering::SeqCst;
                    let slot = take(&slots, Lane::Common, Duration::from_secs(20))
                        .unwrap()
                        .unwrap();
                    let now = busy.fetch_add(1, SeqCst) + 1;
                    std::thread::sleep(Duration::from_millis(20));
                    busy.fetch_sub(1, SeqCst);
                    drop(slot);
                    now
                })
            })
            .collect();
        let most = waiters.into_iter().map(|w| w.join().unwrap()).max();
        assert_eq!(most, Some(2), "never more at work than there are slots");
    }

    #[test]
    fn a_release_never_waits_behind_adds_holding_every_common_slot() {
        let tmp = tempfile::tempdir().unwrap();
        let slots = bound(tmp.path(), 2);
        let adds: Vec<_> = (0..2)
            .map(|_| take(&slots, Lane::Common, Duration::ZERO).unwrap().unwrap())
            .collect();
        let e = take(&slots, Lane::Common, Duration::from_millis(20)).unwrap_err();
        assert_eq!(e.code, Code::TryAgainLater);
        let del = take(&slots, Lane::Release, Duration::ZERO)
            .unwrap()
            .unwrap();
        // The release slot is one: a second release waits for it, or for a common slot.
        let e = take(&slots, Lane::Release, Duration::from_millis(20)).unwrap_err();
        assert_eq!(e.code, Code::TryAgainLater);
        drop(adds);
        let a = take(&slots, Lane::Release, Duration::ZERO)
            .unwrap()
            .unwrap();
        let b = take(&slots, Lane::Release, Duration::ZERO)
            .unwrap()
            .unwrap();
        assert!(
            take(&slots, Lane::Release, Duration::ZERO).is_err(),
            "2 common + 1 release"
        );
        drop((del, a, b));
        assert_eq!(Lane::of(Command::Del), Lane::Release);
        assert_eq!(Lane::of(Command::Gc), Lane::Release);
        assert_eq!(Lane::of(Command::Add), Lane::Common);
    }

    /// A slot of the releases' half that comes free while both an ADD and a release wait goes
    /// to the release, every time (before, each won about half of the races); the ADDs keep the
    /// other half.
    #[test]
    fn a_freed_slot_of_the_releases_half_goes_to_a_waiting_release() {
        let tmp = tempfile::tempdir().unwrap();
        let slots = bound(tmp.path(), 2);
        let common = || take(&slots, Lane::Common, Duration::ZERO).unwrap().unwrap();
        let (a, b) = (common(), common());
        let (mut first, _second) = if a.index == 0 { (a, b) } else { (b, a) };
        // With both common slots held, a release can only take its own slot: hold that too.
        let own = take(&slots, Lane::Release, Duration::ZERO)
            .unwrap()
            .unwrap();
        for round in 0..5 {
            let add = {
                let slots = slots.clone();
                std::thread::spawn(move || take(&slots, Lane::Common, Duration::from_millis(400)))
            };
            held_by_another(&slots, "gate"); // the ADD polls at the gate
            let del = {
                let slots = slots.clone();
                std::thread::spawn(move || take(&slots, Lane::Release, Duration::from_secs(5)))
            };
            held_by_another(&slots, "release-gate"); // the release waits too
            drop(first);
            let del = del.join().unwrap().unwrap().unwrap();
            assert!(
                add.join().unwrap().is_err(),
                "round {round}: the ADD took it"
            );
            drop(del);
            // With no release waiting, an ADD takes slot-0 again at once.
            first = common();
            assert_eq!(first.index, 0);
        }
        drop(own);
        assert_eq!(
            [1, 2, 4, 8].map(releases_first),
            [0, 1, 2, 4],
            "the ADDs always keep at least half"
        );
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
        assert!(
            take(&slots, Lane::Common, Duration::ZERO)
                .unwrap()
                .is_none()
        );
    }
}
