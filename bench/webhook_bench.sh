#!/usr/bin/env bash
# Benchmark of the admission webhook and the offline `validate` command (docs/benchmarks.md,
# section "Webhook and validate").
#
#   bench/webhook_bench.sh [RATE] [DURATION]      defaults: 500 requests/s for 30s
#
# 1. Webhook: the release operator (`run`, webhook + NAD cache against the local control plane from
#    e2e/cluster.sh, which honours WHEREABOUTS_E2E_STATE) serves HTTPS on loopback with a certificate
#    from webhook-certs/mint.sh; vegeta (Go, installed into bench/bin through the Go module proxy)
#    sends AdmissionReviews for a typical NAD at a constant RATE over keep-alive TLS connections and
#    reports latency percentiles.
# SKIP_BUILD=1 uses target/release as it is; OPERATOR=PATH measures that operator binary instead
# (an earlier build, for a before/after comparison in one session). CLUSTER_NADS=N first creates N NADs in the cluster
# (namespace bench-nads) on the range and network of the warn-cross-nad fixture, which is then
# measured too: each of its admissions is an overlap query against N cached NADs.
# 2. validate: 10,000 generated NADs in one multi-document YAML file, timed with the release binary
#    (best of 3).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
RATE="${1:-500}"
DURATION="${2:-30s}"
N_NADS="${N_NADS:-10000}"
work="$(mktemp -d /tmp/wa-webhook-bench.XXXXXX)"
op_pid=""
cleanup() {
  if [[ -n "$op_pid" ]]; then kill "$op_pid" 2>/dev/null || true; wait "$op_pid" 2>/dev/null || true; fi
  rm -rf "$work"
}
trap cleanup EXIT

if [[ -n "${OPERATOR:-}" ]]; then
  OP="$(realpath "$OPERATOR")"
else
  [[ "${SKIP_BUILD:-0}" == 1 ]] || cargo build -q --release --bin whereabouts-operator
  OP="$PWD/target/release/whereabouts-operator"
fi
VEGETA="$PWD/bench/bin/vegeta"
if [[ ! -x "$VEGETA" ]]; then
  GOBIN="$PWD/bench/bin" go install github.com/tsenart/vegeta/v12@v12.12.0
fi

kubeconfig="$(e2e/cluster.sh up | tail -n 1)"
e2e/bin/kubectl --kubeconfig "$kubeconfig" apply -f crds/ >/dev/null
CLUSTER_NADS="${CLUSTER_NADS:-0}"
fixtures=(valid-single invalid-many)
if ((CLUSTER_NADS > 0)); then
  e2e/bin/kubectl --kubeconfig "$kubeconfig" create namespace bench-nads >/dev/null
  python3 - "$CLUSTER_NADS" > "$work/cluster-nads.json" <<'PY'
import json, sys
config = json.dumps({"cniVersion": "0.3.1", "type": "macvlan",
                     "ipam": {"type": "whereabouts", "range": "10.50.0.0/24", "network_name": "blue"}})
print(json.dumps({"apiVersion": "v1", "kind": "List", "items": [
    {"apiVersion": "k8s.cni.cncf.io/v1", "kind": "NetworkAttachmentDefinition",
     "metadata": {"name": f"nad-{i}", "namespace": "bench-nads"}, "spec": {"config": config}}
    for i in range(int(sys.argv[1]))]}))
PY
  echo "creating $CLUSTER_NADS NADs in the cluster..." >&2
  e2e/bin/kubectl --kubeconfig "$kubeconfig" create -f "$work/cluster-nads.json" >/dev/null
  fixtures+=(warn-cross-nad)
