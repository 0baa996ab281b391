//! The plugin must be able to run on the node. An image of the wrong platform (a manifest list
//! that names the wrong image, or an installer run under emulation on a node with binfmt) would
//! otherwise copy a plugin the runtime cannot execute, and every pod start on the node would fail
//! with "exec format error". So before installing, the plugin's ELF machine is compared with this
//! installer's own and with the node's other CNI plugins (native binaries of the node), and a
//! mismatch is refused with both named; the host keeps whatever plugin it had.

use std::io::Read as _;
use std::path::Path;

use anyhow::bail;

/// ELF `e_machine` of a 64-bit little- or big-endian ELF file's first bytes; `None` when the
/// bytes are not such an ELF header.
pub fn elf_machine(header: &[u8]) -> Option<u16> {
    if header.len() < 20 || header[..4] != *b"\x7fELF" {
        return None;
    }
    let bytes = [header[18], header[19]];
    match header[5] {
        1 => Some(u16::from_le_bytes(bytes)),
        2 => Some(u16::from_be_bytes(bytes)),
        _ => None,
    }
}

/// A machine's name as `uname -m` says it.
pub fn machine_name(machine: u16) -> String {
    match machine {
        0x03 => "i386".into(),
        0x14 => "ppc".into(),
        0x15 => "ppc64".into(),
        0x16 => "s390x".into(),
        0x28 => "arm".into(),
        0x3e => "x86_64".into(),
        0xb7 => "aarch64".into(),
        0xf3 => "riscv64".into(),
        0x102 => "loongarch64".into(),
        other => format!("ELF machine {other:#x}"),
    }
}

/// The ELF machine of this installer's own executable (the image's platform); `None` when it
/// cannot be read.
pub fn own_machine() -> Option<u16> {
    header_machine(&std::env::current_exe().ok()?)
}

/// The ELF machine of the file at `path`, from its first bytes only.
fn header_machine(path: &Path) -> Option<u16> {
    let mut header = [0u8; 20];
    std::fs::File::open(path)
        .and_then(|mut f| f.read_exact(&mut header))
        .ok()?;
    elf_machine(&header)
}

/// Refuses `plugin` (its bytes) when it is not an ELF of this installer's machine, or when the
/// node's other CNI plugins in `bin_dir` are all of another machine. `skip` is the plugin's own
/// file name there (the copy being replaced says nothing about the node).
pub fn check(plugin: &[u8], bin_dir: &Path, skip: &str) -> anyhow::Result<()> {
    let Some(machine) = elf_machine(plugin) else {
        bail!("the plugin to install is not an ELF executable");
    };
    let name = machine_name(machine);
    if let Some(own) = own_machine()
        && own != machine
    {
        bail!(
            "the plugin to install is built for {name} but this installer for {}: the image mixes platforms",
            machine_name(own)
        );
    }
    let natives = node_machines(bin_dir, skip);
    if !natives.is_empty() && !natives.iter().any(|(_, m)| *m == machine) {
        let seen: Vec<String> = natives
            .iter()
            .take(3)
            .map(|(file, m)| format!("{file}: {}", machine_name(*m)))
            .collect();
        bail!(
            "the plugin to install is built for {name}, but the node's CNI plugins in {} are not ({}): this image's platform is not the node's, so the plugin could not run here; install the image built for the node's platform (a multi-arch image picks it by itself)",
            bin_dir.display(),
            seen.join(", ")
        );
    }
    Ok(())
}

/// The ELF machines of the files in `bin_dir` (but `skip` and our temporary files), by
/// file name; unreadable files and non-ELF files are left out.
fn node_machines(bin_dir: &Path, skip: &str) -> Vec<(String, u16)> {
    let Ok(entries) = std::fs::read_dir(bin_dir) else {
        return Vec::new();
    };
    let mut found: Vec<(String, u16)> = entries
        .filter_map(Result::ok)
        // (following links: distributions link their CNI plugins into the folder)
        .filter(|e| std::fs::metadata(e.path()).is_ok_and(|m| m.is_file()))
        .filter_map(|e| {
            let name = e.file_name().to_string_lossy().into_owned();
            if name == skip || name.starts_with(super::TEMP_PREFIX) {
                return None;
            }
            Some((name, header_machine(&e.path())?))
        })
        .collect();
    found.sort();
    found
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The first bytes of a 64-bit little-endian ELF of `machine`.
    pub fn elf(machine: u16) -> Vec<u8> {
        let mut h = vec![0x7f, b'E', b'L', b'F', 2, 1, 1, 0];
        h.resize(18, 0);
        h.extend(machine.to_le_bytes());
        h.resize(64, 0);
        h
    }

    #[test]
    fn the_machine_is_read_from_the_elf_header() {
        assert_eq!(elf_machine(&elf(0xb7)), Some(0xb7));
        assert_eq!(elf_machine(b"#!/bin/sh\necho not an ELF at all"), None);
        assert_eq!(elf_machine(&elf(0x3e)[..10]), None);
        let mut big = elf(0);
        big[5] = 2;
        big[18..20].copy_from_slice(&0x16u16.to_be_bytes());
        assert_eq!(
            elf_machine(&big).map(machine_name).as_deref(),
            Some("s390x")
        );
        assert_eq!(machine_name(0x3e), "x86_64");
        assert_eq!(machine_name(0x1234), "ELF machine 0x1234");
    }

    #[test]
    fn a_plugin_of_another_platform_than_the_nodes_is_refused() {
        let own = own_machine().expect("tests run on a known machine");
        let other = if own == 0xb7 { 0x3e } else { 0xb7 };
        let dir = tempfile::tempdir().unwrap();
        // An empty bin dir (a fresh node): only the installer's own machine is known.
        check(&elf(own), dir.path(), "whereabouts").unwrap();
        let err = check(&elf(other), dir.path(), "whereabouts").unwrap_err();
        assert!(
            err.to_string().contains("the image mixes platforms"),
            "{err}"
        );
        assert!(check(b"not an ELF", dir.path(), "whereabouts").is_err());
        // The node's plugins are of another machine (this installer runs under emulation).
        std::fs::write(dir.path().join("loopback"), elf(other)).unwrap();
        std::fs::write(dir.path().join("bridge"), elf(other)).unwrap();
        std::fs::write(dir.path().join("README"), "text, not a plugin").unwrap();
        // The copy being replaced (ours, of the right machine) does not vouch for the node.
        std::fs::write(dir.path().join("whereabouts"), elf(own)).unwrap();
        let err = check(&elf(own), dir.path(), "whereabouts")
            .unwrap_err()
            .to_string();
        let want = format!(
            "built for {}, but the node's CNI plugins in {} are not (bridge: {other_name}, loopback: {other_name})",
            machine_name(own),
            dir.path().display(),
            other_name = machine_name(other)
        );
        assert!(err.contains(&want), "{err}");
        // One plugin of the node's that matches is enough (a node with a few emulated ones).
        std::fs::write(dir.path().join("host-local"), elf(own)).unwrap();
        check(&elf(own), dir.path(), "whereabouts").unwrap();
    }
}
