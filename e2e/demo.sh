#!/usr/bin/env bash
# The demo (`make demo`): a local control plane, our CRDs, the operator with its admission webhook,
# the sample NADs (and one invalid NAD the webhook rejects), three pods given dual-stack addresses
# by the real CNI plugin (inside real network namespaces through Debian's bridge plugin when run as
# root), one pod deleted and its addresses released by the operator, and pool usage from
# `kubectl get ippools` and /metrics. Everything it starts is stopped and removed on exit.
#
# Uses its own state folder (WHEREABOUTS_E2E_STATE, default /tmp/whereabouts-demo), so a control
# plane of the test tier keeps running untouched. Builds the debug binaries (`cargo build --bins`,
# the profile the test tier already built; release adds minutes on a small machine for no
# visible difference here).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
repo="$PWD"

export WHEREABOUTS_E2E_STATE="${WHEREABOUTS_E2E_STATE:-/tmp/whereabouts-demo}"
NS=demo
BRIDGE=wademo0
PODS=(web-0 web-1 web-2)
NAD=whereabouts-dual-stack

bold() { printf '\n\033[1m== %s\033[0m\n' "$*"; }
say() { printf '   %s\n' "$*"; }
run() { printf '\033[2m$ %s\033[0m\n' "$*"; "$@"; }

work="$(mktemp -d /tmp/whereabouts-demo-work.XXXXXX)"
operator_pid=""
cluster_started=0
netns=()
kubectl() { "$repo/e2e/bin/kubectl" --kubeconfig "$ADMIN" "$@"; }

