#!/usr/bin/env bash
# What the node-writes admission policy (config/rbac/node-limits.yaml) costs one write of a pool
# at its object size limit: N JSON patches (add one entry, remove it) of a pool of ENTRIES typical
# entries, by the node identity (token bound to a pod on a Node) with the policy bound, and with
# it unbound. Each patch is one kubectl process, so the figures include its start; the difference
# is the policy. Results: docs/benchmarks.md ("The node-writes policy").
#
# Usage: bench/policy_cost.sh [ENTRIES] [PATCHES]    (defaults 6400, 20: near the limit)
# Needs a running control plane (e2e/cluster.sh up) and the CRDs applied.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
ENTRIES="${1:-6400}" PATCHES="${2:-20}"
export KUBECONFIG="${KUBECONFIG:-$PWD/e2e/.state/kubeconfig}"
K=e2e/bin/kubectl NS="policy-cost-$$" NODE="policy-cost-node-$$" WORK="$(mktemp -d)"
cleanup() {
  $K delete ns "$NS" --wait=false >/dev/null 2>&1 || true
  $K delete node "$NODE" >/dev/null 2>&1 || true
  $K -n whereabouts-system delete pod "agent-$NODE" --wait=false >/dev/null 2>&1 || true
  $K apply -f config/rbac/node-limits.yaml >/dev/null
  rm -rf "$WORK"
}
trap cleanup EXIT

$K apply -f crds/ >/dev/null
for ns in whereabouts-system whereabouts-operator; do $K create ns "$ns" >/dev/null 2>&1 || true; done
$K apply -f config/rbac/service_accounts.yaml -f config/rbac/node-limits.yaml >/dev/null
$K create ns "$NS" >/dev/null
$K -n "$NS" create role w --verb=get,patch --resource=ippools.whereabouts.cni.cncf.io >/dev/null
$K -n "$NS" create rolebinding w --role=w --serviceaccount=whereabouts-system:whereabouts-node >/dev/null
echo "{\"apiVersion\":\"v1\",\"kind\":\"Node\",\"metadata\":{\"name\":\"$NODE\"}}" | $K create -f - >/dev/null
echo "{\"apiVersion\":\"v1\",\"kind\":\"Pod\",\"metadata\":{\"name\":\"agent-$NODE\",\"namespace\":\"whereabouts-system\"},
  \"spec\":{\"nodeName\":\"$NODE\",\"serviceAccountName\":\"whereabouts-node\",\"automountServiceAccountToken\":false,
  \"containers\":[{\"name\":\"c\",\"image\":\"never-pulled\"}]}}" | $K create -f - >/dev/null
UID_="$($K -n whereabouts-system get pod "agent-$NODE" -o jsonpath='{.metadata.uid}')"
TOKEN="$($K -n whereabouts-system create token whereabouts-node --duration=1h --bound-object-kind=Pod \
  --bound-object-name="agent-$NODE" --bound-object-uid="$UID_")"
$K config view --raw --minify -o json | python3 -c '
import json, sys
c = json.load(sys.stdin)
c["users"] = [{"name": "node", "user": {"token": sys.argv[1]}}]
c["contexts"][0]["context"].update(user="node", namespace=sys.argv[2])
print(json.dumps(c))' "$TOKEN" "$NS" > "$WORK/node.kubeconfig"

# Typical entries (64-character container id, 52-character podref, net1, pod UID, node name),
# half of them another node's.
python3 - "$ENTRIES" "$NODE" > "$WORK/pool.json" <<'PY'
import json, sys
n, node = int(sys.argv[1]), sys.argv[2]
al = {str(i): {"id": "%064x" % i, "podref": "tenant-namespace-%02d/app-deployment-7d9f8c6b5-%06d" % (i % 50, i),
               "ifname": "net1", "poduid": "5f0c6a2e-1d3b-4c1e-9a4f-%012d" % i,
               "node": node if i % 2 else "node-b-of-the-cluster"} for i in range(1, n + 1)}
print(json.dumps({"apiVersion": "whereabouts.cni.cncf.io/v1alpha1", "kind": "IPPool",
                  "metadata": {"name": "big"}, "spec": {"range": "10.128.0.0/16", "allocations": al}}))
PY
$K -n "$NS" create -f "$WORK/pool.json" >/dev/null
echo "pool: $ENTRIES entries, $(stat -c %s "$WORK/pool.json") bytes as JSON; $PATCHES patches per run"

run() { # label
  local start end o
  start=$(date +%s.%N)
  for i in $(seq 1 $((PATCHES / 2))); do
    o=$((ENTRIES + 100 + i))
    $K --kubeconfig "$WORK/node.kubeconfig" patch ippool big --type=json -p \
      "[{\"op\":\"add\",\"path\":\"/spec/allocations/$o\",\"value\":{\"id\":\"x$o\",\"podref\":\"$NS/x\",\"ifname\":\"net1\",\"node\":\"$NODE\"}}]" >/dev/null
    $K --kubeconfig "$WORK/node.kubeconfig" patch ippool big --type=json -p \
      "[{\"op\":\"remove\",\"path\":\"/spec/allocations/$o\"}]" >/dev/null
  done
  end=$(date +%s.%N)
  python3 -c "print(f'$1: {($end - $start) / $PATCHES:.3f} s a patch')"
}
for round in 1 2 3; do
  $K apply -f config/rbac/node-limits.yaml >/dev/null; sleep 3; run "policy on "
  $K delete validatingadmissionpolicybinding whereabouts-node-writes >/dev/null; sleep 3; run "policy off"
done
