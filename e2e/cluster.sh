#!/usr/bin/env bash
# Local Kubernetes control plane for e2e tests: etcd + kube-apiserver +
# kube-controller-manager on 127.0.0.1, no kubelet, no scheduler, no Docker.
#
#   e2e/cluster.sh up     build binaries if needed, start everything, wait until
#                         ready; the LAST line of stdout is the absolute path of
#                         the admin kubeconfig (progress goes to stderr).
#                         Idempotent: if the cluster is already up and healthy
#                         it just prints the path again.
#   e2e/cluster.sh down   stop exactly the processes `up` started (pid files),
#                         wait for them to exit, remove the state folder.
#   e2e/cluster.sh env    print `export KUBECONFIG=<path>` (eval "$(... env)").
#   e2e/cluster.sh status print what is running (stderr) and exit 0 if healthy.
#   e2e/cluster.sh restart etcd|kube-apiserver [--crash]
#                         stop one component (SIGTERM; SIGKILL with --crash) and
#                         start it again with the same flags and data; returns
#                         when it is healthy (fault injection).
#   e2e/cluster.sh pause etcd|kube-apiserver SECONDS
#                         SIGSTOP it, SIGCONT after SECONDS: calls hang (faults).
#   e2e/cluster.sh replica
#                         start (if not running) a second kube-apiserver over the same etcd,
#                         with the same flags on a port of its own, and print the path of its
#                         admin kubeconfig (replica.kubeconfig). `restart kube-apiserver-replica`
#                         then restarts it alone: the clients a test points at it see an API
#                         server restart (watches relisted), the other tests see nothing.
#
# Environment:
#   WHEREABOUTS_E2E_STATE    state folder (default: e2e/.state next to this script)
#   WHEREABOUTS_E2E_K8S      which Kubernetes release runs the API server and controller manager
#                            of a new cluster: `newest` (default; e2e/k8s, e2e/bin/) or `min`,
#                            the oldest supported one (e2e/k8s-min, e2e/bin/min/; etcd and
#                            kubectl stay the newest's). Recorded in the state folder (file
#                            `k8s`): restart, status and down act on what `up` started whatever
#                            the variable says, and `up` refuses to reuse a running cluster of
#                            the other release.
#   WHEREABOUTS_E2E_TIMEOUT  seconds to wait for each component (default 60)
#   WHEREABOUTS_E2E_APISERVER_PORT  fixed apiserver port (default: a free one)
#   WHEREABOUTS_E2E_SKIP_BUILD=1    use e2e/bin as is, never call build.sh
#
# State folder layout: pki/ (CA, certs, keys), etcd-data/, *.log, *.pid,
# cluster.env (ports, urls), kubeconfig (admin, O=system:masters), k8s (newest or min).
set -euo pipefail

