#!/usr/bin/env bash
# Builds upstream whereabouts v0.9.2's image as its own Dockerfile does, from its Go module and with
# no registry, so the node tier can install upstream exactly as its users do (issue 26, item 3:
# replacing upstream in place) and then migrate from it:
#
#   localhost/whereabouts-upstream:v0.9.2  ->  OUTDIR/whereabouts-upstream.tar (OCI archive)
#
# What upstream's Dockerfile (final stage, FROM alpine, WORKDIR /) puts in the image, at its paths:
#   /whereabouts /ip-control-loop /node-slice-controller   hack/build-go.sh's three static binaries
#   /install-cni.sh /lib.sh /token-watcher.sh              script/, which its manifests run
#   CMD ["/install-cni.sh"]
# Alpine is not available here; the scripts need only a POSIX shell and coreutils, so the base is
# Debian's busybox-static with its applet links in /bin (as e2e/images.sh builds localhost/busybox).
#
# OUTDIR/images.env gets (or has replaced) UPSTREAM_IMAGE=... and UPSTREAM_ARCHIVE=...; its other
# lines are kept. The build is skipped when its inputs did not change (OUTDIR/.whereabouts-upstream.stamp).
# After a build the archive itself is checked: its layer is unpacked, the binaries must be static
# x86-64 ELF, and the plugin (CNI_COMMAND=VERSION) and upstream's install-cni.sh are run in a chroot
# of it.
#
# Usage: e2e/upstream-image.sh [OUTDIR]   (default e2e/.images; progress on stderr, nothing on stdout)
# Needs: go (module proxy reachable), buildah, busybox-static, python3, tar, chroot (root): all in
# e2e/install-deps.sh.
set -euo pipefail

E2E_DIR="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
OUT="${1:-$E2E_DIR/.images}"
mkdir -p "$OUT"
OUT="$(cd "$OUT" && pwd)"

MODULE=github.com/k8snetworkplumbingwg/whereabouts
VERSION=v0.9.2
# The go.sum hash of the module zip: the image is built from exactly this source, whatever proxy
# or GOFLAGS the machine has (the checksum database checks it too, unless GONOSUMDB says otherwise).
MODULE_SUM='h1:M/LhO2FwXN4C3WPkD0FoT6JACraSW4XrU7mxX9xZd8o='
IMAGE="localhost/whereabouts-upstream:$VERSION"
NAME=whereabouts-upstream
ARCHIVE="$OUT/$NAME.tar"
STAMP="$OUT/.$NAME.stamp"

log() { printf '[upstream-image] %s\n' "$*" >&2; }
die() { printf '[upstream-image] ERROR: %s\n' "$*" >&2; exit 1; }

for tool in go buildah python3 tar chroot sha256sum; do
  command -v "$tool" >/dev/null || die "$tool not found (run e2e/install-deps.sh)"
done
# Its full path: the checks run it under `env -i`, which has no PATH.
CHROOT="$(command -v chroot)"
[[ -x /bin/busybox ]] && /bin/busybox --list >/dev/null || die "/bin/busybox missing (apt-get install busybox-static)"

# Never download another Go toolchain because of the module's go/toolchain lines.
export GOTOOLCHAIN=local
# Images for the node are linux/amd64 only (the node tier runs on this x86-64 machine).
export GOOS=linux GOARCH=amd64 CGO_ENABLED=0

# A private buildah storage, apart from images.sh's ($OUT/storage): images.sh ends each build with
# `rmi --all`, which would delete this image mid-build if both ran at once. Same flags otherwise.
bah() { buildah --storage-driver vfs --root "$OUT/storage-upstream" --runroot "$OUT/run-upstream" "$@"; }

tmp="$(mktemp -d)"
trap 'rm -rf "$tmp"' EXIT

# ------------------------------------------------------------------ the module
# `go mod download` outside any module (in an empty folder) fetches into the module cache and
# prints where it is; the cache is read-only, so the build works on a copy.
log "module: go mod download $MODULE@$VERSION"
moddir="$( (cd "$tmp" && go mod download -json "$MODULE@$VERSION") | python3 -c '
import json, sys
m = json.load(sys.stdin)
if m.get("Error"):
    sys.exit("go mod download: " + m["Error"])
print(m["Sum"], m["Dir"])')" || die "could not download $MODULE@$VERSION (is the Go module proxy reachable?)"
sum="${moddir%% *}"; moddir="${moddir#* }"
[[ "$sum" == "$MODULE_SUM" ]] || die "$MODULE@$VERSION has sum $sum, expected $MODULE_SUM"
for f in Dockerfile hack/build-go.sh script/install-cni.sh script/lib.sh script/token-watcher.sh \
  cmd/whereabouts.go cmd/controlloop cmd/nodeslicecontroller; do
  [[ -e "$moddir/$f" ]] || die "$moddir/$f missing: is this really $MODULE@$VERSION?"
done

