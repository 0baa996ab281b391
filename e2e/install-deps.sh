#!/usr/bin/env bash
# Installs what a fresh Debian 12 machine needs for the e2e control plane
# (e2e/build.sh, e2e/cluster.sh, e2e/selftest.sh) and the chart test
# (e2e/helm-test.sh). Idempotent and non-interactive; run as root. Only apt is
# used here; the Kubernetes, etcd and helm binaries are compiled from source by
# e2e/build.sh via the Go module proxy (by the test scripts that need them),
# nothing prebuilt is downloaded.
#
# Go itself (>= 1.26, see e2e/k8s/go.mod) is expected to be installed
# already; Debian 12's golang package is far too old for Kubernetes 1.37.
set -euo pipefail

# Why each package:
#   openssl                      CA, serving/client certs, SA signing keys
#   python3                      picking free ports; the webhook test server
#   python3-yaml                 the chart test compares helm's and kustomize's objects (e2e/helm_compare.py)
#   curl                         etcd and controller-manager health checks
#   ca-certificates              TLS to the Go module proxy during the build
#   git                          `go` uses it for some module operations
#   util-linux                   setsid, flock (essential on Debian; listed to be explicit)
#   procps                       ps/pgrep for humans inspecting the cluster
#   iproute2                     network namespaces / veths for CNI tests
#   containernetworking-plugins  reference CNI plugins (bridge, loopback, ...)
#                                that the IPAM plugin is chained with in tests
#   prometheus                   a real Prometheus scrapes the operator in the
#                                metrics e2e test; promtool checks the alert rules
# The real node (e2e/node.sh, e2e/images.sh):
#   containerd, runc             the container runtime the kubelet drives
#   iptables, conntrack          kube-proxy's iptables mode
#   socat                        forwards the node address to the loopback-only API server
#   buildah                      builds the images from the Dockerfile, no registry, no daemon
#   musl-tools                   musl-gcc: the static (musl) release build and the pause binary
#   busybox-static               the test workload image
#   binutils                     readelf: the node tests check the plugin is static
# linux/arm64 (make release, the arm64 tests):
#   gcc-aarch64-linux-gnu        cross C compiler and linker for aarch64-unknown-linux-musl (.cargo/config.toml)
#   libc6-dev-arm64-cross        its C headers (only Recommended by it, so --no-install-recommends
#                                leaves them out): without them ring's C fails on <bits/libc-header-start.h>
#   qemu-user-static             runs the arm64 binaries on this x86_64 machine in the tests
PACKAGES=(
  openssl
  python3
  python3-yaml
  curl
  ca-certificates
  git
  util-linux
  procps
  iproute2
  containernetworking-plugins
  prometheus
  containerd
  runc
  iptables
  conntrack
  socat
  buildah
  musl-tools
  busybox-static
  binutils
  gcc-aarch64-linux-gnu
  libc6-dev-arm64-cross
  qemu-user-static
)

if [[ "$(id -u)" != 0 ]]; then
  echo "install-deps: must run as root (apt-get install)" >&2
  exit 1
fi

missing=()
for p in "${PACKAGES[@]}"; do
  # dpkg-query prints "install ok installed" only for a fully installed package.
  if [[ "$(dpkg-query -W -f='${Status}' "$p" 2>/dev/null || true)" != "install ok installed" ]]; then
    missing+=("$p")
  fi
done

if ((${#missing[@]} == 0)); then
  echo "install-deps: all packages present" >&2
else
  echo "install-deps: installing ${missing[*]}" >&2
  export DEBIAN_FRONTEND=noninteractive
  # Only refresh the package lists when something has to be installed.
  apt-get update -q
  apt-get install -y -q --no-install-recommends "${missing[@]}"
fi

if ! command -v go >/dev/null; then
  echo "install-deps: WARNING: go not found in PATH; e2e/build.sh needs Go >= 1.26" >&2
fi
