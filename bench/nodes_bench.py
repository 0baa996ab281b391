#!/usr/bin/env python3
"""Many nodes, one network: N simulated nodes allocating at once from one dual-stack network.

Every node runs M concurrent CNI ADDs (CNI_COMMAND=ADD, network config on stdin, NODENAME=<node>
in each plugin's environment), all nodes at the same time, into ONE network whose `ipRanges` hold
an IPv4 and an IPv6 range. Timed from the first spawn to the last ADD's exit. Modes (--modes):

  ours-slices      our plugin + one node agent per node, `node_slice_size` set (top level for the
                   IPv4 range, inside the IPv6 `ipRanges` entry for that one); the slices are
                   assigned by our operator (`whereabouts-operator run`) from a
                   NetworkAttachmentDefinition with the same config and N Node objects
  ours-agents      our plugin + one node agent per node, no node slices (one pool per range)
  ours-plugins     our plugin alone (`agent_socket: ""`), no node slices
  ours-plugins-slices  our plugin alone with `node_slice_size`: each node alone on the pools
                   of its slices (every node's bound widens, cni::slots)
  upstream-slices  upstream's plugin with `node_slice_size`, slices assigned by OUR operator
                   (upstream slices its first range only; whatever happens is counted)
  upstream         upstream's plugin, no node slices

Every mode gets a fresh namespace, which is also its pool namespace (kubeconfig context), so no
mode sees another's pools, reservations, slices or Leases. After the run the results are
cross-checked against the IPPools: no address twice among the results nor among the pool entries
(any duplicate makes the script exit 3), every returned address present in a pool with its
podref. API requests per ADD are deltas of the API server's apiserver_request_total (admin
kubeconfig, /metrics) around the timed part; API server CPU per ADD is its utime+stime delta
(/proc/<pid>/stat, pid from e2e/cluster.sh's state folder).

Python 3 standard library only; helpers shared with cni_bench.py. See bench/README.md.
"""

import argparse
import datetime
import ipaddress
import json
import os
import random
import re
import resource
import shlex
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import cni_bench as cb  # noqa: E402  (shared helpers: Kube, pct, proc_cpu, wait_quiet, cluster...)

ROOT = cb.ROOT
BENCH = cb.BENCH
STATE_DEFAULT = "/tmp/wa-nodesbench-state"
NODE_LABEL = "whereabouts-bench"  # Node objects this script created carry NODE_LABEL=nodes

MODES = {
    "ours-slices": {"label": "ours, node slices + agents", "impl": "ours", "agents": True,
                    "slices": True},
    "ours-agents": {"label": "ours, agents", "impl": "ours", "agents": True, "slices": False},
    "ours-plugins": {"label": "ours, plugin alone", "impl": "ours", "agents": False,
                     "slices": False},
    "ours-plugins-slices": {"label": "ours, node slices, plugin alone", "impl": "ours",
                            "agents": False, "slices": True},
    "upstream-slices": {"label": "upstream, node slices", "impl": "upstream", "agents": False,
                        "slices": True},
    "upstream": {"label": "upstream", "impl": "upstream", "agents": False, "slices": False},
}

LIVE = set()  # plugin processes started and not yet reaped
DAEMONS = {}  # pid -> Popen of agents and operators still running (cleanup on any exit)


def log(msg):
    print(f"[nodes-bench {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def free_port():
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    return port


def stop_daemon(p, grace=20):
    """SIGTERM, then SIGKILL after `grace` s; only processes this script started."""
    if p is None:
        return
    if p.poll() is None:
        try:
            p.terminate()
            p.wait(timeout=grace)
        except subprocess.TimeoutExpired:
            log(f"pid {p.pid} ignored SIGTERM for {grace} s: SIGKILL")
            p.kill()
            p.wait()
        except ProcessLookupError:
            pass
    DAEMONS.pop(p.pid, None)


def kill_live():
    for p in list(LIVE):
        if p.poll() is None:
            try:
                p.kill()  # the plugins start no processes of their own
            except ProcessLookupError:
                pass
            p.wait()
        LIVE.discard(p)


def mem_available_mb():
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) / 1024.0
    return None


def normalize_ip(ip, network_name):
    """Reservation name of an address (upstream's NormalizeIP, which ours keeps)."""
    s = str(ip)
    if s.endswith(":"):
        s += "0"
    s = s.replace(":", "-")
    return f"{network_name}-{s}" if network_name else s


# ------------------------------------------------------------------ API server metrics

REQ_RE = re.compile(r'^apiserver_request_total\{(.*)\} ([0-9.e+]+)$')


def api_counts(kube):
    """apiserver_request_total, every series, keyed by (group, resource, subresource, verb, code)."""
    r = kube.run("get", "--raw", "/metrics", timeout=60)
    out = {}
    for line in r.stdout.splitlines():
        m = REQ_RE.match(line)
        if not m:
            continue
        lab = dict(cb.LABEL_RE.findall(m.group(1)))
        key = (lab.get("group", ""), lab.get("resource", ""), lab.get("subresource", ""),
               lab.get("verb", ""), lab.get("code", ""))
        out[key] = out.get(key, 0.0) + float(m.group(2))
    return out


def api_diff(before, after, adds):
    """Resource requests (non-resource ones, e.g. our own /metrics scrape, apart) in the timed
    part: total, by verb, by group/resource/verb/code, and per ADD."""
    by_key, by_verb, nonres = {}, {}, 0
    total = rejected = errors5 = 0
    for key in set(before) | set(after):
        d = int(round(after.get(key, 0) - before.get(key, 0)))
        if d <= 0:
            continue
        group, res, sub, verb, code = key
        if not res:
            nonres += d
            continue
        name = f"{group + '/' if group else ''}{res}{'/' + sub if sub else ''} {verb} {code}"
        by_key[name] = by_key.get(name, 0) + d
        by_verb[verb] = by_verb.get(verb, 0) + d
        total += d
        if code in ("409", "422", "429"):
            rejected += d
        if code.startswith("5"):
            errors5 += d
    wa = sum(v for k, v in by_key.items()
             if k.startswith("whereabouts.cni.cncf.io/") or k.startswith("coordination.k8s.io/"))
    return {
        "api_requests": total,
        "api_requests_per_add": total / adds if adds else None,
        "api_requests_by_verb": dict(sorted(by_verb.items(), key=lambda kv: -kv[1])),
        "api_requests_whereabouts_and_leases": wa,
        "api_rejected": rejected,
        "api_5xx": errors5,
        "api_nonresource_requests": nonres,
        "api_by_resource_verb_code": dict(sorted(by_key.items())),
    }


# ------------------------------------------------------------------ one mode


