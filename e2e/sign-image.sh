#!/usr/bin/env bash
# Signs the multi-arch image (the OCI archive of e2e/multiarch-image.sh) with cosign and verifies
# it, all offline: a key pair made here, no transparency log (Rekor), no Fulcio certificate, no
# registry.
#
# What is signed is the image index: the bytes whose sha256 is the image's digest (what a node
# pulls by, `REGISTRY/whereabouts@sha256:...`). The index names each platform's manifest by
# digest, each manifest its config and layers, so the signature covers every byte of the image
# once each blob is checked against its digest; `verify` does both: cosign on the index, then the
# digest of every blob the index reaches.
#
# Usage (keygen, sign and check read the private key's password from COSIGN_PASSWORD; empty is
# allowed, unset is not):
#   e2e/sign-image.sh keygen DIR                  DIR/cosign.key, DIR/cosign.pub
#   e2e/sign-image.sh sign ARCHIVE KEY [BUNDLE]   signs; the signature goes to BUNDLE
#                                                 (default ARCHIVE without .tar + .sigstore.json)
#   e2e/sign-image.sh verify ARCHIVE PUB [BUNDLE] exit 0 only if the image is the one signed
#   e2e/sign-image.sh check ARCHIVE               the whole round in a temporary folder: a key
#                                                 pair, sign, verify, then tampered copies of the
#                                                 archive and another key, which must all fail
# Needs e2e/bin/cosign (e2e/build.sh cosign) and python3. Progress on stderr.
set -euo pipefail
E2E_DIR="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
COSIGN="${COSIGN:-$E2E_DIR/bin/cosign}"

log() { printf '[sign-image] %s\n' "$*" >&2; }
die() { printf '[sign-image] ERROR: %s\n' "$*" >&2; exit 1; }

need_password() {
  [[ -v COSIGN_PASSWORD ]] || die "COSIGN_PASSWORD is not set (the private key's password; may be empty)"
  export COSIGN_PASSWORD
}

need_file() { [[ -s "$1" ]] || die "$1 missing${2:+ ($2)}"; }

# cosign, as root in a network namespace of its own with no interface but a down loopback: proof
# that nothing here needs the public-good instance (TUF root, Rekor, Fulcio) or any other host.
cosign() {
  if [[ $EUID -eq 0 ]] && command -v unshare >/dev/null; then
    unshare --net "$COSIGN" "$@"
  else
    "$COSIGN" "$@"
  fi
}

default_bundle() { echo "${1%.tar}.sigstore.json"; }

# index_blob ARCHIVE OUT: the archive's image index (the blob its index.json points at) to OUT.
index_blob() {
  python3 - "$1" "$2" <<'EOF'
import json, sys, tarfile
archive, out = sys.argv[1:]
with tarfile.open(archive) as t:
    (top,) = json.loads(t.extractfile("index.json").read())["manifests"]
    algo, hexd = top["digest"].split(":")
    data = t.extractfile(f"blobs/{algo}/{hexd}").read()
open(out, "wb").write(data)
EOF
}

# blobs_match ARCHIVE: every blob the image index reaches (manifests, configs, layers) is in the
# archive with the size and sha256 its descriptor names. Fails naming the first that is not.
blobs_match() {
  python3 - "$1" <<'EOF'
import hashlib, json, sys, tarfile
t = tarfile.open(sys.argv[1])

def blob(desc):
    algo, hexd = desc["digest"].split(":")
    data = t.extractfile(f"blobs/{algo}/{hexd}").read() if algo == "sha256" else b""
    if hashlib.sha256(data).hexdigest() != hexd or len(data) != desc["size"]:
        sys.exit(f"[sign-image] blob {desc['digest']} ({desc.get('mediaType')}) is not what its descriptor names")
    return data

(top,) = json.loads(t.extractfile("index.json").read())["manifests"]
count = 0
for m in json.loads(blob(top))["manifests"]:
    manifest = json.loads(blob(m))
    for d in [manifest["config"], *manifest["layers"]]:
        blob(d)
        count += 1
    count += 1
print(f"[sign-image] {count + 1} blobs match their digests", file=sys.stderr)
EOF
}

keygen() {
  local dir="$1"
  need_password
  mkdir -p "$dir"
  (cd "$dir" && cosign generate-key-pair --output-key-prefix cosign >/dev/null 2>&1) \
    || die "cosign generate-key-pair failed in $dir"
  log "key pair: $dir/cosign.key, $dir/cosign.pub"
}

# sign ARCHIVE KEY [BUNDLE]: a cosign bundle (signature and key hint) for the image index. No
# signing config, no transparency log upload: nothing leaves the machine.
sign() {
  local archive="$1" key="$2" bundle="${3:-$(default_bundle "$1")}" tmp
  need_password
  need_file "$archive" "e2e/multiarch-image.sh builds it"
  need_file "$key" "e2e/sign-image.sh keygen makes it"
  tmp="$(mktemp -d)"
  index_blob "$archive" "$tmp/index.json"
  if ! cosign sign-blob --yes --key "$key" --use-signing-config=false --tlog-upload=false \
      --bundle "$bundle" "$tmp/index.json" >/dev/null 2>"$tmp/err"; then
    cat "$tmp/err" >&2; rm -rf "$tmp"; die "cosign sign-blob failed"
  fi
  rm -rf "$tmp"
  log "signed $archive's image index: $bundle"
}

