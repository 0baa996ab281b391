#!/usr/bin/env python3
"""How many entries one IPPool holds before the API server refuses the write.

An IPPool keeps every allocation of its range in one object, and etcd refuses a request larger
than its --max-request-bytes (1.5 MiB by default). This grows a pool with merge patches, as the
plugin writes it (entries of --id-len character container ids, a realistic podref, ifname and pod
UID), until the API server refuses, then finds the exact count one entry at a time, and prints the
stored object's size (JSON, managedFields included) at the limit. Standard library only.

    python3 bench/pool_limit.py --kubeconfig e2e/.state/kubeconfig [--id-len 64]
"""

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "e2e" / "chaos"))
from kube import Kube  # noqa: E402

GROUP = "/apis/whereabouts.cni.cncf.io/v1alpha1"


def entry(i, id_len):
    cid = (f"{i:08x}" * 16)[:id_len]
    return {"id": cid, "podref": f"tenant-namespace-{i % 50:02d}/app-deployment-7d9f8c6b5-{i:06d}",
            "ifname": "net1", "poduid": f"5f0c6a2e-1d3b-4c1e-9a4f-{i:012d}"}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--kubeconfig", required=True)
    ap.add_argument("--id-len", type=int, default=64)
    ap.add_argument("--namespace", default="pool-limit")
    args = ap.parse_args()
    kube = Kube(args.kubeconfig, timeout=60)
    ns = f"{args.namespace}-{args.id_len}"
    kube.ok("POST", "/api/v1/namespaces", {"metadata": {"name": ns}}, allow=(409,))
    name = "10.128.0.0-16"
    path = f"{GROUP}/namespaces/{ns}/ippools/{name}"
    kube.ok("DELETE", path, allow=(404,))
    kube.ok("POST", f"{GROUP}/namespaces/{ns}/ippools", {
        "apiVersion": "whereabouts.cni.cncf.io/v1alpha1", "kind": "IPPool",
        "metadata": {"name": name}, "spec": {"range": "10.128.0.0/16", "allocations": {}}})

    def add(start, count):
        body = {"spec": {"allocations": {str(start + k + 1): entry(start + k, args.id_len)
                                         for k in range(count)}}}
        # One try: "request is too large" is a 500, which Kube.call would retry.
        status, text = kube._once("PATCH", path, body, "application/merge-patch+json")
        try:
            return status, json.loads(text)
        except ValueError:
            return status, text

    n, step, error = 0, 1000, None
    while step >= 1:
        status, doc = add(n, step)
        if status == 200:
            n += step
            if step == 1000:
                mf = len(json.dumps(doc["metadata"].get("managedFields", []), separators=(",", ":")))
                size = len(json.dumps(doc, separators=(",", ":")))
                print(f"{n} entries: object {size} bytes, managedFields {mf}", file=sys.stderr)
        else:
            error = doc.get("message") if isinstance(doc, dict) else str(doc)
            step //= 10 if step >= 10 else 2
    stored = kube.ok("GET", path)
    size = len(json.dumps(stored, separators=(",", ":")))
    managed = len(json.dumps(stored["metadata"].get("managedFields", []), separators=(",", ":")))
    one = len(json.dumps({"1": entry(1, args.id_len)}, separators=(",", ":"))) - 2
    print(json.dumps({"id_len": args.id_len, "max_entries": n, "object_bytes": size,
                      "managed_fields_bytes": managed, "entry_json_bytes": one,
                      "bytes_per_entry": round(size / max(n, 1), 1), "refused_with": error},
                     indent=1))
    kube.ok("DELETE", f"/api/v1/namespaces/{ns}", allow=(404,))


if __name__ == "__main__":
    main()