class Mode:
    """One mode: its namespace (= pool namespace), kubeconfig copy, per-node flat files, network
    configs, agents; the NAD, the operator and the slice wait for the slice modes."""

    def __init__(self, kube, key, args, workroot, nodes):
        self.kube = kube
        self.key = key
        self.spec = MODES[key]
        self.args = args
        self.nodes = nodes
        suffix = f"{int(time.time() * 1000) % 10**8:08d}"
        self.ns = f"nb-{key}-{suffix}"
        self.dir = Path(workroot) / self.ns
        self.dir.mkdir(parents=True)
        self.kubeconfig = self.dir / "kubeconfig"
        self.binary = Path(args.ours if self.spec["impl"] == "ours" else args.upstream)
        # --v6 none: single-stack IPv4 (the only shape upstream's node slices support).
        self.ranges = [args.v4] + ([args.v6] if args.v6 else [])
        self.nets = [ipaddress.ip_network(r, strict=False) for r in self.ranges]
        self.agents = {}  # node -> Popen
        self.operator = None
        self.operator_log = self.dir / "operator.log"
        self.slices = {}  # node -> [ip_network of its slices]
        self.slice_info = None

    # -- configs

    def ipam(self, node_dir=None):
        ranges = [{"range": r} for r in self.ranges]
        if self.args.size:
            # --size N: exactly N addresses in each range (range_start/range_end).
            for r, net in zip(ranges, self.nets):
                r["range_start"] = str(net[1])
                r["range_end"] = str(net[self.args.size])
        ipam = {"type": "whereabouts", "network_name": self.args.network_name, "ipRanges": ranges}
        if self.spec["slices"]:
            ipam["node_slice_size"] = self.args.v4_slice
            if len(ranges) > 1:
                ranges[1]["node_slice_size"] = self.args.v6_slice
        if node_dir is not None:
            ipam.update({"configuration_path": str(node_dir / "whereabouts.conf"),
                         "log_level": "verbose"})
        return ipam

    def netconf(self, node_dir=None):
        return {"cniVersion": "1.0.0", "name": self.args.network_name, "type": "bridge",
                "ipam": self.ipam(node_dir)}

    def node_dir(self, node):
        return self.dir / node

    def setup(self):
        self.kube.run("create", "namespace", self.ns)
        # The operator's (and the admin identity's) kubeconfig.
        shutil.copyfile(self.kube.kubeconfig, self.kubeconfig)
        self.kube.run("config", "set-context", "--current", f"--namespace={self.ns}",
                      kubeconfig=str(self.kubeconfig))
        for node in self.nodes:
            self.node_dir(node).mkdir()
        if self.as_node():
            self.node_identity()
        for node in self.nodes:
            d = self.node_dir(node)
            # log_file and agent_socket are the node's: read from its flat file only.
            flat = {"kubernetes": {"kubeconfig": str(self.plugin_kubeconfig(node))},
                    "log_file": str(d / "plugin.log")}
            if self.spec["impl"] == "ours":
                # agent_socket is read from the flat file only; "" = never an agent.
                flat["agent_socket"] = str(d / "agent.sock") if self.spec["agents"] else ""
                # Each simulated node has its own bound on plugin processes at work.
                flat["plugin_slots_dir"] = str(d / "plugin-slots")
                if self.args.plugin_slots is not None:
                    flat["plugin_slots"] = self.args.plugin_slots
            (d / "whereabouts.conf").write_text(json.dumps(flat))
            (d / "netconf.json").write_text(json.dumps(self.netconf(d)))
        if self.spec["slices"]:
            self.prepare_slices()
        if self.spec["agents"]:
            for node in self.nodes:
                self.start_agent(node)

    def as_node(self):
        """Whether our plugins and agents run as the node account (--identity node...)."""
        return self.spec["impl"] == "ours" and self.args.identity != "admin"

    def plugin_kubeconfig(self, node):
        """Whose credentials node `node`'s plugins and agent use: its own (--identity node), else
        the admin's."""
        if self.as_node():
            return self.node_dir(node) / "kubeconfig"
        return self.kubeconfig

    def token_pod(self, node):
        """The pod (never run: no kubelet) that node `node`'s token is bound to."""
        return f"agent-{self.ns}-{node}"

    def node_identity(self):
        """--identity node / node-no-leases: our plugins and agents run as the real node account
        whereabouts-system/whereabouts-node, each node with a token bound to a pod on it (as the
        DaemonSet's projected token is), with the node Role of config/rbac/node.yaml (without
        its Lease rule for node-no-leases: no writer turns) in this namespace, the node
        ClusterRole, and config/rbac/node-limits.yaml (the policies and the APF level;
        --node-policy off leaves the binding of the node-writes policy out)."""
        rbac = ROOT / "config" / "rbac"
        # The install's two namespaces (the node's and, since the operator has its own, the
        # operator's, which service_accounts.yaml names too).
        self.kube.run("apply", "-f", str(ROOT / "config" / "namespace" / "namespace.yaml"))
        self.kube.run("apply", "-f", str(rbac / "service_accounts.yaml"))
        self.kube.run("apply", "-f", str(rbac / "node-limits.yaml"))
        if self.args.node_policy == "off":
            self.kube.run("delete", "validatingadmissionpolicybinding", "whereabouts-node-writes")
        import yaml  # PyYAML (python3-yaml, e2e/install-deps.sh), only for this option
        docs = [d for d in yaml.safe_load_all((rbac / "node.yaml").read_text()) if d]
        items = []
        for d in docs:
            # The pool namespace's Role and binding move to this run's namespace; the ones of the
            # DaemonSet's own namespace (the same names) stay where they are.
            if d["kind"] in ("Role", "RoleBinding") and d["metadata"]["namespace"] == "kube-system":
                d["metadata"]["namespace"] = self.ns
                if d["kind"] == "Role" and self.args.identity == "node-no-leases":
                    d["rules"] = [r for r in d["rules"]
                                  if "coordination.k8s.io" not in r["apiGroups"]]
            items.append(d)
        self.kube.run("apply", "-f", "-", input_text=json.dumps(
            {"apiVersion": "v1", "kind": "List", "items": items}))
        view = self.kube.json("config", "view", "--raw", "--minify")
        cluster = view["clusters"][0]["cluster"]
        for node in self.nodes:
            pod = self.token_pod(node)
            self.kube.run("create", "-f", "-", input_text=json.dumps({
                "apiVersion": "v1", "kind": "Pod",
                "metadata": {"name": pod, "namespace": "whereabouts-system"},
                "spec": {"nodeName": node, "serviceAccountName": "whereabouts-node",
                         "automountServiceAccountToken": False,
                         "containers": [{"name": "agent", "image": "never-pulled"}]}}))
            uid = self.kube.run("-n", "whereabouts-system", "get", "pod", pod, "-o",
                                "jsonpath={.metadata.uid}").stdout.strip()
            token = self.kube.run("-n", "whereabouts-system", "create", "token",
                                  "whereabouts-node", "--duration=2h", "--bound-object-kind=Pod",
                                  f"--bound-object-name={pod}",
                                  f"--bound-object-uid={uid}").stdout.strip()
            self.plugin_kubeconfig(node).write_text(json.dumps({
                "apiVersion": "v1", "kind": "Config", "current-context": "node",
                "clusters": [{"name": "c", "cluster": cluster}],
                "users": [{"name": "node", "user": {"token": token}}],
                "contexts": [{"name": "node", "context": {"cluster": "c", "user": "node",
                                                          "namespace": self.ns}}]}))

    # -- node slices

    def sliced_ranges(self):
        """The ranges whose slices must be assigned before timing: upstream slices only its
        first range; ours every range with a slice size (both here)."""
        return self.nets[:1] if self.spec["impl"] == "upstream" else self.nets

    def prepare_slices(self):
        nad = {"apiVersion": "k8s.cni.cncf.io/v1", "kind": "NetworkAttachmentDefinition",
               "metadata": {"name": self.args.network_name, "namespace": self.ns},
               "spec": {"config": json.dumps(self.netconf())}}
        (self.dir / "nad.json").write_text(json.dumps(nad, indent=2))
        self.kube.run("create", "-f", str(self.dir / "nad.json"))
        t0 = time.monotonic()
        if self.args.slice_assigner == "operator":
            self.start_operator()
        else:
            self.assign_slices_ourselves()
        ready, pools = self.wait_slices(self.args.slice_timeout)
        waited = time.monotonic() - t0
        self.slice_info = {
            "assigner": ("our operator (whereabouts-operator run)"
                         if self.args.slice_assigner == "operator" else "the benchmark itself "
                         "(upstream's layout, first range only)"),
            "ready": ready, "wait_s": round(waited, 2),
            "nodeslicepools": [{"name": p["metadata"]["name"], "range": p["spec"].get("range"),
                                "sliceSize": p["spec"].get("sliceSize"),
                                "allocations": len((p.get("status") or {}).get("allocations") or [])}
                               for p in pools],
        }
        if self.spec["impl"] == "upstream":
            # Upstream's plugin looks its slice up by name: network_name (else the network's name).
            self.slice_info["upstream_lookup_name_present"] = any(
                p["metadata"]["name"] == self.args.network_name for p in pools)
        if ready:
            log(f"  slices assigned for {len(self.nodes)} nodes in {waited:.1f} s: "
                + ", ".join(f"{p['name']} {p['range']} {p['sliceSize']}"
                            for p in self.slice_info["nodeslicepools"]))
        else:
            log(f"  WARNING: slices not assigned for every node within {self.args.slice_timeout:.0f} s "
                f"(NodeSlicePools: {self.slice_info['nodeslicepools']}); running the ADDs anyway")
            if self.operator is not None:
                problems = self.operator_problems()
                self.slice_info["operator_problems"] = problems
                for line in problems[:6]:
                    log(f"  operator: {line}")
        if self.operator is not None and not self.args.keep_operator:
            stop_daemon(self.operator)
            self.operator = None

    def start_operator(self):
        port = free_port()
        logf = open(self.operator_log, "wb")
        cmd = [str(self.args.operator), "run", f"--admin-addr=127.0.0.1:{port}",
               f"--pool-namespace={self.ns}", "--leader-election=false",
               # The simulated pods do not exist: no audit may free their entries meanwhile.
               "--audit-interval=24h", *shlex.split(self.args.operator_args)]
        self.operator = subprocess.Popen(
            cmd, stdout=logf, stderr=logf, stdin=subprocess.DEVNULL,
            env={**os.environ, "KUBECONFIG": str(self.kubeconfig), "RUST_LOG": "info",
                 "NO_COLOR": "1"})
        logf.close()
        DAEMONS[self.operator.pid] = self.operator
        deadline = time.monotonic() + 120
        while True:
            if self.operator.poll() is not None:
                raise RuntimeError(f"operator exited (rc={self.operator.returncode}): "
                                   f"{self.operator_log.read_text(errors='replace')[-2000:]}")
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/readyz", timeout=2) as r:
                    if r.status == 200:
                        break
            except OSError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError("operator not ready within 120 s")
            time.sleep(0.2)
        log(f"  operator ready (pid {self.operator.pid}, pool namespace {self.ns}, "
            f"log {self.operator_log})")

    def operator_problems(self):
        if not self.operator_log.exists():
            return []
        text = re.sub(r"\x1b\[[0-9;]*m", "", self.operator_log.read_text(errors="replace"))
        return [l[:600] for l in text.splitlines() if re.search(r"\b(WARN|ERROR)\b", l)][:20]

    def assign_slices_ourselves(self):
        """--slice-assigner bench: one NodeSlicePool in upstream's layout (named network_name,
        the first range, node i -> i-th slice), written with the admin kubeconfig."""
        net = self.nets[0]
        size = int(self.args.v4_slice.lstrip("/"))
        subnets = net.subnets(new_prefix=size)
        allocs = [{"nodeName": node, "sliceRange": str(next(subnets))} for node in self.nodes]
        obj = {"apiVersion": "whereabouts.cni.cncf.io/v1alpha1", "kind": "NodeSlicePool",
               "metadata": {"name": self.args.network_name, "namespace": self.ns},
               "spec": {"range": str(net), "sliceSize": self.args.v4_slice}}
        (self.dir / "nodeslicepool.json").write_text(json.dumps(obj))
        self.kube.run("create", "-f", str(self.dir / "nodeslicepool.json"))
        self.kube.run("patch", "nodeslicepools.whereabouts.cni.cncf.io", self.args.network_name,
                      "-n", self.ns, "--subresource=status", "--type=merge",
                      "-p", json.dumps({"status": {"allocations": allocs}}))

    def wait_slices(self, timeout):
        """Waits until, for every range to slice, a NodeSlicePool of that range lists a slice for
        every node. Returns (ready, pools)."""
        deadline = time.monotonic() + timeout
        want = set(self.nodes)
        while True:
            pools = self.kube.json("get", "nodeslicepools.whereabouts.cni.cncf.io",
                                   "-n", self.ns)["items"]
            covered, slices = set(), {}
            for p in pools:
                try:
                    prange = ipaddress.ip_network(p["spec"]["range"], strict=False)
                except (KeyError, ValueError):
                    continue
                allocs = (p.get("status") or {}).get("allocations") or []
                nodes_here = {a.get("nodeName") for a in allocs}
                for a in allocs:
                    try:
                        slices.setdefault(a.get("nodeName"), []).append(
                            ipaddress.ip_network(a["sliceRange"], strict=False))
                    except (KeyError, ValueError):
                        pass
                if want <= nodes_here:
                    covered.add(prange)
            self.slices = slices
            if all(n in covered for n in self.sliced_ranges()):
                return True, pools
            if self.operator is not None and self.operator.poll() is not None:
                log(f"  operator exited (rc={self.operator.returncode}) while waiting for slices")
                return False, pools
            if time.monotonic() > deadline:
                return False, pools
            time.sleep(0.5)

    # -- agents

    def start_agent(self, node):
        d = self.node_dir(node)
        sock = d / "agent.sock"
        logf = open(d / "agent.log", "wb")
        p = subprocess.Popen(
            [str(self.args.operator), "agent", "--socket", str(sock),
             "--kubeconfig", str(self.plugin_kubeconfig(node)),
             "--serves-kubeconfig", str(self.plugin_kubeconfig(node)),
             "--pool-namespace", self.ns, "--admin-addr", "127.0.0.1:0",
             *shlex.split(self.args.agent_args)],
            stdout=logf, stderr=logf, stdin=subprocess.DEVNULL,
            env={**os.environ, "NODENAME": node, "RUST_LOG": "info,whereabouts::agent=debug"})
        logf.close()
        DAEMONS[p.pid] = p
        self.agents[node] = p
        deadline = time.monotonic() + 20
        while not sock.exists():
            if p.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"node agent of {node} did not start: "
                                   f"{(d / 'agent.log').read_text(errors='replace')[-2000:]}")
            time.sleep(0.02)

    def daemon_cpu(self):
        procs = list(self.agents.values()) + ([self.operator] if self.operator else [])
        return sum(cb.proc_cpu(p.pid) or 0.0 for p in procs)

    def agent_served(self):
        if not self.spec["agents"]:
            return None
        return sum((self.node_dir(n) / "agent.log").read_text(errors="replace").count(" served ")
                   for n in self.nodes if (self.node_dir(n) / "agent.log").exists())

    def teardown(self, delete_namespace=True):
        kill_live()
        for p in self.agents.values():
            stop_daemon(p)
        self.agents = {}
        stop_daemon(self.operator)
        self.operator = None
        if not delete_namespace:
            log(f"interrupted: namespace {self.ns} left in place")
            return
        if self.as_node():
            # No kubelet confirms their end: forced.
            pods = [self.token_pod(n) for n in self.nodes]
            self.kube.run("-n", "whereabouts-system", "delete", "pod", *pods, "--force",
                          "--grace-period=0", check=False)
        r = self.kube.run("delete", "namespace", self.ns, "--wait=true", "--timeout=180s",
                          check=False, timeout=240)
        if r.returncode != 0:
            log(f"warning: deleting namespace {self.ns}: {r.stderr.strip()}")

    # -- the timed part

    def spawn(self, node, i, command="ADD", gen=0):
        """Plugin `command` for pod i of node; `gen` 1 is the pod that replaces it (--recreate)."""
        d = self.node_dir(node)
        suffix = f"-g{gen}" if gen else ""
        pod = f"pod-{node}-{i}{suffix}"
        uid = f"00000000-0000-{gen:04d}-{self.nodes.index(node):04d}-{i:012d}"
        env = {
            "PATH": os.environ.get("PATH", "/usr/bin:/bin"),
            "CNI_COMMAND": command,
            "CNI_CONTAINERID": f"c-{node}-{i:04d}{suffix}-{self.ns}",
            "CNI_NETNS": f"/var/run/netns/{pod}",
            "CNI_IFNAME": "eth0",
            "CNI_PATH": "/opt/cni/bin",
            "CNI_ARGS": f"IgnoreUnknown=1;K8S_POD_NAMESPACE={self.ns};K8S_POD_NAME={pod};"
                        f"K8S_POD_UID={uid}",
            "NODENAME": node,
            "WHEREABOUTS_CONF_DIR": str(d),
        }
        p = cb.spawn_plugin(self.binary, env, d / "netconf.json", d / f"{i}{suffix}.out",
                            d / f"{i}{suffix}.err")
        LIVE.add(p)
        return p

    def run(self, per_node, timeout, min_free_mb):
        """All nodes' ADDs at once (spawned round-robin over the nodes); waits for every one,
        kills what is left at the deadline or when memory runs low. Returns (results, extra)."""
        jobs = [(node, i) for i in range(per_node) for node in self.nodes]
        lead = self.args.first_alone
        if lead:  # the first node's ADDs first, alone for `lead` seconds, then the others'
            jobs.sort(key=lambda job: job[0] != self.nodes[0])
        n = len(jobs)
        starts, ends, rcs = [None] * n, [None] * n, [None] * n
        killed = [None] * n  # why a process was killed
        procs = [None] * n
        mem = {"min_available_mb": mem_available_mb(), "peak_live": 0, "low_memory_abort": False}
        mem["available_before_mb"] = mem["min_available_mb"]
        done = threading.Event()

        attempts = [1] * n

        def waiter(k, p):
            rcs[k] = p.wait()  # blocking waitpid: no polling delay in the latency
            ends[k] = time.monotonic()
            # --runtime-retries: as a kubelet does with a failed sandbox, DEL it, wait its
            # backoff, ADD again (the container id stays: the pod is the same).
            node, i = jobs[k]
            while (rcs[k] != 0 and attempts[k] <= self.args.runtime_retries and not killed[k]
                   and time.monotonic() < t0 + timeout):
                dl = self.spawn(node, i, command="DEL")
                dl.wait()
                LIVE.discard(dl)
                pause = self.args.retry_pause
                time.sleep(random.uniform(pause / 2, pause * 1.5))
                attempts[k] += 1
                p = self.spawn(node, i)
                procs[k] = p
                rcs[k] = p.wait()
                ends[k] = time.monotonic()

        def kill_all(reason):
            for k, p in enumerate(procs):
                if p is not None and p.poll() is None:
                    killed[k] = killed[k] or reason
                    try:
                        p.kill()
                    except ProcessLookupError:
                        pass

        def watch_memory():
            while not done.wait(0.1):
                avail = mem_available_mb()
                mem["min_available_mb"] = min(mem["min_available_mb"], avail)
                mem["peak_live"] = max(mem["peak_live"], sum(1 for p in procs if p is not None
                                                             and p.returncode is None))
                if avail < min_free_mb and not mem["low_memory_abort"]:
                    mem["low_memory_abort"] = True
                    log(f"  MemAvailable {avail:.0f} MiB < {min_free_mb} MiB: killing the plugins")
                    kill_all(f"killed by the benchmark: MemAvailable below {min_free_mb} MiB")

        threads = []
        watcher = threading.Thread(target=watch_memory, daemon=True)
        watcher.start()
        t0 = time.monotonic()
        for k, (node, i) in enumerate(jobs):
            if lead and k == per_node:
                time.sleep(lead)
            starts[k] = time.monotonic()
            p = self.spawn(node, i)
            procs[k] = p
            th = threading.Thread(target=waiter, args=(k, p), daemon=True)
            th.start()
            threads.append(th)
            if mem["low_memory_abort"]:
                kill_all(f"killed by the benchmark: MemAvailable below {min_free_mb} MiB")
        spawn_s = time.monotonic() - t0
        deadline = t0 + timeout
        for th in threads:
            th.join(timeout=max(0.0, deadline - time.monotonic()))
            if th.is_alive():
                kill_all("killed by the benchmark after the mode's deadline (--timeout)")
                break
        for th in threads:
            th.join()
        done.set()
        watcher.join()
        LIVE.difference_update(procs)
        wall = max(ends) - t0
        lat = [(e - s) * 1000.0 for s, e in zip(starts, ends)]
        results = [self.outcome(k, node, i, rcs[k], killed[k]) for k, (node, i) in enumerate(jobs)]
        for r, ms, a in zip(results, lat, attempts):
            r["latency_ms"] = round(ms, 2)
            r["attempts"] = a
        mem["peak_used_mb"] = round(mem["available_before_mb"] - mem["min_available_mb"], 1)
        retried = sum(1 for a in attempts if a > 1)
        return results, {"wall_s": wall, "spawn_s": spawn_s, "memory": mem,
                         "runtime_retried": retried, "runtime_attempts": sum(attempts)}

    def recreate(self, per_node, timeout):
        """--recreate: every pod replaced at once. The DEL of each old sandbox (retried every
        1-3 s until it succeeds, as runtimes do) races the ADD of its replacement (retried as
        --runtime-retries says). Timed to the last replacement's address."""
        jobs = [(node, i) for i in range(per_node) for node in self.nodes]
        t0 = time.monotonic()
        stats = {"del_attempts": 0, "del_failed": 0, "add_attempts": 0, "placed": 0,
                 "del_deadlines": 0, "add_deadlines": 0}
        ends = []
        lock = threading.Lock()

        def run(node, i, command, gen):
            p = self.spawn(node, i, command, gen=gen)
            rc = p.wait()
            LIVE.discard(p)
            d, suffix = self.node_dir(node), f"-g{gen}" if gen else ""
            text = (d / f"{i}{suffix}.out").read_text(errors="replace")
            return rc, "did not finish within" in text

        def old(node, i):
            while time.monotonic() < t0 + timeout:
                rc, late = run(node, i, "DEL", 0)
                with lock:
                    stats["del_attempts"] += 1
                    stats["del_deadlines"] += late
                if rc == 0:
                    return
                time.sleep(random.uniform(1, 3))
            with lock:
                stats["del_failed"] += 1

        def new(node, i):
            for attempt in range(self.args.runtime_retries + 1):
                rc, late = run(node, i, "ADD", 1)
                with lock:
                    stats["add_attempts"] += 1
                    stats["add_deadlines"] += late
                if rc == 0:
                    with lock:
                        stats["placed"] += 1
                        ends.append(time.monotonic())
                    return
                if attempt < self.args.runtime_retries and time.monotonic() < t0 + timeout:
                    run(node, i, "DEL", 1)
                    pause = self.args.retry_pause
                    time.sleep(random.uniform(pause / 2, pause * 1.5))

        threads = [threading.Thread(target=f, args=job, daemon=True)
                   for job in jobs for f in (old, new)]
        for th in threads:
            th.start()
        for th in threads:
            th.join(timeout=max(0.0, t0 + timeout + 150 - time.monotonic()))
        kill_live()
        stats["wall_s"] = round((max(ends) if ends else time.monotonic()) - t0, 2)
        _, in_pool = cb.pool_owners(self.kube, self.ns)
        refs = [ref for v in in_pool.values() for ref in v]
        stats["pool_entries_new"] = sum(1 for r in refs if r.endswith("-g1"))
        stats["pool_entries_old"] = sum(1 for r in refs if not r.endswith("-g1"))
        stats["pool_duplicates"] = sum(len(set(v)) - 1 for v in in_pool.values())
        log(f"  re-creation: {json.dumps(stats)}")
        return stats

    def outcome(self, k, node, i, rc, killed):
        d = self.node_dir(node)
        out = (d / f"{i}.out").read_text(errors="replace")
        err = (d / f"{i}.err").read_text(errors="replace")
        res = {"node": node, "podref": f"{self.ns}/pod-{node}-{i}", "rc": rc,
               "killed": killed, "addresses": [], "error": None}
        try:
            doc = json.loads(out) if out.strip() else {}
        except ValueError:
            doc = {}
        if rc == 0:
            res["addresses"] = [ip["address"] for ip in doc.get("ips", [])]
        if killed:
            res["error"] = killed
        elif rc == 0:
            # One address from each range, nothing else.
            got = [ipaddress.ip_interface(a).ip for a in res["addresses"]]
            if len(got) != len(self.nets) or any(
                    sum(1 for ip in got if ip in net) != 1 for net in self.nets):
                res["error"] = (f"expected one address in each of {', '.join(self.ranges)}, "
                                f"got {out.strip()[:300]!r}")
        else:
            msg = doc.get("msg") or ""
            det = doc.get("details") or ""
            res["error"] = (f"rc={rc} {msg} {det if det != msg else ''}"
                            f" stderr={stderr_gist(err)!r}").strip()
        return res

    # -- verification

    def verify(self, results):
        returned = {}  # ip -> podrefs, from every process that exited 0
        for r in results:
            if r["rc"] == 0 and not r["killed"]:
                for a in r["addresses"]:
                    returned.setdefault(str(ipaddress.ip_interface(a).ip), []).append(r["podref"])
        # A duplicate is an address held by two different pods. The same address twice for one
        # pod (upstream's slices on a second range) is a wrong result, counted apart.
        dup_results = sum(len(set(v)) - 1 for v in returned.values())
        repeated_results = sum(len(v) - len(set(v)) for v in returned.values())

        pools, in_pool = cb.pool_owners(self.kube, self.ns)
        dup_pool = sum(len(set(v)) - 1 for v in in_pool.values())
        repeated_pool = sum(len(v) - len(set(v)) for v in in_pool.values())
        missing = sum(1 for ip, refs in returned.items() for ref in refs
                      if ref not in in_pool.get(ip, []))
        # Leaked: entries of pods whose ADD did not exit 0 (a runtime would not use them).
        ok_refs = {r["podref"] for r in results if r["rc"] == 0 and not r["killed"]}
        leaked = sum(1 for refs in in_pool.values() for ref in refs if ref not in ok_refs)

        resv = self.kube.json("get", "overlappingrangeipreservations.whereabouts.cni.cncf.io",
                              "-n", self.ns)["items"]
        resv_by_name = {o["metadata"]["name"]: o["spec"].get("podref") for o in resv}
        missing_resv = sum(
            1 for ip, refs in returned.items() for ref in refs
            if resv_by_name.get(normalize_ip(ipaddress.ip_address(ip), self.args.network_name)) != ref)
        leaked_resv = sum(1 for ref in resv_by_name.values() if ref not in ok_refs)

        check = {
            "pools": sorted(p["metadata"]["name"] for p in pools),
            "pool_entries": sum(len(v) for v in in_pool.values()),
            "dup_results": dup_results,
            "dup_pool": dup_pool,
            "duplicate_addresses": sorted(
                {ip for ip, v in returned.items() if len(set(v)) > 1}
                | {ip for ip, v in in_pool.items() if len(set(v)) > 1})[:50],
            "repeated_in_one_result": repeated_results,
            "repeated_in_pool": repeated_pool,
            "missing_in_pool": missing,
            "leaked_in_pool": leaked,
            "reservations": len(resv),
            "missing_reservation": missing_resv,
            "leaked_reservations": leaked_resv,
        }
        if self.spec["slices"]:
            # Addresses of a sliced range that lie outside every slice of their node.
            sliced = self.sliced_ranges()
            outside = 0
            for r in results:
                if r["rc"] != 0 or r["killed"]:
                    continue
                mine = self.slices.get(r["node"], [])
                for a in r["addresses"]:
                    ip = ipaddress.ip_interface(a).ip
                    if any(ip in net for net in sliced) and not any(
                            ip.version == s.version and ip in s for s in mine):
                        outside += 1
            check["outside_node_slice"] = outside
        return check

    def retries(self):
        text = "".join((self.node_dir(n) / f).read_text(errors="replace")
                       for n in self.nodes for f in ("plugin.log", "agent.log")
                       if (self.node_dir(n) / f).exists())
        if self.spec["impl"] == "upstream":
            return {"retries": len(cb.UPSTREAM_RETRY_RE.findall(text)),
                    "leader_timeouts": len(cb.UPSTREAM_LEADER_TIMEOUT_RE.findall(text))}
        return {"retries": sum(int(n) for n in cb.CONFLICTS_RE.findall(text))}

    def log_errors(self, limit=8):
        seen, out = set(), []
        for n in self.nodes:
            f = self.node_dir(n) / "plugin.log"
            if not f.exists():
                continue
            for line in f.read_text(errors="replace").splitlines():
                low = line.lower()
                if not ("error" in low or "warn" in low or "[panic]" in low):
                    continue
                key = re.sub(r"\d+", "#", re.sub(r"^\S+\s+", "", line))[:200]
                if key not in seen:
                    seen.add(key)
                    out.append(line[:600])
                    if len(out) >= limit:
                        return out
        return out


