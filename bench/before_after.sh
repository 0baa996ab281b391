#!/usr/bin/env bash
# Before and after in one session: the benchmarks of docs/benchmarks.md that a change of the
# engine, the plugin, the agent, the operator or the webhook can move, for an earlier revision
# (BASE) and HEAD, on one private control plane, alternating where the tool allows it.
#
#   bench/before_after.sh BASE_REV            # the full set (about 50 minutes on 2 cores)
#   QUICK=1 bench/before_after.sh BASE_REV    # one short run of each, to try the script
#   PARTS="cni nodes" CNI_CONCURRENCY=200 HEAD_REV=REV bench/before_after.sh BASE_REV
#                                             # only these parts (cni, storms, nodes, operator,
#                                             # webhook, abuse), the CNI scenarios at 200 only
#
# Builds (release, glibc, as docs/benchmarks.md's CNI figures): BASE in a temporary worktree with
# its own target dir, HEAD from the clean tree's commit (git archive), both copied to bench/bin as
# whereabouts-<rev>, whereabouts-operator-<rev> and webhook_serve-<rev>. Results: the tables and
# logs in bench/results/before-after-<BASE>-<HEAD>-<UTC>/. The real-node benchmark is not part of
# it (one node per machine, images per build): run bench/node_run.sh on each revision.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
base="$(git rev-parse --short "${1:?usage: bench/before_after.sh BASE_REV}")"
head="$(git rev-parse --short "${HEAD_REV:-HEAD}")"  # HEAD_REV: the "after" revision, HEAD by default
quick="${QUICK:-0}"
parts=" ${PARTS:-cni storms nodes operator webhook abuse} "
part() { [[ "$parts" == *" $1 "* ]]; }
out="$PWD/bench/results/before-after-$base-$head-$(date -u +%Y%m%dT%H%M%SZ)"
mkdir -p "$out" bench/bin
export WHEREABOUTS_E2E_STATE=/tmp/wa-bench-state
log() { echo "[before-after $(date -u +%H:%M:%S)] $*" >&2; }

# Builds one revision into bench/bin (skipped when its binaries are there).
build() {
  local rev="$1" src="/tmp/wa-src-$1" target="/tmp/wa-target-$1"
  if [[ -x "bench/bin/whereabouts-$rev" && -x "bench/bin/whereabouts-operator-$rev" &&
        -x "bench/bin/webhook_serve-$rev" ]]; then
    return
  fi
  log "building $rev (release)"
  rm -rf "$src" && mkdir -p "$src"
  git archive "$rev" | tar -x -C "$src"
  (cd "$src" && CARGO_TARGET_DIR="$target" cargo build -q --release --locked --bins --example webhook_serve)
  cp "$target/release/whereabouts" "bench/bin/whereabouts-$rev"
  cp "$target/release/whereabouts-operator" "bench/bin/whereabouts-operator-$rev"
  cp "$target/release/examples/webhook_serve" "bench/bin/webhook_serve-$rev"
  rm -rf "$src" "$target"
}
build "$base"
build "$head"
[[ -x bench/bin/whereabouts-upstream ]] || bench/build.sh --upstream-only
P_A="bench/bin/whereabouts-$head" O_A="bench/bin/whereabouts-operator-$head"
P_B="bench/bin/whereabouts-$base" O_B="bench/bin/whereabouts-operator-$base"

kubeconfig="$(e2e/cluster.sh up | tail -n 1)"
trap 'e2e/cluster.sh down >/dev/null 2>&1 || true' EXIT
kubectl() { e2e/bin/kubectl --kubeconfig "$kubeconfig" "$@"; }
kubectl apply -f crds/ >/dev/null

# 1. CNI allocation: both builds with and without their node agent, and upstream, alternating.
if part cni; then
log "CNI allocation"
if [[ "$quick" == 1 ]]; then cni_args=(--seq 10 --concurrency 50 --repeat 1); else
  cni_args=(--seq 50 --concurrency "${CNI_CONCURRENCY:-50,100,200}" --repeat 3); fi
python3 bench/cni_bench.py --kubeconfig "$kubeconfig" --keep-cluster \
  --impls ours-agent,ours-agent-baseline,ours,ours-baseline,upstream \
  --ours "$P_A" --operator "$O_A" \
  --baseline "$P_B=ours at $base" --baseline-operator "$O_B=ours at $base, node agent" \
  "${cni_args[@]}" --quiet-wait 0 >"$out/cni.md" 2>"$out/cni.log"
fi

