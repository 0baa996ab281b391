#!/usr/bin/env bash
# The chart test (make helm): charts/whereabouts renders the same objects as the kustomize
# install config/default, and its values change what they say and nothing else.
#   1. the chart's copies (crds/, files/) equal their sources in config/;
#      appVersion equals the crate version (Cargo.toml);
#   2. helm lint, with the defaults and with every switch flipped;
#   3. helm template compared object by object (apiVersion/kind/namespace/name) with
#      kubectl kustomize, ignoring only the chart's own labels (e2e/helm_compare.py):
#      the defaults; namespace.create; certManager + monitoring in another namespace;
#      every other value at once (pool namespace, agent off, image, replicas, scheduling, resources);
#      each distribution's CNI folders (values node.cniBinDir/cniConfDir = config/components/layout-*).
# helm and kubectl are built into e2e/bin by e2e/build.sh (skipped when up to date;
# WHEREABOUTS_E2E_SKIP_BUILD=1 uses e2e/bin as is). No cluster is needed.
# Ends with "N passed, N failed".
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

BIN_DIR=e2e/bin
CHART=charts/whereabouts
HELM="$BIN_DIR/helm"
KUBECTL="$BIN_DIR/kubectl"

log() { printf '[helm-test] %s\n' "$*" >&2; }
die() { printf '[helm-test] ERROR: %s\n' "$*" >&2; exit 1; }

command -v python3 >/dev/null || die "python3 not found (run e2e/install-deps.sh)"
python3 -c 'import yaml' 2>/dev/null || die "PyYAML not found (python3-yaml; run e2e/install-deps.sh)"
if [[ "${WHEREABOUTS_E2E_SKIP_BUILD:-0}" == 1 ]] || ! command -v go >/dev/null; then
  for b in helm kubectl; do
    [[ -x "$BIN_DIR/$b" ]] || die "$BIN_DIR/$b missing and not building (need go, see e2e/build.sh)"
  done
else
  e2e/build.sh helm kubectl || die "build failed (e2e/build.sh, see messages above)"
fi

work="$(mktemp -d /tmp/wa-helm-test.XXXXXX)"
trap 'rm -rf "$work"' EXIT

passed=0
failed=0
check() { # NAME COMMAND...: runs one check, counts it
  local name="$1"; shift
  if "$@"; then
    log "PASS $name"; passed=$((passed + 1))
  else
    log "FAIL $name"; failed=$((failed + 1))
  fi
}

# 1. Copies and versions.
same_file() { # SOURCE COPY
  cmp -s "$1" "$2" && return 0
  echo "$2 differs from $1: cp $1 $2" >&2
  diff -u "$1" "$2" | head -40 >&2 || true
  return 1
}
crd_copies() {
  local ok=0 src_list copy_list
  src_list="$(cd config/crd && ls -- *.yaml | grep -vx kustomization.yaml)"
  copy_list="$(cd "$CHART/crds" && ls -- *.yaml)"
  if [[ "$src_list" != "$copy_list" ]]; then
    echo "$CHART/crds/ has [$(tr '\n' ' ' <<<"$copy_list")], config/crd/ has [$(tr '\n' ' ' <<<"$src_list")]" >&2
    ok=1
  fi
  local f
  for f in $src_list; do
    [[ -f "$CHART/crds/$f" ]] && { same_file "config/crd/$f" "$CHART/crds/$f" || ok=1; }
  done
  return $ok
}
check "crds/ equals config/crd (make crds refreshes both)" crd_copies
check "files/dashboard.json equals config/monitoring" \
  same_file config/monitoring/dashboard.json "$CHART/files/dashboard.json"
check "files/prometheusrule.yaml equals config/monitoring" \
  same_file config/monitoring/prometheusrule.yaml "$CHART/files/prometheusrule.yaml"

