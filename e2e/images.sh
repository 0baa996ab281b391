#!/usr/bin/env bash
# Builds the OCI images the real node runs (e2e/node.sh), with no registry and no base image:
#   localhost/whereabouts:<tag>  the repo's Dockerfile, stage `local`, linux/amd64: the static
#                                binaries of `cargo build --release --target x86_64-unknown-linux-musl`
#                                and their SBOM (e2e/sbom.sh), in target/image/amd64/ as `make release`
#                                puts them
#   localhost/pause:3.10         Kubernetes' own pause.c (from the pinned k8s.io/kubernetes
#                                module), compiled statically with musl-gcc
#   localhost/busybox:latest     Debian's busybox-static and its applet links, for test pods
#   localhost/multus-thick:v4.3.0  Multus's thick mode (multus-daemon, multus-shim) for the node
#                                tier's thick-mode test
# Each goes to an OCI archive in the output folder; `images.env` there names them:
#   WHEREABOUTS_IMAGE=localhost/whereabouts:<tag>  (the tag is a digest of the two binaries, the
#   SBOM and the Dockerfile, so a rebuild is a new tag and a node never runs a stale image under an
#   old name)
#   PAUSE_IMAGE=...  BUSYBOX_IMAGE=...  and *_ARCHIVE=<path> for each.
#
# Usage: e2e/images.sh [OUTDIR]    (default e2e/.images; progress on stderr, nothing on stdout)
# Needs: buildah (Debian), musl-tools, busybox-static, go (for the module path of pause.c),
# cargo-cyclonedx (make deps).
set -euo pipefail

E2E_DIR="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
REPO="$(cd "$E2E_DIR/.." && pwd)"
OUT="${1:-$E2E_DIR/.images}"
mkdir -p "$OUT"
OUT="$(cd "$OUT" && pwd)"
CARGO="${CARGO:-cargo}"
TARGET=x86_64-unknown-linux-musl
PAUSE_VERSION=3.10

log() { printf '[images] %s\n' "$*" >&2; }
die() { printf '[images] ERROR: %s\n' "$*" >&2; exit 1; }

for tool in buildah musl-gcc go sha256sum; do
  command -v "$tool" >/dev/null || die "$tool not found (run e2e/install-deps.sh)"
done
[[ -x /bin/busybox ]] && /bin/busybox --list >/dev/null || die "/bin/busybox missing (apt-get install busybox-static)"
if command -v rustup >/dev/null && ! rustup target list --installed | grep -qx "$TARGET"; then
  die "the Rust target $TARGET is not installed (rustup target add $TARGET, or make deps)"
fi
# A private storage, so the images built here never mix with anything else buildah holds.
bah() { buildah --storage-driver vfs --root "$OUT/storage" --runroot "$OUT/run" "$@"; }

# build NAME REF CONTEXT [BUD ARGS...]: builds REF unless its archive is newer than its inputs'
# stamp, then writes OUT/NAME.tar.
build() {
  local name="$1" ref="$2" ctx="$3" stamp="$4"; shift 4
  if [[ -s "$OUT/$name.tar" && "$(cat "$OUT/.$name.stamp" 2>/dev/null)" == "$stamp" ]]; then
    log "$ref: up to date ($OUT/$name.tar)"
    return 0
  fi
  log "$ref: building"
  bah bud --quiet --layers=false -t "$ref" "$@" "$ctx" >/dev/null
  rm -f "$OUT/$name.tar"
  bah push --quiet "$ref" "oci-archive:$OUT/$name.tar:$ref" >&2
  bah rmi --all --force >/dev/null 2>&1 || true
  echo "$stamp" > "$OUT/.$name.stamp"
}

# 1. whereabouts, from the repo's Dockerfile with the host-built static binaries.
log "static binaries: $CARGO build --release --locked --target $TARGET --bins"
(cd "$REPO" && "$CARGO" build --release --locked --target "$TARGET" --bins >&2)
bins=("$REPO/target/$TARGET/release/whereabouts" "$REPO/target/$TARGET/release/whereabouts-operator")
install -D -m 0755 -t "$REPO/target/image/amd64" "${bins[@]}"
sbom="$REPO/target/image/amd64/sbom.cdx.json"
CARGO="$CARGO" "$E2E_DIR/sbom.sh" "$TARGET" "$sbom"
digest="$(cat "${bins[@]}" "$sbom" "$REPO/Dockerfile" | sha256sum | cut -c1-12)"
WHEREABOUTS_IMAGE="localhost/whereabouts:dev-$digest"
build whereabouts "$WHEREABOUTS_IMAGE" "$REPO" "$digest" --target local -f "$REPO/Dockerfile" \
  --platform linux/amd64 --build-arg TARGETARCH=amd64

