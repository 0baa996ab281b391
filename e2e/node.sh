#!/usr/bin/env bash
# A real Kubernetes node on this machine, joined to the control plane of e2e/cluster.sh:
# containerd (Debian) + runc, kubelet, kube-proxy (iptables mode) and kube-scheduler, all built
# or installed by the project. Multus (thin plugin, built from ../shared/vendor) is the node's only
# CNI config, as on users' nodes: its cluster network gives pods eth0, and its default network
# net1, both from Debian's `bridge` plugin with our `whereabouts` as the IPAM, installed on the
# host by the whereabouts DaemonSet as on any node; NADs attach further interfaces (net2, ...).
#
#   e2e/node.sh up      start the cluster if needed (e2e/cluster.sh up), build the images
#                       (e2e/images.sh), start the node, wait until it is Ready; the LAST line of
#                       stdout is the admin kubeconfig path. Idempotent.
#   e2e/node.sh down    stop exactly what `up` started (pid files), remove the node's containers,
#                       network namespaces, mounts, cgroups, links, iptables chain and host files.
#   e2e/node.sh status  exit 0 if every node component runs and the Node is Ready.
#   e2e/node.sh restart containerd|kubelet   stop one component and start it again (tests).
#   e2e/node.sh stop kubelet / start kubelet  for node-failure tests.
#   e2e/node.sh env     print the node's settings (NODE_DIR, NODE_NAME, CTR, images).
#
# Environment: WHEREABOUTS_E2E_STATE (the cluster's state folder; the node's is its node/),
# WHEREABOUTS_E2E_TIMEOUT (seconds per wait, default 120), WHEREABOUTS_E2E_NODE_NETWORKS (1 or 2:
# whereabouts networks per pod, default 2), WHEREABOUTS_E2E_IMAGES (images folder, default
# e2e/.images).
#
# Addresses. Everything stays on this machine: the node's address 10.85.0.1 (and fd00:85::1) sits
# on `wab0`, a bridge with no ports but the pods' veths; pods are dual-stack on eth0, 10.85.0.0/22
# and fd00:85::/116 (both from our IPAM, so status.podIPs has one of each), and 10.86.0.0/22 (net1,
# bridge `wab1`, no host address); `wab2`, a bridge with no ports at all, is the master of the
# tests' macvlan NADs, and `wab3`, another, the bridge of their bridge NADs (this machine's
# kernel has no ipvlan); the Service range 10.96.0.0/16 is routed into `wab0`, so a
# packet to a Service is either DNATed by kube-proxy or stays on the bridge; a guard chain drops
# anything the pods would send out of another interface. The API server listens on loopback only;
# socat forwards 10.85.0.1:6443 to it and is the `kubernetes` Service's endpoint, so pods and
# host-network pods reach the API server the in-cluster way (10.96.0.1:443 through kube-proxy).
set -euo pipefail