app_version() {
  local crate chart
  crate="$(sed -n 's/^version *= *"\(.*\)"/\1/p' Cargo.toml | head -1)"
  chart="$(sed -n 's/^appVersion: *"\{0,1\}\([^"]*\)"\{0,1\}$/\1/p' "$CHART/Chart.yaml")"
  [[ -n "$crate" && "$crate" == "$chart" ]] && return 0
  echo "Chart.yaml appVersion '$chart' != Cargo.toml version '$crate'" >&2
  return 1
}
check "appVersion equals the crate version" app_version

# 2. Lint.
check "helm lint (defaults)" "$HELM" lint --strict "$CHART"
check "helm lint (certManager, monitoring, agent off, namespace.create)" \
  "$HELM" lint --strict "$CHART" --set certManager=true,monitoring.enabled=true,agent.enabled=false,namespace.create=true

# 3. Renderings against kustomize.
"$KUBECTL" kustomize config/default >"$work/default.yaml"
"$KUBECTL" kustomize config/default-cert-manager >"$work/default-cert-manager.yaml"
"$KUBECTL" kustomize config/monitoring >"$work/monitoring.yaml"

render() { # OUT NAMESPACE HELM-ARGS...
  local out="$1" ns="$2"; shift 2
  "$HELM" template whereabouts "$CHART" --namespace "$ns" --include-crds "$@" >"$work/$out"
}
compare() { # LABEL RENDERING helm_compare.py-ARGS...
  local label="$1" rendering="$2"; shift 2
  python3 e2e/helm_compare.py "$work/$rendering" --label "$label" "$@"
}

# The defaults: config/default without the release namespace (helm install --create-namespace
# makes it); the operator's namespace is the chart's (operator.createNamespace).
render default.chart.yaml whereabouts-system
check "defaults = config/default (less the release Namespace)" \
  compare defaults default.chart.yaml --expect "$work/default.yaml" --drop Namespace/whereabouts-system

render namespace.chart.yaml whereabouts-system --set namespace.create=true
check "namespace.create = config/default" \
  compare namespace.create namespace.chart.yaml --expect "$work/default.yaml"

# config/default-cert-manager (cert-manager's objects, the operator serving its files), the monitoring objects,
# and every namespaced object (and reference to one) in the release namespace; the agent's
# resources (Helm merges maps: a key set replaces only that key).
render all-on.chart.yaml net-system --set certManager=true,monitoring.enabled=true,namespace.create=true \
  --set agent.resources.limits.memory=512Mi
check "certManager + monitoring in namespace net-system = config/default-cert-manager + monitoring" \
  compare certmanager+monitoring all-on.chart.yaml --expect "$work/default-cert-manager.yaml" \
    --expect "$work/monitoring.yaml" --namespace net-system \
    --set "DaemonSet/whereabouts-node:spec.template.spec.containers[agent].resources.limits.memory=512Mi"

# The operator's namespace (restricted, its own by default): another one moves the operator's
# objects and every reference to them; an empty one puts the operator next to the node DaemonSet.
render operator-ns.chart.yaml whereabouts-system --set operator.namespace=net-ops
check "operator.namespace moves the operator's objects and the references to them" \
  compare operator.namespace operator-ns.chart.yaml --expect "$work/default.yaml" \
    --drop Namespace/whereabouts-system --operator-namespace net-ops
render operator-release-ns.chart.yaml whereabouts-system --set operator.namespace=
check "operator.namespace empty: the operator in the release namespace, no Namespace rendered" \
  compare operator.namespace= operator-release-ns.chart.yaml --expect "$work/default.yaml" \
    --drop Namespace/whereabouts-system --drop Namespace/whereabouts-operator \
    --operator-namespace whereabouts-system
restricted_operator_ns() {
  python3 - "$work/default.yaml" <<'PY'
import sys, yaml
ns = {o["metadata"]["name"]: o["metadata"].get("labels", {})
      for o in yaml.safe_load_all(open(sys.argv[1])) if o and o["kind"] == "Namespace"}
want = {"whereabouts-system": "privileged", "whereabouts-operator": "restricted"}
got = {n: ns.get(n, {}).get("pod-security.kubernetes.io/enforce") for n in want}
sys.exit(0 if got == want else f"Pod Security levels {got}, want {want}")
PY
}
check "config/default: the node's namespace privileged, the operator's restricted" restricted_operator_ns

# Every other value, each changing only its own fields. (Maps given whole: Helm merges them into
# the defaults key by key.)
cat >"$work/values.yaml" <<'EOF'
poolNamespace: net-pools
image:
  repository: registry.example.com/whereabouts
  tag: "9.9.9"
  pullPolicy: Always
agent:
  enabled: false
operator:
  replicas: 3
  resources: {requests: {cpu: 100m, memory: 128Mi}, limits: {cpu: "2", memory: 512Mi}}
  nodeSelector: {node-role.kubernetes.io/control-plane: ""}
  tolerations: [{key: node-role.kubernetes.io/control-plane, effect: NoSchedule}]
node:
  resources: {requests: {cpu: 20m, memory: 64Mi}, limits: {cpu: 200m, memory: 1Gi}}
  nodeSelector: {kubernetes.io/os: linux}
  tolerations: [{key: dedicated, operator: Equal, value: net, effect: NoSchedule}]
  seLinuxOptions: {level: "s0"}
EOF
render values.chart.yaml whereabouts-system -f "$work/values.yaml"
operator=Deployment/whereabouts-operator
node=DaemonSet/whereabouts-node
check "non-default values change only their fields" \
  compare values values.chart.yaml --expect "$work/default.yaml" --drop Namespace/whereabouts-system \
    --pool-namespace net-pools --no-agent \
    --image registry.example.com/whereabouts:9.9.9 --pull-policy Always \
    --set "$operator:spec.replicas=3" \
    --set "$operator:spec.template.spec.containers[operator].resources={requests: {cpu: 100m, memory: 128Mi}, limits: {cpu: \"2\", memory: 512Mi}}" \
    --set "$operator:spec.template.spec.nodeSelector={node-role.kubernetes.io/control-plane: ''}" \
    --set "$operator:spec.template.spec.tolerations=[{key: node-role.kubernetes.io/control-plane, effect: NoSchedule}]" \
    --set "$node:spec.template.spec.containers[install-cni].resources={requests: {cpu: 20m, memory: 64Mi}, limits: {cpu: 200m, memory: 1Gi}}" \
    --set "$node:spec.template.spec.nodeSelector={kubernetes.io/os: linux}" \
    --set "$node:spec.template.spec.tolerations=[{key: dedicated, operator: Equal, value: net, effect: NoSchedule}]" \
    --set "$node:spec.template.spec.securityContext.seLinuxOptions={type: spc_t, level: s0}"

# No SELinux type: the chart's null and kustomize's component (config/components/no-selinux).
"$KUBECTL" kustomize e2e/kustomize/no-selinux >"$work/no-selinux.yaml"
render no-selinux.chart.yaml whereabouts-system --set node.seLinuxOptions=null
check "node.seLinuxOptions=null = config/components/no-selinux" \
  compare no-selinux no-selinux.chart.yaml --expect "$work/no-selinux.yaml" --drop Namespace/whereabouts-system
no_selinux_type() { ! grep -q 'seLinuxOptions' "$work/no-selinux.yaml"; }
check "the no-selinux component removes the type" no_selinux_type

# Each distribution's CNI folders: the chart's two values and kustomize's component render the
# same DaemonSet, and that DaemonSet names the layout's folders in all five places (installer
# flags, its two mounts, the agent's kubeconfig, the two hostPaths) and the defaults in none.
layout() { # NAME BIN CONF
  local name="$1" bin="$2" conf="$3" out="$work/layout-$1.yaml"
  "$KUBECTL" kustomize "e2e/kustomize/layout-$name" >"$out" || return 1
  render "layout-$name.chart.yaml" whereabouts-system --set "node.cniBinDir=$bin,node.cniConfDir=$conf"
  compare "layout-$name" "layout-$name.chart.yaml" --expect "$out" --drop Namespace/whereabouts-system || return 1
  local want
  for want in "--cni-bin-dir=$bin" "--cni-conf-dir=$conf" "mountPath: /host$bin" "mountPath: /host$conf" \
      "--serves-kubeconfig=$conf/whereabouts.d/whereabouts.kubeconfig" "path: $bin" "path: $conf"; do
    grep -qF -- "$want" "$out" || { echo "layout $name: no '$want' in the DaemonSet" >&2; return 1; }
  done
  if [[ "$bin" != /opt/cni/bin ]] && grep -qE -- '[ =]/opt/cni/bin$' "$out"; then
    echo "layout $name: /opt/cni/bin is still named" >&2; return 1
  fi
}
check "layout openshift" layout openshift /var/lib/cni/bin /etc/kubernetes/cni/net.d
check "layout k3s" layout k3s /var/lib/rancher/k3s/data/cni /var/lib/rancher/k3s/agent/etc/cni/net.d
check "layout microk8s" layout microk8s /var/snap/microk8s/current/opt/cni/bin /var/snap/microk8s/current/args/cni-network
check "layout gke" layout gke /home/kubernetes/bin /etc/cni/net.d

# A folder that is not a clean absolute path is refused at render time, naming the value and its key.
refuses_bad_folders() {
  local key bad out
  for key in cniBinDir cniConfDir; do
    for bad in opt/cni/bin /etc/cni/net.d/ /etc/../tmp /a//b ""; do
      if out="$("$HELM" template whereabouts "$CHART" --set "node.$key=$bad" 2>&1)"; then
        echo "node.$key=$bad rendered" >&2; return 1
      fi
      grep -qF "node.$key \"$bad\" is not a clean absolute path" <<<"$out" || { echo "$out" >&2; return 1; }
    done
  done
}
check "node.cniBinDir/cniConfDir: bad folders are refused, naming them" refuses_bad_folders

# The comparison itself must catch a difference (a test that cannot fail proves nothing).
sed 's/--pool-namespace=kube-system/--pool-namespace=elsewhere/' "$work/default.chart.yaml" >"$work/broken.chart.yaml"
catches_drift() {
  ! compare broken broken.chart.yaml --expect "$work/default.yaml" --drop Namespace/whereabouts-system >"$work/broken.out" &&
    grep -q 'differs: apps/v1/Deployment/whereabouts-operator/whereabouts-operator' "$work/broken.out" &&
    grep -q 'differs: apps/v1/DaemonSet/whereabouts-system/whereabouts-node' "$work/broken.out"
}
check "a changed flag is reported" catches_drift

echo "helm: $passed passed, $failed failed"
((failed == 0))