# 2. DEL storms: 200 ADDs then 200 DELs of one /24, with and without the agent, alternating builds.
log "DEL storms"
storm() { # build-label plugin operator mode rep
  local ns="storm-$1-$4-$5" dir="$out/storm-$1-$4-$5"
  mkdir -p "$dir"
  kubectl create namespace "$ns" >/dev/null
  cp "$kubeconfig" "$dir/kc"
  e2e/bin/kubectl --kubeconfig "$dir/kc" config set-context --current --namespace "$ns" >/dev/null
  local agent_args=() agent_pid=""
  if [[ "$4" == agent ]]; then
    "$3" agent --socket "$dir/agent.sock" --kubeconfig "$dir/kc" --serves-kubeconfig "$dir/kc" \
      --admin-addr 127.0.0.1:0 2>"$dir/agent.log" &
    agent_pid=$!
    for _ in $(seq 50); do [[ -S "$dir/agent.sock" ]] && break; sleep 0.1; done
    agent_args=(--agent-socket "$dir/agent.sock")
  fi
  echo "== $1 $4 run $5" >>"$out/del_storm.txt"
  python3 bench/del_storm.py --kubeconfig "$dir/kc" --namespace "$ns" --n 200 \
    --range 10.42.0.0/24 --plugin "$2" "${agent_args[@]}" >>"$out/del_storm.txt" 2>&1
  if [[ -n "$agent_pid" ]]; then kill "$agent_pid" 2>/dev/null || true; wait "$agent_pid" || true; fi
  kubectl delete namespace "$ns" --wait=false >/dev/null
}
runs=3; [[ "$quick" == 1 ]] && runs=1
part storms && for rep in $(seq "$runs"); do
  for mode in agent direct; do
    storm "$head" "$P_A" "$O_A" "$mode" "$rep"
    storm "$base" "$P_B" "$O_B" "$mode" "$rep"
  done
done

# 2b. Many nodes, one network: 10 simulated nodes x 100 ADDs through their agents, into node
# slices (the operator assigns them) and into one pool per range (the default install: where the
# agents' groups and writer turns contend, and where a regression once went unnoticed because
# only slices were compared), each build twice, alternating.
if part nodes; then
  log "nodes: agents with slices and on one pool"
  nodes_args=(--modes ours-slices,ours-agents --nodes 10 --per-node 100)
  [[ "$quick" == 1 ]] && nodes_args=(--modes ours-slices,ours-agents --nodes 2 --per-node 10)
  for rev in "$head" "$base" "$head" "$base"; do
    echo "== nodes $rev" >>"$out/nodes.md"
    python3 bench/nodes_bench.py --kubeconfig "$kubeconfig" --keep-cluster "${nodes_args[@]}" \
      --ours "bench/bin/whereabouts-$rev" --operator "bench/bin/whereabouts-operator-$rev" \
      --out "$out" >>"$out/nodes.md" 2>>"$out/nodes-$rev.log"
  done
fi

# 3. The operator: 1000 pods' addresses released after one deletecollection.
op_runs=2; [[ "$quick" == 1 ]] && op_runs=1
part operator && log "operator" && for rev in "$head" "$base"; do
  echo "== operator $rev" >>"$out/operator.txt"
  python3 bench/operator_bench.py --kubeconfig "$kubeconfig" --keep-cluster --runs "$op_runs" \
    --parallel 8 --operator "bench/bin/whereabouts-operator-$rev" \
    --plugin "bench/bin/whereabouts-$rev" >>"$out/operator.txt" 2>"$out/operator-$rev.log"
done

# 4. The webhook (vegeta against the real operator) and `validate` of 10,000 NADs.
rate=500 duration=30s; [[ "$quick" == 1 ]] && duration=5s
part webhook && log "webhook and validate" && for rev in "$head" "$base" "$head" "$base"; do
  echo "== webhook $rev" >>"$out/webhook.txt"
  OPERATOR="bench/bin/whereabouts-operator-$rev" bench/webhook_bench.sh "$rate" "$duration" \
    >>"$out/webhook.txt" 2>"$out/webhook-$rev.log"
  [[ "$quick" == 1 ]] && break
done

# 5. The webhook under abuse (no API server): the real router and TLS stack of each build.
part abuse && log "webhook under abuse" && for rev in "$head" "$base"; do
  echo "== abuse $rev" >>"$out/abuse.txt"
  python3 bench/webhook_abuse.py --server "bench/bin/webhook_serve-$rev" \
    >>"$out/abuse.txt" 2>"$out/abuse-$rev.log"
done
log "done: $out"
echo "$out"
