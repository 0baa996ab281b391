#!/usr/bin/env bash
# One command: build both binaries, start a private control plane, run the CNI
# allocation benchmark, stop the control plane. Extra arguments go to
# cni_bench.py (e.g. --repeat 1 --concurrency 50).
#
#   bench/run.sh               ours built from the work tree
#   bench/run.sh --from-head   ours built from `git archive HEAD`
set -euo pipefail
BENCH="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
ours=()
if [[ "${1:-}" == "--from-head" ]]; then
  shift
  "$BENCH/build.sh" --from-head
  ours=(--ours "$BENCH/bin/whereabouts-ours")
else
  "$BENCH/build.sh"
fi
exec python3 "$BENCH/cni_bench.py" "${ours[@]}" "$@"