def stderr_gist(err):
    """The telling lines of a failed plugin's stderr: a Go panic or error lines (upstream), an
    ERROR line (ours); else its end."""
    lines = err.strip().splitlines()
    keep = [l for l in lines if re.search(r"^panic:|\[error\]|\bERROR\b|Observed a panic", l)]
    if keep:
        return " | ".join(l.strip()[:300] for l in keep[:3])
    return err.strip()[-400:]


def summarize_errors(results, limit=6):
    counts = {}
    for r in results:
        if r["error"]:
            key = re.sub(r"\d+", "#", r["error"])[:300]
            counts.setdefault(key, [0, r["error"][:800]])[0] += 1
    return [{"count": c, "example": ex}
            for c, ex in sorted(counts.values(), key=lambda x: -x[0])[:limit]]


def cpu_snapshot(mode):
    snap = {name: cb.proc_cpu(pid) for name, pid in cb.CLUSTER_PIDS.items()}
    ru = resource.getrusage(resource.RUSAGE_CHILDREN)
    # Reaped plugin processes, plus the agents (and a kept operator), which work for them.
    snap["plugins and agents"] = ru.ru_utime + ru.ru_stime + mode.daemon_cpu()
    snap["machine"] = cb.machine_busy()
    return snap


class ReadyzProbe:
    """The control plane's responsiveness while a mode runs: every 0.5 s, a GET of /readyz and a
    renewal (PATCH of renewTime) of a Lease of another client, each on a kept connection, as the
    admin (exempt from API Priority and Fairness: what the server itself answers, not what a
    queued client sees). `baseline()` measures a few rounds on the quiet server first; `stats()`
    gives percentiles in ms and the failures of each."""

    LEASE = "/apis/coordination.k8s.io/v1/namespaces/default/leases/nodes-bench-probe"

    def __init__(self, kube, workdir):
        import base64
        import http.client
        import ssl
        self._http = http.client
        cfg = json.loads(kube.run("config", "view", "--raw", "-o", "json").stdout)
        cluster, user = cfg["clusters"][0]["cluster"], cfg["users"][0]["user"]
        d = Path(workdir)
        files = {}
        for key in ("certificate-authority-data", "client-certificate-data", "client-key-data"):
            files[key] = d / f"readyz-{key}.pem"
            files[key].write_bytes(base64.b64decode(cluster.get(key) or user[key]))
        self.ctx = ssl.create_default_context(cafile=str(files["certificate-authority-data"]))
        self.ctx.load_cert_chain(str(files["client-certificate-data"]),
                                 str(files["client-key-data"]))
        hostport = cluster["server"].removeprefix("https://")
        self.host, self.port = hostport.rsplit(":", 1)
        self.samples = {"readyz": [], "lease": []}
        self.failures = {"readyz": 0, "lease": 0}
        self.conn = None
        self.done = threading.Event()
        lease = {"apiVersion": "coordination.k8s.io/v1", "kind": "Lease",
                 "metadata": {"name": "nodes-bench-probe"}, "spec": {"holderIdentity": "probe"}}
        self.request("POST", self.LEASE.rsplit("/", 1)[0], json.dumps(lease))

    def request(self, method, path, body=None, content_type="application/json"):
        """(status, ms); status 0 when the connection failed."""
        started = time.monotonic()
        try:
            if self.conn is None:
                self.conn = self._http.HTTPSConnection(self.host, int(self.port),
                                                       context=self.ctx, timeout=30)
            headers = {"Content-Type": content_type} if body is not None else {}
            self.conn.request(method, path, body=body, headers=headers)
            r = self.conn.getresponse()
            r.read()
            status = r.status
        except OSError:
            self.conn, status = None, 0
        return status, (time.monotonic() - started) * 1000.0

    def once(self):
        now = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%S.%fZ")
        patch = json.dumps({"spec": {"renewTime": now}})
        for what, (status, ms) in (
                ("readyz", self.request("GET", "/readyz")),
                ("lease", self.request("PATCH", self.LEASE, patch,
                                       "application/merge-patch+json"))):
            if status == 200:
                self.samples[what].append(ms)
            else:
                self.failures[what] += 1

    def baseline(self, n=10):
        for _ in range(n):
            self.once()
        quiet = {k: cb.pct(v or [0.0], 50) for k, v in self.samples.items()}
        self.samples = {"readyz": [], "lease": []}
        self.failures = {"readyz": 0, "lease": 0}
        return quiet

    def start(self):
        def loop():
            while not self.done.wait(0.5):
                self.once()
        self.thread = threading.Thread(target=loop, daemon=True)
        self.thread.start()

    def stats(self):
        self.done.set()
        self.thread.join()
        self.request("DELETE", self.LEASE)
        out = {}
        for what, s in self.samples.items():
            v = s or [0.0]
            out[what] = {"n": len(s), "failures": self.failures[what], "p50": round(cb.pct(v, 50), 1),
                         "p99": round(cb.pct(v, 99), 1), "max": round(max(v), 1)}
        return out


