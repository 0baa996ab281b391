#!/usr/bin/env bash
# Mints a development CA and a serving certificate for the admission webhook.
#
#   webhook-certs/mint.sh [--dns NAME]... [--ip IP]... [--out DIR] [--days N]
#
# Writes DIR/ca.crt, DIR/ca.key (reused on later runs, so rotating the serving certificate keeps
# the same trust anchor), DIR/tls.crt and DIR/tls.key, then prints the base64 caBundle for the
# ValidatingWebhookConfiguration on stdout (progress goes to stderr). The files are written to a
# temporary name and renamed, so a running operator never reads a half-written pair.
# Default: --dns whereabouts-webhook.whereabouts-system.svc --out webhook-certs/dev. Keys are never committed.
set -euo pipefail

dns=()
ips=()
out=""
days=365
usage() { sed -n '2,11p' "$0" | sed 's/^# \{0,1\}//' >&2; exit 2; }
while [[ $# -gt 0 ]]; do
  case "$1" in
    --dns) dns+=("${2:?--dns needs a name}"); shift 2 ;;
    --ip) ips+=("${2:?--ip needs an address}"); shift 2 ;;
    --out) out="${2:?--out needs a directory}"; shift 2 ;;
    --days) days="${2:?--days needs a number}"; shift 2 ;;
    -h|--help) usage ;;
    *) echo "mint.sh: unknown argument $1" >&2; usage ;;
  esac
done
[[ -n "$out" ]] || out="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)/dev"
if [[ ${#dns[@]} -eq 0 && ${#ips[@]} -eq 0 ]]; then
  dns=(whereabouts-webhook.whereabouts-system.svc)
fi
command -v openssl >/dev/null || { echo "mint.sh: needs the openssl CLI (apt-get install openssl)" >&2; exit 2; }
mkdir -p "$out"
umask 077
work="$(mktemp -d "$out/.mint.XXXXXX")"
trap 'rm -rf "$work"' EXIT

if [[ ! -s "$out/ca.crt" || ! -s "$out/ca.key" ]]; then
  echo "mint.sh: new development CA in $out" >&2
  openssl req -x509 -newkey ec -pkeyopt ec_paramgen_curve:prime256v1 -nodes -sha256 \
    -days 3650 -subj "/CN=whereabouts development CA" \
    -addext "basicConstraints=critical,CA:TRUE" -addext "keyUsage=critical,keyCertSign,cRLSign" \
    -keyout "$work/ca.key" -out "$work/ca.crt" 2>/dev/null
  mv "$work/ca.key" "$out/ca.key"
  mv "$work/ca.crt" "$out/ca.crt"
fi

san=""
for d in "${dns[@]}"; do san+="${san:+,}DNS:$d"; done
for i in "${ips[@]}"; do san+="${san:+,}IP:$i"; done
cn="${dns[0]:-${ips[0]}}"
openssl req -newkey ec -pkeyopt ec_paramgen_curve:prime256v1 -nodes -sha256 \
  -subj "/CN=$cn" -keyout "$work/tls.key" -out "$work/tls.csr" 2>/dev/null
printf 'subjectAltName=%s\nbasicConstraints=critical,CA:FALSE\nkeyUsage=critical,digitalSignature,keyEncipherment\nextendedKeyUsage=serverAuth\n' "$san" >"$work/ext"
openssl x509 -req -in "$work/tls.csr" -CA "$out/ca.crt" -CAkey "$out/ca.key" -CAcreateserial \
  -CAserial "$work/ca.srl" -days "$days" -sha256 -extfile "$work/ext" -out "$work/tls.crt" 2>/dev/null
chmod 644 "$work/tls.crt" "$out/ca.crt"
# Key first, then certificate: the operator only installs a pair whose key matches.
mv "$work/tls.key" "$out/tls.key"
mv "$work/tls.crt" "$out/tls.crt"
echo "mint.sh: $out/tls.crt for $san (valid $days days)" >&2
base64 -w0 <"$out/ca.crt"
echo
