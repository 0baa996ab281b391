#!/usr/bin/env bash
# Installs upstream whereabouts v0.9.2 on the cluster the way its users do, from its own manifests
# in its Go module, so the node tier can test replacing it in place (issue 26, item 3):
#
#   KUBECONFIG=... e2e/upstream-install.sh IMAGE            apply, wait for the rollouts
#   KUBECONFIG=... e2e/upstream-install.sh --delete IMAGE   delete what it applied except the CRDs,
#                                                           wait until its pods are gone
#
# IMAGE is e2e/upstream-image.sh's (UPSTREAM_IMAGE in e2e/.images/images.env), already imported
# into the node's containerd. Applied, in this order, with `kubectl apply -f` as upstream's README:
#   doc/crds/whereabouts.cni.cncf.io_*.yaml   the three CRDs (ippools, nodeslicepools,
#                                             overlappingrangeipreservations)
#   doc/crds/daemonset-install.yaml           ServiceAccount kube-system/whereabouts, ClusterRole
#                                             whereabouts-cni, ClusterRoleBinding whereabouts,
#                                             ConfigMap kube-system/whereabouts-config, DaemonSet
#                                             kube-system/whereabouts (install-cni.sh, token-watcher.sh,
#                                             ip-control-loop with its daily reconciler)
#   doc/crds/node-slice-controller.yaml       Deployment kube-system/whereabouts-controller
# (upstream's README lists only the first two CRDs and the DaemonSet; its Helm chart, whose
# templates these files mirror, also installs the nodeslicepools CRD and the controller by default.)
#
# The only edit, on each container: `image:` becomes IMAGE (upstream's is
# ghcr.io/k8snetworkplumbingwg/whereabouts:latest, which cannot be pulled here), and
# `imagePullPolicy: Never` is added (a `:latest` image defaults to Always, i.e. a pull that cannot
# work here; with Never a missing import fails at once with ErrImageNeverPull naming the image).
# Nothing else is changed: the host paths (/opt/cni/bin, /etc/cni/net.d) are those of e2e/node.sh.
# The edited manifests, and their diff against upstream's, are kept in WORKDIR
# ($WHEREABOUTS_E2E_STATE/upstream-install, else e2e/.state/upstream-install).
#
# Progress on stderr. Waits up to WHEREABOUTS_E2E_UPSTREAM_TIMEOUT s (default 300) per rollout.
set -euo pipefail

E2E_DIR="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
MODULE=github.com/k8snetworkplumbingwg/whereabouts
VERSION=v0.9.2
# See e2e/upstream-image.sh: the manifests come from exactly the source the image is built from.
MODULE_SUM='h1:M/LhO2FwXN4C3WPkD0FoT6JACraSW4XrU7mxX9xZd8o='
UPSTREAM_IMAGE_REF=ghcr.io/k8snetworkplumbingwg/whereabouts:latest
NS=kube-system
# The pods' labels, from the manifests: the DaemonSet's selector and the controller's.
DS_PODS='name=whereabouts'
CONTROLLER_PODS='app=whereabouts-controller'
TIMEOUT="${WHEREABOUTS_E2E_UPSTREAM_TIMEOUT:-300}"

log() { printf '[upstream-install] %s\n' "$*" >&2; }
die() { printf '[upstream-install] ERROR: %s\n' "$*" >&2; exit 1; }
usage() { echo "usage: e2e/upstream-install.sh [--delete] IMAGE   (KUBECONFIG in the environment)" >&2; exit 2; }