def run_mode(kube, key, args, workroot, nodes):
    mode = Mode(kube, key, args, workroot, nodes)
    interrupted = False
    log(f"{MODES[key]['label']}: {len(nodes)} nodes x {args.per_node} ADDs "
        f"(namespace {mode.ns}, {mode.dir})")
    try:
        mode.setup()
        busy_before = (cb.wait_quiet(args.quiet_wait, args.quiet_cores)
                       if args.quiet_wait > 0 else None)
        api_before = api_counts(kube)
        cpu_before = cpu_snapshot(mode)
        probe = ReadyzProbe(kube, mode.dir)
        quiet_ms = probe.baseline()
        probe.start()
        results, extra = mode.run(args.per_node, args.timeout, args.min_free_mb)
        extra["control_plane_ms"] = {"quiet_p50": quiet_ms, **probe.stats()}
        cpu = cb.cpu_delta(cpu_before, cpu_snapshot(mode))
        adds = len(results)
        api = api_diff(api_before, api_counts(kube), adds)
        check = mode.verify(results)
        if args.recreate:
            check["recreate"] = mode.recreate(args.per_node, args.timeout)
        lat = [r["latency_ms"] for r in results]
        apiserver_cpu = cpu.get("kube-apiserver")
        rec = {
            "mode": key,
            "label": MODES[key]["label"],
            "impl": MODES[key]["impl"],
            "binary": str(mode.binary),
            "namespace": mode.ns,
            "nodes": len(nodes),
            "per_node": args.per_node,
            "adds": adds,
            "ranges": mode.ranges,
            "config": mode.ipam(),
            "plugin_slots": args.plugin_slots if MODES[key]["impl"] == "ours" else None,
            "first_alone_s": args.first_alone,
            "identity": args.identity if MODES[key]["impl"] == "ours" else "admin",
            "node_policy": args.node_policy if args.identity != "admin" else None,
            "agent_args": args.agent_args if MODES[key]["agents"] else None,
            "slices": mode.slice_info,
            "ok": sum(1 for r in results if r["error"] is None),
            "failures": sum(1 for r in results if r["error"] is not None),
            "killed": sum(1 for r in results if r["killed"]),
            **extra,
            "latency_ms": {"p50": cb.pct(lat, 50), "p99": cb.pct(lat, 99), "min": min(lat),
                           "max": max(lat), "mean": statistics.mean(lat)},
            "ok_per_node": {n: sum(1 for r in results if r["node"] == n and r["error"] is None)
                            for n in nodes},
            **api,
            "cpu_s": cpu,
            "apiserver_cpu_s_per_add": apiserver_cpu / adds if apiserver_cpu is not None else None,
            "others_busy_cores_before": busy_before,
            **check,
            **mode.retries(),
            "agent_served": mode.agent_served(),
            "errors": summarize_errors(results),
            "log_errors": mode.log_errors(),
            "latencies_ms": lat,
        }
        rec["duplicates"] = rec["dup_results"] + rec["dup_pool"]
        log(f"  ok={rec['ok']} fail={rec['failures']} dup={rec['duplicates']} "
            f"same-address-twice-for-one-pod={rec['repeated_in_one_result']}"
            f"/{rec['repeated_in_pool']} "
            f"missing={rec['missing_in_pool']}+{rec['missing_reservation']} "
            f"leaked={rec['leaked_in_pool']}/{rec['leaked_reservations']} "
            f"wall={rec['wall_s']:.2f}s (spawn {rec['spawn_s']:.2f}s) "
            f"p50={rec['latency_ms']['p50']:.0f}ms p99={rec['latency_ms']['p99']:.0f}ms "
            f"api={rec['api_requests']} ({rec['api_requests_per_add']:.2f}/ADD, "
            f"{fmt_verbs(rec)}) rejected={rec['api_rejected']} 5xx={rec['api_5xx']} "
            f"retries={rec['retries']} cpu={cpu} mem={extra['memory']} "
            f"control_plane_ms={extra['control_plane_ms']}"
            + (f" runtime-retried={rec['runtime_retried']} attempts={rec['runtime_attempts']}"
               if args.runtime_retries else "")
            + (f" agent-served={rec['agent_served']}" if rec["agent_served"] is not None else "")
            + (f" outside-node-slice={rec['outside_node_slice']}"
               if "outside_node_slice" in rec else ""))
        for e in rec["errors"]:
            log(f"  error x{e['count']}: {e['example']}")
        for line in rec["log_errors"]:
            log(f"  log: {line}")
        if rec["repeated_in_one_result"] or rec["repeated_in_pool"]:
            log(f"  WARNING: {key}: the same address twice for one pod: "
                f"{rec['repeated_in_one_result']} in results, {rec['repeated_in_pool']} in pools "
                "(counted as failed ADDs, not as duplicates: no two pods share it)")
        if rec["duplicates"]:
            log(f"  !!! DUPLICATE ADDRESSES in {key}: {rec['duplicates']} "
                f"({rec['dup_results']} among the results, {rec['dup_pool']} among the pool "
                f"entries): {rec['duplicate_addresses'][:10]}")
        return rec
    except KeyboardInterrupt:
        interrupted = True
        raise
    finally:
        kill_live()
        mode.teardown(delete_namespace=not interrupted)


