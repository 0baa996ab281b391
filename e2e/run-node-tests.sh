#!/usr/bin/env bash
# Runs the node tier: a control plane and a real node of their own (state in e2e/.state-node, so
# the e2e tier's cluster is not disturbed), the images built from this tree, then the node tests,
# one at a time (they share the node and disturb it). Stops what it started.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
[[ "$(id -u)" == 0 ]] || { echo "run-node-tests: needs root (containerd, links, iptables)" >&2; exit 1; }

export WHEREABOUTS_E2E_STATE="$PWD/e2e/.state-node"
started=0
if ! e2e/node.sh status >/dev/null 2>&1; then
  started=1
fi
cleanup() { if [[ $started == 1 ]]; then e2e/cluster.sh down || true; fi; }
trap cleanup EXIT

# `up` builds the node binaries and the images (static release build included) when needed.
e2e/node.sh up >/dev/null
# The migration and reinstall tests install the chart with helm (built once, like the node's binaries).
e2e/build.sh helm
cargo test --test node -- --test-threads=1 "$@"