E2E_DIR="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
BIN_DIR="$E2E_DIR/bin"
STATE_DIR="${WHEREABOUTS_E2E_STATE:-$E2E_DIR/.state}"
case "$STATE_DIR" in /*) ;; *) STATE_DIR="$(pwd)/$STATE_DIR" ;; esac
STATE_DIR="${STATE_DIR%/}"
NODE_DIR="$STATE_DIR/node"
IMAGES_DIR="${WHEREABOUTS_E2E_IMAGES:-$E2E_DIR/.images}"
TIMEOUT="${WHEREABOUTS_E2E_TIMEOUT:-120}"
NETWORKS="${WHEREABOUTS_E2E_NODE_NETWORKS:-2}"

NODE_NAME=wab-node
NODE_IP=10.85.0.1
POD_BRIDGE=wab0
POD_CIDR=10.85.0.0/22
NODE_IP6=fd00:85::1
POD_CIDR6=fd00:85::/116
NET2_BRIDGE=wab1
NET2_CIDR=10.86.0.0/22
# The tests' NADs: macvlan children of one portless bridge, bridge NADs on another.
MACVLAN_MASTER=wab2
NAD_BRIDGE=wab3
SERVICE_CIDR=10.96.0.0/16
API_FORWARD_PORT=6443
GUARD_CHAIN=WAB-NODE-GUARD
# Where the DaemonSet installs the plugin and its flat file: the standard host paths.
CNI_BIN_DIR=/opt/cni/bin
CNI_HOST_CONF_DIR=/etc/cni/net.d
DEBIAN_CNI_DIR=/usr/lib/cni
SOCK="$NODE_DIR/containerd.sock"
CTR=(ctr --address "$SOCK" --namespace k8s.io)
# Start order; stops go in reverse.
COMPONENTS=(containerd api-forward kube-scheduler kubelet kube-proxy)

# Pid files, logs, start/stop/wait: shared with e2e/cluster.sh.
PROC_DIR="$NODE_DIR"
PROC_TAG=node
exe_of() {
  case "$1" in
    containerd) command -v containerd ;;
    api-forward) command -v socat ;;
    *) echo "$BIN_DIR/$1" ;;
  esac
}
# shellcheck source=lib/procs.sh
source "$E2E_DIR/lib/procs.sh"

kubectl_admin() { "$BIN_DIR/kubectl" --kubeconfig "$STATE_DIR/kubeconfig" "$@"; }

# ------------------------------------------------------------------- identities

# node_cert NAME SUBJECT EXT: a key and certificate signed by the cluster CA.
node_cert() {
  local name="$1" subj="$2" ext="$3" pki="$NODE_DIR/pki"
  mkdir -p "$pki"
  (
    exec >>"$pki/openssl.log" 2>&1
    openssl ecparam -name prime256v1 -genkey -noout -out "$pki/$name.key"
    openssl req -new -key "$pki/$name.key" -subj "$subj" -out "$pki/$name.csr"
    printf '%s\n' "$ext" > "$pki/$name.ext"
    openssl x509 -req -in "$pki/$name.csr" -CA "$CA_CERT" -CAkey "$CA_KEY" -CAcreateserial \
      -days 30 -sha256 -extfile "$pki/$name.ext" -out "$pki/$name.crt"
    rm -f "$pki/$name.csr" "$pki/$name.ext"
  )
}

client_identity() {
  local name="$1" subj="$2"
  node_cert "$name" "$subj" "basicConstraints=CA:FALSE
keyUsage=critical,digitalSignature,keyEncipherment
extendedKeyUsage=clientAuth"
  local kc="$NODE_DIR/$name.kubeconfig"
  KUBECONFIG="$kc" "$BIN_DIR/kubectl" config set-cluster e2e --server="$APISERVER_URL" \
    --certificate-authority="$CA_CERT" --embed-certs=true >/dev/null
  KUBECONFIG="$kc" "$BIN_DIR/kubectl" config set-credentials "$name" \
    --client-certificate="$NODE_DIR/pki/$name.crt" --client-key="$NODE_DIR/pki/$name.key" \
    --embed-certs=true >/dev/null
  KUBECONFIG="$kc" "$BIN_DIR/kubectl" config set-context e2e --cluster=e2e --user="$name" >/dev/null
  KUBECONFIG="$kc" "$BIN_DIR/kubectl" config use-context e2e >/dev/null
}

# ------------------------------------------------------------------- host setup

# Host files and folders the node creates outside its state folder, one path a line, so that
# `down` removes exactly those (and what the DaemonSet installed into them).
record() { printf '%s\n' "$1" >> "$NODE_DIR/host-paths"; }

# mkdir -p that records the topmost folder it had to create.
ensure_dir() {
  local top="$1"
  [[ -d "$top" ]] && return 0
  while [[ ! -d "$(dirname "$top")" ]]; do top="$(dirname "$top")"; done
  mkdir -p "$1"
  record "$top"
}

setup_host() {
  ensure_dir "$CNI_BIN_DIR"
  ensure_dir "$CNI_HOST_CONF_DIR"
  ensure_dir /run/whereabouts
  ensure_dir /var/log/pods
  ensure_dir /var/log/containers
  # The runtime looks for every plugin in one folder; Debian's reference plugins live elsewhere.
  local p
  for p in bridge loopback host-local portmap macvlan ipvlan; do
    [[ -x "$DEBIAN_CNI_DIR/$p" ]] || die "$DEBIAN_CNI_DIR/$p missing (apt-get install containernetworking-plugins)"
    if [[ ! -e "$CNI_BIN_DIR/$p" ]]; then
      ln -s "$DEBIAN_CNI_DIR/$p" "$CNI_BIN_DIR/$p"
      record "$CNI_BIN_DIR/$p"
    fi
  done
  # Multus, the node's CNI, as its own DaemonSet would install it.
  install -m 0755 "$BIN_DIR/multus" "$CNI_BIN_DIR/multus"
  record "$CNI_BIN_DIR/multus"
  # What the DaemonSet installs: removed on `down` whoever wrote it last.
  record "$CNI_BIN_DIR/whereabouts"
  record "$CNI_HOST_CONF_DIR/whereabouts.d"

  # The root mount shared, as systemd makes it on every node at boot: pods that mount host paths
  # with mountPropagation HostToContainer (Multus's thick daemon: the host's root and its network
  # namespaces) are refused by the runtime otherwise ("not a shared or slave mount").
  mount --make-rshared /
  # The node's address, on a bridge that has no port to any real network.
  ip link show "$POD_BRIDGE" >/dev/null 2>&1 || ip link add "$POD_BRIDGE" type bridge
  ip addr replace "$NODE_IP/22" dev "$POD_BRIDGE"
  ip -6 addr replace "$NODE_IP6/116" dev "$POD_BRIDGE" nodad
  ip link set "$POD_BRIDGE" up
  ip link show "$NET2_BRIDGE" >/dev/null 2>&1 || ip link add "$NET2_BRIDGE" type bridge
  ip link set "$NET2_BRIDGE" up
  local master
  for master in "$MACVLAN_MASTER" "$NAD_BRIDGE"; do
    ip link show "$master" >/dev/null 2>&1 || ip link add "$master" type bridge
    ip link set "$master" up
  done
  ip route replace "$SERVICE_CIDR" dev "$POD_BRIDGE" src "$NODE_IP"
  # Nothing from a pod leaves by another interface (the bridge plugin turns on ip_forward).
  iptables -w -N "$GUARD_CHAIN" 2>/dev/null || iptables -w -F "$GUARD_CHAIN"
  iptables -w -A "$GUARD_CHAIN" -i "wab+" ! -o "wab+" -j DROP
  iptables -w -C FORWARD -j "$GUARD_CHAIN" 2>/dev/null || iptables -w -I FORWARD 1 -j "$GUARD_CHAIN"
  ip6tables -w -N "$GUARD_CHAIN" 2>/dev/null || ip6tables -w -F "$GUARD_CHAIN"
  ip6tables -w -A "$GUARD_CHAIN" -i "wab+" ! -o "wab+" -j DROP
  ip6tables -w -C FORWARD -j "$GUARD_CHAIN" 2>/dev/null || ip6tables -w -I FORWARD 1 -j "$GUARD_CHAIN"
  # kube-proxy's Service rules for traffic that crosses the bridge.
  sysctl -qw net.bridge.bridge-nf-call-iptables=1 2>/dev/null || true
}

# The pod networks: Multus is the only config containerd sees. Its cluster network (eth0, bridge
# wab0) is a conflist in a folder of its own, named by network name with `confDir` (with a
# .conflist path, Multus v4.3.0 re-marshals the config on DEL and drops the IPAM's keys); its
# default network (net1, bridge wab1) is a NAD in kube-system, Multus's namespace, as users define
# default networks. Both use our IPAM; on net1 a StatefulSet pod keeps its address
# (sticky_statefulset): the plugin reads the pod with the node's identity.
write_cni_configs() {
  local nets="$NODE_DIR/cni-networks" defaults='[]'
  mkdir -p "$NODE_DIR/net.d" "$nets"
  cat > "$nets/10-wab-pods.conflist" <<EOF
{"cniVersion": "1.0.0", "name": "wab-pods", "plugins": [
  {"type": "bridge", "bridge": "$POD_BRIDGE", "isGateway": true, "isDefaultGateway": true,
   "ipMasq": false, "hairpinMode": true,
   "ipam": {"type": "whereabouts", "range": "$POD_CIDR", "range_start": "10.85.0.10",
            "ipRanges": [{"range": "$POD_CIDR6", "range_start": "fd00:85::10"}]}},
  {"type": "portmap", "capabilities": {"portMappings": true}}
]}
EOF
  [[ "$NETWORKS" == 2 ]] && defaults='["wab-net2"]'
  # systemNamespaces empty: pods of kube-system get the default network too, as every other pod.
  cat > "$NODE_DIR/net.d/00-multus.conf" <<EOF
{"cniVersion": "1.0.0", "name": "multus-cni-network", "type": "multus",
 "kubeconfig": "$NODE_DIR/multus.kubeconfig", "confDir": "$nets",
 "cniDir": "$NODE_DIR/multus-cache", "binDir": "$CNI_BIN_DIR",
 "clusterNetwork": "wab-pods", "defaultNetworks": $defaults, "systemNamespaces": [],
 "logFile": "$NODE_DIR/multus.log", "logLevel": "verbose"}
EOF
}

# The default network's NAD (and the NAD CRD, which Multus's own install would bring).
apply_default_network() {
  kubectl_admin apply -f "$E2E_DIR/../crds/network-attachment-definitions.yaml" >/dev/null
  kubectl_admin wait --for condition=established --timeout=60s \
    crd/network-attachment-definitions.k8s.cni.cncf.io >/dev/null
  [[ "$NETWORKS" == 2 ]] || { kubectl_admin -n kube-system delete net-attach-def wab-net2 --ignore-not-found >/dev/null; return 0; }
  # Kept from an earlier `up` of this cluster: a NAD write now could meet the webhook of an
  # install whose operator is not running yet.
  kubectl_admin -n kube-system get net-attach-def wab-net2 >/dev/null 2>&1 && return 0
  local config
  config='{"cniVersion": "1.0.0", "name": "wab-net2", "type": "bridge", "bridge": "'"$NET2_BRIDGE"'", "isGateway": false, "ipMasq": false, "ipam": {"type": "whereabouts", "range": "'"$NET2_CIDR"'", "range_start": "10.86.0.10", "sticky_statefulset": true}}'
  kubectl_admin apply -f - >/dev/null <<EOF
apiVersion: k8s.cni.cncf.io/v1
kind: NetworkAttachmentDefinition
metadata: {name: wab-net2, namespace: kube-system}
spec:
  config: '$config'
EOF
}

# Multus reads pods and NADs and writes pods' network-status: the rights its own manifests give
# its ServiceAccount, here bound to the node's `system:multus` certificate.
grant_multus() {
  kubectl_admin apply -f - >/dev/null <<EOF
apiVersion: rbac.authorization.k8s.io/v1
kind: ClusterRole
metadata: {name: e2e-node-multus}
rules:
  - apiGroups: ["k8s.cni.cncf.io"]
    resources: ["*"]
    verbs: ["get", "list", "watch"]
  - apiGroups: [""]
    resources: ["pods", "pods/status"]
    verbs: ["get", "list", "update", "watch"]
  - apiGroups: ["", "events.k8s.io"]
    resources: ["events"]
    verbs: ["create", "patch", "update"]
---
apiVersion: rbac.authorization.k8s.io/v1
kind: ClusterRoleBinding
metadata: {name: e2e-node-multus}
roleRef: {apiGroup: rbac.authorization.k8s.io, kind: ClusterRole, name: e2e-node-multus}
subjects:
  - {apiGroup: rbac.authorization.k8s.io, kind: User, name: "system:multus"}
EOF
}

write_containerd_config() {
  cat > "$NODE_DIR/containerd.toml" <<EOF
version = 2
root = "$NODE_DIR/containerd/root"
state = "$NODE_DIR/containerd/state"
disabled_plugins = ["io.containerd.snapshotter.v1.aufs", "io.containerd.snapshotter.v1.btrfs",
  "io.containerd.snapshotter.v1.zfs", "io.containerd.snapshotter.v1.devmapper"]
[grpc]
  address = "$SOCK"
[ttrpc]
  address = "$NODE_DIR/containerd.sock.ttrpc"
[plugins."io.containerd.internal.v1.opt"]
  path = "$NODE_DIR/containerd/opt"
[plugins."io.containerd.grpc.v1.cri"]
  sandbox_image = "$PAUSE_IMAGE"
  # Processes here lack CAP_SYS_RESOURCE: lowering oom_score_adj below the runtime's own fails
  # every sandbox ("can't get final child's PID from pipe: EOF").
  restrict_oom_score_adj = true
  stream_server_address = "127.0.0.1"
  [plugins."io.containerd.grpc.v1.cri".containerd]
    snapshotter = "overlayfs"
    default_runtime_name = "runc"
    [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc]
      runtime_type = "io.containerd.runc.v2"
      [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc.options]
        SystemdCgroup = false
  [plugins."io.containerd.grpc.v1.cri".cni]
    bin_dir = "$CNI_BIN_DIR"
    conf_dir = "$NODE_DIR/net.d"
    # Multus alone: with more, every config in the folder is attached to every pod.
    max_conf_num = 1
EOF
}

write_kubelet_config() {
  cat > "$NODE_DIR/kubelet.yaml" <<EOF
apiVersion: kubelet.config.k8s.io/v1beta1
kind: KubeletConfiguration
# This machine mounts cgroup v1; kubelet 1.35+ refuses it unless told otherwise (KEP-5573).
failCgroupV1: false
cgroupDriver: cgroupfs
containerRuntimeEndpoint: unix://$SOCK
address: $NODE_IP
port: 10250
readOnlyPort: 0
healthzBindAddress: 127.0.0.1
healthzPort: $KUBELET_HEALTHZ_PORT
authentication:
  anonymous: {enabled: false}
  webhook: {enabled: false}
  x509: {clientCAFile: "$CA_CERT"}
# Only holders of a cluster-CA certificate reach this port, on an address of this machine.
authorization: {mode: AlwaysAllow}
tlsCertFile: "$NODE_DIR/pki/kubelet-serving.crt"
tlsPrivateKeyFile: "$NODE_DIR/pki/kubelet-serving.key"
failSwapOn: false
# The test machine's disk and memory are not the node's to defend.
evictionHard: {}
imageGCHighThresholdPercent: 100
imageGCLowThresholdPercent: 99
maxPods: 250
# Static pods (tests/node/lifecycle.rs): the kubelet runs what a test writes here, and mirrors it
# into the API under another UID than the one it passes the plugin as K8S_POD_UID.
staticPodPath: "$NODE_DIR/manifests"
fileCheckFrequency: 5s
serializeImagePulls: false
clusterDomain: cluster.local
resolvConf: ""
EOF
}

write_proxy_config() {
  cat > "$NODE_DIR/kube-proxy.yaml" <<EOF
apiVersion: kubeproxy.config.k8s.io/v1alpha1
kind: KubeProxyConfiguration
clientConnection:
  kubeconfig: "$NODE_DIR/kube-proxy.kubeconfig"
mode: iptables
hostnameOverride: $NODE_NAME
bindAddress: 127.0.0.1
healthzBindAddress: 127.0.0.1:$PROXY_HEALTHZ_PORT
metricsBindAddress: 127.0.0.1:$PROXY_METRICS_PORT
clusterCIDR: $POD_CIDR
# Leave the machine's conntrack settings alone.
conntrack: {maxPerCore: 0, min: 0, tcpEstablishedTimeout: 0s, tcpCloseWaitTimeout: 0s}
iptables: {localhostNodePorts: false}
nodePortAddresses: ["$NODE_IP/32"]
EOF
}

# The `kubernetes` Service's endpoint: the API server's forwarder on the node address. The API
# server runs with --endpoint-reconciler-type=none (its own address is loopback, which is not a
# valid endpoint), so this slice is the only one.
publish_api_endpoint() {
  kubectl_admin apply -f - >/dev/null <<EOF
apiVersion: discovery.k8s.io/v1
kind: EndpointSlice
metadata:
  name: kubernetes-e2e-node
  namespace: default
  labels:
    kubernetes.io/service-name: kubernetes
    endpointslice.kubernetes.io/managed-by: e2e-node.whereabouts
addressType: IPv4
endpoints:
  - addresses: ["$NODE_IP"]
    conditions: {ready: true}
ports:
  - name: https
    port: $API_FORWARD_PORT
    protocol: TCP
EOF
}

import_images() {
  local a
  # Upstream v0.9.2's image (migration test) and Multus's thick mode (its test), when built.
  for a in "$PAUSE_ARCHIVE" "$BUSYBOX_ARCHIVE" "$WHEREABOUTS_ARCHIVE" ${UPSTREAM_ARCHIVE:+"$UPSTREAM_ARCHIVE"} \
    ${MULTUS_THICK_ARCHIVE:+"$MULTUS_THICK_ARCHIVE"}; do
    "${CTR[@]}" images import "$a" >/dev/null \
      || die "ctr images import $a failed"
  done
}

node_ready() {
  [[ "$(kubectl_admin get node "$NODE_NAME" \
    -o jsonpath='{.status.conditions[?(@.type=="Ready")].status}' 2>/dev/null)" == True ]]
}

healthy() {
  components_running || return 1
  node_ready
}

load_env() {
  [[ -f "$STATE_DIR/cluster.env" ]] || die "no cluster env at $STATE_DIR/cluster.env"
  # shellcheck disable=SC1091
  source "$STATE_DIR/cluster.env"
  [[ -f "$IMAGES_DIR/images.env" ]] || die "no images at $IMAGES_DIR (run e2e/images.sh)"
  # shellcheck disable=SC1091
  source "$IMAGES_DIR/images.env"
  [[ -f "$NODE_DIR/ports.env" ]] && source "$NODE_DIR/ports.env"
  return 0
}

start_containerd() {
  start containerd --config "$NODE_DIR/containerd.toml" --log-level warn
  wait_for containerd "containerd on $SOCK" "${CTR[@]}" version
}

start_kubelet() {
  start kubelet \
    --config="$NODE_DIR/kubelet.yaml" \
    --kubeconfig="$NODE_DIR/kubelet.kubeconfig" \
    --hostname-override="$NODE_NAME" \
    --node-ip="$NODE_IP" \
    --root-dir="$NODE_DIR/kubelet" \
    --v=1
  wait_for kubelet "kubelet /healthz" curl -fsS --max-time 2 "http://127.0.0.1:$KUBELET_HEALTHZ_PORT/healthz"
}

# Kubernetes' version skew policy: a kubelet, kube-proxy and kube-scheduler must not be newer than
# the API server. The node's binaries are the newest release's (e2e/k8s); a control plane of the
# oldest supported release (cluster.sh with WHEREABOUTS_E2E_K8S=min) is older, so the node refuses
# to join it rather than run a combination Kubernetes does not support (and the node tier is run
# against the newest release only: `make e2e-min` runs the tiers without a node).
# Checked before the node's binaries are built (minutes), from the release they are built from
# (e2e/k8s/go.mod), or from the kubelet itself when nothing is built.
# minor_of VERSION: the minor of v1.MINOR.PATCH (fails when it is not one).
minor_of() { [[ "$1" =~ ^v?1\.([0-9]+)\. ]] && echo "${BASH_REMATCH[1]}"; }
check_version_skew() {
  local server node server_minor node_minor
  server="$(kubectl_admin get --raw /version | python3 -c 'import json, sys; print(json.load(sys.stdin)["gitVersion"])')" \
    || die "could not read the API server's version (/version)"
  if [[ "${WHEREABOUTS_E2E_SKIP_BUILD:-0}" == 1 ]]; then
    node="$("$BIN_DIR/kubelet" --version | awk '{print $2}')" || die "$BIN_DIR/kubelet --version failed"
  else
    node="$(awk '$1 == "k8s.io/kubernetes" {print $2}' "$E2E_DIR/k8s/go.mod")"
  fi
  server_minor="$(minor_of "$server")" || die "API server version '$server' is not v1.MINOR.PATCH"
  node_minor="$(minor_of "$node")" || die "kubelet version '$node' is not v1.MINOR.PATCH"
  ((node_minor <= server_minor)) \
    || die "the node's kubelet ($node) is newer than the API server ($server): the version skew policy forbids it; run the node against the newest release's control plane (WHEREABOUTS_E2E_K8S unset or newest, in a state folder of its own)"
  log "versions: API server $server, kubelet $node"
}

cmd_up() {
  local kubeconfig
  # (fd 8, this script's lock, is not handed to the control plane's daemons)
  kubeconfig="$("$E2E_DIR/cluster.sh" up 8<&- | tail -n 1)" || die "e2e/cluster.sh up failed"
  if [[ -d "$NODE_DIR" ]] && healthy 2>/dev/null; then
    log "already up"
    echo "$kubeconfig"
    return 0
  fi
  [[ -d "$NODE_DIR" ]] && { log "stale node state: tearing it down first"; cmd_down; }
  [[ "$(id -u)" == 0 ]] || die "must run as root (containerd, network links, iptables)"
  local tool
  for tool in containerd containerd-shim-runc-v2 runc ctr socat iptables ip6tables ip openssl curl python3 setsid; do
    command -v "$tool" >/dev/null || die "$tool not found (run e2e/install-deps.sh)"
  done
  check_version_skew
  if [[ "${WHEREABOUTS_E2E_SKIP_BUILD:-0}" != 1 ]]; then
    "$E2E_DIR/build.sh" kubelet kube-scheduler kube-proxy crictl multus multus-daemon multus-shim || die "build failed (e2e/build.sh)"
    "$E2E_DIR/images.sh" "$IMAGES_DIR" || die "image build failed (e2e/images.sh)"
    # Upstream v0.9.2's image, for the migration test (tests/node/migration.rs); rebuilt only
    # when its inputs change.
    "$E2E_DIR/upstream-image.sh" "$IMAGES_DIR" || die "image build failed (e2e/upstream-image.sh)"
  fi
  for tool in kubelet kube-scheduler kube-proxy crictl multus; do
    [[ -x "$BIN_DIR/$tool" ]] || die "$BIN_DIR/$tool missing (e2e/build.sh $tool)"
  done
  mkdir -p "$NODE_DIR" "$NODE_DIR/manifests"
  trap on_up_exit EXIT
  load_env

  local ports
  ports="$(free_ports 4)"
  read -r KUBELET_HEALTHZ_PORT PROXY_HEALTHZ_PORT PROXY_METRICS_PORT SCHED_PORT <<<"$ports"
  cat > "$NODE_DIR/ports.env" <<EOF
KUBELET_HEALTHZ_PORT=$KUBELET_HEALTHZ_PORT
PROXY_HEALTHZ_PORT=$PROXY_HEALTHZ_PORT
PROXY_METRICS_PORT=$PROXY_METRICS_PORT
SCHED_PORT=$SCHED_PORT
EOF

  log "identities: kubelet, kube-proxy, kube-scheduler (signed by the cluster CA)"
  client_identity kubelet "/O=system:nodes/CN=system:node:$NODE_NAME"
  client_identity kube-proxy "/CN=system:kube-proxy"
  client_identity kube-scheduler "/CN=system:kube-scheduler"
  client_identity multus "/CN=system:multus"
  grant_multus
  apply_default_network
  node_cert kubelet-serving "/CN=$NODE_NAME" "basicConstraints=CA:FALSE
keyUsage=critical,digitalSignature,keyEncipherment
extendedKeyUsage=serverAuth
subjectAltName=IP:$NODE_IP,DNS:$NODE_NAME"

  log "host: bridges $POD_BRIDGE ($NODE_IP), $NET2_BRIDGE, $MACVLAN_MASTER and $NAD_BRIDGE, route for $SERVICE_CIDR, guard chain"
  setup_host
  write_cni_configs
  write_containerd_config
  write_kubelet_config
  write_proxy_config

  start_containerd
  import_images

  start api-forward "TCP-LISTEN:$API_FORWARD_PORT,bind=$NODE_IP,reuseaddr,fork" "TCP:127.0.0.1:$APISERVER_PORT"
  publish_api_endpoint

  start kube-scheduler \
    --kubeconfig="$NODE_DIR/kube-scheduler.kubeconfig" \
    --authentication-kubeconfig="$NODE_DIR/kube-scheduler.kubeconfig" \
    --authorization-kubeconfig="$NODE_DIR/kube-scheduler.kubeconfig" \
    --bind-address=127.0.0.1 --secure-port="$SCHED_PORT" --leader-elect=false --v=1
  wait_for kube-scheduler "kube-scheduler /healthz" curl -fsSk --max-time 2 "https://127.0.0.1:$SCHED_PORT/healthz"

  # The kubelet registers the Node, which kube-proxy waits for.
  start_kubelet
  start kube-proxy --config="$NODE_DIR/kube-proxy.yaml" --v=1
  wait_for kube-proxy "kube-proxy /healthz" curl -fsS --max-time 2 "http://127.0.0.1:$PROXY_HEALTHZ_PORT/healthz"
  wait_for kubelet "Node $NODE_NAME Ready" node_ready

  trap - EXIT
  log "up: node $NODE_NAME Ready ($NETWORKS whereabouts network(s) per pod), state in $NODE_DIR"
  echo "$kubeconfig"
}

on_up_exit() {
  local rc=$?
  ((rc == 0)) && return 0
  log "up failed (exit $rc); stopping what was started (logs stay in $NODE_DIR until 'down')"
  stop_all || true
  exit "$rc"
}

# Every pod sandbox and container the runtime holds, stopped and removed: their network
# namespaces go with them (the CNI DELs of the runtime free their addresses while the API server
# is up).
remove_containers() {
  local id
  "${CTR[@]}" version >/dev/null 2>&1 || return 0
  for id in $("${CTR[@]}" tasks list -q 2>/dev/null); do
    "${CTR[@]}" tasks kill -s SIGKILL "$id" >/dev/null 2>&1 || true
  done
  sleep 0.5
  for id in $("${CTR[@]}" tasks list -q 2>/dev/null); do
    "${CTR[@]}" tasks delete -f "$id" >/dev/null 2>&1 || true
  done
  for id in $("${CTR[@]}" containers list -q 2>/dev/null); do
    "${CTR[@]}" containers delete "$id" >/dev/null 2>&1 || true
  done
}

stop_all() {
  local i
  for ((i = ${#COMPONENTS[@]} - 1; i >= 0; i--)); do
    [[ "${COMPONENTS[$i]}" == containerd ]] && remove_containers
    stop_one "${COMPONENTS[$i]}"
  done
}

# Shims of our containerd (they outlive it by design, and one whose containerd was restarted may
# outlive its tasks too): found by our socket path in their command line.
stop_shims() {
  local pid
  for pid in $(pgrep -f -- "containerd-shim-runc-v2 .*-address $SOCK( |\$)" || true); do
    kill -KILL "$pid" 2>/dev/null || true
  done
}

# The kubelet's and kube-proxy's iptables chains (KUBE-*): no one else makes them here.
remove_kube_chains() {
  local t table chain
  for t in iptables ip6tables; do
    for table in filter nat mangle; do
      $t -w -t "$table" -S 2>/dev/null | awk '/^-A / && / -j KUBE-/' | sed 's/^-A/-D/' |
        while read -r rule; do eval "$t -w -t $table $rule" 2>/dev/null || true; done
      for chain in $($t -w -t "$table" -S 2>/dev/null | awk '/^-N KUBE-/ {print $2}'); do
        $t -w -t "$table" -F "$chain" 2>/dev/null || true
      done
      for chain in $($t -w -t "$table" -S 2>/dev/null | awk '/^-N KUBE-/ {print $2}'); do
        $t -w -t "$table" -X "$chain" 2>/dev/null || true
      done
    done
  done
}

cleanup_host() {
  local m ns path
  stop_shims
  # Mounts under the node's folder (pod volumes, rootfs, shm), deepest first.
  for m in $(awk -v d="$NODE_DIR/" 'index($2, d) == 1 {print $2}' /proc/self/mounts | sort -r); do
    umount -l "$m" 2>/dev/null || true
  done
  # Network namespaces the runtime made (cni-<uuid>).
  for ns in $(ip netns list 2>/dev/null | awk '/^cni-/ {print $1}'); do
    ip netns delete "$ns" 2>/dev/null || true
  done
  # Empty cgroups of the kubelet's pods (cgroup v1: one tree per controller).
  for path in /sys/fs/cgroup/*/kubepods; do
    [[ -d "$path" ]] && find "$path" -depth -type d -exec rmdir {} + 2>/dev/null || true
  done
  ip link del "$POD_BRIDGE" 2>/dev/null || true
  ip link del "$NET2_BRIDGE" 2>/dev/null || true
  ip link del "$MACVLAN_MASTER" 2>/dev/null || true
  ip link del "$NAD_BRIDGE" 2>/dev/null || true
  ip route del "$SERVICE_CIDR" 2>/dev/null || true
  local t
  for t in iptables ip6tables; do
    while $t -w -D FORWARD -j "$GUARD_CHAIN" 2>/dev/null; do :; done
    $t -w -F "$GUARD_CHAIN" 2>/dev/null || true
    $t -w -X "$GUARD_CHAIN" 2>/dev/null || true
  done
  remove_kube_chains
  # Host paths this node created, newest first.
  if [[ -f "$NODE_DIR/host-paths" ]]; then
    tac "$NODE_DIR/host-paths" | while read -r path; do
      [[ -n "$path" ]] && rm -rf -- "$path"
    done
  fi
}