# ----------------------------------------------------------------- nodes


CPU_CGROUP = Path("/sys/fs/cgroup/cpu/wa-nodesbench-apiserver")  # cgroup v1 cpu controller


def throttle_apiserver(cores):
    """Holds the API server to `cores` CPUs (a CFS quota), so that a storm can be tried against a
    control plane slower than this machine's: the one-pool storm of 2026-12-07 collapsed only on
    a machine about half as fast as usual (docs/benchmarks.md). Needs root and the cgroup v1 cpu
    controller; the cgroup is removed by release_apiserver."""
    pid = cb.CLUSTER_PIDS.get("kube-apiserver")
    if pid is None:
        raise RuntimeError("--apiserver-cores needs the kube-apiserver's pid (a cluster this "
                           "benchmark starts, or --kubeconfig from its --state folder)")
    if not CPU_CGROUP.parent.is_dir():
        raise RuntimeError(f"--apiserver-cores {cores}: no cgroup v1 cpu controller at "
                           f"{CPU_CGROUP.parent} on this machine")
    CPU_CGROUP.mkdir(exist_ok=True)
    (CPU_CGROUP / "cpu.cfs_period_us").write_text("100000")
    (CPU_CGROUP / "cpu.cfs_quota_us").write_text(str(int(cores * 100000)))
    (CPU_CGROUP / "cgroup.procs").write_text(str(pid))
    log(f"kube-apiserver (pid {pid}) held to {cores} CPU(s) in {CPU_CGROUP}")