fi
webhook-certs/mint.sh --ip 127.0.0.1 --out "$work/certs" >/dev/null 2>&1
free_port() { python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])'; }
wport="$(free_port)"; aport="$(free_port)"
KUBECONFIG="$kubeconfig" RUST_LOG=warn "$OP" run --leader-election=false \
  --webhook-addr "127.0.0.1:$wport" --admin-addr "127.0.0.1:$aport" \
  --tls-cert-file "$work/certs/tls.crt" --tls-key-file "$work/certs/tls.key" 2>"$work/operator.log" &
op_pid=$!
for _ in $(seq 100); do
  if curl -sf "http://127.0.0.1:$aport/readyz" >/dev/null 2>&1; then break; fi
  sleep 0.2
done
curl -sf "http://127.0.0.1:$aport/readyz" >/dev/null || { cat "$work/operator.log" >&2; echo "operator not ready" >&2; exit 1; }

target() {
  printf 'POST https://127.0.0.1:%s/validate\nContent-Type: application/json\n@%s\n\n' "$wport" "$1"
}
report() {
  python3 -c '
import json, sys
r = json.load(sys.stdin)
l = {k: v / 1e6 for k, v in r["latencies"].items()}
print("| %s | %.0f | %d | %.2f | %.2f | %.2f | %.2f | %.1f%% |" % (sys.argv[1], r["rate"], r["requests"],
      l["50th"], l["90th"], l["99th"], l["max"], r["success"] * 100))
' "$1"
}
echo "| request | rate (req/s) | requests | p50 (ms) | p90 (ms) | p99 (ms) | max (ms) | 2xx |"
echo "|---|---|---|---|---|---|---|---|"
for fixture in "${fixtures[@]}"; do
  # A discarded 5 s warm-up at the same rate: connection set-up, the operator's first watches
  # and lazy initialisation are not what the percentiles should describe.
  target "tests/fixtures/admission/$fixture.json" \
    | "$VEGETA" attack -rate="$RATE" -duration=5s -root-certs "$work/certs/ca.crt" -keepalive=true -workers 4 >/dev/null
  target "tests/fixtures/admission/$fixture.json" \
    | "$VEGETA" attack -rate="$RATE" -duration="$DURATION" -root-certs "$work/certs/ca.crt" -keepalive=true -workers 4 \
    | "$VEGETA" report -type=json | report "$fixture"
done

python3 - "$N_NADS" "$work/nads.yaml" <<'PY'
import json, sys
n, path = int(sys.argv[1]), sys.argv[2]
with open(path, "w") as f:
    for i in range(n):
        a, b = divmod(i, 250)
        ipam = {"type": "whereabouts", "range": f"10.{a}.{b}.0/24", "gateway": f"10.{a}.{b}.1",
                "exclude": [f"10.{a}.{b}.1/32"], "network_name": f"net{i % 4}"}
        if i % 3 == 0:
            ipam["ipRanges"] = [{"range": f"fd00:{i:x}::/64"}]
        config = json.dumps({"cniVersion": "0.3.1", "name": f"n{i}", "type": "macvlan", "master": "eth0", "ipam": ipam})
        f.write(f"---\napiVersion: k8s.cni.cncf.io/v1\nkind: NetworkAttachmentDefinition\nmetadata:\n  name: nad-{i}\n  namespace: team-{i % 50}\nspec:\n  config: '{config}'\n")
PY
best=""
for _ in 1 2 3; do
  start=$(date +%s.%N)
  "$OP" validate "$work/nads.yaml" >/dev/null 2>"$work/validate.err" || { cat "$work/validate.err" >&2; exit 1; }
  end=$(date +%s.%N)
  t=$(python3 -c "print(f'{$end - $start:.3f}')")
  if [[ -z "$best" ]] || python3 -c "import sys; sys.exit(0 if $t < $best else 1)"; then best=$t; fi
done
echo
echo "validate: $N_NADS NADs ($(du -h "$work/nads.yaml" | cut -f1) of YAML) in ${best}s (best of 3) = $(python3 -c "print(f'{$N_NADS / $best:,.0f}')") NADs/s; $(tail -n 1 "$work/validate.err")"