delete=false
if [[ "${1:-}" == --delete ]]; then delete=true; shift; fi
[[ $# -eq 1 ]] || usage
image="$1"
[[ "$image" == *:* && "$image" != *[[:space:]]* ]] || die "IMAGE must be NAME:TAG, got '$image'"
[[ -n "${KUBECONFIG:-}" ]] || die "KUBECONFIG is not set"
[[ -x "$E2E_DIR/bin/kubectl" ]] || die "$E2E_DIR/bin/kubectl missing (e2e/build.sh kubectl)"
command -v go >/dev/null || die "go not found (needed to locate upstream's module)"
kubectl() { "$E2E_DIR/bin/kubectl" "$@"; }
work="${WHEREABOUTS_E2E_STATE:-$E2E_DIR/.state}/upstream-install"

# ------------------------------------------------------------------ upstream's manifests
# `go mod download` in an empty folder: outside any module, it only fetches into the module cache
# (read-only) and prints the folder; GOTOOLCHAIN=local never downloads another Go.
scratch="$(mktemp -d)"
trap 'rm -rf "$scratch"' EXIT
mod="$( (cd "$scratch" && GOTOOLCHAIN=local GOFLAGS= go mod download -json "$MODULE@$VERSION") \
  | python3 -c 'import json, sys; m = json.load(sys.stdin); print(m.get("Sum", ""), m.get("Dir", ""))')" \
  || die "could not download $MODULE@$VERSION (is the Go module proxy reachable?)"
[[ "${mod%% *}" == "$MODULE_SUM" ]] || die "$MODULE@$VERSION has sum '${mod%% *}', expected $MODULE_SUM"
crds="${mod#* }/doc/crds"

rm -rf "$work" && mkdir -p "$work"
# The CRDs are applied as they are.
crd_files=("$crds"/whereabouts.cni.cncf.io_*.yaml)
[[ ${#crd_files[@]} -eq 3 && -f "${crd_files[0]}" ]] || die "expected 3 CRDs in $crds, found: ${crd_files[*]}"
# The workloads get the image edit (above). Every `image:` line must be upstream's reference, so
# a manifest with some other image (which would then be pulled) fails here instead of on the node.
workloads=()
for f in daemonset-install.yaml node-slice-controller.yaml; do
  [[ -f "$crds/$f" ]] || die "$crds/$f missing"
  others="$(grep -E '^[[:space:]-]*image:' "$crds/$f" | grep -vF "image: $UPSTREAM_IMAGE_REF" || true)"
  [[ -z "$others" ]] || die "$f has an image this script does not replace: $others"
  grep -q 'imagePullPolicy:' "$crds/$f" && die "$f already sets imagePullPolicy: review this script's edit"
  sed -E "s|^([[:space:]]*)image: $UPSTREAM_IMAGE_REF\$|\1image: $image\n\1imagePullPolicy: Never|" \
    "$crds/$f" > "$work/$f"
  n="$(grep -c "image: $image\$" "$work/$f" || true)"
  [[ "$n" -eq "$(grep -cE '^[[:space:]-]*image:' "$crds/$f")" && "$n" -ge 1 ]] \
    || die "$f: replaced $n image line(s), not every one"
  diff -u "$crds/$f" "$work/$f" >> "$work/edits.diff" || true
  workloads+=("$work/$f")
done
# kubectl's `-f FILE` arguments for the files given.
fileargs() { args=(); local f; for f in "$@"; do args+=(-f "$f"); done; }

# ------------------------------------------------------------------ delete
# Everything of the two workload manifests goes (ServiceAccount, RBAC, ConfigMap, DaemonSet,
# Deployment); the CRDs, and so every pool and reservation, stay for whatever replaces upstream.
if $delete; then
  log "deleting upstream $VERSION's workloads (the CRDs stay)"
  fileargs "${workloads[@]}"
  # In the files' order, as `kubectl delete -f` of upstream's manifests does: the ServiceAccount
  # goes first, so from then on the token in the host's kubeconfig is refused (401).
  # Foreground: each object goes only after its dependents (ReplicaSet, pods).
  kubectl delete --ignore-not-found --cascade=foreground --wait=true --timeout="${TIMEOUT}s" \
    "${args[@]}" >&2 || die "kubectl delete did not finish within ${TIMEOUT} s"
  # Then the pods themselves, whatever their owners' finalizers did: a test that follows must
  # find no upstream process on the node (the installer would write the host's files again).
  deadline=$((SECONDS + TIMEOUT))
  while :; do
    left=""
    for sel in "$DS_PODS" "$CONTROLLER_PODS"; do
      left+="$(kubectl -n "$NS" get pods -l "$sel" -o name)" || die "cannot list pods -l $sel in $NS"
    done
    [[ -z "$left" ]] && break
    ((SECONDS < deadline)) || die "upstream's pods still there after ${TIMEOUT} s: $left"
    sleep 2
  done
  log "upstream $VERSION deleted; its files on the host stay (/opt/cni/bin/whereabouts, /etc/cni/net.d/whereabouts.d/)"
  exit 0
fi

# ------------------------------------------------------------------ apply
log "applying upstream $VERSION (image $image; edits in $work/edits.diff)"
fileargs "${crd_files[@]}"
kubectl apply "${args[@]}" >&2
# The workloads' custom resources must be served before the controllers list them.
for f in "${crd_files[@]}"; do
  name="$(basename "$f" .yaml)"; name="${name#whereabouts.cni.cncf.io_}.whereabouts.cni.cncf.io"
  kubectl wait --for=condition=Established --timeout="${TIMEOUT}s" "crd/$name" >&2
done
fileargs "${workloads[@]}"
kubectl apply "${args[@]}" >&2
kubectl -n "$NS" rollout status daemonset/whereabouts --timeout="${TIMEOUT}s" >&2 \
  || die "DaemonSet $NS/whereabouts not rolled out within ${TIMEOUT} s (is $image imported on the node?)"
kubectl -n "$NS" rollout status deployment/whereabouts-controller --timeout="${TIMEOUT}s" >&2 \
  || die "Deployment $NS/whereabouts-controller not rolled out within ${TIMEOUT} s (it runs on the pod network: is a whereabouts plugin on the host?)"
log "upstream $VERSION installed"
