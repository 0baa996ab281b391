#!/usr/bin/env bash
# Runs the e2e tier: starts the local control plane (or reuses a running one), runs the e2e test
# target against it, and stops the control plane again if this script started it.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

started=0
if ! e2e/cluster.sh status >/dev/null 2>&1; then
  started=1
fi
cleanup() { if [[ $started == 1 ]]; then e2e/cluster.sh down || true; fi; }
trap cleanup EXIT

e2e/cluster.sh up >/dev/null
cargo build --bins
# The release binaries of both platforms and their SBOMs (target/image/{amd64,arm64}/):
# tests/e2e/arm64.rs runs the arm64 ones under qemu; both go into the multi-arch image, whose SBOMs
# and signature tests/e2e/supply.rs checks.
make --no-print-directory release >&2
# cosign, for the signed image (tests/e2e/supply.rs, e2e/sign-image.sh).
e2e/build.sh cosign
# Upstream's plugin (v0.9.2) for the mixed-fleet tests (tests/e2e/slices.rs).
[[ -x bench/bin/whereabouts-upstream ]] || bench/build.sh --upstream-only
# Tests run in parallel, each in its own namespace; two threads keep a 2-core machine responsive.
cargo test --test e2e -- --test-threads="${E2E_THREADS:-2}" "$@"
