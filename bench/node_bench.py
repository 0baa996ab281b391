#!/usr/bin/env python3
"""Pods-to-Running on the real node of e2e/node.sh, for three IPAMs in one run.

A Deployment of busybox pods is scaled from 0 to N and timed from the scale request until the
Deployment reports N ready replicas; then scaled back to 0 and the node left clean before the next
run. The pods' networks (e2e/node.sh: bridge `wab0` as eth0, and with --networks 2 also `wab1` as
eth1) get their addresses from, in turn:

  ours        our plugin as installed by `kubectl apply -k` (DaemonSet: installer + node agent)
  upstream    upstream whereabouts v0.9.2's plugin (built from its Go module), swapped in for
              /opt/cni/bin/whereabouts with its own flat file (the admin kubeconfig). It accepts
              no IPAM type but `whereabouts`, so it takes our binary's place: for its runs the
              DaemonSet is moved off the node (a nodeSelector no node has), so that its
              installer does not put ours back, and restored afterwards
  host-local  Debian's host-local: IPAM that costs nothing, the floor

Runs alternate between the IPAMs (ours, upstream, host-local, ours, ...) so that a slow minute of
the machine does not land on one of them only. Prints one JSON line per run and a summary table
(medians, ranges, ratios). The node must be up with whereabouts installed: bench/node_run.sh does
both, then calls this script.
"""

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
KUBECTL = os.path.join(REPO, "e2e/bin/kubectl")
NS = "bench-node"
PLUGIN = "/opt/cni/bin/whereabouts"
OURS = os.path.join(REPO, "target/x86_64-unknown-linux-musl/release/whereabouts")
UPSTREAM = os.path.join(REPO, "bench/bin/whereabouts-upstream")
# The node's networks: conflist file, bridge, range, first address (as e2e/node.sh writes them).
NETWORKS = [
    ("10-wab-pods.conflist", "wab-pods", "wab0", "10.85.0.0/22", "10.85.0.10", True),
    ("20-wab-net2.conflist", "wab-net2", "wab1", "10.86.0.0/22", "10.86.0.10", False),
]


def node_env():
    out = subprocess.run([os.path.join(REPO, "e2e/node.sh"), "env"], check=True,
                         capture_output=True, text=True).stdout
    return dict(line.split("=", 1) for line in out.splitlines() if "=" in line)


def kubectl(kubeconfig, *args, stdin=None, check=True):
    r = subprocess.run([KUBECTL, "--kubeconfig", kubeconfig, *args], input=stdin,
                       capture_output=True, text=True)
    if check and r.returncode != 0:
        sys.exit(f"kubectl {' '.join(args)}: {r.stderr}")
    return r.stdout


def ipam_config(impl, cidr, start, name, state_dir):
    if impl == "ours":
        return {"type": "whereabouts", "range": cidr, "range_start": start}
    if impl == "upstream":
        return {"type": "whereabouts", "range": cidr, "range_start": start,
                "configuration_path": os.path.join(state_dir, "upstream-flat.conf")}
    if impl == "host-local":
        return {"type": "host-local", "ranges": [[{"subnet": cidr, "rangeStart": start}]],
                "dataDir": os.path.join(state_dir, "host-local")}
    raise ValueError(impl)


def write_conflists(conf_dir, impl, networks, state_dir):
    """The node's CNI configs for `impl`; written to a temporary name and renamed, so the runtime
    never reads half a file."""
    for i, (fname, name, bridge, cidr, start, gw) in enumerate(NETWORKS):
        path = os.path.join(conf_dir, fname)
        if i >= networks:
            if os.path.exists(path):
                os.remove(path)
            continue
        plugin = {"type": "bridge", "bridge": bridge, "isGateway": gw, "ipMasq": False,
                  "ipam": ipam_config(impl, cidr, start, name, state_dir)}
        if gw:
            plugin.update({"isDefaultGateway": True, "hairpinMode": True})
        conf = {"cniVersion": "1.0.0", "name": name, "plugins": [plugin]}
        with open(path + ".tmp", "w") as f:
            json.dump(conf, f)
        os.replace(path + ".tmp", path)
    # containerd reloads the folder on a change; give it a moment.
    time.sleep(2)


def same_file(a, b):
    with open(a, "rb") as fa, open(b, "rb") as fb:
        return fa.read() == fb.read()


def place_plugin(kc, impl):
    """Upstream: DaemonSet off the node, upstream's binary in place. Otherwise: the DaemonSet
    back, and wait until its installer has put our binary back and its agent serves."""
    ds = ["-n", "whereabouts-system", "patch", "daemonset", "whereabouts-node", "--type=merge"]
    if impl == "upstream":
        kubectl(kc, *ds, "-p", '{"spec":{"template":{"spec":{"nodeSelector":{"bench.whereabouts/off":"true"}}}}}')
        deadline = time.monotonic() + 120
        while kubectl(kc, "-n", "whereabouts-system", "get", "pods", "-o", "name", "-l",
                      "app.kubernetes.io/name=whereabouts-node").strip():
            if time.monotonic() > deadline:
                sys.exit("the DaemonSet's pod did not leave within 120 s")
            time.sleep(0.5)
        shutil.copy(UPSTREAM, PLUGIN + ".bench")
        os.replace(PLUGIN + ".bench", PLUGIN)
        return
    if same_file(PLUGIN, OURS) and os.path.exists("/run/whereabouts/agent.sock"):
        return
    kubectl(kc, *ds, "-p", '{"spec":{"template":{"spec":{"nodeSelector":null}}}}')
    kubectl(kc, "-n", "whereabouts-system", "rollout", "status", "daemonset/whereabouts-node",
            "--timeout=120s")
    deadline = time.monotonic() + 120
    while not (same_file(PLUGIN, OURS) and os.path.exists("/run/whereabouts/agent.sock")):
        if time.monotonic() > deadline:
            sys.exit("our plugin and agent were not back within 120 s")
        time.sleep(0.5)


