#!/usr/bin/env python3
"""N concurrent CNI ADDs, then N concurrent DELs of the same containers, into one pool.

Runs a plugin binary exactly as a runtime does (network config on stdin, CNI_* environment) and
prints the wall time of each phase and the kube-apiserver's CPU seconds for both together (read
from /proc of the pid in the cluster state folder). Used for docs/benchmarks.md ("DEL storms").

  python3 bench/del_storm.py --kubeconfig K --namespace NS --n 200 --range 10.42.0.0/24 \\
      --plugin target/release/whereabouts [--state /tmp/wa-bench-state]

The kubeconfig's context namespace is where the pool lives; pods need not exist. With
--agent-socket the plugin hands its requests to a node agent listening there (start it first:
whereabouts-operator agent --socket S --kubeconfig K --serves-kubeconfig K); without, it never
uses one.
"""
import argparse, json, os, subprocess, time

ap = argparse.ArgumentParser()
ap.add_argument("--kubeconfig", required=True)
ap.add_argument("--namespace", required=True, help="K8S_POD_NAMESPACE passed to the plugin")
ap.add_argument("--n", type=int, default=100)
ap.add_argument("--range", default="10.42.0.0/24")
ap.add_argument("--plugin", default="target/release/whereabouts")
ap.add_argument("--state", default="/tmp/wa-bench-state")
ap.add_argument("--agent-socket", default="", help="the node agent's socket (default: no agent)")
a = ap.parse_args()

# agent_socket is read from the node's flat file only: write one next to the kubeconfig.
flat = os.path.join(os.path.dirname(os.path.abspath(a.kubeconfig)), "del-storm-flat.conf")
with open(flat, "w") as f:
    json.dump({"kubernetes": {"kubeconfig": a.kubeconfig}, "agent_socket": a.agent_socket}, f)
conf = json.dumps({"cniVersion": "1.0.0", "name": "net", "type": "macvlan",
                   "ipam": {"type": "whereabouts", "range": a.range, "configuration_path": flat}})
pid = int(open(os.path.join(a.state, "kube-apiserver.pid")).read())

def apiserver_cpu():
    f = open(f"/proc/{pid}/stat").read().split(")")[1].split()
    return (int(f[11]) + int(f[12])) / os.sysconf("SC_CLK_TCK")

def spawn(cmd, i):
    env = dict(os.environ, WHEREABOUTS_CONF_DIR=os.path.dirname(flat), CNI_COMMAND=cmd, CNI_CONTAINERID=f"storm{i}", CNI_NETNS="/x",
               CNI_IFNAME="net1", CNI_PATH="/x",
               CNI_ARGS=f"K8S_POD_NAMESPACE={a.namespace};K8S_POD_NAME=storm{i}")
    p = subprocess.Popen([a.plugin], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, env=env)
    p.stdin.write(conf.encode())
    p.stdin.close()
    return p

cpu0 = apiserver_cpu()
for cmd in ("ADD", "DEL"):
    started = time.time()
    procs = [spawn(cmd, i) for i in range(a.n)]
    failed = sum(1 for p in procs if p.wait() != 0)
    print(f"{cmd} x{a.n}: {time.time() - started:.2f} s, {failed} failed", flush=True)
print(f"kube-apiserver CPU for both: {apiserver_cpu() - cpu0:.1f} s")
