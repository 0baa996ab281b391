#!/usr/bin/env bash
# The SBOM of the binaries built for one Rust target: CycloneDX 1.5 JSON made from Cargo.lock by
# cargo-cyclonedx (`make deps` installs it), listing the crates of that target's build with their
# versions, checksums and licences; no dev-dependency, no crate only another platform uses.
# `make release` and e2e/images.sh write one per platform to target/image/<arch>/sbom.cdx.json,
# which the Dockerfile's `local` stage puts into the image at /usr/share/doc/whereabouts/.
#
# Usage: e2e/sbom.sh TARGET OUTFILE    e.g. e2e/sbom.sh x86_64-unknown-linux-musl target/image/amd64/sbom.cdx.json
set -euo pipefail
REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
CARGO="${CARGO:-cargo}"

die() { printf '[sbom] ERROR: %s\n' "$*" >&2; exit 1; }

[[ $# -eq 2 ]] || die "usage: e2e/sbom.sh TARGET OUTFILE"
target="$1" out="$2"
"$CARGO" cyclonedx --version >/dev/null 2>&1 || die "cargo-cyclonedx not found (make deps installs it)"

# Reproducible: with SOURCE_DATE_EPOCH set, cargo-cyclonedx writes that time and no random serial
# number, so the same Cargo.lock gives the same file (and the image the same digest). The time is
# that of the last commit to change what the SBOM describes (Cargo.toml, Cargo.lock), not the
# build's; 0 without git (a builder stage).
commit_time="$(git -C "$REPO" log -1 --format=%ct -- Cargo.toml Cargo.lock 2>/dev/null || true)"
SOURCE_DATE_EPOCH="${SOURCE_DATE_EPOCH:-${commit_time:-0}}"
export SOURCE_DATE_EPOCH

# cargo-cyclonedx writes NAME.json beside Cargo.toml only: a name of this run's own, then moved,
# so that two builds at once (make release, e2e/images.sh) never take each other's file.
name="sbom-$$-$target"
trap 'rm -f "$REPO/$name.json"' EXIT
(cd "$REPO" && "$CARGO" cyclonedx --quiet --format json --spec-version 1.5 \
  --target "$target" --override-filename "$name") || die "cargo cyclonedx failed for $target"
mkdir -p "$(dirname "$out")"
mv -f "$REPO/$name.json" "$out"
printf '[sbom] %s: %s\n' "$target" "$out" >&2
