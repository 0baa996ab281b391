//! Helpers shared by the webhook's integration tests.

use std::path::{Path, PathBuf};
use std::process::Command;

/// A CA and a serving certificate for 127.0.0.1 in `dir`, made by `webhook-certs/mint.sh`.
pub fn mint(dir: &Path) {
    let script = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("webhook-certs/mint.sh");
    let out = Command::new(script)
        .args(["--ip", "127.0.0.1", "--out"])
        .arg(dir)
        .output()
        .expect("run webhook-certs/mint.sh");
    assert!(
        out.status.success(),
        "mint.sh: {}",
        String::from_utf8_lossy(&out.stderr)
    );
}