def release_apiserver():
    if not CPU_CGROUP.exists():
        return
    root = CPU_CGROUP.parent / "cgroup.procs"
    for pid in (CPU_CGROUP / "cgroup.procs").read_text().split():
        try:
            root.write_text(pid)
        except OSError:
            pass  # exited meanwhile
    try:
        CPU_CGROUP.rmdir()
    except OSError as e:
        log(f"could not remove {CPU_CGROUP}: {e}")


def ensure_nodes(kube, names):
    """Creates the Node objects (labelled NODE_LABEL=nodes); refuses to touch a node of the same
    name that this script did not create."""
    existing = {n["metadata"]["name"]: n for n in kube.json("get", "nodes")["items"]}
    todo = []
    for name in names:
        if name in existing:
            if (existing[name]["metadata"].get("labels") or {}).get(NODE_LABEL) != "nodes":
                raise RuntimeError(f"node {name} exists and is not one of this benchmark's "
                                   f"(label {NODE_LABEL}=nodes); pick --node-prefix")
            continue
        todo.append({"apiVersion": "v1", "kind": "Node",
                     "metadata": {"name": name, "labels": {NODE_LABEL: "nodes"}}})
    if todo:
        path = Path(tempfile.mkdtemp(prefix="wa-nodesbench-nodes-")) / "nodes.json"
        path.write_text(json.dumps({"apiVersion": "v1", "kind": "List", "items": todo}))
        kube.run("create", "-f", str(path))
        shutil.rmtree(path.parent, ignore_errors=True)
    log(f"{len(names)} Node objects ready ({len(todo)} created)")


