#!/usr/bin/env bash
# The multi-arch image, built as the README's "Multi-arch image" says: `make release`'s binaries
# and SBOMs (target/image/amd64/, target/image/arm64/), one image per platform from the
# Dockerfile's `local` stage, joined in one image index (`buildah manifest`), written as an OCI
# archive, with each platform's SBOM beside it:
#
#   localhost/whereabouts:multiarch  ->  OUTDIR/whereabouts-multiarch.tar
#                                        OUTDIR/whereabouts-multiarch-{amd64,arm64}.cdx.json
#
# Then the archive is checked as a registry client would read it: its index lists exactly
# linux/amd64 and linux/arm64, and each platform's image holds the two binaries, static, built for
# that platform's machine (x86-64, AArch64), byte for byte those of target/image/<arch>/, and the
# SBOM of that platform's build at /usr/share/doc/whereabouts/sbom.cdx.json, byte for byte the one
# beside the archive. (What the SBOM lists is checked by tests/e2e/supply.rs.)
#
# Usage: e2e/multiarch-image.sh [OUTDIR]   (default e2e/.images; needs buildah, python3; run
# `make release` first). Progress on stderr.
set -euo pipefail
E2E_DIR="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
REPO="$(cd "$E2E_DIR/.." && pwd)"
OUT="${1:-$E2E_DIR/.images}"
mkdir -p "$OUT"
OUT="$(cd "$OUT" && pwd)"
IMAGE=localhost/whereabouts:multiarch
ARCHIVE="$OUT/whereabouts-multiarch.tar"
PLATFORMS=(amd64 arm64)

log() { printf '[multiarch-image] %s\n' "$*" >&2; }
die() { printf '[multiarch-image] ERROR: %s\n' "$*" >&2; exit 1; }

for arch in "${PLATFORMS[@]}"; do
  for bin in whereabouts whereabouts-operator; do
    [[ -x "$REPO/target/image/$arch/$bin" ]] || die "target/image/$arch/$bin missing (make release)"
  done
  # No image without its SBOM: an image that cannot say what it is built from is not shipped.
  [[ -s "$REPO/target/image/$arch/sbom.cdx.json" ]] \
    || die "target/image/$arch/sbom.cdx.json missing (make release makes it with e2e/sbom.sh)"
done
# A storage of its own (images.sh's ends each build with `rmi --all`).
bah() { buildah --storage-driver vfs --root "$OUT/storage-multiarch" --runroot "$OUT/run-multiarch" "$@"; }
bah rmi --all --force >/dev/null 2>&1 || true
bah manifest rm "$IMAGE" >/dev/null 2>&1 || true

# The README's commands.
bah manifest create "$IMAGE" >/dev/null
for arch in "${PLATFORMS[@]}"; do
  log "linux/$arch"
  # (TARGETARCH is given too: buildah sets it from --platform, older ones may not.)
  bah bud --quiet --layers=false --platform "linux/$arch" --build-arg "TARGETARCH=$arch" \
    --target local --manifest "$IMAGE" -f "$REPO/Dockerfile" "$REPO" >/dev/null
done
rm -f "$ARCHIVE"
bah manifest push --quiet --all "$IMAGE" "oci-archive:$ARCHIVE:$IMAGE" >&2
bah rmi --all --force >/dev/null 2>&1 || true
for arch in "${PLATFORMS[@]}"; do
  cp "$REPO/target/image/$arch/sbom.cdx.json" "${ARCHIVE%.tar}-$arch.cdx.json"
done

# ------------------------------------------------------------------ the check
log "checking $ARCHIVE"
python3 - "$ARCHIVE" "$REPO/target/image" <<'EOF'
import hashlib, io, json, sys, tarfile

archive, binaries = sys.argv[1], sys.argv[2]
MACHINES = {"amd64": 0x3E, "arm64": 0xB7}
TRIPLES = {"amd64": "x86_64-unknown-linux-musl", "arm64": "aarch64-unknown-linux-musl"}
outer = tarfile.open(archive)

def blob(digest):
    algo, hexd = digest.split(":")
    data = outer.extractfile(f"blobs/{algo}/{hexd}").read()
    assert hashlib.sha256(data).hexdigest() == hexd, f"blob {digest} does not match its digest"
    return data

index = json.loads(outer.extractfile("index.json").read())
# buildah writes the index as the archive's only entry (its ref name) pointing at the image index.
(top,) = index["manifests"]
image_index = json.loads(blob(top["digest"]))
found = {}
for m in image_index["manifests"]:
    p = m["platform"]
    assert p["os"] == "linux", p
    manifest = json.loads(blob(m["digest"]))
    config = json.loads(blob(manifest["config"]["digest"]))
    assert config["architecture"] == p["architecture"], (config["architecture"], p)
    files = {}
    for layer in manifest["layers"]:
        with tarfile.open(fileobj=io.BytesIO(blob(layer["digest"]))) as t:
            for member in t.getmembers():
                if member.isfile():
                    files[member.name.lstrip("./")] = t.extractfile(member).read()
    for name in ("whereabouts", "whereabouts-operator"):
        data = files[f"usr/local/bin/{name}"]
        machine = int.from_bytes(data[18:20], "little")
        want = MACHINES[p["architecture"]]
        assert data[:4] == b"\x7fELF" and machine == want, f"{p['architecture']} {name}: machine {machine:#x}, want {want:#x}"
        # Static: no program interpreter (PT_INTERP) in its program headers.
        phoff, phentsize, phnum = (int.from_bytes(data[32:40], "little"),
                                   int.from_bytes(data[54:56], "little"), int.from_bytes(data[56:58], "little"))
        types = [int.from_bytes(data[phoff + i * phentsize:][:4], "little") for i in range(phnum)]
        assert 3 not in types, f"{p['architecture']} {name} is dynamically linked"
        with open(f"{binaries}/{p['architecture']}/{name}", "rb") as f:
            assert f.read() == data, f"{p['architecture']} {name} is not target/image's"
    sbom = files.get("usr/share/doc/whereabouts/sbom.cdx.json")
    assert sbom is not None, f"{p['architecture']}: no /usr/share/doc/whereabouts/sbom.cdx.json"
    with open(archive.removesuffix(".tar") + f"-{p['architecture']}.cdx.json", "rb") as f:
        assert f.read() == sbom, f"{p['architecture']}: the image's SBOM is not the one beside the archive"
    triple = {q["name"]: q["value"] for q in json.loads(sbom)["metadata"]["properties"]}
    triple = triple["cdx:rustc:sbom:target:triple"]
    assert triple == TRIPLES[p["architecture"]], f"{p['architecture']}: SBOM of {triple}"
    found[p["architecture"]] = manifest["config"]["digest"]
assert sorted(found) == ["amd64", "arm64"], f"platforms in the index: {sorted(found)}"
print(f"[multiarch-image] index {top['digest'][:19]}: " + ", ".join(f"linux/{a}" for a in sorted(found)), file=sys.stderr)
EOF
log "ok: $IMAGE in $ARCHIVE"
