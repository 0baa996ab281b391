#!/usr/bin/env bash
# `make e2e-min`: part of the e2e tier against the oldest supported Kubernetes release (README
# "Supported Kubernetes versions"), whose kube-apiserver and kube-controller-manager are built
# from e2e/k8s-min (e2e/bin/min/; etcd and kubectl are the newest release's).
#
# Which tests: those whose outcome depends on what the API server does, not only on our code:
#   webhook::     the admission webhook as the API server calls it (matchConditions)
#   certs::       the operator-managed webhook certificate and caBundle
#   install::     every object of config/default accepted by the server, install-cni with real
#                 tokens and their rotation, the critical-pods quota
#   operator::    pod cleanup (DisruptionTarget set by the Eviction API and the taint manager),
#                 StatefulSet replacements, leader election on a Lease, the audit
#   keep::        sticky StatefulSet addresses with the real StatefulSet controller recreating and
#                 scaling down pods, IPAMClaims
#   slices::      NodeSlicePools, with upstream's plugin on the same pools
#   node_limits:: the ValidatingAdmissionPolicies on the node identity (CEL, matchConditions, the
#                 node name the API server puts in a pod-bound token)
# The rest of the e2e tier (the plugin's allocation paths, the agent, metrics, arm64, ...) talks
# to the API server only through plain reads and writes of our CRDs, the same on every release.
# Arguments replace these filters (cargo test's: a test runs if its name contains one of them).
#
# A control plane of its own (state in e2e/.state-min, WHEREABOUTS_E2E_MIN_STATE overrides), so
# the e2e tier's (e2e/.state) may run beside it; stopped again if this script started it. After
# `make e2e` nothing is compiled but the two Go binaries on their first run: the test binary and
# our binaries are the same debug build (`cargo test --test e2e`), upstream's plugin is there.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

export WHEREABOUTS_E2E_K8S=min
export WHEREABOUTS_E2E_STATE="${WHEREABOUTS_E2E_MIN_STATE:-$PWD/e2e/.state-min}"
log() { printf '[e2e-min] %s\n' "$*" >&2; }
die() { printf '[e2e-min] ERROR: %s\n' "$*" >&2; exit 1; }

filters=(webhook:: certs:: install:: operator:: keep:: slices:: node_limits:: relist::)
(($# == 0)) || filters=("$@")

started=0
if ! e2e/cluster.sh status >/dev/null 2>&1; then
  started=1
fi
cleanup() { if [[ $started == 1 ]]; then e2e/cluster.sh down || true; fi; }
trap cleanup EXIT

start=$SECONDS
kubeconfig="$(e2e/cluster.sh up | tail -n 1)"
log "control plane up in $((SECONDS - start)) s"

# The run counts only if the API server really is the pinned oldest release: a reused folder or a
# wrong binary would otherwise pass against the newest and prove nothing.
want="$(awk '$1 == "k8s.io/kubernetes" {print $2}' e2e/k8s-min/go.mod)"
got="$(e2e/bin/kubectl --kubeconfig "$kubeconfig" get --raw /version \
  | python3 -c 'import json, sys; print(json.load(sys.stdin)["gitVersion"])')"
[[ "$got" == "$want" ]] || die "the API server in $WHEREABOUTS_E2E_STATE is $got, not $want (e2e/k8s-min/go.mod)"
log "API server $got"

# Upstream's plugin (v0.9.2) for the mixed-fleet tests (tests/e2e/slices.rs); built by
# e2e/run-tests.sh already when run after it.
[[ -x bench/bin/whereabouts-upstream ]] || bench/build.sh --upstream-only
# Two threads, as the e2e tier: a 2-core machine stays responsive.
cargo test --test e2e -- --test-threads="${E2E_THREADS:-2}" "${filters[@]}"
log "done in $((SECONDS - start)) s"
