#!/usr/bin/env bash
# Re-pins e2e/k8s/go.mod (or, with --dir, another module of the same layout such as e2e/k8s-min,
# the oldest supported release) to another Kubernetes release:
#   e2e/k8s/bump.sh 1.37.2
#   e2e/k8s/bump.sh --dir e2e/k8s-min 1.33.13
# k8s.io/kubernetes requires its staging modules (k8s.io/api, k8s.io/client-go,
# ...) at v0.0.0, which the Go proxy does not serve; each one is replaced by
# its published tag v0.<minor>.<patch>. The list of staging modules is read
# from the release's own go.mod, so new/removed ones are picked up.
set -euo pipefail
usage="usage: $0 [--dir MODULE_DIR] 1.MINOR.PATCH"
dir="$(dirname "${BASH_SOURCE[0]}")"
if [[ "${1:-}" == --dir ]]; then
  dir="${2:?$usage}"
  shift 2
fi
# The module must already exist with its tool lines (the binaries it pins): only the kubernetes
# require and the replace block are rewritten here.
[[ -f "$dir/go.mod" ]] || { echo "$dir/go.mod not found ($usage)" >&2; exit 1; }
cd "$dir"
export GOTOOLCHAIN="${GOTOOLCHAIN:-local}"

v="${1:?$usage}"
v="${v#v}"
staging_v="0.${v#1.}"

modfile="$(go mod download -json "k8s.io/kubernetes@v$v" | python3 -c 'import json,sys; print(json.load(sys.stdin)["GoMod"])')"
mapfile -t mods < <(grep -E '^[[:space:]]+k8s\.io/[a-z0-9-]+ v0\.0\.0([[:space:]]|$)' "$modfile" | awk '{print $1}' | sort -u)
((${#mods[@]} > 0)) || { echo "no v0.0.0 staging requirements found in $modfile" >&2; exit 1; }

# Rewrite the replace block (one block, sorted, like the checked-in file).
go mod edit -require="k8s.io/kubernetes@v$v"
python3 - "$staging_v" "${mods[@]}" <<'PY'
import re, sys
ver, mods = sys.argv[1], sys.argv[2:]
src = open("go.mod").read()
src = re.sub(r"\nreplace \(\n.*?\n\)\n", "\n", src, flags=re.S)   # block form
src = re.sub(r"\nreplace [^\n(]+\n", "\n", src)                   # one-line form
block = "replace (\n" + "".join(f"\t{m} => {m} v{ver}\n" for m in mods) + ")\n"
open("go.mod", "w").write(src.rstrip("\n") + "\n\n" + block)
PY
go mod tidy
echo "pinned k8s.io/kubernetes v$v with ${#mods[@]} staging modules at v$staging_v" >&2