# hack/build-go.sh's version stamp. It reads the version from git, which a module zip does not
# have: VERSION given makes it "released", so the plugin reports plain "v0.9.2" like the
# released image; GitSHA stays empty (the zip does not say which commit it is).
ldflags="-X $MODULE/pkg/version.Version=$VERSION -X $MODULE/pkg/version.GitSHA= \
-X $MODULE/pkg/version.GitTreeState=clean -X $MODULE/pkg/version.ReleaseStatus=released"
# hack/build-go.sh's three builds (output name, package). -trimpath, which upstream does not use,
# only keeps the temporary build path out of the binaries, so equal inputs give equal bytes.
builds=("whereabouts ./cmd/" "ip-control-loop ./cmd/controlloop/" "node-slice-controller ./cmd/nodeslicecontroller/")
goflags=(-trimpath -ldflags "$ldflags")

# The image's Containerfile: upstream's final stage with `FROM alpine` replaced by the rootfs
# below (busybox and its links, /tmp). Its ENV PATH is alpine's, which the scripts run under.
containerfile='FROM scratch
LABEL org.opencontainers.image.source=https://github.com/k8snetworkplumbingwg/whereabouts
LABEL org.opencontainers.image.version=v0.9.2
COPY rootfs/ /
ENV PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin
CMD ["/install-cni.sh"]'

# Everything the image depends on: the Go toolchain, the module, the flags, busybox, this script.
stamp="$( { go version; echo "$MODULE@$VERSION $sum"; printf '%s\n' "${goflags[@]}" "${builds[@]}";
  echo "$containerfile"; sha256sum /bin/busybox "${BASH_SOURCE[0]}" | cut -d' ' -f1; } | sha256sum | cut -c1-16)"

# images.env: replace our two lines, keep every other line (images.sh's), atomically.
write_env() {
  local env="$OUT/images.env" new
  new="$(mktemp "$OUT/.images.env.XXXXXX")"
  if [[ -f "$env" ]]; then
    grep -v -e '^UPSTREAM_IMAGE=' -e '^UPSTREAM_ARCHIVE=' "$env" > "$new" || true
  fi
  printf 'UPSTREAM_IMAGE=%s\nUPSTREAM_ARCHIVE=%s\n' "$IMAGE" "$ARCHIVE" >> "$new"
  chmod 0644 "$new"
  mv -f "$new" "$env"
}

if [[ -s "$ARCHIVE" && "$(cat "$STAMP" 2>/dev/null)" == "$stamp" ]]; then
  log "$IMAGE: up to date ($ARCHIVE)"
  write_env
  exit 0
fi

# ------------------------------------------------------------------ the binaries
start=$SECONDS
src="$tmp/src"
cp -r "$moddir" "$src"
chmod -R u+w "$src"
ctx="$OUT/ctx-upstream"
rm -rf "$ctx" && mkdir -p "$ctx/rootfs/bin" "$ctx/rootfs/tmp"
chmod 1777 "$ctx/rootfs/tmp"
for b in "${builds[@]}"; do
  out="${b%% *}" pkg="${b#* }"
  log "go build $pkg -> /$out (CGO_ENABLED=0, the module's go.mod and go.sum)"
  (cd "$src" && go build "${goflags[@]}" -o "$ctx/rootfs/$out" "$pkg") \
    || die "go build of $MODULE@$VERSION $pkg failed"
done
log "binaries built in $((SECONDS - start)) s"

# ------------------------------------------------------------------ the rootfs
# Module zips do not keep file modes (the cache holds everything 0444), but the DaemonSet runs
# /install-cni.sh and /token-watcher.sh directly, so they need the executable bit they have in
# upstream's git tree; lib.sh is only sourced.
install -m 0755 "$src/script/install-cni.sh" "$ctx/rootfs/install-cni.sh"
install -m 0755 "$src/script/token-watcher.sh" "$ctx/rootfs/token-watcher.sh"
install -m 0644 "$src/script/lib.sh" "$ctx/rootfs/lib.sh"
cp /bin/busybox "$ctx/rootfs/bin/busybox"
for applet in $(/bin/busybox --list); do
  [[ "$applet" == busybox ]] || ln -s busybox "$ctx/rootfs/bin/$applet"
done
printf '%s\n' "$containerfile" > "$ctx/Containerfile"

# ------------------------------------------------------------------ the image
log "$IMAGE: building"
bah bud --quiet --layers=false -t "$IMAGE" -f "$ctx/Containerfile" "$ctx" >/dev/null
rm -f "$ARCHIVE" "$STAMP"
bah push --quiet "$IMAGE" "oci-archive:$ARCHIVE:$IMAGE" >&2
bah rmi --all --force >/dev/null 2>&1 || true

# ------------------------------------------------------------------ check the archive
# No runtime is available without the node, so the archive is unpacked and run in a chroot.
log "checking $ARCHIVE"
root="$tmp/root"
mkdir -p "$tmp/oci" "$root"
tar -xf "$ARCHIVE" -C "$tmp/oci"
layers="$(python3 - "$tmp/oci" "$IMAGE" <<'EOP'
import json, sys, os
oci, ref = sys.argv[1], sys.argv[2]
blob = lambda d: os.path.join(oci, "blobs", *d.split(":"))
idx = json.load(open(os.path.join(oci, "index.json")))
m = [x for x in idx["manifests"] if x.get("annotations", {}).get("org.opencontainers.image.ref.name") in (ref, ref.split(":")[-1])]
if len(m) != 1:
    sys.exit("index.json names %d manifests for %s" % (len(m), ref))