E2E_DIR="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
BIN_DIR="$E2E_DIR/bin"
STATE_DIR="${WHEREABOUTS_E2E_STATE:-$E2E_DIR/.state}"
# Make the state path absolute (the printed kubeconfig path must be absolute,
# and callers may run us from any cwd). Its parent has to exist.
case "$STATE_DIR" in
  /*) ;;
  *) STATE_DIR="$(pwd)/$STATE_DIR" ;;
esac
STATE_DIR="${STATE_DIR%/}"
TIMEOUT="${WHEREABOUTS_E2E_TIMEOUT:-60}"
KUBECONFIG_PATH="$STATE_DIR/kubeconfig"
PKI="$STATE_DIR/pki"
# Start order; `down` stops them in reverse.
COMPONENTS=(etcd kube-apiserver kube-controller-manager)

# Cluster configuration. Without a node no traffic goes to the service range;
# with e2e/node.sh, kube-proxy serves it on that node only (see node.sh).
SERVICE_CIDR="10.96.0.0/16"
SA_ISSUER="https://kubernetes.default.svc.cluster.local"

# Pid files, logs, start/stop/wait: shared with e2e/node.sh.
PROC_DIR="$STATE_DIR"
PROC_TAG=cluster
# The control plane's release (WHEREABOUTS_E2E_K8S above). A state folder's recorded release
# wins over the variable, so that its processes are always recognised by their executables
# (is_our_process) and stopped by `down`; the variable chooses only for a new cluster (cmd_up).
K8S_FILE="$STATE_DIR/k8s"
REQUESTED_K8S="${WHEREABOUTS_E2E_K8S:-}"
K8S="$(cat "$K8S_FILE" 2>/dev/null || true)"
K8S="${K8S:-${REQUESTED_K8S:-newest}}"
exe_of() {
  case "$K8S:$1" in
    *:kube-apiserver-replica) exe_of kube-apiserver ;;
    min:kube-apiserver|min:kube-controller-manager) echo "$BIN_DIR/min/$1" ;;
    *) echo "$BIN_DIR/$1" ;;
  esac
}
# The binaries a cluster of release K8S runs (e2e/build.sh names).
binaries() {
  if [[ "$K8S" == min ]]; then
    echo etcd min/kube-apiserver min/kube-controller-manager kubectl
  else
    echo etcd kube-apiserver kube-controller-manager kubectl
  fi
}
# shellcheck source=lib/procs.sh
source "$E2E_DIR/lib/procs.sh"
for k in "$K8S" ${REQUESTED_K8S:+"$REQUESTED_K8S"}; do
  [[ "$k" == newest || "$k" == min ]] \
    || die "WHEREABOUTS_E2E_K8S (or $K8S_FILE) is '$k': want newest or min"
done

# Stops the components by their pid files, newest first.
stop_components() {
  local i
  for ((i = ${#COMPONENTS[@]} - 1; i >= 0; i--)); do
    stop_one "${COMPONENTS[$i]}"
  done
}

# ------------------------------------------------------------------- ports

port_is_free() {
  python3 - "$1" <<'EOF'
import socket, sys
s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
try:
    s.bind(("127.0.0.1", int(sys.argv[1])))
except OSError:
    sys.exit(1)
EOF
}

# --------------------------------------------------------------------- pki

# All keys are ECDSA P-256: generated instantly, and supported by etcd's and
# Kubernetes' TLS stacks, service-account tokens (ES256) and python's ssl.
# sign_cert NAME SUBJECT EXTENSIONS [CA]: key + cert signed by CA (default:
# the cluster CA "ca").
sign_cert() {
  local name="$1" subj="$2" ext="$3" ca="${4:-ca}"
  openssl ecparam -name prime256v1 -genkey -noout -out "$PKI/$name.key"
  openssl req -new -key "$PKI/$name.key" -subj "$subj" -out "$PKI/$name.csr"
  printf '%s\n' "$ext" > "$PKI/$name.ext"
  openssl x509 -req -in "$PKI/$name.csr" -CA "$PKI/$ca.crt" -CAkey "$PKI/$ca.key" \
    -CAcreateserial -days 365 -sha256 -extfile "$PKI/$name.ext" -out "$PKI/$name.crt"
  rm -f "$PKI/$name.csr" "$PKI/$name.ext"
}

make_pki() {
  mkdir -p "$PKI"
  (
    set -e
    exec >>"$PKI/openssl.log" 2>&1
    openssl ecparam -name prime256v1 -genkey -noout -out "$PKI/ca.key"
    openssl req -x509 -new -key "$PKI/ca.key" -sha256 -days 3650 \
      -subj "/CN=whereabouts-e2e-ca" \
      -addext "basicConstraints=critical,CA:TRUE" \
      -addext "keyUsage=critical,keyCertSign,cRLSign,digitalSignature" \
      -out "$PKI/ca.crt"
    # Serving cert of the apiserver: reached as https://127.0.0.1:PORT (and
    # localhost); the in-cluster names are there for completeness.
    sign_cert apiserver "/CN=kube-apiserver" \
"basicConstraints=CA:FALSE
keyUsage=critical,digitalSignature,keyEncipherment
extendedKeyUsage=serverAuth
subjectAltName=IP:127.0.0.1,DNS:localhost,IP:10.96.0.1,DNS:kubernetes,DNS:kubernetes.default,DNS:kubernetes.default.svc,DNS:kubernetes.default.svc.cluster.local"
    # The API server's identity towards kubelets (logs, exec), for e2e/node.sh's node.
    sign_cert apiserver-kubelet-client "/O=system:masters/CN=kube-apiserver-kubelet-client" \
"basicConstraints=CA:FALSE
keyUsage=critical,digitalSignature,keyEncipherment
extendedKeyUsage=clientAuth"
    # Cluster admin: the group system:masters bypasses RBAC.
    sign_cert admin "/O=system:masters/CN=kubernetes-admin" \
"basicConstraints=CA:FALSE
keyUsage=critical,digitalSignature,keyEncipherment
extendedKeyUsage=clientAuth"
    # The controller manager's own identity, bound by the bootstrap RBAC
    # policy (it then gets per-controller service-account credentials).
    sign_cert controller-manager "/CN=system:kube-controller-manager" \
"basicConstraints=CA:FALSE
keyUsage=critical,digitalSignature,keyEncipherment
extendedKeyUsage=clientAuth"
    # Front proxy (aggregation layer): its own CA, as kubeadm does, because
    # a cert from it can assert any user via X-Remote-User headers. Without
    # it the controller manager's delegated authn logs "missing content for
    # CA bundle ...requestheader-client-ca-file" again and again.
    openssl ecparam -name prime256v1 -genkey -noout -out "$PKI/front-proxy-ca.key"
    openssl req -x509 -new -key "$PKI/front-proxy-ca.key" -sha256 -days 3650 \
      -subj "/CN=whereabouts-e2e-front-proxy-ca" \
      -addext "basicConstraints=critical,CA:TRUE" \
      -addext "keyUsage=critical,keyCertSign,cRLSign,digitalSignature" \
      -out "$PKI/front-proxy-ca.crt"
    sign_cert front-proxy-client "/CN=front-proxy-client" \
"basicConstraints=CA:FALSE
keyUsage=critical,digitalSignature,keyEncipherment
extendedKeyUsage=clientAuth" front-proxy-ca
    # Service-account token signing key pair.
    openssl ecparam -name prime256v1 -genkey -noout -out "$PKI/sa.key"
    openssl ec -in "$PKI/sa.key" -pubout -out "$PKI/sa.pub"
  ) || { tail -n 20 "$PKI/openssl.log" >&2; die "generating certificates with openssl failed"; }
}

# write_kubeconfig FILE CERTNAME USER [PORT]: certs embedded, so the file stands alone; the API
# server at PORT (default: the first one's).
write_kubeconfig() {
  local file="$1" cert="$2" user="$3" port="${4:-$APISERVER_PORT}"
  cat > "$file" <<EOF
apiVersion: v1
kind: Config
clusters:
- name: whereabouts-e2e
  cluster:
    server: https://127.0.0.1:${port}
    certificate-authority-data: $(base64 -w0 < "$PKI/ca.crt")
users:
- name: ${user}
  user:
    client-certificate-data: $(base64 -w0 < "$PKI/$cert.crt")
    client-key-data: $(base64 -w0 < "$PKI/$cert.key")
contexts:
- name: whereabouts-e2e
  context:
    cluster: whereabouts-e2e
    user: ${user}
current-context: whereabouts-e2e
EOF
  chmod 600 "$file"
}

kubectl_admin() {
  "$BIN_DIR/kubectl" --kubeconfig "$KUBECONFIG_PATH" --request-timeout=5s "$@"
}

readyz_ok() { readyz_ok_at "$KUBECONFIG_PATH"; }

# readyz_ok_at KUBECONFIG: the API server of KUBECONFIG answers /readyz.
readyz_ok_at() {
  [[ "$("$BIN_DIR/kubectl" --kubeconfig "$1" --request-timeout=5s get --raw /readyz 2>/dev/null)" == "ok" ]]
}

etcd_healthy() {
  curl --noproxy '*' -fsS --max-time 2 "http://127.0.0.1:$ETCD_PORT/health" | grep -q '"health":"true"'
}

healthy() {
  [[ -f "$KUBECONFIG_PATH" ]] || return 1
  components_running || return 1
  readyz_ok
}

# ------------------------------------------------------------- components

# Each starts its component with the ports of cluster.env and waits until it is healthy; `up`
# and `restart` share them, so a restarted component runs with exactly the flags it had.
start_etcd() {
  # etcd: plain HTTP, bound to loopback only, a single throwaway member.
  # --unsafe-no-fsync: the data is disposable and fsync dominates write
  # latency on CI disks.
  start etcd \
    --name=e2e \
    --data-dir="$STATE_DIR/etcd-data" \
    --listen-client-urls="http://127.0.0.1:$ETCD_PORT" \
    --advertise-client-urls="http://127.0.0.1:$ETCD_PORT" \
    --listen-peer-urls="http://127.0.0.1:$ETCD_PEER_PORT" \
    --initial-advertise-peer-urls="http://127.0.0.1:$ETCD_PEER_PORT" \
    --initial-cluster="e2e=http://127.0.0.1:$ETCD_PEER_PORT" \
    --initial-cluster-state=new \
    --unsafe-no-fsync=true \
    --log-level=warn
  wait_for etcd "etcd healthy on http://127.0.0.1:$ETCD_PORT/health" \
    etcd_healthy
}

# The ResourceQuota admission plugin limits the critical priority classes as GKE's API servers
# do (`limitedResources`): a pod of system-node-critical or system-cluster-critical is refused in
# a namespace with no quota covering its class. So every test runs where the node DaemonSet needs
# its quota (config/cni/critical-quota.yaml) outside kube-system.
write_admission_config() {
  cat > "$STATE_DIR/admission.yaml" <<'EOF'
apiVersion: apiserver.config.k8s.io/v1
kind: AdmissionConfiguration
plugins:
  - name: ResourceQuota
    configuration:
      apiVersion: apiserver.config.k8s.io/v1
      kind: ResourceQuotaConfiguration
      limitedResources:
        - resource: pods
          matchScopes:
            - scopeName: PriorityClass
              operator: In
              values: ["system-node-critical", "system-cluster-critical"]
EOF
}

# start_kube_apiserver [NAME PORT KUBECONFIG]: the first API server, or with arguments the replica.
start_kube_apiserver() {
  local name="${1:-kube-apiserver}" port="${2:-$APISERVER_PORT}" kubeconfig="${3:-$KUBECONFIG_PATH}"
  # kube-apiserver. Admission plugins: the default set (it includes
  # NamespaceLifecycle, ServiceAccount, MutatingAdmissionWebhook,
  # ValidatingAdmissionWebhook, ValidatingAdmissionPolicy, ResourceQuota...), with the
  # ResourceQuota configuration above.
  write_admission_config
  # --advertise-address: there is no non-loopback interface to guess from.
  # --endpoint-reconciler-type=none: loopback is not a valid Endpoints
  #   address, and nothing here routes to the `kubernetes` service anyway.
  # --allow-privileged: CNI/IPAM DaemonSets usually ask for privileged pods.
  # --enable-aggregator-routing: webhooks behind a Service are called at an endpoint's address,
  #   since this API server runs outside any pod network and no kube-proxy serves it.
  # --kubelet-*: reach e2e/node.sh's kubelet by its InternalIP, as a cluster CA client.
  start "$name" \
    --bind-address=127.0.0.1 \
    --secure-port="$port" \
    --advertise-address=127.0.0.1 \
    --etcd-servers="http://127.0.0.1:$ETCD_PORT" \
    --tls-cert-file="$PKI/apiserver.crt" \
    --tls-private-key-file="$PKI/apiserver.key" \
    --client-ca-file="$PKI/ca.crt" \
    --cert-dir="$STATE_DIR/$name-certs" \
    --authorization-mode=Node,RBAC \
    --service-cluster-ip-range="$SERVICE_CIDR" \
    --service-account-issuer="$SA_ISSUER" \
    --service-account-key-file="$PKI/sa.pub" \
    --service-account-signing-key-file="$PKI/sa.key" \
    --api-audiences="$SA_ISSUER" \
    --requestheader-client-ca-file="$PKI/front-proxy-ca.crt" \
    --requestheader-allowed-names=front-proxy-client \
    --requestheader-username-headers=X-Remote-User \
    --requestheader-group-headers=X-Remote-Group \
    --requestheader-extra-headers-prefix=X-Remote-Extra- \
    --proxy-client-cert-file="$PKI/front-proxy-client.crt" \
    --proxy-client-key-file="$PKI/front-proxy-client.key" \
    --endpoint-reconciler-type=none \
    --allow-privileged=true \
    --admission-control-config-file="$STATE_DIR/admission.yaml" \
    --enable-aggregator-routing=true \
    --kubelet-preferred-address-types=InternalIP \
    --kubelet-client-certificate="$PKI/apiserver-kubelet-client.crt" \
    --kubelet-client-key="$PKI/apiserver-kubelet-client.key" \
    --v=1
  wait_for "$name" "$name /readyz on https://127.0.0.1:$port" readyz_ok_at "$kubeconfig"
}

REPLICA_KUBECONFIG="$STATE_DIR/replica.kubeconfig"

# The replica's start (for `replica` and `restart`), on the port recorded in replica.port.
start_kube_apiserver_replica() {
  start_kube_apiserver kube-apiserver-replica "$(cat "$STATE_DIR/replica.port")" "$REPLICA_KUBECONFIG"
}

# ------------------------------------------------------------------- verbs

# Serializes up/down (e.g. several test binaries calling `up` at once: the
# first starts the cluster, the others wait and then find it healthy). The
# lock is on this script file itself: no lock file is left behind, `down` can
# remove the whole state folder, and clusters with different state folders
# also serialize, which they must because they share e2e/bin (the build).
# The started daemons must NOT inherit fd 9 (see start()), or they would hold
# the lock for their whole life.
take_lock() {
  command -v flock >/dev/null || return 0
  exec 9<"$E2E_DIR/cluster.sh"
  # A cold `up` builds for many minutes; wait long for it.
  flock -w 1800 9 || die "could not lock $E2E_DIR/cluster.sh within 1800 s (another up/down running?)"
}

# A node of e2e/node.sh keeps its state in STATE_DIR/node (mounts, containers, host links): it
# goes first, by its own `down`.
stop_node() {
  [[ -d "$STATE_DIR/node" ]] || return 0
  WHEREABOUTS_E2E_STATE="$STATE_DIR" "$E2E_DIR/node.sh" down 9<&- || log "node.sh down failed (see above)"
}

on_up_exit() {
  local rc=$?
  ((rc == 0)) && return 0
  log "up failed (exit $rc); stopping what was started"
  stop_components || true
  # The logs stay for diagnosis; the next `up` or `down` clears the folder.
  log "logs kept in $STATE_DIR (removed by the next 'up' or by 'down')"
  exit "$rc"
}

cmd_up() {
  take_lock
  if healthy; then
    # A test run meant for one release must not silently pass against the other.
    [[ -z "$REQUESTED_K8S" || "$REQUESTED_K8S" == "$K8S" ]] \
      || die "the cluster in $STATE_DIR runs Kubernetes '$K8S', not WHEREABOUTS_E2E_K8S=$REQUESTED_K8S: stop it first ($0 down) or use another WHEREABOUTS_E2E_STATE"
    log "already up (Kubernetes $K8S)"
    echo "$KUBECONFIG_PATH"
    return 0
  fi
  if [[ -d "$STATE_DIR" ]]; then
    log "stale state in $STATE_DIR (not healthy): stopping leftovers and starting afresh"
    stop_node
    stop_components
    rm -rf "$STATE_DIR"
  fi
  # A new cluster: the release asked for, else the one the stale folder had, else the newest.
  K8S="${REQUESTED_K8S:-$K8S}"

  for tool in python3 openssl base64 setsid; do
    command -v "$tool" >/dev/null || die "$tool not found (run e2e/install-deps.sh)"
  done

  # Build (or check) the binaries before any process starts.
  if [[ "${WHEREABOUTS_E2E_SKIP_BUILD:-0}" == 1 ]] || ! command -v go >/dev/null; then
    [[ "${WHEREABOUTS_E2E_SKIP_BUILD:-0}" == 1 ]] || log "go not found: using e2e/bin as is"
    local b
    for b in $(binaries); do
      [[ -x "$BIN_DIR/$b" ]] || die "$BIN_DIR/$b missing and not building (need go, see e2e/build.sh)"
    done
  else
    # shellcheck disable=SC2046 # binaries prints plain names, one word each
    "$E2E_DIR/build.sh" $(binaries) || die "build failed (e2e/build.sh, see messages above)"
  fi

  mkdir -p "$STATE_DIR"
  # Before any process starts, so that a failed `up` and `down` stop the right executables.
  echo "$K8S" > "$K8S_FILE"
  trap on_up_exit EXIT

  local ports
  ports="$(free_ports 4)" || die "could not pick free ports (python3)"
  read -r ETCD_PORT ETCD_PEER_PORT APISERVER_PORT KCM_PORT <<<"$ports"
  if [[ -n "${WHEREABOUTS_E2E_APISERVER_PORT:-}" ]]; then
    APISERVER_PORT="$WHEREABOUTS_E2E_APISERVER_PORT"
    port_is_free "$APISERVER_PORT" || die "port $APISERVER_PORT (WHEREABOUTS_E2E_APISERVER_PORT) is in use"
  fi
  cat > "$STATE_DIR/cluster.env" <<EOF
ETCD_PORT=$ETCD_PORT
ETCD_PEER_PORT=$ETCD_PEER_PORT
APISERVER_PORT=$APISERVER_PORT
KCM_PORT=$KCM_PORT
APISERVER_URL=https://127.0.0.1:$APISERVER_PORT
KUBECONFIG=$KUBECONFIG_PATH
CA_CERT=$PKI/ca.crt
CA_KEY=$PKI/ca.key
EOF

  log "generating certificates in $PKI"
  make_pki
  write_kubeconfig "$KUBECONFIG_PATH" admin kubernetes-admin
  write_kubeconfig "$STATE_DIR/controller-manager.kubeconfig" controller-manager system:kube-controller-manager

  start_etcd
  start_kube_apiserver

  # kube-controller-manager with every controller (--controllers=*), its own
  # credentials per controller, and the CA for the root-ca ConfigMap and CSR
  # signing. No leader election: there is only one.
  start kube-controller-manager \
    --kubeconfig="$STATE_DIR/controller-manager.kubeconfig" \
    --authentication-kubeconfig="$STATE_DIR/controller-manager.kubeconfig" \
    --authorization-kubeconfig="$STATE_DIR/controller-manager.kubeconfig" \
    --bind-address=127.0.0.1 \
    --secure-port="$KCM_PORT" \
    --cert-dir="$STATE_DIR/controller-manager-certs" \
    --controllers='*' \
    --use-service-account-credentials=true \
    --service-account-private-key-file="$PKI/sa.key" \
    --root-ca-file="$PKI/ca.crt" \
    --cluster-signing-cert-file="$PKI/ca.crt" \
    --cluster-signing-key-file="$PKI/ca.key" \
    --service-cluster-ip-range="$SERVICE_CIDR" \
    --leader-elect=false \
    --v=1
  wait_for kube-controller-manager "kube-controller-manager /healthz on https://127.0.0.1:$KCM_PORT" \
    curl --noproxy '*' -fsSk --max-time 2 "https://127.0.0.1:$KCM_PORT/healthz"
  # Pods are rejected by the ServiceAccount admission plugin until the
  # namespace's `default` ServiceAccount exists; wait for it in `default`
  # so tests can create pods right away.
  wait_for kube-controller-manager "ServiceAccount default/default (created by the controller manager)" \
    kubectl_admin get serviceaccount default -n default

  trap - EXIT
  log "up: kube-apiserver ($K8S: $("$(exe_of kube-apiserver)" --version 2>/dev/null || echo '?')) at https://127.0.0.1:$APISERVER_PORT, logs in $STATE_DIR/*.log"
  echo "$KUBECONFIG_PATH"
}

cmd_down() {
  take_lock
  if [[ ! -d "$STATE_DIR" ]]; then
    log "nothing to do: $STATE_DIR does not exist"
    return 0
  fi
  stop_node
  stop_one kube-apiserver-replica
  stop_components
  rm -rf "$STATE_DIR"
  log "down: stopped and removed $STATE_DIR"
}

cmd_env() {
  [[ -f "$KUBECONFIG_PATH" ]] || die "no cluster: $KUBECONFIG_PATH does not exist (run: $0 up)"
  printf 'export KUBECONFIG=%q\n' "$KUBECONFIG_PATH"
}

# The component NAME must be one of COMPONENTS with a start function; its pid must be ours.
running_pid() {
  local name="$1" pid
  [[ -f "$STATE_DIR/cluster.env" ]] || die "no cluster: $STATE_DIR/cluster.env missing (run: $0 up)"
  case "$name" in
    etcd|kube-apiserver|kube-apiserver-replica) ;;
    *) die "want etcd, kube-apiserver or kube-apiserver-replica, got '$name'" ;;
  esac
  pid="$(pid_of "$name")"
  is_our_process "$pid" "$name" || die "$name is not running"
  echo "$pid"
}

# restart NAME [--crash]: stop it (SIGTERM, as a rolling restart would; with --crash SIGKILL, as
# a crash or an OOM kill would) and start it again with the same flags; returns once it is
# healthy. The data (etcd-data) and certificates stay.
cmd_restart() {
  local name="$1" how="${2:-}"
  [[ -z "$how" || "$how" == --crash ]] || die "restart: want --crash or nothing, got '$how'"
  running_pid "$name" >/dev/null
  take_lock
  # shellcheck disable=SC1091 # written by `up`
  source "$STATE_DIR/cluster.env"
  if [[ "$how" == --crash ]]; then stop_one "$name" KILL; else stop_one "$name"; fi
  "start_${name//-/_}"
  log "$name restarted (pid $(pid_of "$name"))"
}

# pause NAME SECONDS: SIGSTOP, then SIGCONT after SECONDS. Clients' connections stay open and
# their calls hang until their own timeouts, as with a stalled or overloaded server. The process
# is resumed however this script ends.
cmd_pause() {
  local name="$1" seconds="$2" pid
  [[ "$seconds" =~ ^[0-9]+(\.[0-9]+)?$ ]] || die "pause: SECONDS must be a number, got '$seconds'"
  pid="$(running_pid "$name")"
  trap 'kill -CONT "$pid" 2>/dev/null || true' EXIT
  kill -STOP "$pid"
  log "$name (pid $pid) paused for $seconds s"
  sleep "$seconds"
  kill -CONT "$pid"
  trap - EXIT
  log "$name (pid $pid) resumed"
}

cmd_replica() {
  [[ -f "$STATE_DIR/cluster.env" ]] || die "no cluster: $STATE_DIR/cluster.env missing (run: $0 up)"
  take_lock
  # shellcheck disable=SC1091 # written by `up`
  source "$STATE_DIR/cluster.env"
  if ! is_our_process "$(pid_of kube-apiserver-replica)" kube-apiserver-replica; then
    free_ports 1 > "$STATE_DIR/replica.port" || die "could not pick a free port (python3)"
    write_kubeconfig "$REPLICA_KUBECONFIG" admin kubernetes-admin "$(cat "$STATE_DIR/replica.port")"
    start_kube_apiserver_replica
    log "replica: kube-apiserver-replica at https://127.0.0.1:$(cat "$STATE_DIR/replica.port")"
  fi
  echo "$REPLICA_KUBECONFIG"
}

cmd_status() {
  local name pid rc=0
  log "Kubernetes release: $K8S"
  for name in "${COMPONENTS[@]}"; do
    pid="$(pid_of "$name")"
    if is_our_process "$pid" "$name"; then
      log "$name: running (pid $pid)"
    else
      log "$name: not running"; rc=1
    fi
  done
  if [[ -f "$KUBECONFIG_PATH" ]] && readyz_ok; then
    log "readyz: ok; kubeconfig: $KUBECONFIG_PATH"
  else
    log "readyz: not ok"; rc=1
  fi
  return "$rc"
}

case "${1:-}" in
  up) cmd_up ;;
  down) cmd_down ;;
  env) cmd_env ;;
  status) cmd_status ;;
  restart) cmd_restart "${2:-}" "${3:-}" ;;
  pause) cmd_pause "${2:-}" "${3:-}" ;;
  replica) cmd_replica ;;
  *)
    echo "usage: $0 up|down|env|status|replica|restart etcd|kube-apiserver|kube-apiserver-replica [--crash]|pause etcd|kube-apiserver SECONDS" >&2
    exit 2
    ;;
esac