def delete_nodes(kube):
    r = kube.run("delete", "nodes", "-l", f"{NODE_LABEL}=nodes", "--wait=false", check=False)
    if r.returncode != 0:
        log(f"warning: deleting the benchmark's Node objects: {r.stderr.strip()}")


# ----------------------------------------------------------------- reporting


def fmt_verbs(rec):
    adds = rec["adds"] or 1
    return ", ".join(f"{v} {n / adds:.3g}" for v, n in rec["api_requests_by_verb"].items()) or "none"


def fmt_slices(rec):
    s = rec.get("slices")
    if not s:
        return "–"
    who = "operator" if s["assigner"].startswith("our operator") else "bench"
    state = f"ready in {s['wait_s']:.1f} s" if s["ready"] else f"NOT ready after {s['wait_s']:.0f} s"
    return f"{who}: {len(s['nodeslicepools'])} pool(s), {state}"


def markdown(records, failed_modes):
    lines = [
        "| mode | nodes x ADDs | ok | failed | duplicates | wall s | p50 ms | p99 ms "
        "| API requests / ADD | by verb, per ADD | kube-apiserver CPU ms / ADD | slices |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---|---:|---|",
    ]
    for r in records:
        cpu = r["apiserver_cpu_s_per_add"]
        lines.append(
            f"| {r['mode']} | {r['nodes']} x {r['per_node']} | {r['ok']} | {r['failures']} "
            f"| {r['duplicates']} | {r['wall_s']:.2f} | {r['latency_ms']['p50']:.0f} "
            f"| {r['latency_ms']['p99']:.0f} | {r['api_requests_per_add']:.2f} | {fmt_verbs(r)} "
            f"| {'n/a' if cpu is None else f'{cpu * 1000:.1f}'} | {fmt_slices(r)} |")
    for key, err in failed_modes:
        lines.append(f"| {key} | – | – | – | – | – | – | – | – | harness error: {err[:120]} | – | – |")
    lines += ["", "| mode | missing in pool / reservations | leaked pool entries / reservations "
                  "| same address twice for one pod (results / pools) "
                  "| rejected (409/422/429) | 5xx | retries | CPU s: plugins+agents / kube-apiserver / etcd / rest "
                  "| peak memory MiB (live plugins) | outside node's slice |",
              "|---|---|---|---|---:|---:|---|---|---|---:|"]
    for r in records:
        c = r["cpu_s"]
        cpu = " / ".join(f"{c[k]:.1f}" if c.get(k) is not None else "?"
                         for k in ("plugins and agents", "kube-apiserver", "etcd", "others"))
        retr = str(r["retries"])
        if r.get("leader_timeouts"):
            retr += f" ({r['leader_timeouts']} leader-election timeouts)"
        lines.append(
            f"| {r['mode']} | {r['missing_in_pool']} / {r['missing_reservation']} "
            f"| {r['leaked_in_pool']} / {r['leaked_reservations']} "
            f"| {r.get('repeated_in_one_result', '?')} / {r.get('repeated_in_pool', '?')} | {r['api_rejected']} "
            f"| {r['api_5xx']} | {retr} | {cpu} "
            f"| {r['memory']['peak_used_mb']:.0f} ({r['memory']['peak_live']}) "
            f"| {r.get('outside_node_slice', '–')} |")
    notes = [r for r in records if r.get("slices")]
    if notes:
        lines.append("")
        for r in notes:
            s = r["slices"]
            lines.append(f"- {r['mode']}: slices assigned by {s['assigner']}: "
                         + ("; ".join(f"{p['name']} {p['range']} {p['sliceSize']} "
                                      f"({p['allocations']} nodes)" for p in s["nodeslicepools"])
                            or "no NodeSlicePool")
                         + ("" if s["ready"] else " — NOT every node had a slice when timing began"))
    for r in records:
        for e in r["errors"][:2]:
            lines.append(f"- {r['mode']}: error x{e['count']}: `{e['example'][:300]}`")
    return "\n".join(lines)


# ---------------------------------------------------------------------- main


