#!/usr/bin/env bash
# Builds the two CNI binaries the allocation benchmark compares.
#
#   bench/build.sh              ours from the work tree -> target/release/whereabouts
#   bench/build.sh --upstream-only  upstream only (the chaos tier's mixed fleet)
#   bench/build.sh --from-head  ours from `git archive HEAD` (ignores uncommitted
#                               edits in the work tree) -> bench/bin/whereabouts-ours,
#                               commit recorded in bench/bin/whereabouts-ours.commit
#
# Upstream always: the Go module pinned in bench/upstream/go.mod ->
# bench/bin/whereabouts-upstream (CGO_ENABLED=0, version stamped like upstream's
# hack/build-go.sh does).
#
# Env: BENCH_CARGO_TARGET_DIR  target dir for --from-head (default /tmp/wa-bench-target)
set -euo pipefail
BENCH="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
ROOT="$(dirname "$BENCH")"
mkdir -p "$BENCH/bin"

# ---- upstream
UPSTREAM_MOD=github.com/k8snetworkplumbingwg/whereabouts
UPSTREAM_VERSION="$(cd "$BENCH/upstream" && go list -m -f '{{.Version}}' "$UPSTREAM_MOD")"
V="$UPSTREAM_MOD/pkg/version"
echo "[build] upstream $UPSTREAM_MOD@$UPSTREAM_VERSION -> bench/bin/whereabouts-upstream" >&2
(cd "$BENCH/upstream" && CGO_ENABLED=0 go build \
  -ldflags "-X $V.Version=$UPSTREAM_VERSION -X $V.GitSHA=module-proxy -X $V.ReleaseStatus=released" \
  -o "$BENCH/bin/whereabouts-upstream" "$UPSTREAM_MOD/cmd")

# ---- ours
if [[ "${1:-}" == "--upstream-only" ]]; then
  exit 0
elif [[ "${1:-}" == "--from-head" ]]; then
  commit="$(git -C "$ROOT" rev-parse --short HEAD)"
  src="$(mktemp -d /tmp/wa-bench-src.XXXXXX)"
  trap 'rm -rf "$src"' EXIT
  git -C "$ROOT" archive HEAD | tar -x -C "$src"
  target="${BENCH_CARGO_TARGET_DIR:-/tmp/wa-bench-target}"
  echo "[build] ours at $commit (git archive) -> bench/bin/whereabouts-ours" >&2
  (cd "$src" && CARGO_TARGET_DIR="$target" cargo build --release --bin whereabouts)
  cp "$target/release/whereabouts" "$BENCH/bin/whereabouts-ours"
  echo "$commit" > "$BENCH/bin/whereabouts-ours.commit"
else
  echo "[build] ours from the work tree -> target/release/whereabouts" >&2
  (cd "$ROOT" && cargo build --release --bin whereabouts)
fi