def deployment(replicas, image):
    return json.dumps({
        "apiVersion": "apps/v1", "kind": "Deployment",
        "metadata": {"name": "bench", "namespace": NS},
        "spec": {"replicas": replicas, "selector": {"matchLabels": {"app": "bench"}},
                 "template": {"metadata": {"labels": {"app": "bench"}}, "spec": {
                     "terminationGracePeriodSeconds": 1,
                     "automountServiceAccountToken": False, "enableServiceLinks": False,
                     "containers": [{"name": "main", "image": image, "imagePullPolicy": "Never",
                                     "command": ["/bin/sh", "-c",
                                                 "trap 'exit 0' TERM; while true; do sleep 1; done"]}]}}}})


def ready_replicas(kc):
    out = kubectl(kc, "-n", NS, "get", "deployment", "bench", "-o",
                  "jsonpath={.status.readyReplicas}", check=False)
    return int(out) if out.strip().isdigit() else 0


def pod_count(kc):
    out = kubectl(kc, "-n", NS, "get", "pods", "-o", "name", check=False)
    return len(out.split())


def one_run(kc, replicas, timeout):
    """Seconds from the scale request to `replicas` ready (None past `timeout`); then back to 0."""
    start = time.monotonic()
    kubectl(kc, "-n", NS, "scale", "deployment/bench", f"--replicas={replicas}")
    elapsed = None
    while elapsed is None and time.monotonic() - start <= timeout:
        if ready_replicas(kc) >= replicas:
            elapsed = time.monotonic() - start
        else:
            time.sleep(0.2)
    kubectl(kc, "-n", NS, "scale", "deployment/bench", "--replicas=0")
    deadline = time.monotonic() + 300
    while pod_count(kc) > 0:
        if time.monotonic() > deadline:
            sys.exit("pods did not go away within 300 s")
        time.sleep(0.5)
    return elapsed


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--impls", default="ours,upstream,host-local")
    ap.add_argument("--replicas", type=int, default=100)
    ap.add_argument("--networks", default="1,2", help="whereabouts networks per pod, comma list")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--timeout", type=float, default=900)
    args = ap.parse_args()

    env = node_env()
    state = os.path.dirname(env["NODE_DIR"])
    kc = os.path.join(state, "kubeconfig")
    bench_dir = os.path.join(env["NODE_DIR"], "bench")
    os.makedirs(os.path.join(bench_dir, "host-local"), exist_ok=True)
    impls = args.impls.split(",")
    if "upstream" in impls:
        if not os.path.exists(UPSTREAM):
            sys.exit("bench/bin/whereabouts-upstream missing: run bench/node_run.sh")
        # Upstream's own flat file: the admin kubeconfig, pools in kube-system as ours.
        with open(os.path.join(bench_dir, "upstream-flat.conf"), "w") as f:
            json.dump({"kubernetes": {"kubeconfig": kc}, "log_level": "error"}, f)

    kubectl(kc, "create", "namespace", NS, check=False)
    deadline = time.monotonic() + 60
    while kubectl(kc, "-n", NS, "get", "serviceaccount", "default", check=False) == "":
        if time.monotonic() > deadline:
            sys.exit("no default ServiceAccount in the bench namespace")
        time.sleep(0.5)
    kubectl(kc, "apply", "-f", "-", stdin=deployment(0, env["BUSYBOX_IMAGE"]))

    results = {}
    try:
        for networks in [int(n) for n in args.networks.split(",")]:
            for rep in range(args.repeat):
                for impl in impls:
                    place_plugin(kc, impl)
                    write_conflists(env["CNI_CONF_DIR"], impl, networks, bench_dir)
                    t = one_run(kc, args.replicas, args.timeout)
                    row = {"impl": impl, "networks": networks, "replicas": args.replicas,
                           "run": rep + 1, "seconds": None if t is None else round(t, 2)}
                    print(json.dumps(row), flush=True)
                    results.setdefault((networks, impl), []).append(t)
    finally:
        write_conflists(env["CNI_CONF_DIR"], "ours", 2 if env.get("NETWORKS", "2") == "2" else 1,
                        bench_dir)
        kubectl(kc, "delete", "namespace", NS, "--wait=false", check=False)
        place_plugin(kc, "ours")

    print(f"\n| {args.replicas} pods to Ready | " + " | ".join(impls) +
          " | ours / host-local | upstream / ours |")
    print("|---|" + "---:|" * (len(impls) + 2))
    for networks in sorted({n for n, _ in results}):
        med = {}
        cells = []
        for impl in impls:
            ts = [t for t in results.get((networks, impl), []) if t is not None]
            failed = len(results.get((networks, impl), [])) - len(ts)
            if ts:
                med[impl] = statistics.median(ts)
                cells.append(f"{med[impl]:.1f} s ({min(ts):.1f}-{max(ts):.1f})"
                             + (f", {failed} timed out" if failed else ""))
            else:
                cells.append("timed out")
        ratio = lambda a, b: f"{med[a] / med[b]:.2f}x" if a in med and b in med else "-"
        print(f"| {networks} network(s) | " + " | ".join(cells) +
              f" | {ratio('ours', 'host-local')} | {ratio('upstream', 'ours')} |")


if __name__ == "__main__":
    main()