cmd_down() {
  if [[ ! -d "$NODE_DIR" ]]; then
    log "nothing to do: $NODE_DIR does not exist"
    return 0
  fi
  if [[ -f "$STATE_DIR/kubeconfig" ]]; then
    kubectl_admin delete node "$NODE_NAME" --wait=false >/dev/null 2>&1 || true
    kubectl_admin -n default delete endpointslice kubernetes-e2e-node --wait=false >/dev/null 2>&1 || true
    kubectl_admin delete clusterrolebinding,clusterrole e2e-node-multus --wait=false >/dev/null 2>&1 || true
    kubectl_admin -n kube-system delete net-attach-def wab-net2 --wait=false >/dev/null 2>&1 || true
  fi
  stop_all
  cleanup_host
  rm -rf "$NODE_DIR"
  log "down: node stopped and removed"
}

cmd_status() {
  local name rc=0
  for name in "${COMPONENTS[@]}"; do
    if is_our_process "$(pid_of "$name")" "$name"; then log "$name: running (pid $(pid_of "$name"))"
    else log "$name: not running"; rc=1; fi
  done
  if node_ready; then log "node $NODE_NAME: Ready"; else log "node $NODE_NAME: not Ready"; rc=1; fi
  return "$rc"
}

cmd_component() {
  local verb="$1" name="${2:-}"
  [[ -d "$NODE_DIR" ]] || die "no node (run: $0 up)"
  load_env
  case "$name" in
    containerd|kubelet) ;;
    *) die "$verb: want containerd or kubelet, got '$name'" ;;
  esac
  if [[ "$verb" == stop || "$verb" == restart ]]; then stop_one "$name"; fi
  if [[ "$verb" == start || "$verb" == restart ]]; then
    is_our_process "$(pid_of "$name")" "$name" && die "$name is already running"
    "start_$name"
  fi
}

