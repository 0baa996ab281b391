#!/usr/bin/env bash
# `check && pass ... || fail ...` is fine here: pass always succeeds.
# shellcheck disable=SC2015
# Proves that the control plane of e2e/cluster.sh does what the e2e tests need:
#   readyz, the controller manager (default ServiceAccount, Deployment ->
#   ReplicaSet -> Pods), Pods stay Pending (no scheduler/kubelet), CRDs,
#   a validating admission webhook at https://127.0.0.1:PORT that the
#   apiserver really calls, and server-side dry-run apply.
# Then `down`, and checks that no started process survives and the state
# folder is gone. If a cluster was already up, it is reused and left up.
#
# Usage: e2e/selftest.sh        (prints "N passed, N failed" at the end)
set -euo pipefail

E2E_DIR="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
CLUSTER="$E2E_DIR/cluster.sh"
KUBECTL="$E2E_DIR/bin/kubectl"
STATE_DIR="${WHEREABOUTS_E2E_STATE:-$E2E_DIR/.state}"
case "$STATE_DIR" in /*) ;; *) STATE_DIR="$(pwd)/$STATE_DIR" ;; esac
TMP="$(mktemp -d /tmp/whereabouts-selftest.XXXXXX)"
NS="selftest-$$"
WEBHOOK_PID=""
PASSED=0
FAILED=0

say() { printf '[selftest] %s\n' "$*" >&2; }
pass() { PASSED=$((PASSED + 1)); say "PASS: $*"; }
fail() { FAILED=$((FAILED + 1)); say "FAIL: $*"; }
k() { "$KUBECTL" --kubeconfig "$KCFG" --request-timeout=10s "$@"; }

# poll SECONDS CMD...: retry CMD every 0.5 s until it succeeds.
poll() {
  local deadline=$((SECONDS + $1)); shift
  until "$@" >/dev/null 2>&1; do
    ((SECONDS < deadline)) || return 1
    sleep 0.5
  done
}

cleanup() {
  # Only the webhook server is ours to stop here (started below, by pid).
  if [[ -n "$WEBHOOK_PID" ]] && kill -0 "$WEBHOOK_PID" 2>/dev/null; then
    kill "$WEBHOOK_PID" 2>/dev/null || true
    wait "$WEBHOOK_PID" 2>/dev/null || true
  fi
  if [[ "${KEEP_CLUSTER:-0}" != 1 ]]; then
    "$CLUSTER" down || true
  fi
  rm -rf "$TMP"
}
trap cleanup EXIT

KEEP_CLUSTER=0
if "$CLUSTER" status 2>/dev/null; then
  KEEP_CLUSTER=1
  say "a cluster is already up: reusing it and leaving it up"
fi

# ---- up
start=$SECONDS
out="$("$CLUSTER" up)"
KCFG="$(tail -n 1 <<<"$out")"
say "up took $((SECONDS - start)) s; kubeconfig: $KCFG"
if [[ "$KCFG" == /* && -f "$KCFG" ]]; then pass "up printed an absolute kubeconfig path"; else fail "up printed '$KCFG'"; fi

start=$SECONDS
again="$("$CLUSTER" up | tail -n 1)"
[[ "$again" == "$KCFG" ]] && pass "second up is a no-op ($((SECONDS - start)) s), same path" || fail "second up printed '$again'"

[[ "$("$CLUSTER" env)" == "export KUBECONFIG=$KCFG" ]] && pass "env prints export KUBECONFIG=..." || fail "env: $("$CLUSTER" env)"

# ---- readyz
[[ "$(k get --raw /readyz)" == ok ]] && pass "/readyz is ok" || fail "/readyz not ok"

# ---- namespace + default ServiceAccount (serviceaccount controller)
k create namespace "$NS" >/dev/null
if poll 30 k -n "$NS" get serviceaccount default; then
  pass "namespace $NS got its default ServiceAccount"
else
  fail "no default ServiceAccount in $NS"
fi
# ... and the root CA ConfigMap (root-ca-cert-publisher controller)
poll 30 k -n "$NS" get configmap kube-root-ca.crt && pass "kube-root-ca.crt ConfigMap published" || fail "no kube-root-ca.crt"

# ---- a Pod stays Pending (no scheduler, no kubelet)
k -n "$NS" run lonely --image=registry.k8s.io/pause:3.10 --restart=Never >/dev/null
sleep 2
phase="$(k -n "$NS" get pod lonely -o jsonpath='{.status.phase}/{.spec.nodeName}')"
[[ "$phase" == "Pending/" ]] && pass "Pod created and stays Pending, unscheduled" || fail "Pod phase/node: $phase"

# ---- CRD
cat > "$TMP/crd.yaml" <<'EOF'
apiVersion: apiextensions.k8s.io/v1
kind: CustomResourceDefinition
metadata:
  name: widgets.selftest.example.com
spec:
  group: selftest.example.com
  scope: Namespaced
  names: {plural: widgets, singular: widget, kind: Widget}
  versions:
  - name: v1
    served: true
    storage: true
    schema:
      openAPIV3Schema:
        type: object
        properties:
          spec:
            type: object
            properties:
              size: {type: integer}
EOF
k apply -f "$TMP/crd.yaml" >/dev/null
if k wait --for=condition=Established --timeout=30s crd/widgets.selftest.example.com >/dev/null &&
   poll 30 k -n "$NS" get widgets &&
   printf 'apiVersion: selftest.example.com/v1\nkind: Widget\nmetadata: {name: w1}\nspec: {size: 3}\n' | k -n "$NS" apply -f - >/dev/null &&
   [[ "$(k -n "$NS" get widget w1 -o jsonpath='{.spec.size}')" == 3 ]]; then
  pass "CRD established, custom resource stored and read back"
else
  fail "CRD"
fi

# ---- Deployment -> ReplicaSet -> Pods (deployment + replicaset controllers)
k -n "$NS" create deployment web --image=registry.k8s.io/pause:3.10 --replicas=2 >/dev/null
rs_and_pods() {
  [[ "$(k -n "$NS" get rs -l app=web -o name | wc -l)" -ge 1 ]] &&
  [[ "$(k -n "$NS" get pods -l app=web -o name | wc -l)" -eq 2 ]]
}
if poll 30 rs_and_pods; then
  pass "Deployment created a ReplicaSet and 2 Pods"
else
  fail "Deployment: $(k -n "$NS" get rs,pods -l app=web 2>&1 | tr '\n' ' ')"
fi

# ---- validating webhook at https://127.0.0.1:PORT, cert signed by the cluster CA
PKI="$STATE_DIR/pki"
WPORT="$(python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])')"
openssl ecparam -name prime256v1 -genkey -noout -out "$TMP/wh.key" 2>/dev/null
openssl req -new -key "$TMP/wh.key" -subj "/CN=selftest-webhook" -out "$TMP/wh.csr" 2>/dev/null
printf 'subjectAltName=IP:127.0.0.1,DNS:localhost\nextendedKeyUsage=serverAuth\n' > "$TMP/wh.ext"
openssl x509 -req -in "$TMP/wh.csr" -CA "$PKI/ca.crt" -CAkey "$PKI/ca.key" -CAcreateserial \
  -CAserial "$TMP/ca.srl" -days 1 -sha256 -extfile "$TMP/wh.ext" -out "$TMP/wh.crt" 2>/dev/null
cat > "$TMP/webhook.py" <<'EOF'
# Allows every AdmissionReview and logs one line per request to stdout.
import http.server, json, ssl, sys
port, cert, key = int(sys.argv[1]), sys.argv[2], sys.argv[3]
class H(http.server.BaseHTTPRequestHandler):
    def do_POST(self):
        review = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        req = review["request"]
        print(f"REQUEST {self.path} {req['operation']} {req['kind']['kind']} "
              f"{req.get('namespace')}/{req.get('name')} uid={req['uid']}", flush=True)
        body = json.dumps({"apiVersion": "admission.k8s.io/v1", "kind": "AdmissionReview",
                           "response": {"uid": req["uid"], "allowed": True}}).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)
    def log_message(self, *a):
        pass
ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
ctx.load_cert_chain(cert, key)
srv = http.server.HTTPServer(("127.0.0.1", port), H)
srv.socket = ctx.wrap_socket(srv.socket, server_side=True)
print(f"LISTENING {port}", flush=True)
srv.serve_forever()
EOF
python3 "$TMP/webhook.py" "$WPORT" "$TMP/wh.crt" "$TMP/wh.key" > "$TMP/webhook.log" 2>&1 &
WEBHOOK_PID=$!
poll 10 grep -q LISTENING "$TMP/webhook.log" || say "webhook server did not start: $(cat "$TMP/webhook.log")"
cat > "$TMP/vwc.yaml" <<EOF
apiVersion: admissionregistration.k8s.io/v1
kind: ValidatingWebhookConfiguration
metadata:
  name: selftest-allow-all
webhooks:
- name: allow-all.selftest.example.com
  admissionReviewVersions: ["v1"]
  sideEffects: None
  failurePolicy: Fail
  timeoutSeconds: 5
  namespaceSelector:
    matchLabels:
      kubernetes.io/metadata.name: $NS
  rules:
  - apiGroups: [""]
    apiVersions: ["v1"]
    operations: ["CREATE"]
    resources: ["configmaps"]
  clientConfig:
    url: https://127.0.0.1:$WPORT/validate
    caBundle: $(base64 -w0 < "$PKI/ca.crt")
EOF
k apply -f "$TMP/vwc.yaml" >/dev/null
# Webhook configurations take effect asynchronously; create ConfigMaps until
# one shows up in the webhook's log.
seen=0
for i in $(seq 1 20); do
  k -n "$NS" create configmap "hooked-$i" --from-literal=a=b >/dev/null
  if grep -q "ConfigMap $NS/hooked-$i " "$TMP/webhook.log"; then seen=$i; break; fi
  sleep 0.5
done
if ((seen > 0)); then
  pass "apiserver called the webhook at https://127.0.0.1:$WPORT (ConfigMap hooked-$seen): $(grep "hooked-$seen " "$TMP/webhook.log")"
else
  fail "webhook never called; its log: $(cat "$TMP/webhook.log")"
fi
k delete validatingwebhookconfiguration selftest-allow-all >/dev/null && pass "webhook configuration deleted" || fail "delete webhook configuration"
kill "$WEBHOOK_PID"; wait "$WEBHOOK_PID" 2>/dev/null || true; WEBHOOK_PID=""

# ---- server-side apply with server dry-run of ordinary objects
cat > "$TMP/ssa.yaml" <<EOF
apiVersion: v1
kind: Namespace
metadata: {name: selftest-dryrun}
---
apiVersion: v1
kind: ServiceAccount
metadata: {name: dryrun, namespace: $NS}
---
apiVersion: rbac.authorization.k8s.io/v1
kind: ClusterRole
metadata: {name: selftest-dryrun}
rules:
- apiGroups: [""]
  resources: [pods]
  verbs: [get, list]
---
apiVersion: apps/v1
kind: Deployment
metadata: {name: dryrun, namespace: $NS}
spec:
  replicas: 1
  selector: {matchLabels: {app: dryrun}}
  template:
    metadata: {labels: {app: dryrun}}
    spec:
      containers: [{name: c, image: registry.k8s.io/pause:3.10}]
EOF
if out="$(k apply --server-side --dry-run=server -f "$TMP/ssa.yaml" 2>&1)"; then
  say "$out"
  if ! k get namespace selftest-dryrun >/dev/null 2>&1 && ! k get clusterrole selftest-dryrun >/dev/null 2>&1; then
    pass "server-side apply --dry-run=server of Namespace, ServiceAccount, ClusterRole, Deployment (nothing persisted)"
  else
    fail "dry-run persisted objects"
  fi
else
  fail "server-side dry-run apply: $out"
fi
k delete namespace "$NS" --wait=false >/dev/null
k delete crd widgets.selftest.example.com --wait=false >/dev/null

# ---- down
if [[ "$KEEP_CLUSTER" != 1 ]]; then
  pids="$(cat "$STATE_DIR"/*.pid)"
  start=$SECONDS
  "$CLUSTER" down
  say "down took $((SECONDS - start)) s"
  alive=""
  for p in $pids; do
    if [[ -d /proc/$p && "$(awk '{print $3}' "/proc/$p/stat" 2>/dev/null)" != Z ]]; then alive+=" $p"; fi
  done
  [[ -z "$alive" ]] && pass "down: no process from the pid files (${pids//$'\n'/ }) remains" || fail "down: still alive:$alive"
  [[ ! -e "$STATE_DIR" ]] && pass "down: state folder removed" || fail "down: $STATE_DIR still exists"
  KEEP_CLUSTER=1 # already down; the EXIT trap need not call it again
fi

echo "$PASSED passed, $FAILED failed"
((FAILED == 0))