cleanup() {
  local rc=$?
  set +e
  bold "Cleaning up"
  if [[ -n "$operator_pid" ]]; then kill "$operator_pid" 2>/dev/null && wait "$operator_pid" 2>/dev/null; say "operator stopped"; fi
  if [[ ${#netns[@]} -gt 0 ]]; then
    for n in "${netns[@]}"; do ip netns delete "$n" 2>/dev/null; done
    say "network namespaces deleted: ${netns[*]}"
  fi
  if ip link show "$BRIDGE" >/dev/null 2>&1; then ip link delete "$BRIDGE" && say "bridge $BRIDGE deleted"; fi
  if [[ $cluster_started == 1 ]]; then
    kubectl delete validatingwebhookconfiguration whereabouts-demo --ignore-not-found >/dev/null 2>&1
    e2e/cluster.sh down >/dev/null 2>&1 && say "control plane stopped, $WHEREABOUTS_E2E_STATE removed"
  fi
  if [[ $rc != 0 && -s "$work/operator.log" ]]; then
    echo "--- last lines of the operator log ---" >&2
    tail -n 30 "$work/operator.log" >&2
  fi
  rm -rf "$work"
  if [[ $rc == 0 ]]; then bold "Demo finished"; else echo "demo failed (exit $rc)" >&2; fi
  exit "$rc"
}
trap cleanup EXIT
trap 'exit 130' INT TERM

free_port() { python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'; }
wait_for() { # wait_for SECONDS COMMAND...
  local deadline=$((SECONDS + $1)); shift
  until "$@" >/dev/null 2>&1; do
    if ((SECONDS > deadline)); then echo "timed out waiting for: $*" >&2; return 1; fi
    sleep 0.2
  done
}

bold "Building the binaries (cargo build --bins)"
cargo build --bins --quiet
BIN="$repo/target/debug"
say "$BIN/whereabouts (the CNI plugin), $BIN/whereabouts-operator"

bold "Starting a local control plane (etcd + kube-apiserver + kube-controller-manager on 127.0.0.1)"
cluster_started=1
ADMIN="$(e2e/cluster.sh up | tail -n1)"
say "state: $WHEREABOUTS_E2E_STATE, admin kubeconfig: $ADMIN"

bold "Installing the CRDs"
run kubectl apply -f crds/
kubectl wait --for=condition=Established --timeout=30s \
  crd/ippools.whereabouts.cni.cncf.io crd/overlappingrangeipreservations.whereabouts.cni.cncf.io \
  crd/network-attachment-definitions.k8s.cni.cncf.io >/dev/null
kubectl create namespace "$NS" >/dev/null
kubectl -n "$NS" create serviceaccount default >/dev/null 2>&1 || true

bold "Starting the operator with its admission webhook"
ca_bundle="$(webhook-certs/mint.sh --ip 127.0.0.1 --out "$work/certs" 2>/dev/null)"
webhook_port="$(free_port)"
admin_port="$(free_port)"
KUBECONFIG="$ADMIN" RUST_LOG=info POD_NAME=demo-operator "$BIN/whereabouts-operator" run \
  --webhook-addr "127.0.0.1:$webhook_port" --admin-addr "127.0.0.1:$admin_port" \
  --tls-cert-file "$work/certs/tls.crt" --tls-key-file "$work/certs/tls.key" \
  --pool-namespace "$NS" --leader-election=false --audit-interval=10s \
  >"$work/operator.log" 2>&1 &
operator_pid=$!
wait_for 30 curl -sf "http://127.0.0.1:$admin_port/readyz"
say "ready: webhook https://127.0.0.1:$webhook_port/validate, admin http://127.0.0.1:$admin_port (/readyz, /metrics)"
kubectl apply -f - >/dev/null <<EOF
apiVersion: admissionregistration.k8s.io/v1
kind: ValidatingWebhookConfiguration
metadata:
  name: whereabouts-demo
webhooks:
  - name: nad.whereabouts.cni.cncf.io
    clientConfig:
      url: https://127.0.0.1:$webhook_port/validate
      caBundle: $ca_bundle
    rules:
      - apiGroups: ["k8s.cni.cncf.io"]
        apiVersions: ["v1"]
        operations: ["CREATE", "UPDATE"]
        resources: ["network-attachment-definitions"]
        scope: Namespaced
    namespaceSelector:
      matchLabels:
        kubernetes.io/metadata.name: $NS
    failurePolicy: Fail
    sideEffects: None
    timeoutSeconds: 5
    admissionReviewVersions: ["v1"]
EOF
say "ValidatingWebhookConfiguration whereabouts-demo registered (scoped to namespace $NS)"
# The API server picks up a new webhook configuration asynchronously: wait until a bad NAD is refused.
probe='{"apiVersion":"k8s.cni.cncf.io/v1","kind":"NetworkAttachmentDefinition","metadata":{"name":"probe"},"spec":{"config":"{\"cniVersion\":\"0.3.1\",\"name\":\"p\",\"type\":\"macvlan\",\"ipam\":{\"type\":\"whereabouts\",\"range\":\"bad\"}}"}}'
wait_for 20 bash -c "! echo '$probe' | '$repo/e2e/bin/kubectl' --kubeconfig '$ADMIN' -n $NS create --dry-run=server -f -"

bold "Applying the sample NADs (config/samples)"
run kubectl apply -n "$NS" -k config/samples

bold "Applying an invalid NAD: the webhook rejects it and says why"
cat >"$work/broken.yaml" <<'EOF'
apiVersion: k8s.cni.cncf.io/v1
kind: NetworkAttachmentDefinition
metadata:
  name: broken
spec:
  config: '{"cniVersion": "0.3.1", "name": "broken", "type": "macvlan", "master": "eth0",
            "ipam": {"type": "whereabouts", "range": "10.50.0.0/24", "range_start": "10.60.0.10",
                     "exclude": ["not-an-address"]}}'
EOF
sed 's/^/   | /' "$work/broken.yaml"
if kubectl apply -n "$NS" -f "$work/broken.yaml" 2>"$work/rejected.txt"; then
  echo "the invalid NAD was accepted" >&2
  exit 1
fi
sed 's/^/   kubectl: /' "$work/rejected.txt"

bold "Playing the container runtime for ${#PODS[@]} pods on NAD $NAD (10.20.0.0/24 + fd00:20::/64)"
# The node's flat file and kubeconfig, as install-cni writes them on a node; the context namespace
# is where pools live.
cp "$ADMIN" "$work/node.kubeconfig"
"$repo/e2e/bin/kubectl" --kubeconfig "$work/node.kubeconfig" config set-context --current --namespace "$NS" >/dev/null
printf '{"kubernetes": {"kubeconfig": "%s"}}\n' "$work/node.kubeconfig" >"$work/whereabouts.conf"
# The network config Multus would hand over: the NAD's ipam, with a bridge instead of macvlan
# (this machine has no eth0 to hang macvlans on).
kubectl -n "$NS" get net-attach-def "$NAD" -o jsonpath='{.spec.config}' |
  python3 -c 'import json, sys
conf = json.load(sys.stdin)
conf.update({"cniVersion": "1.0.0", "type": "bridge", "bridge": sys.argv[1]})
conf.pop("master", None); conf.pop("mode", None)
conf["ipam"]["configuration_path"] = sys.argv[2]
print(json.dumps(conf))' "$BRIDGE" "$work/whereabouts.conf" >"$work/net.json"
say "network config: $(cat "$work/net.json")"

as_root=0
if [[ $(id -u) == 0 ]] && command -v ip >/dev/null && [[ -x /usr/lib/cni/bridge ]]; then
  as_root=1
  mkdir -p "$work/cni-bin"
  ln -s /usr/lib/cni/bridge "$work/cni-bin/bridge"
  ln -s "$BIN/whereabouts" "$work/cni-bin/whereabouts"
  say "as root: Debian's bridge plugin calls ours as its IPAM, in a real network namespace per pod"
else
  say "not root (or no /usr/lib/cni/bridge): calling the whereabouts plugin directly, no network namespaces"
fi

cni() { # cni COMMAND POD NETNS-PATH
  local plugin="$BIN/whereabouts" path="$BIN"
  if [[ $as_root == 1 ]]; then plugin="$work/cni-bin/bridge"; path="$work/cni-bin"; fi
  env -i PATH="$PATH" CNI_COMMAND="$1" CNI_CONTAINERID="ctr-$2" CNI_NETNS="$3" CNI_IFNAME=net1 \
    CNI_PATH="$path" CNI_ARGS="IgnoreUnknown=1;K8S_POD_NAMESPACE=$NS;K8S_POD_NAME=$2;K8S_POD_UID=$4" \
    WHEREABOUTS_CONF_DIR="$work" "$plugin" <"$work/net.json"
}

declare -A addrs uids netns_of
for pod in "${PODS[@]}"; do
  uids[$pod]="$(kubectl -n "$NS" run "$pod" --image=registry.invalid/pause --restart=Never \
    --overrides='{"spec":{"automountServiceAccountToken":false}}' -o jsonpath='{.metadata.uid}')"
  nspath=/var/run/netns/none
  if [[ $as_root == 1 ]]; then
    n="wademo-$pod"; ip netns add "$n"; netns+=("$n"); nspath="/var/run/netns/$n"
  fi
  netns_of[$pod]="$nspath"
  result="$(cni ADD "$pod" "$nspath" "${uids[$pod]}")"
  addrs[$pod]="$(python3 -c 'import json, sys; print(" ".join(i["address"] for i in json.load(sys.stdin)["ips"]))' <<<"$result")"
  say "pod $NS/$pod: ADD -> ${addrs[$pod]}"
  if [[ $as_root == 1 ]]; then
    ip -n "wademo-$pod" -br addr show net1 | sed 's/^/      ip -n wademo-'"$pod"' addr: /'
  fi
  # What Multus writes on the pod: the operator reads it to know what to release.
  ips_json="$(python3 -c 'import json, sys; print(json.dumps([a.split("/")[0] for a in sys.argv[1:]]))' ${addrs[$pod]})"
  kubectl -n "$NS" annotate pod "$pod" \
    "k8s.v1.cni.cncf.io/network-status=[{\"name\":\"$NS/$NAD\",\"interface\":\"net1\",\"ips\":$ips_json}]" >/dev/null
done

bold "The pools"
run kubectl get ippools -n "$NS"
run kubectl get ippool 10.20.0.0-24 -n "$NS" -o yaml

victim="${PODS[1]}"
bold "Deleting pod $victim: the operator releases ${addrs[$victim]}"
start=$SECONDS
run kubectl -n "$NS" delete pod "$victim" --wait=false
wait_for 30 bash -c "! { '$repo/e2e/bin/kubectl' --kubeconfig '$ADMIN' -n $NS get ippool 10.20.0.0-24 -o jsonpath='{.spec.allocations}' | grep -q '\"$NS/$victim\"'; } && ! { '$repo/e2e/bin/kubectl' --kubeconfig '$ADMIN' -n $NS get ippool fd00-20---64 -o jsonpath='{.spec.allocations}' | grep -q '\"$NS/$victim\"'; }"
say "released within $((SECONDS - start)) s; allocations left:"
for pool in 10.20.0.0-24 fd00-20---64; do
  kubectl -n "$NS" get ippool "$pool" -o jsonpath='{.spec.allocations}' |
    python3 -c 'import json, sys
for k, v in sorted(json.load(sys.stdin).items()):
    print("      %s offset %s: %s" % (sys.argv[1], k, v["podref"]))' "$pool"
done
run kubectl -n "$NS" get events --field-selector reason=AddressReleased -o custom-columns=OBJECT:.involvedObject.name,MESSAGE:.message
# The runtime's DEL for the deleted pod's sandbox finds nothing left to release: it succeeds.
cni DEL "$victim" "${netns_of[$victim]}" "${uids[$victim]}" && say "runtime DEL for $victim: ok (nothing left to release)"

bold "Pool usage from /metrics"
run curl -s "http://127.0.0.1:$admin_port/metrics" -o "$work/metrics.txt"
grep '^whereabouts_' "$work/metrics.txt" | grep -v '_bucket{' | sed 's/^/   /'