cmd_env() {
  [[ -d "$NODE_DIR" ]] || die "no node (run: $0 up)"
  load_env
  cat <<EOF
NODE_DIR=$NODE_DIR
STATIC_POD_PATH=$NODE_DIR/manifests
NODE_NAME=$NODE_NAME
NODE_IP=$NODE_IP
CNI_CONF_DIR=$NODE_DIR/net.d
NETWORKS=$(grep -q wab-net2 "$NODE_DIR/net.d/00-multus.conf" && echo 2 || echo 1)
MACVLAN_MASTER=$MACVLAN_MASTER
NAD_BRIDGE=$NAD_BRIDGE
CONTAINERD_SOCKET=$SOCK
WHEREABOUTS_IMAGE=$WHEREABOUTS_IMAGE
PAUSE_IMAGE=$PAUSE_IMAGE
BUSYBOX_IMAGE=$BUSYBOX_IMAGE
UPSTREAM_IMAGE=${UPSTREAM_IMAGE:-}
MULTUS_THICK_IMAGE=${MULTUS_THICK_IMAGE:-}
IMAGES_DIR=$IMAGES_DIR
EOF
}

# up/down/restart of one node are serialized (a test may call `up` from several threads).
# cluster.sh, called by `up` with the lock held, may call `down` for a stale node: no second lock.
if [[ "${WHEREABOUTS_E2E_NODE_LOCKED:-0}" != 1 ]]; then
  exec 8<"$E2E_DIR/node.sh"
  flock -w 1800 8 || die "could not lock e2e/node.sh within 1800 s"
  export WHEREABOUTS_E2E_NODE_LOCKED=1
fi

case "${1:-}" in
  up) cmd_up ;;
  down) cmd_down ;;
  status) cmd_status ;;
  env) cmd_env ;;
  restart|stop|start) cmd_component "$1" "${2:-}" ;;
  *) echo "usage: $0 up|down|status|env|restart COMPONENT|stop kubelet|start kubelet" >&2; exit 2 ;;
esac
