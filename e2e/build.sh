#!/usr/bin/env bash
# Builds the local control-plane binaries into e2e/bin/:
#   etcd, kube-apiserver, kube-controller-manager, kubectl
# and, for the real node of e2e/node.sh, kubelet, kube-scheduler, kube-proxy and crictl,
# and, for the chart test e2e/helm-test.sh, helm,
# and, for signing and verifying the image offline (e2e/sign-image.sh), cosign,
# and Multus's thin plugin (`multus`, the node's CNI) and its thick mode (`multus-daemon`,
# `multus-shim`) from the source archive in
# ../shared/vendor (WHEREABOUTS_E2E_MULTUS_SOURCE overrides; never copied into the repository),
# from the Go modules pinned in e2e/etcd/go.mod, e2e/k8s/go.mod, e2e/cri-tools/go.mod,
# e2e/helm/go.mod and e2e/cosign/go.mod,
# and, only when named, the oldest supported Kubernetes release's control plane
# (`min/kube-apiserver`, `min/kube-controller-manager` -> e2e/bin/min/) from e2e/k8s-min/go.mod,
# for `make e2e-min` (a cold Go cache takes as long as the newest release's: not built by default).
#
# A binary is rebuilt only when its stamp (e2e/bin/.NAME.stamp, e2e/bin/min/.NAME.stamp) differs from
# the current inputs: Go version, build flags and the go.mod/go.sum of its
# module (so bumping a pinned version rebuilds). The Go build cache (~/.cache/go-build) makes rebuilds incremental.
#
# Usage: e2e/build.sh [NAME...]     (default: etcd, kube-apiserver, kube-controller-manager, kubectl)
# Progress goes to stderr; nothing is printed on stdout.
set -euo pipefail

E2E_DIR="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
BIN_DIR="$E2E_DIR/bin"

# Never let `go` silently download another toolchain: the pinned modules need
# go >= 1.26.0 and the machine has one; if that changes we want a clear error.
export GOTOOLCHAIN="${GOTOOLCHAIN:-local}"
# Static, pure-Go binaries (as upstream builds the server components); also
# means no C compiler is needed.
export CGO_ENABLED=0

log() { printf '[build] %s\n' "$*" >&2; }
die() { printf '[build] ERROR: %s\n' "$*" >&2; exit 1; }

command -v go >/dev/null || die "go not found in PATH (need Go >= 1.26)"
command -v sha256sum >/dev/null || die "sha256sum not found (coreutils)"

# module dir, package path for each binary
module_of() {
  case "$1" in
    etcd) echo "$E2E_DIR/etcd" ;;
    kube-apiserver|kube-controller-manager|kubectl|kubelet|kube-scheduler|kube-proxy) echo "$E2E_DIR/k8s" ;;
    min/kube-apiserver|min/kube-controller-manager) echo "$E2E_DIR/k8s-min" ;;
    crictl) echo "$E2E_DIR/cri-tools" ;;
    helm) echo "$E2E_DIR/helm" ;;
    cosign) echo "$E2E_DIR/cosign" ;;
    *) die "unknown binary '$1' (want etcd, kube-apiserver, kube-controller-manager, kubectl, kubelet, kube-scheduler, kube-proxy, crictl, helm, cosign, multus, multus-daemon, multus-shim, min/kube-apiserver, min/kube-controller-manager)" ;;
  esac
}
package_of() {
  case "$1" in
    etcd) echo "go.etcd.io/etcd/server/v3" ;; # module root is etcd's main package
    crictl) echo "sigs.k8s.io/cri-tools/cmd/crictl" ;;
    helm) echo "helm.sh/helm/v3/cmd/helm" ;;
    cosign) echo "github.com/sigstore/cosign/v3/cmd/cosign" ;;
    *) echo "k8s.io/kubernetes/cmd/${1#min/}" ;;
  esac
}

# -X flags so that `kubectl version` and the apiserver's /version report the
# pinned release instead of "v0.0.0-master". Upstream sets the same variables
# (hack/lib/version.sh). Only for the kubernetes binaries.
version_ldflags() {
  local mod_dir="$1" v major minor
  v="$(cd "$mod_dir" && go list -m -f '{{.Version}}' k8s.io/kubernetes)"
  major="${v#v}"; major="${major%%.*}"
  minor="${v#v*.}"; minor="${minor%%.*}"
  local p flags=""
  for p in k8s.io/component-base/version k8s.io/client-go/pkg/version; do
    flags+=" -X $p.gitVersion=$v -X $p.gitMajor=$major -X $p.gitMinor=$minor -X $p.gitTreeState=clean"
  done
  echo "$flags"
}

# The variables upstream's Makefile sets: `helm version` reports the pinned release, and the
# Kubernetes version that `helm template` and `helm lint` assume (deprecated APIs) is that of
# the client-go helm is built with (v0.34.x -> 1.34) instead of the 1.20 default.
helm_ldflags() {
  local mod_dir="$1" v cg minor
  v="$(cd "$mod_dir" && go list -m -f '{{.Version}}' helm.sh/helm/v3)"
  cg="$(cd "$mod_dir" && go list -m -f '{{.Version}}' k8s.io/client-go)"
  minor="${cg#v0.}"; minor="${minor%%.*}"
  local flags=" -X helm.sh/helm/v3/internal/version.version=$v -X helm.sh/helm/v3/internal/version.gitTreeState=clean"
  local p
  for p in helm.sh/helm/v3/pkg/lint/rules helm.sh/helm/v3/pkg/chartutil; do
    flags+=" -X $p.k8sVersionMajor=1 -X $p.k8sVersionMinor=$minor"
  done
  echo "$flags"
}

