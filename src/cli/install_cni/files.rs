//! Files on the host, written so that the runtime never sees half of one: a temporary file in
//! the target's directory, fsynced, given its mode and renamed over the target.

use std::io::Write as _;
use std::os::unix::fs::{OpenOptionsExt as _, PermissionsExt as _};
use std::path::Path;
use std::sync::atomic::{AtomicU64, Ordering};

use super::TEMP_PREFIX;

/// Writes `contents` to `target` atomically with `mode`, unless it already holds exactly those
/// bytes with that mode. Returns whether it wrote.
pub fn write_atomic(target: &Path, contents: &[u8], mode: u32) -> std::io::Result<bool> {
    if let Ok(meta) = std::fs::metadata(target)
        && meta.permissions().mode() & 0o7777 == mode
        && meta.len() == contents.len() as u64
        && std::fs::read(target).is_ok_and(|current| current == contents)
    {
        return Ok(false);
    }
    static COUNTER: AtomicU64 = AtomicU64::new(0);
    let dir = target.parent().unwrap_or(Path::new("."));
    let name = target
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_default();
    let temp = dir.join(format!(
        "{TEMP_PREFIX}{name}.{}.{}",
        std::process::id(),
        COUNTER.fetch_add(1, Ordering::Relaxed)
    ));
    let written = (|| {
        // Created owner-only: a kubeconfig's token is never readable by others, not even briefly.
        let mut file = std::fs::OpenOptions::new()
            .write(true)
            .create_new(true)
            .mode(0o600)
            .open(&temp)?;
        file.write_all(contents)?;
        file.set_permissions(std::fs::Permissions::from_mode(mode))?;
        file.sync_all()?;
        drop(file);
        std::fs::rename(&temp, target)?;
        // Make the rename itself durable.
        std::fs::File::open(dir)?.sync_all()
    })();
    if written.is_err() {
        let _ = std::fs::remove_file(&temp);
    }
    written.map(|()| true)
}

/// Removes temporary files a killed installer left in `dir`.
pub fn remove_stale_temps(dir: &Path) {
    let Ok(entries) = std::fs::read_dir(dir) else {
        return;
    };
    for entry in entries.flatten() {
        if entry.file_name().to_string_lossy().starts_with(TEMP_PREFIX) {
            let path = entry.path();
            match std::fs::remove_file(&path) {
                Ok(()) => {
                    tracing::info!(path = %path.display(), "removed a leftover temporary file")
                }
                Err(e) => {
                    tracing::warn!(path = %path.display(), error = %e, "cannot remove a leftover temporary file")
                }
            }
        }
    }
}