man = json.load(open(blob(m[0]["digest"])))
cfg = json.load(open(blob(man["config"]["digest"])))
if cfg["config"].get("Cmd") != ["/install-cni.sh"] or cfg["architecture"] != "amd64":
    sys.exit("unexpected config: Cmd %s, architecture %s" % (cfg["config"].get("Cmd"), cfg["architecture"]))
print("\n".join(blob(l["digest"]) for l in man["layers"]))
EOP
)" || die "$ARCHIVE is not the OCI archive of $IMAGE"
while read -r layer; do tar -xf "$layer" -C "$root"; done <<< "$layers"
# Static x86-64 executables: read from the ELF header (type EXEC, machine x86-64) and program
# headers (no PT_INTERP, no PT_DYNAMIC), so `file` is not needed; its verdict is logged if present.
elf_static() {
  python3 - "$1" <<'EOP2'
import struct, sys
with open(sys.argv[1], "rb") as f:
    h = f.read(64)
    if h[:4] != b"\x7fELF" or h[4] != 2 or h[5] != 1:
        sys.exit("not a 64-bit little-endian ELF file")
    e_type, e_machine = struct.unpack_from("<HH", h, 16)
    if e_type != 2 or e_machine != 62:
        sys.exit("ELF type %d machine %d, not an x86-64 executable" % (e_type, e_machine))
    phoff, = struct.unpack_from("<Q", h, 32)
    phentsize, phnum = struct.unpack_from("<HH", h, 54)
    for i in range(phnum):
        f.seek(phoff + i * phentsize)
        p_type, = struct.unpack("<I", f.read(4))
        if p_type in (2, 3):
            sys.exit("dynamically linked (PT_DYNAMIC or PT_INTERP)")
EOP2
}
for f in whereabouts ip-control-loop node-slice-controller; do
  [[ -x "$root/$f" ]] || die "/$f missing or not executable in the image"
  why="$(elf_static "$root/$f" 2>&1)" || die "/$f is not a static x86-64 executable: $why"
  if command -v file >/dev/null; then log "/$f: $(file -b "$root/$f")"; fi
done
[[ -x "$root/install-cni.sh" && -x "$root/token-watcher.sh" && -f "$root/lib.sh" ]] \
  || die "upstream's scripts missing or not executable in the image"
for applet in sh cp cat sed mkdir base64 md5sum awk tr chmod touch date sleep; do
  [[ -x "$root/bin/$applet" ]] || die "/bin/$applet missing in the image"
done
ver="$(env -i CNI_COMMAND=VERSION "$CHROOT" "$root" /whereabouts </dev/null)" || die "/whereabouts CNI_COMMAND=VERSION failed"
[[ "$ver" == *'"supportedVersions"'* ]] || die "/whereabouts answered VERSION with: $ver"
log "/whereabouts VERSION: $ver"

# Upstream's DaemonSet command's first line, with a fake service account and empty host folders:
# the plugin and the flat file must land where a node's runtime and the plugin look for them.
sa="$root/var/run/secrets/kubernetes.io/serviceaccount"
mkdir -p "$sa" "$root/host/opt/cni/bin" "$root/host/etc/cni/net.d"
echo "fake-token" > "$sa/token"
echo "fake-ca" > "$sa/ca.crt"
env -i PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin \
  KUBERNETES_SERVICE_HOST=10.96.0.1 KUBERNETES_SERVICE_PORT=443 WHEREABOUTS_NAMESPACE=kube-system \
  "$CHROOT" "$root" /bin/sh -c 'SLEEP=false source /install-cni.sh' > "$tmp/install.log" 2>&1 \
  || die "install-cni.sh failed in the image: $(cat "$tmp/install.log")"
cmp -s "$root/whereabouts" "$root/host/opt/cni/bin/whereabouts" || die "install-cni.sh did not copy the plugin"
kc="$root/host/etc/cni/net.d/whereabouts.d/whereabouts.kubeconfig"
conf="$root/host/etc/cni/net.d/whereabouts.d/whereabouts.conf"
grep -q 'server: https://10.96.0.1:443' "$kc" && grep -q 'token: "fake-token"' "$kc" \
  && grep -q "certificate-authority-data: $(echo fake-ca | base64)" "$kc" \
  || die "install-cni.sh wrote an unexpected kubeconfig: $(cat "$kc")"
grep -q '"kubeconfig": "/etc/cni/net.d/whereabouts.d/whereabouts.kubeconfig"' "$conf" \
  || die "install-cni.sh wrote an unexpected flat file: $(cat "$conf")"
log "install-cni.sh in the image wrote: $(cd "$root/host" && find . -type f | sed 's|^\.||' | sort | tr '\n' ' ')"

echo "$stamp" > "$STAMP"
write_env
log "$IMAGE: $ARCHIVE ($(du -h "$ARCHIVE" | cut -f1)) in $((SECONDS - start)) s; names in $OUT/images.env"
