#!/usr/bin/env bash
# The README's "Install on a cluster", command for command, for a cluster whose nodes hold IMAGE:
# the NAD CRD (there is no Multus here), an overlay of config/default that sets the image,
# `kubectl apply -k` and the rollout waits. The operator makes the webhook's certificate itself.
#
#   KUBECONFIG=... e2e/install.sh IMAGE [WORKDIR]
#
# WORKDIR (default $WHEREABOUTS_E2E_STATE/install, else e2e/.state-install) gets the overlay
# (whereabouts-install/). Progress on stderr.
set -euo pipefail
E2E_DIR="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
REPO="$(cd "$E2E_DIR/.." && pwd)"
image="${1:?usage: e2e/install.sh IMAGE [WORKDIR]}"
work="${2:-${WHEREABOUTS_E2E_STATE:-$E2E_DIR/.state}/install}"
[[ -n "${KUBECONFIG:-}" ]] || { echo "install: KUBECONFIG is not set" >&2; exit 2; }
[[ "$image" == *:* ]] || { echo "install: IMAGE must be NAME:TAG, got '$image'" >&2; exit 2; }
kubectl() { "$E2E_DIR/bin/kubectl" "$@"; }

rm -rf "$work" && mkdir -p "$work"
cd "$work"
kubectl apply -f "$REPO/crds/network-attachment-definitions.yaml" >&2

mkdir -p whereabouts-install
cat > whereabouts-install/kustomization.yaml <<EOF
resources:
  - $(realpath --relative-to="$work/whereabouts-install" "$REPO/config/default")
images:
  - name: whereabouts
    newName: ${image%:*}
    newTag: ${image##*:}
EOF
kubectl apply -k whereabouts-install >&2
kubectl -n whereabouts-operator rollout status deployment/whereabouts-operator --timeout=300s >&2
kubectl -n whereabouts-system rollout status daemonset/whereabouts-node --timeout=300s >&2