# verify ARCHIVE PUB [BUNDLE]: the index is signed by PUB's key, and every blob is the index's.
verify() {
  local archive="$1" pub="$2" bundle="${3:-$(default_bundle "$1")}" tmp
  need_file "$archive"
  need_file "$pub"
  need_file "$bundle" "the signature: e2e/sign-image.sh sign makes it"
  tmp="$(mktemp -d)"
  index_blob "$archive" "$tmp/index.json"
  if ! cosign verify-blob --key "$pub" --bundle "$bundle" --insecure-ignore-tlog \
      "$tmp/index.json" >/dev/null 2>"$tmp/err"; then
    sed 's/^/[sign-image]   cosign: /' "$tmp/err" >&2; rm -rf "$tmp"
    log "NOT verified: $archive's image index is not the one $pub signed"
    return 1
  fi
  rm -rf "$tmp"
  if ! blobs_match "$archive"; then
    log "NOT verified: $archive holds blobs that are not its signed index's"
    return 1
  fi
  log "verified: $archive is the image $pub signed"
}

# tamper_index ARCHIVE OUT: a well-formed copy (every blob matches its digest) of another image:
# the index's linux/amd64 entry points at the linux/arm64 image, so amd64 nodes would run arm64
# binaries. Only the signature can tell.
tamper_index() {
  python3 - "$1" "$2" <<'EOF'
import hashlib, io, json, sys, tarfile
src, out = sys.argv[1:]
with tarfile.open(src) as t, tarfile.open(out, "w") as o:
    (top,) = json.loads(t.extractfile("index.json").read())["manifests"]
    algo, hexd = top["digest"].split(":")
    index = json.loads(t.extractfile(f"blobs/{algo}/{hexd}").read())
    by_arch = {m["platform"]["architecture"]: m for m in index["manifests"]}
    for key in ("digest", "size"):
        by_arch["amd64"][key] = by_arch["arm64"][key]
    data = json.dumps(index).encode()
    top["digest"], top["size"] = "sha256:" + hashlib.sha256(data).hexdigest(), len(data)
    def add(name, payload):
        info = tarfile.TarInfo(name); info.size = len(payload)
        o.addfile(info, io.BytesIO(payload))
    for m in t.getmembers():
        if m.name != "index.json":
            o.addfile(m, t.extractfile(m) if m.isfile() else None)
    add(f"blobs/sha256/{top['digest'].split(':')[1]}", data)
    add("index.json", json.dumps({"schemaVersion": 2, "manifests": [top]}).encode())
EOF
}

# tamper_layer ARCHIVE OUT: a copy whose largest layer has one byte changed, digests left as they
# were: the signed index is intact, the image under it is not.
tamper_layer() {
  python3 - "$1" "$2" <<'EOF'
import io, sys, tarfile
src, out = sys.argv[1:]
with tarfile.open(src) as t, tarfile.open(out, "w") as o:
    largest = max((m for m in t.getmembers() if m.isfile()), key=lambda m: m.size)
    for m in t.getmembers():
        data = t.extractfile(m).read() if m.isfile() else None
        if m is largest:
            data = bytearray(data); data[len(data) // 2] ^= 0xFF; data = bytes(data)
        o.addfile(m, io.BytesIO(data) if data is not None else None)
EOF
}

# must_fail WHAT CMD...: CMD must exit non-zero (a verification that passes here is a bug).
must_fail() {
  local what="$1"; shift
  if "$@"; then die "$what: verified, but must not"; fi
  log "ok: $what: rejected"
}

# The folder of `check`, removed on any exit (a failed step exits through die).
CHECK_DIR=""
trap '[[ -z "$CHECK_DIR" ]] || rm -rf "$CHECK_DIR"' EXIT

check() {
  local archive="$1" dir
  need_password
  need_file "$archive" "e2e/multiarch-image.sh builds it"
  CHECK_DIR="$(mktemp -d)"
  dir="$CHECK_DIR"
  keygen "$dir/keys"
  sign "$archive" "$dir/keys/cosign.key" "$dir/image.sigstore.json"
  verify "$archive" "$dir/keys/cosign.pub" "$dir/image.sigstore.json" || die "the signed image does not verify"
  log "ok: the signed image verifies"

  tamper_index "$archive" "$dir/index-tampered.tar"
  blobs_match "$dir/index-tampered.tar" || die "the tampered index's copy is not well-formed"
  must_fail "a copy with another image index (amd64 entry -> the arm64 image)" \
    verify "$dir/index-tampered.tar" "$dir/keys/cosign.pub" "$dir/image.sigstore.json"
  tamper_layer "$archive" "$dir/layer-tampered.tar"
  must_fail "a copy with one byte of a layer changed" \
    verify "$dir/layer-tampered.tar" "$dir/keys/cosign.pub" "$dir/image.sigstore.json"
  keygen "$dir/other"
  must_fail "the image against another key" \
    verify "$archive" "$dir/other/cosign.pub" "$dir/image.sigstore.json"
  log "4 passed, 0 failed"
}

[[ -x "$COSIGN" ]] || die "$COSIGN missing (e2e/build.sh cosign)"
[[ $# -ge 1 ]] || die "usage: e2e/sign-image.sh keygen DIR | sign ARCHIVE KEY [BUNDLE] | verify ARCHIVE PUB [BUNDLE] | check ARCHIVE"
cmd="$1"; shift
case "$cmd" in
  keygen) [[ $# -eq 1 ]] || die "usage: keygen DIR"; keygen "$1" ;;
  sign) [[ $# -ge 2 && $# -le 3 ]] || die "usage: sign ARCHIVE KEY [BUNDLE]"; sign "$@" ;;
  verify) [[ $# -ge 2 && $# -le 3 ]] || die "usage: verify ARCHIVE PUB [BUNDLE]"; verify "$@" ;;
  check) [[ $# -eq 1 ]] || die "usage: check ARCHIVE"; check "$1" ;;
  *) die "unknown command '$cmd' (keygen, sign, verify, check)" ;;
esac
