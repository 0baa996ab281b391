#!/usr/bin/env bash
# Pods-to-Running on a real node (docs/benchmarks.md, "A real node"): a private control plane and
# node (state in /tmp/wa-node-bench), whereabouts installed with e2e/install.sh as the README says,
# upstream's plugin built from its Go module, then bench/node_bench.py with the arguments given.
# Stops everything it started. One node per machine: not while the node tier runs.
#
#   bench/node_run.sh                      # 100 pods, 1 and 2 networks, 3 runs each, 3 IPAMs
#   bench/node_run.sh --repeat 1 --replicas 20 --networks 1    # a quick look
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
export WHEREABOUTS_E2E_STATE="${WHEREABOUTS_E2E_STATE:-/tmp/wa-node-bench}"
trap 'e2e/cluster.sh down || true' EXIT

if [[ ! -x bench/bin/whereabouts-upstream ]]; then
  v="$(cd bench/upstream && go list -m -f '{{.Version}}' github.com/k8snetworkplumbingwg/whereabouts)"
  echo "[bench] building upstream whereabouts $v" >&2
  (cd bench/upstream && CGO_ENABLED=0 go build \
    -ldflags "-X github.com/k8snetworkplumbingwg/whereabouts/pkg/version.Version=$v" \
    -o ../bin/whereabouts-upstream github.com/k8snetworkplumbingwg/whereabouts/cmd)
fi
kubeconfig="$(e2e/node.sh up | tail -n 1)"
# shellcheck disable=SC1090
source e2e/.images/images.env
KUBECONFIG="$kubeconfig" e2e/install.sh "$WHEREABOUTS_IMAGE"
python3 bench/node_bench.py "$@"
