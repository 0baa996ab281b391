#!/usr/bin/env bash
# The chaos tier: starts a control plane of its own (state e2e/.state-chaos, so that restarting
# its etcd and API server disturbs nothing else), builds what the mixed fleet needs (our static
# release, upstream's v0.9.2 plugin), runs e2e/chaos/chaos.py with the given arguments, and stops
# the control plane again if this script started it. See e2e/chaos/README.md.
#
#   e2e/run-chaos.sh --rounds 3 --seed 2        (make chaos-smoke)
#   e2e/run-chaos.sh --rounds 20 --seed 1       (make chaos)
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

export WHEREABOUTS_E2E_STATE="${WHEREABOUTS_CHAOS_STATE:-$PWD/e2e/.state-chaos}"
started=0
if ! e2e/cluster.sh status >/dev/null 2>&1; then
  started=1
fi
cleanup() { if [[ $started == 1 ]]; then e2e/cluster.sh down || true; fi; }
trap cleanup EXIT

kubeconfig="$(e2e/cluster.sh up | tail -n 1)"
e2e/bin/kubectl --kubeconfig "$kubeconfig" apply -f crds/ >/dev/null
[[ -x bench/bin/whereabouts-upstream ]] || bench/build.sh --upstream-only
cargo build --release --locked --target x86_64-unknown-linux-musl --bins
python3 e2e/chaos/chaos.py --kubeconfig "$kubeconfig" --state "$WHEREABOUTS_E2E_STATE" "$@"