# 2. pause: the sandbox image every pod starts with.
pause_src="$(cd "$E2E_DIR/k8s" && GOTOOLCHAIN=local go list -m -f '{{.Dir}}' k8s.io/kubernetes)/build/pause/linux/pause.c"
[[ -f "$pause_src" ]] || die "pause.c not found at $pause_src (go mod download in e2e/k8s)"
ctx="$OUT/ctx-pause"
rm -rf "$ctx" && mkdir -p "$ctx"
musl-gcc -Os -static -Wall -Werror -DVERSION="v$PAUSE_VERSION-whereabouts-e2e" -o "$ctx/pause" "$pause_src"
strip "$ctx/pause"
cat > "$ctx/Containerfile" <<'EOC'
FROM scratch
COPY pause /pause
USER 65535:65535
ENTRYPOINT ["/pause"]
EOC
PAUSE_IMAGE="localhost/pause:$PAUSE_VERSION"
build pause "$PAUSE_IMAGE" "$ctx" "$(cat "$ctx/pause" "$ctx/Containerfile" | sha256sum | cut -c1-12)" -f "$ctx/Containerfile"

# 3. busybox: a shell, ip, sleep, ... for test workloads.
ctx="$OUT/ctx-busybox"
rm -rf "$ctx" && mkdir -p "$ctx/rootfs/bin" "$ctx/rootfs/tmp"
cp /bin/busybox "$ctx/rootfs/bin/busybox"
for applet in $(/bin/busybox --list); do
  [[ "$applet" == busybox ]] || ln -s busybox "$ctx/rootfs/bin/$applet"
done
cat > "$ctx/Containerfile" <<'EOC'
FROM scratch
COPY rootfs/ /
ENV PATH=/bin
CMD ["/bin/sh"]
EOC
BUSYBOX_IMAGE="localhost/busybox:latest"
build busybox "$BUSYBOX_IMAGE" "$ctx" "$(cat /bin/busybox "$ctx/Containerfile" | sha256sum | cut -c1-12)" -f "$ctx/Containerfile"

# 4. multus-thick: Multus v4.3.0's thick mode (e2e/build.sh multus-daemon multus-shim) at the
#    paths of its own image, and busybox for the init container that copies the shim to the host.
ctx="$OUT/ctx-multus-thick"
rm -rf "$ctx" && mkdir -p "$ctx/rootfs/bin" "$ctx/rootfs/usr/src/multus-cni/bin"
for b in multus-daemon multus-shim; do
  [[ -x "$E2E_DIR/bin/$b" ]] || die "e2e/bin/$b missing (e2e/build.sh $b)"
  cp "$E2E_DIR/bin/$b" "$ctx/rootfs/usr/src/multus-cni/bin/$b"
done
cp /bin/busybox "$ctx/rootfs/bin/busybox"
for applet in sh cp mv; do ln -s busybox "$ctx/rootfs/bin/$applet"; done
# The daemon checks it runs as root with os/user, which (built without cgo) reads /etc/passwd;
# without the file it dereferences a nil user and panics.
mkdir -p "$ctx/rootfs/etc" "$ctx/rootfs/var"
echo 'root:x:0:0:root:/root:/bin/sh' > "$ctx/rootfs/etc/passwd"
echo 'root:x:0:' > "$ctx/rootfs/etc/group"
# The runtime names network namespaces by /var/run/netns/...: /var/run is /run, as in a distro.
ln -s ../run "$ctx/rootfs/var/run"
cat > "$ctx/Containerfile" <<'EOC'
FROM scratch
COPY rootfs/ /
ENV PATH=/bin
EOC
MULTUS_THICK_IMAGE="localhost/multus-thick:v4.3.0"
build multus-thick "$MULTUS_THICK_IMAGE" "$ctx" \
  "$( { cat "$E2E_DIR/bin/multus-daemon" "$E2E_DIR/bin/multus-shim" /bin/busybox "$ctx/Containerfile" "$ctx/rootfs/etc/passwd"; readlink "$ctx/rootfs/var/run"; } | sha256sum | cut -c1-12)" \
  -f "$ctx/Containerfile"

# upstream-image.sh's lines (UPSTREAM_*) are kept: it builds separately, and rarely.
upstream_lines="$(grep '^UPSTREAM_' "$OUT/images.env" 2>/dev/null || true)"
cat > "$OUT/images.env" <<EOE
$upstream_lines
WHEREABOUTS_IMAGE=$WHEREABOUTS_IMAGE
WHEREABOUTS_ARCHIVE=$OUT/whereabouts.tar
PAUSE_IMAGE=$PAUSE_IMAGE
PAUSE_ARCHIVE=$OUT/pause.tar
BUSYBOX_IMAGE=$BUSYBOX_IMAGE
BUSYBOX_ARCHIVE=$OUT/busybox.tar
MULTUS_THICK_IMAGE=$MULTUS_THICK_IMAGE
MULTUS_THICK_ARCHIVE=$OUT/multus-thick.tar
EOE
log "images in $OUT (names in $OUT/images.env)"