def main():
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--modes", default=",".join(MODES),
                    help=f"comma separated, run in this order (default {','.join(MODES)})")
    ap.add_argument("--nodes", type=int, default=10, help="simulated nodes (default 10)")
    ap.add_argument("--per-node", type=int, default=100,
                    help="concurrent ADDs per node (default 100)")
    ap.add_argument("--node-prefix", default="node-", help="Node names: PREFIX0..PREFIX<N-1>")
    ap.add_argument("--v4", default="10.40.0.0/16", help="the IPv4 range (default 10.40.0.0/16)")
    ap.add_argument("--v6", default="fd00:10::/112",
                    help="the IPv6 range (default fd00:10::/112); 'none' for single-stack IPv4")
    ap.add_argument("--v4-slice", default="/24",
                    help="node_slice_size at the top level (the IPv4 range; default /24)")
    ap.add_argument("--v6-slice", default="/120",
                    help="node_slice_size of the IPv6 ipRanges entry (default /120)")
    ap.add_argument("--network-name", default="nodesbench",
                    help="ipam network_name; also the NAD's and the NodeSlicePool's name")
    ap.add_argument("--runtime-retries", type=int, default=0,
                    help="retry a failed ADD up to N times as a kubelet does: DEL, a pause of "
                         "--retry-pause (jittered 0.5x-1.5x), ADD again (default 0: each ADD once)")
    ap.add_argument("--first-alone", type=float, default=0.0, metavar="S",
                    help="spawn the first node's ADDs first and the other nodes' S seconds "
                         "later (a node that bursts alone, and widens its bound, then meets a "
                         "storm; default 0: all at once)")
    ap.add_argument("--retry-pause", type=float, default=10.0,
                    help="the pause before a retried ADD, s (default 10: the kubelet's pod worker "
                         "backoff)")
    ap.add_argument("--size", type=int, default=0,
                    help="exactly N addresses per range (range_start/range_end; default: all)")
    ap.add_argument("--recreate", action="store_true",
                    help="then replace every pod at once: old DELs (retried every 1-3 s until "
                         "they succeed) race the new pods' ADDs (retried per --runtime-retries)")
    ap.add_argument("--identity", choices=("admin", "node", "node-no-leases"), default="admin",
                    help="who our plugins and agents are: the cluster admin (default), or the "
                         "real node account with config/rbac's rights and limits (node-no-leases: "
                         "without the Lease rule, so no writer turns); upstream stays admin")
    ap.add_argument("--node-policy", choices=("on", "off"), default="on",
                    help="with --identity node: whether the node-writes admission policy "
                         "(config/rbac/node-limits.yaml) is bound (default on; off measures its "
                         "cost)")
    ap.add_argument("--agent-args", default="",
                    help="extra flags of every node agent (e.g. '--max-queued-per-pool 20' to make "
                         "them hand requests back)")
    ap.add_argument("--plugin-slots", type=int, default=None,
                    help="ours: plugin_slots of every node's flat file (default: the plugin's own; "
                         "0 = unbounded)")
    ap.add_argument("--ours", default=str(ROOT / "target" / "release" / "whereabouts"))
    ap.add_argument("--operator", default=str(ROOT / "target" / "release" / "whereabouts-operator"),
                    help="our operator binary: node agents (`agent`) and slice assignment (`run`)")
    ap.add_argument("--upstream", default=str(BENCH / "bin" / "whereabouts-upstream"))
    ap.add_argument("--slice-assigner", choices=("operator", "bench"), default="operator",
                    help="who assigns the node slices: our operator (default), or this script "
                         "writing one NodeSlicePool in upstream's layout (first range only)")
    ap.add_argument("--operator-args", default="",
                    help="extra arguments for `whereabouts-operator run` (shell words)")
    ap.add_argument("--keep-operator", action="store_true",
                    help="keep the operator running through the timed part (default: stopped "
                         "once the slices are assigned, so it adds no requests or CPU)")
    ap.add_argument("--slice-timeout", type=float, default=60.0,
                    help="wait at most this long (s) for every node's slices (default 60)")
    ap.add_argument("--apiserver-cores", type=float, default=0.0, metavar="N",
                    help="hold the kube-apiserver to N CPUs (CFS quota, cgroup v1 cpu "
                         "controller, root) for the whole run: a slower control plane on "
                         "demand; 0 (default) leaves it alone")
    ap.add_argument("--timeout", type=float, default=300.0,
                    help="deadline per mode from the first spawn, s (default 300)")
    ap.add_argument("--min-free-mb", type=int, default=512,
                    help="kill the plugins when MemAvailable falls below this (default 512 MiB)")
    ap.add_argument("--kubeconfig", help="use this cluster instead of starting one")
    ap.add_argument("--state", default=STATE_DEFAULT,
                    help=f"WHEREABOUTS_E2E_STATE for e2e/cluster.sh (default {STATE_DEFAULT})")
    ap.add_argument("--keep-cluster", action="store_true", help="do not stop the cluster we started")
    ap.add_argument("--kubectl", default=str(cb.KUBECTL_DEFAULT))
    ap.add_argument("--quiet-wait", type=float, default=30.0,
                    help="before each mode wait at most this long (s) for a quiet machine; 0 = never")
    ap.add_argument("--quiet-cores", type=float, default=0.3)
    ap.add_argument("--out", default=str(BENCH / "results"))
    ap.add_argument("--render", metavar="RESULTS_JSON", help="print the tables of an earlier run")
    args = ap.parse_args()
    if args.apiserver_cores < 0 or 0 < args.apiserver_cores < 0.01:
        ap.error(f"--apiserver-cores {args.apiserver_cores}: want 0 (off) or at least 0.01 CPU "
                 "(the smallest CFS quota, 1 ms per 100 ms period)")
    if args.render:
        doc = json.loads(Path(args.render).read_text())
        print(markdown(doc["results"], doc.get("failed_modes", [])))
        return 0

    modes = [m for m in args.modes.split(",") if m]
    for m in modes:
        if m not in MODES:
            sys.exit(f"unknown mode {m!r}; known: {', '.join(MODES)}")
    if not args.first_alone >= 0:  # also refuses nan
        sys.exit(f"--first-alone {args.first_alone}: must be 0 or more seconds")
    args.ours, args.operator, args.upstream = (str(Path(p).resolve()) for p in
                                               (args.ours, args.operator, args.upstream))
    need = set()
    for m in modes:
        need.add(args.ours if MODES[m]["impl"] == "ours" else args.upstream)
        if MODES[m]["agents"] or (MODES[m]["slices"] and args.slice_assigner == "operator"):
            need.add(args.operator)
    for p in sorted(need):
        if not os.access(p, os.X_OK):
            sys.exit(f"binary {p} not found or not executable (see bench/README.md)")
    if args.v6.lower() in ("", "none"):
        args.v6 = ""
    for flag, val in (("--v4-slice", args.v4_slice), ("--v6-slice", args.v6_slice)):
        if not re.fullmatch(r"/?\d+", val):
            sys.exit(f"{flag}: want a prefix length like /24, got {val!r}")
    args.v4_slice = "/" + args.v4_slice.lstrip("/")
    args.v6_slice = "/" + args.v6_slice.lstrip("/")
    nodes = [f"{args.node_prefix}{i}" for i in range(args.nodes)]

    # SIGTERM/SIGHUP unwind like Ctrl-C, so that everything started is stopped.
    def on_signal(signum, _frame):
        raise KeyboardInterrupt(f"signal {signum}")
    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGHUP, on_signal)

    started = False
    kube = None
    records, failed_modes, env = [], [], {}
    workroot = tempfile.mkdtemp(prefix="wa-nodesbench-")
    rc = 0
    try:
        kubeconfig = args.kubeconfig
        if not kubeconfig:
            log(f"starting the control plane: WHEREABOUTS_E2E_STATE={args.state} e2e/cluster.sh up")
            started = True  # `down` is safe even if `up` failed half way
            kubeconfig = cb.cluster("up", args.state)
        kube = cb.Kube(args.kubectl, kubeconfig)
        if Path(os.path.realpath(kubeconfig)).parent == Path(os.path.realpath(args.state)):
            for comp in ("kube-apiserver", "etcd"):
                pidfile = Path(args.state) / f"{comp}.pid"
                if pidfile.exists():
                    cb.CLUSTER_PIDS[comp] = int(pidfile.read_text().strip())
        if "kube-apiserver" not in cb.CLUSTER_PIDS:
            log("kube-apiserver's pid unknown (not our e2e/cluster.sh state): no CPU figures")
        if args.apiserver_cores:
            throttle_apiserver(args.apiserver_cores)
        kube.run("apply", "-f", str(ROOT / "crds"))
        kube.run("wait", "--for=condition=Established", "--timeout=60s",
                 "crd/ippools.whereabouts.cni.cncf.io",
                 "crd/overlappingrangeipreservations.whereabouts.cni.cncf.io",
                 "crd/nodeslicepools.whereabouts.cni.cncf.io",
                 "crd/network-attachment-definitions.k8s.cni.cncf.io")
        cb.IMPLS["ours"]["binary"] = Path(args.ours)
        cb.IMPLS["upstream"]["binary"] = Path(args.upstream)
        env = cb.environment(kube)
        log(f"environment: {json.dumps(env)}")
        if any(MODES[m]["slices"] for m in modes) or args.identity != "admin":
            ensure_nodes(kube, nodes)
        t_all = time.monotonic()
        for m in modes:
            try:
                records.append(run_mode(kube, m, args, workroot, nodes))
            except KeyboardInterrupt:
                raise
            except Exception as e:  # noqa: BLE001  one broken mode must not hide the others
                log(f"{m}: HARNESS ERROR: {e}")
                failed_modes.append((m, str(e)))
                rc = 1
        env["total_runtime_s"] = time.monotonic() - t_all
    except BaseException:
        kill_live()
        rc = 1
        raise
    finally:
        kill_live()
        for p in list(DAEMONS.values()):
            stop_daemon(p)
        if args.apiserver_cores:
            release_apiserver()
        if records or failed_modes:
            out = Path(args.out)
            out.mkdir(parents=True, exist_ok=True)
            stamp = datetime.datetime.now(datetime.timezone.utc).strftime("%Y%m%dT%H%M%SZ")
            path = out / f"nodes-{stamp}.json"
            doc = {"environment": env, "workdir": workroot, "args": vars(args),
                   "failed_modes": failed_modes, "results": records}
            path.write_text(json.dumps(doc, indent=2))
            (out / "nodes-latest.json").write_text(json.dumps(doc, indent=2))
            log(f"wrote {path} (per-process outputs and logs kept in {workroot})")
            print(markdown(records, failed_modes))
        if kube is not None and not (started and not args.keep_cluster):
            delete_nodes(kube)  # a cluster that stays up keeps no Node objects of ours
        if started and not args.keep_cluster:
            log("stopping the control plane")
            try:
                cb.cluster("down", args.state)
            except Exception as e:  # noqa: BLE001
                log(f"e2e/cluster.sh down failed: {e}")
                rc = rc or 1
    dups = [(r["mode"], r["duplicates"]) for r in records if r["duplicates"]]
    if dups:
        log("!!! DUPLICATE ADDRESSES: " + ", ".join(f"{m}: {n}" for m, n in dups))
        return 3
    return rc


if __name__ == "__main__":
    sys.exit(main())