# Multus v4.3.0 is not served by the Go proxy: it builds from its archive, vendored dependencies
# included, with no download. The archive's sha256 is checked against the one its README gives.
# A clone elsewhere (CI's) finds the workplace's copy at its usual place.
MULTUS_SOURCE="${WHEREABOUTS_E2E_MULTUS_SOURCE:-$E2E_DIR/../../shared/vendor/multus-cni-v4.3.0.tar.gz}"
[[ -f "$MULTUS_SOURCE" || -n "${WHEREABOUTS_E2E_MULTUS_SOURCE:-}" ]] \
  || MULTUS_SOURCE=/work/shared/vendor/multus-cni-v4.3.0.tar.gz
MULTUS_SHA256=2660d40d01f02a4fb9a0422eb58e9b3708624ec1372fab19bdce99ec044f1dc7

# stamp_of NAME: the stamp file next to e2e/bin/NAME (NAME may be in a folder: min/kube-apiserver).
stamp_of() {
  local dir=""
  [[ "$1" == */* ]] && dir="${1%/*}/"
  echo "$BIN_DIR/$dir.${1##*/}.stamp"
}

# up_to_date NAME WANT: e2e/bin/NAME exists and was built from the inputs whose hash is WANT.
up_to_date() {
  [[ -x "$BIN_DIR/$1" && "$(cat "$(stamp_of "$1")" 2>/dev/null || true)" == "$2" ]] || return 1
  log "$1: up to date"
}

# built NAME WANT START: e2e/bin/NAME.tmp becomes NAME, stamped with WANT.
built() {
  mv -f "$BIN_DIR/$1.tmp" "$BIN_DIR/$1"
  echo "$2" > "$(stamp_of "$1")"
  log "$1: built in $(($(date +%s) - $3)) s -> $BIN_DIR/$1"
}

# build_multus NAME: multus (the thin plugin), multus-daemon or multus-shim (thick mode), each
# from the same archive's ./cmd/NAME.
build_multus() {
  local name="$1" want src start
  [[ -f "$MULTUS_SOURCE" ]] || die "Multus source $MULTUS_SOURCE missing (see ../shared/vendor/README.md)"
  [[ "$(sha256sum "$MULTUS_SOURCE" | cut -d' ' -f1)" == "$MULTUS_SHA256" ]] \
    || die "$MULTUS_SOURCE: sha256 is not $MULTUS_SHA256"
  want="$( { go version; echo "CGO_ENABLED=$CGO_ENABLED"; echo "$MULTUS_SHA256"; } | sha256sum | cut -d' ' -f1)"
  up_to_date "$name" "$want" && return 0
  log "$name: building ./cmd/$name from $MULTUS_SOURCE (the first one about 4 minutes)"
  start=$(date +%s)
  src="$(mktemp -d)"
  tar -xzf "$MULTUS_SOURCE" -C "$src" --strip-components=1
  if ! (cd "$src" && go build -mod=vendor -trimpath -ldflags="-s -w" -o "$BIN_DIR/$name.tmp" "./cmd/$name"); then
    rm -rf "$src" "$BIN_DIR/$name.tmp"
    die "go build of $name failed"
  fi
  rm -rf "$src"
  built "$name" "$want" "$start"
}

build_one() {
  [[ "$1" == multus* ]] && { build_multus "$1"; return; }
  local name="$1" mod_dir pkg ldflags want start
  mod_dir="$(module_of "$name")"
  pkg="$(package_of "$name")"
  ldflags="-s -w"
  case "$name" in
    etcd) ;;
    crictl) ldflags+=" -X sigs.k8s.io/cri-tools/pkg/version.Version=$(cd "$mod_dir" && go list -m -f '{{.Version}}' sigs.k8s.io/cri-tools)" ;;
    helm) ldflags+="$(helm_ldflags "$mod_dir")" ;;
    # `cosign version` reports the pinned release (upstream's Makefile sets the same variable).
    cosign) ldflags+=" -X sigs.k8s.io/release-utils/version.gitVersion=$(cd "$mod_dir" && go list -m -f '{{.Version}}' github.com/sigstore/cosign/v3)" ;;
    *) ldflags+="$(version_ldflags "$mod_dir")" ;;
  esac
  # `go mod edit -json` rather than the raw go.mod: comment edits don't count.
  want="$( { go version; echo "CGO_ENABLED=$CGO_ENABLED"; echo "pkg=$pkg"; echo "ldflags=$ldflags";
             (cd "$mod_dir" && go mod edit -json); cat "$mod_dir/go.sum"; } | sha256sum | cut -d' ' -f1)"
  up_to_date "$name" "$want" && return 0
  log "$name: building $pkg from $mod_dir (this takes minutes on a cold Go build cache)"
  start=$(date +%s)
  mkdir -p "$(dirname "$BIN_DIR/$name")"
  # -mod=readonly: go.sum is checked in and complete; never rewrite it here.
  if ! (cd "$mod_dir" && go build -mod=readonly -trimpath -ldflags="$ldflags" \
          -o "$BIN_DIR/$name.tmp" "$pkg"); then
    rm -f "$BIN_DIR/$name.tmp"
    die "go build of $name failed (module $mod_dir)"
  fi
  built "$name" "$want" "$start"
}

mkdir -p "$BIN_DIR"
# Two builds at once would race on e2e/bin/*.tmp; serialize them with a lock
# on this script file (no lock file to clean up).
if command -v flock >/dev/null; then
  exec 8<"$E2E_DIR/build.sh"
  flock -w 3600 8 || die "another e2e/build.sh is still running after 3600 s"
fi
if [[ $# -eq 0 ]]; then
  set -- etcd kube-apiserver kube-controller-manager kubectl
fi
for n in "$@"; do
  build_one "$n"
done
