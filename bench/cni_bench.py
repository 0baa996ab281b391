#!/usr/bin/env python3
"""CNI allocation benchmark: our whereabouts vs upstream (Go) whereabouts.

Runs the CNI binaries directly (CNI_COMMAND=ADD, network config on stdin)
against a real kube-apiserver (e2e/cluster.sh) and measures

  * seq:      N sequential ADDs into one IPv4 /16 pool -> p50/p99 latency;
  * conc-v4:  N concurrent ADD processes into one IPv4 /24 pool;
  * conc-ds:  N concurrent dual-stack ADDs (IPv4 /24 + IPv6 /64).

Every scenario gets a fresh namespace (pools, reservations and upstream's
leader-election Lease live in the kubeconfig context's namespace), and after
it the results are cross-checked against the IPPool objects: every returned
address must be in a pool with the right podref, no address may appear twice
in the results or in the pools.

Python 3 standard library only. See bench/README.md.
"""

import argparse
import datetime
import ipaddress
import json
import os
import platform
import resource
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
BENCH = ROOT / "bench"
KUBECTL_DEFAULT = ROOT / "e2e" / "bin" / "kubectl"
CLUSTER_SH = ROOT / "e2e" / "cluster.sh"
STATE_DEFAULT = "/tmp/wa-bench-state"

# How each implementation is run and how its log shows lost races.
IMPLS = {
    "ours": {
        "label": "ours",
        "binary": ROOT / "target" / "release" / "whereabouts",
        "env": {},
        "log_level": "verbose",
    },
    # The same plugin handing its requests to the node agent (whereabouts-operator agent), which
    # runs for the scenario on a socket of its own.
    "ours-agent": {
        "label": "ours, node agent",
        "binary": ROOT / "target" / "release" / "whereabouts",
        "agent": ROOT / "target" / "release" / "whereabouts-operator",
        "env": {},
        "log_level": "verbose",
    },
    # "ours" and "ours-agent" with the operator running on the scenario's namespace (it writes
    # the pools' status subresource): what the status writes cost a burst (docs/benchmarks.md).
    "ours-op": {
        "label": "ours, operator running",
        "binary": ROOT / "target" / "release" / "whereabouts",
        "operator": ROOT / "target" / "release" / "whereabouts-operator",
        "env": {},
        "log_level": "verbose",
    },
    "ours-agent-op": {
        "label": "ours, node agent, operator running",
        "binary": ROOT / "target" / "release" / "whereabouts",
        "agent": ROOT / "target" / "release" / "whereabouts-operator",
        "operator": ROOT / "target" / "release" / "whereabouts-operator",
        "env": {},
        "log_level": "verbose",
    },
    # An earlier build of ours (--baseline), run exactly like "ours", to check for regressions.
    "ours-baseline": {
        "label": "ours, baseline",
        "binary": None,
        "env": {},
        "log_level": "verbose",
    },
    # An earlier build of ours with its own node agent (--baseline and --baseline-operator), run
    # exactly like "ours-agent", to check the agent path for regressions in the same run.
    "ours-agent-baseline": {
        "label": "ours, node agent, baseline",
        "binary": None,
        "agent": None,
        "env": {},
        "log_level": "verbose",
    },
    "upstream": {
        "label": "upstream",
        "binary": BENCH / "bin" / "whereabouts-upstream",
        "env": {},
        # Upstream logs pool-update failures (its retries) at error level,
        # which "verbose" includes; "debug" would add ~15 lines per ADD.
        "log_level": "verbose",
    },
}

V4_SEQ = "10.20.0.0/16"
V4 = "10.30.0.0/24"
V6 = "fd00:30::/64"

LIVE = set()  # plugin processes started and not yet reaped
AGENT = {}  # "pid" of the running scenario's node agent, if any
CONFLICTS_RE = re.compile(r"conflicts=(\d+)")
UPSTREAM_RETRY_RE = re.compile(r"IPAM error updating pool \(attempt")
UPSTREAM_LEADER_TIMEOUT_RE = re.compile(r"time limit exceeded while waiting to become leader")


def log(msg):
    print(f"[bench] {msg}", file=sys.stderr, flush=True)


def pct(values, p):
    """Nearest-rank percentile (p in 0..100) of a non-empty list."""
    s = sorted(values)
    k = max(0, min(len(s) - 1, int(round(p / 100.0 * len(s) + 0.5)) - 1))
    return s[k]


class Kube:
    def __init__(self, kubectl, kubeconfig):
        self.kubectl = str(kubectl)
        self.kubeconfig = str(kubeconfig)

    def run(self, *args, kubeconfig=None, check=True, timeout=120, input_text=None):
        cmd = [self.kubectl, "--kubeconfig", kubeconfig or self.kubeconfig, *args]
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout,
                           input=input_text)
        if check and r.returncode != 0:
            raise RuntimeError(f"{' '.join(cmd)} failed: {r.stderr.strip()}")
        return r

    def json(self, *args, kubeconfig=None):
        return json.loads(self.run(*args, "-o", "json", kubeconfig=kubeconfig).stdout)


# ------------------------------------------------------------------ scenario


class Scenario:
    """One fresh namespace, kubeconfig copy, flat file and network config."""

    def __init__(self, kube, impl_key, name, ranges, workroot):
        self.kube = kube
        self.impl_key = impl_key
        self.impl = IMPLS[impl_key]
        self.name = name
        suffix = f"{int(time.time() * 1000) % 10**8:08d}"
        self.ns = f"bench-{impl_key}-{name}-{suffix}".lower()
        self.dir = Path(workroot) / self.ns
        self.dir.mkdir(parents=True)
        self.kubeconfig = self.dir / "kubeconfig"
        self.flat = self.dir / "whereabouts.conf"
        self.logfile = self.dir / "plugin.log"
        self.netconf = self.dir / "netconf.json"
        self.ranges = ranges
        self.socket = self.dir / "agent.sock"
        self.agent_log = self.dir / "agent.log"
        self.agent = None
        self.operator = None

    def setup(self):
        self.kube.run("create", "namespace", self.ns)
        shutil.copyfile(self.kube.kubeconfig, self.kubeconfig)
        self.kube.run("config", "set-context", "--current", f"--namespace={self.ns}",
                      kubeconfig=str(self.kubeconfig))
        # agent_socket and log_file are read from the node's flat file only.
        flat = {"kubernetes": {"kubeconfig": str(self.kubeconfig)}, "log_file": str(self.logfile)}
        if "agent" in self.impl:
            flat["agent_socket"] = str(self.socket)
        elif self.impl_key in ("ours", "ours-op"):
            flat["agent_socket"] = ""  # never an agent at the default path
        if self.impl_key.startswith("ours"):
            # The scenario is a node of its own: its own bound on plugins at work (plugin_slots).
            flat["plugin_slots_dir"] = str(self.dir / "plugin-slots")
        self.flat.write_text(json.dumps(flat))
        ipam = {
            "type": "whereabouts",
            "configuration_path": str(self.flat),
            "log_level": self.impl["log_level"],
        }
        if "agent" in self.impl:
            self.start_agent()
        if "operator" in self.impl:
            self.start_operator()
        if len(self.ranges) == 1:
            ipam["range"] = self.ranges[0]
        else:
            ipam["ipRanges"] = [{"range": r} for r in self.ranges]
        conf = {"cniVersion": "1.0.0", "name": "bench", "type": "bridge", "ipam": ipam}
        self.netconf.write_text(json.dumps(conf))

    def start_agent(self):
        log_file = open(self.agent_log, "wb")
        self.agent = subprocess.Popen(
            [str(self.impl["agent"]), "agent", "--socket", str(self.socket),
             "--kubeconfig", str(self.kubeconfig), "--serves-kubeconfig", str(self.kubeconfig),
             "--admin-addr", "127.0.0.1:0"],
            stdout=log_file, stderr=log_file,
            env={**os.environ, "RUST_LOG": "info,whereabouts::agent=debug"})
        log_file.close()
        AGENT["pid"] = self.agent.pid
        deadline = time.monotonic() + 10
        while not self.socket.exists():
            if self.agent.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"node agent did not start: {self.agent_log.read_text()[-2000:]}")
            time.sleep(0.02)

    def start_operator(self):
        """`whereabouts-operator run` on this namespace alone, ready before the burst."""
        log_file = open(self.dir / "operator.log", "wb")
        self.operator = subprocess.Popen(
            [str(self.impl["operator"]), "run", f"--pool-namespace={self.ns}",
             "--leader-election=false", "--admin-addr=127.0.0.1:0"],
            stdout=log_file, stderr=log_file,
            env={**os.environ, "KUBECONFIG": str(self.kubeconfig), "RUST_LOG": "info"})
        log_file.close()
        time.sleep(3)  # caches synced and loops started
        if self.operator.poll() is not None:
            raise RuntimeError(f"operator exited: {(self.dir / 'operator.log').read_text()[-2000:]}")

    def stop_agent(self):
        if self.agent is not None:
            self.agent.terminate()
            self.agent.wait(timeout=30)
            AGENT.pop("pid", None)
            self.agent = None

    def agent_served(self):
        if not self.agent_log.exists():
            return None
        return self.agent_log.read_text(errors="replace").count(" served ")

    def teardown(self):
        self.stop_agent()
        if self.operator is not None:
            self.operator.terminate()
            self.operator.wait(timeout=30)
            self.operator = None
        r = self.kube.run("delete", "namespace", self.ns, "--wait=true", "--timeout=120s",
                          check=False, timeout=180)
        if r.returncode != 0:
            log(f"warning: deleting namespace {self.ns}: {r.stderr.strip()}")

    # -- running the plugin

    def spawn(self, i):
        pod = f"pod-{i}"
        env = {
            "PATH": os.environ.get("PATH", "/usr/bin:/bin"),
            "CNI_COMMAND": "ADD",
            "CNI_CONTAINERID": f"c{i:04d}-{self.ns}",
            "CNI_NETNS": f"/var/run/netns/{pod}",
            "CNI_IFNAME": "eth0",
            "CNI_PATH": "/opt/cni/bin",
            # The node's whereabouts directory, which holds the flat file.
            "WHEREABOUTS_CONF_DIR": str(self.dir),
            "CNI_ARGS": f"IgnoreUnknown=1;K8S_POD_NAMESPACE={self.ns};K8S_POD_NAME={pod};"
                        f"K8S_POD_UID=00000000-0000-0000-0000-{i:012d}",
            **self.impl["env"],
        }
        p = spawn_plugin(self.impl["binary"], env, self.netconf,
                         self.dir / f"{i}.out", self.dir / f"{i}.err")
        LIVE.add(p)
        return p

    def outcome(self, i, rc, timed_out):
        LIVE.difference_update([p for p in LIVE if p.returncode is not None])
        out = (self.dir / f"{i}.out").read_text(errors="replace")
        err = (self.dir / f"{i}.err").read_text(errors="replace")
        res = {"i": i, "podref": f"{self.ns}/pod-{i}", "rc": rc, "timed_out": timed_out,
               "addresses": [], "error": None}
        if timed_out:
            res["error"] = "killed by the benchmark after the scenario deadline"
            return res
        try:
            doc = json.loads(out) if out.strip() else {}
        except ValueError:
            doc = {}
        if rc == 0:
            res["addresses"] = [ip["address"] for ip in doc.get("ips", [])]
            if len(res["addresses"]) != len(self.ranges):
                res["error"] = f"expected {len(self.ranges)} addresses, got {out.strip()!r}"
        else:
            msg = doc.get("msg") or doc.get("details") or ""
            res["error"] = (f"rc={rc} {msg} {doc.get('details', '') if msg != doc.get('details') else ''}"
                            f" stderr={err.strip()[-400:]!r}").strip()
        return res

    def kill(self, p):
        try:
            p.kill()  # the plugin starts no processes of its own
        except ProcessLookupError:
            pass
        p.wait()

    # -- verification

    def verify(self, results):
        """Cross-checks results against the IPPools; returns a dict of counts."""
        ok = [r for r in results if r["error"] is None]
        seen = {}
        for r in ok:
            for a in r["addresses"]:
                ip = str(ipaddress.ip_interface(a).ip)
                seen.setdefault(ip, []).append(r["podref"])
        dup_results = sum(len(v) - 1 for v in seen.values() if len(v) > 1)

        pools, in_pool = pool_owners(self.kube, self.ns)
        dup_pool = sum(len(v) - 1 for v in in_pool.values() if len(v) > 1)

        missing = 0
        for ip, podrefs in seen.items():
            for podref in podrefs:
                if podref not in in_pool.get(ip, []):
                    missing += 1
        # Both implementations also write an OverlappingRangeIPReservation
        # per address by default (enable_overlapping_ranges defaults to true).
        resv = self.kube.json("get", "overlappingrangeipreservations.whereabouts.cni.cncf.io",
                              "-n", self.ns)["items"]
        resv_by_name = {o["metadata"]["name"]: o["spec"].get("podref") for o in resv}
        missing_resv = 0
        for ip, podrefs in seen.items():
            for podref in podrefs:
                if resv_by_name.get(ip.replace(":", "-")) != podref:
                    missing_resv += 1
        ok_podrefs = {r["podref"] for r in ok}
        leaked = sum(1 for refs in in_pool.values() for ref in refs if ref not in ok_podrefs)
        leaked_resv = sum(1 for ref in resv_by_name.values() if ref not in ok_podrefs)
        return {
            "pools": [p["metadata"]["name"] for p in pools],
            "pool_entries": sum(len(v) for v in in_pool.values()),
            "dup_results": dup_results,
            "dup_pool": dup_pool,
            "missing_in_pool": missing,
            "leaked_in_pool": leaked,
            "reservations": len(resv),
            "missing_reservation": missing_resv,
            "leaked_reservations": leaked_resv,
        }

    def retries(self):
        """Lost races from the plugin log: ours logs conflicts=N per address,
        upstream one error line per failed pool update."""
        text = "".join(f.read_text(errors="replace") for f in (self.logfile, self.agent_log)
                       if f.exists())
        if self.impl_key == "upstream":
            return {
                "retries": len(UPSTREAM_RETRY_RE.findall(text)),
                "leader_timeouts": len(UPSTREAM_LEADER_TIMEOUT_RE.findall(text)),
            }
        return {"retries": sum(int(n) for n in CONFLICTS_RE.findall(text))}

    def log_errors(self, limit=8):
        """Distinct error/warning lines from the plugin log (timestamps cut)."""
        if not self.logfile.exists():
            return []
        seen, out = set(), []
        for line in self.logfile.read_text(errors="replace").splitlines():
            low = line.lower()
            if not ("error" in low or "warn" in low or "[panic]" in low):
                continue
            key = re.sub(r"^\S+\s+", "", line)
            key = re.sub(r"\d+", "#", key)[:200]
            if key not in seen:
                seen.add(key)
                out.append(line[:600])
                if len(out) >= limit:
                    break
        return out


def summarize_errors(results, limit=6):
    counts = {}
    for r in results:
        if r["error"]:
            key = re.sub(r"\d+", "#", r["error"])[:300]
            if key not in counts:
                counts[key] = [0, r["error"][:800]]
            counts[key][0] += 1
    return [{"count": c, "example": ex} for c, ex in
            sorted(counts.values(), key=lambda x: -x[0])[:limit]]


def run_sequential(sc, count, deadline):
    results, lat = [], []
    for i in range(count):
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            results.append({"i": i, "podref": f"{sc.ns}/pod-{i}", "rc": None, "timed_out": True,
                            "addresses": [], "error": "not started: scenario deadline passed"})
            continue
        t = time.monotonic()
        p = sc.spawn(i)
        timed_out = False
        try:
            rc = p.wait(timeout=remaining)
        except subprocess.TimeoutExpired:
            sc.kill(p)
            rc, timed_out = None, True
        lat.append((time.monotonic() - t) * 1000.0)
        results.append(sc.outcome(i, rc, timed_out))
    return results, lat, None


def run_concurrent(sc, n, deadline):
    procs, starts, ends = [], [None] * n, [None] * n
    timed = [False] * n
    rcs = [None] * n

    def waiter(i, p):
        try:
            rcs[i] = p.wait(timeout=max(0.0, deadline - time.monotonic()))
            ends[i] = time.monotonic()
        except subprocess.TimeoutExpired:
            timed[i] = True
            sc.kill(p)
            ends[i] = time.monotonic()

    threads = []
    t0 = time.monotonic()
    for i in range(n):
        starts[i] = time.monotonic()
        p = sc.spawn(i)
        procs.append(p)
        th = threading.Thread(target=waiter, args=(i, p), daemon=True)
        th.start()
        threads.append(th)
    spawned = time.monotonic() - t0
    for th in threads:
        th.join()
    wall = max(ends) - t0
    lat = [(e - s) * 1000.0 for s, e in zip(starts, ends)]
    results = [sc.outcome(i, rcs[i], timed[i]) for i in range(n)]
    return results, lat, {"wall_s": wall, "spawn_s": spawned}


METRIC_RE = re.compile(r'^(apiserver_request_total|etcd_requests_total|etcd_request_errors_total)\{(.*)\} ([0-9.e+]+)$')
LABEL_RE = re.compile(r'(\w+)="([^"]*)"')
WATCHED_GROUPS = {"whereabouts.cni.cncf.io", "coordination.k8s.io"}


def api_requests(kube):
    """apiserver_request_total for the whereabouts group and Leases, keyed by
    (resource, verb, code). The API server counts every request it answered,
    so deltas around a run are an implementation-independent count of what
    each plugin asked for and how much of it was rejected."""
    r = kube.run("get", "--raw", "/metrics", check=False, timeout=60)
    out = {}
    for line in r.stdout.splitlines():
        m = METRIC_RE.match(line)
        if not m:
            continue
        labels = dict(LABEL_RE.findall(m.group(2)))
        if labels.get("group") not in WATCHED_GROUPS:
            continue
        if m.group(1) == "apiserver_request_total":
            key = f"{labels.get('resource')} {labels.get('verb')} {labels.get('code')}"
        else:
            # The API server's own storage calls (see server_cas_retries).
            kind = "etcd" if m.group(1) == "etcd_requests_total" else "etcd-error"
            key = f"{kind} {labels.get('resource')} {labels.get('operation')}"
        out[key] = out.get(key, 0) + float(m.group(3))
    return out


def api_delta(before, after):
    d = {k: int(after.get(k, 0) - before.get(k, 0)) for k in set(before) | set(after)}
    d = {k: v for k, v in sorted(d.items()) if v}
    api = {k: v for k, v in d.items() if not k.startswith("etcd")}
    total = sum(api.values())
    rejected = sum(v for k, v in api.items() if k.rsplit(" ", 1)[1] in ("409", "422", "429"))
    errors = sum(v for k, v in api.items() if k.rsplit(" ", 1)[1].startswith("5"))
    return {"api_requests": total, "api_rejected": rejected, "api_5xx": errors,
            "server_cas_retries": server_cas_retries(d), "api_by_resource_verb_code": d}


def server_cas_retries(d):
    """Pool writes the API server attempted in etcd beyond the successful
    ones: a PATCH that carries no resourceVersion is re-applied by the
    server's GuaranteedUpdate loop every time its compare-and-swap loses, and
    each attempt decodes, patches, validates and re-encodes the whole pool.
    None when the run has no etcd counters (older result files)."""
    if not any(k.startswith("etcd ") for k in d):
        return None
    attempts = d.get("etcd ippools update", 0)
    done = sum(v for k, v in d.items()
               if k.startswith("ippools ") and k.split()[1] in ("PATCH", "PUT") and k.split()[2].startswith("2"))
    return max(0, attempts - done)


CLUSTER_PIDS = {}  # component -> pid, when we know the control plane's pid files
CLK_TCK = os.sysconf("SC_CLK_TCK")


def pool_owners(kube, ns):
    """The namespace's IPPools, and every address they record with the podrefs recording it."""
    pools = kube.json("get", "ippools.whereabouts.cni.cncf.io", "-n", ns)["items"]
    owners = {}
    for pool in pools:
        net = ipaddress.ip_network(pool["spec"]["range"], strict=False)
        for off, alloc in (pool["spec"].get("allocations") or {}).items():
            owners.setdefault(str(net.network_address + int(off)), []).append(alloc.get("podref"))
    return pools, owners


def spawn_plugin(binary, env, stdin_path, out_path, err_path):
    """Starts one plugin process with `stdin_path` on its stdin and its stdout and stderr in
    files; the parent keeps no file open."""
    out = open(out_path, "wb")
    err = open(err_path, "wb")
    inp = open(stdin_path, "rb")
    try:
        return subprocess.Popen([str(binary)], stdin=inp, stdout=out, stderr=err, env=env)
    finally:
        inp.close()
        out.close()
        err.close()


def proc_cpu(pid):
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / CLK_TCK
    except (OSError, IndexError, ValueError):
        return None


def machine_busy():
    """CPU seconds the whole machine spent busy so far (all cores)."""
    f = Path("/proc/stat").read_text().splitlines()[0].split()[1:]
    user, nice, system, idle, iowait, irq, softirq, steal = (int(x) for x in f[:8])
    return (user + nice + system + irq + softirq + steal) / CLK_TCK


def wait_quiet(max_wait, threshold):
    """This machine is shared: waits (at most max_wait s) until the other
    processes use less than `threshold` cores, sampled over 2 s. Returns the
    last sample (busy cores while our benchmark was idle)."""
    deadline = time.monotonic() + max_wait
    while True:
        b0, t0 = machine_busy(), time.monotonic()
        time.sleep(2.0)
        busy = (machine_busy() - b0) / (time.monotonic() - t0)
        if busy < threshold or time.monotonic() >= deadline:
            if busy >= threshold:
                log(f"  machine still busy ({busy:.2f} cores used by others) after {max_wait:.0f} s; running anyway")
            return round(busy, 2)
        log(f"  waiting for a quieter machine: {busy:.2f} cores busy")


def cpu_snapshot():
    snap = {name: proc_cpu(pid) for name, pid in CLUSTER_PIDS.items()}
    ru = resource.getrusage(resource.RUSAGE_CHILDREN)
    snap["plugin processes"] = ru.ru_utime + ru.ru_stime
    if "pid" in AGENT:  # the node agent works for the plugins: its CPU counts as theirs
        snap["plugin processes"] += proc_cpu(AGENT["pid"]) or 0.0
    snap["machine"] = machine_busy()
    return snap


def cpu_delta(before, after):
    d = {k: round(after[k] - before[k], 2) for k in before
         if before.get(k) is not None and after.get(k) is not None}
    # Whatever the machine did besides the plugins and our control plane:
    # other users of this shared machine (and our kube-controller-manager).
    d["others"] = round(d["machine"] - sum(v for k, v in d.items() if k != "machine"), 2)
    return d


def kill_live():
    """Kills plugin processes still running (an interrupted run)."""
    for p in list(LIVE):
        if p.poll() is None:
            log(f"killing plugin process {p.pid}")
            try:
                p.kill()
            except ProcessLookupError:
                pass
            p.wait()
        LIVE.discard(p)


def run_scenario(kube, impl_key, kind, n, workroot, timeout, quiet):
    ranges = {"seq": [V4_SEQ], "conc-v4": [V4], "conc-ds": [V4, V6]}[kind]
    sc = Scenario(kube, impl_key, f"{kind}-{n}", ranges, workroot)
    log(f"{IMPLS[impl_key]['label']}: {kind} N={n} (namespace {sc.ns})")
    sc.setup()
    try:
        busy_before = wait_quiet(*quiet) if quiet else None
        api_before = api_requests(kube)
        cpu_before = cpu_snapshot()
        deadline = time.monotonic() + timeout
        t0 = time.monotonic()
        if kind == "seq":
            results, lat, extra = run_sequential(sc, n, deadline)
            extra = {"wall_s": time.monotonic() - t0}
        else:
            results, lat, extra = run_concurrent(sc, n, deadline)
        cpu = cpu_delta(cpu_before, cpu_snapshot())
        api = api_delta(api_before, api_requests(kube))
        check = sc.verify(results)
        rec = {
            "impl": impl_key,
            "label": IMPLS[impl_key]["label"],
            "scenario": kind,
            "n": n,
            "namespace": sc.ns,
            "ranges": ranges,
            "ok": sum(1 for r in results if r["error"] is None),
            "failures": sum(1 for r in results if r["error"] is not None),
            "timed_out": sum(1 for r in results if r["timed_out"]),
            "latency_ms": {
                "p50": pct(lat, 50), "p99": pct(lat, 99),
                "min": min(lat), "max": max(lat), "mean": statistics.mean(lat),
            } if lat else None,
            "latencies_ms": [round(x, 2) for x in lat],
            **extra,
            **api,
            "cpu_s": cpu,
            "others_busy_cores_before": busy_before,
            **check,
            **sc.retries(),
            "agent_served": sc.agent_served(),
            "errors": summarize_errors(results),
            "log_errors": sc.log_errors(),
        }
        rec["duplicates"] = rec["dup_results"] + rec["dup_pool"]
        log(f"  ok={rec['ok']} fail={rec['failures']} dup={rec['duplicates']} "
            f"missing={rec['missing_in_pool']}+{rec['missing_reservation']} "
            f"leaked={rec['leaked_in_pool']}/{rec['leaked_reservations']} "
            f"wall={rec['wall_s']:.2f}s p50={rec['latency_ms']['p50']:.0f}ms "
            f"p99={rec['latency_ms']['p99']:.0f}ms retries={rec['retries']} "
            f"api={rec['api_requests']} rejected={rec['api_rejected']} 5xx={rec['api_5xx']} "
            f"server-cas-retries={rec['server_cas_retries']} cpu={cpu}"
            + (f" agent-served={rec['agent_served']}" if rec["agent_served"] is not None else ""))
        for e in rec["errors"]:
            log(f"  error x{e['count']}: {e['example']}")
        for line in rec["log_errors"]:
            log(f"  log: {line}")
        return rec
    finally:
        kill_live()
        sc.teardown()


# ----------------------------------------------------------------- reporting


def scenario_title(kind):
    return {"seq": "sequential, IPv4 /16", "conc-v4": "concurrent, IPv4 /24",
            "conc-ds": "concurrent, dual-stack /24 + /64"}[kind]


def aggregate(records):
    """Groups the runs of one (implementation, scenario, N): counts are summed
    over the runs, wall time is the median run, latencies are pooled."""
    groups = {}
    for r in records:
        groups.setdefault((r["impl"], r["scenario"], r["n"]), []).append(r)
    rows = []
    for (impl, kind, n), runs in groups.items():
        walls = [r["wall_s"] for r in runs]
        lat = [x for r in runs for x in r["latencies_ms"]]
        row = {
            "impl": impl, "label": runs[0]["label"], "scenario": kind, "n": n,
            "runs": len(runs),
            "wall_s_median": statistics.median(walls),
            "wall_s_min": min(walls), "wall_s_max": max(walls),
            "latency_ms_p50": pct(lat, 50) if lat else None,
            "latency_ms_p99": pct(lat, 99) if lat else None,
            "latency_ms_max": max(lat) if lat else None,
            "retries_per_run": [r["retries"] for r in runs],
            "api_requests_per_run": [r["api_requests"] for r in runs],
            "api_rejected_per_run": [r["api_rejected"] for r in runs],
            "api_5xx": sum(r["api_5xx"] for r in runs),
            "server_cas_retries_per_run": [server_cas_retries(r["api_by_resource_verb_code"])
                                           for r in runs],
            "cpu_s_per_run": {k: statistics.mean(r["cpu_s"].get(k, 0) for r in runs)
                              for k in runs[0]["cpu_s"]},
        }
        for r in runs:
            # Older result files: every reservation not backing a returned address.
            r.setdefault("leaked_reservations", r["reservations"] - r["ok"] * len(r["ranges"]))
        for k in ("ok", "failures", "timed_out", "duplicates", "missing_in_pool",
                  "leaked_in_pool", "missing_reservation", "leaked_reservations"):
            row[k] = sum(r[k] for r in runs)
        if impl == "upstream":
            row["leader_timeouts"] = sum(r.get("leader_timeouts", 0) for r in runs)
        rows.append(row)
    return rows


def fmt_retries(row):
    per = row["retries_per_run"]
    s = "/".join(str(x) for x in per)
    if row["impl"] == "upstream":
        s += " pool-update retries"
        if row.get("leader_timeouts"):
            s += f"; {row['leader_timeouts']} leader-election timeouts"
    return s


def fmt_wall(row):
    if row["runs"] == 1:
        return f"{row['wall_s_median']:.2f}"
    return f"{row['wall_s_median']:.2f} ({row['wall_s_min']:.2f}–{row['wall_s_max']:.2f})"


def markdown(records):
    rows = aggregate(records)
    lines = [
        "| implementation | scenario | N | runs | ok | failed | duplicates | missing in pool "
        "| leaked pool entries / reservations | wall s, median (min–max) | per-ADD p50 ms | p99 ms | max ms "
        "| conflict retries per run |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['label']} | {scenario_title(r['scenario'])} | {r['n']} | {r['runs']} | {r['ok']} "
            f"| {r['failures']} | {r['duplicates']} | {r['missing_in_pool'] + r['missing_reservation']} "
            f"| {r['leaked_in_pool']} / {r['leaked_reservations']} "
            f"| {fmt_wall(r)} | {r['latency_ms_p50']:.1f} | {r['latency_ms_p99']:.1f} "
            f"| {r['latency_ms_max']:.1f} | {fmt_retries(r)} |")
    lines += ["", "| implementation | scenario | N | API requests per run | rejected (409/422/429) "
                  "| 5xx | pool writes the API server retried internally | CPU s per run: plugins / kube-apiserver / etcd / rest of the machine |",
              "|---|---|---:|---:|---:|---:|---:|---|"]
    for r in rows:
        c = r["cpu_s_per_run"]
        cpu = " / ".join(f"{c[k]:.1f}" if k in c else "?" for k in
                         ("plugin processes", "kube-apiserver", "etcd", "others"))
        lines.append(f"| {r['label']} | {scenario_title(r['scenario'])} | {r['n']} "
                     f"| {'/'.join(map(str, r['api_requests_per_run']))} "
                     f"| {'/'.join(map(str, r['api_rejected_per_run']))} | {r['api_5xx']} "
                     f"| {'/'.join('n/a' if x is None else str(x) for x in r['server_cas_retries_per_run'])} "
                     f"| {cpu} |")
    # Side by side, ratio upstream / ours. Sequential: per-ADD p50 latency;
    # concurrent: wall time from the first spawn to the last exit.
    by = {}
    for r in rows:
        by.setdefault((r["scenario"], r["n"]), {})[r["impl"]] = r
    present = [k for k in IMPLS if any(r["impl"] == k for r in rows)]
    label = {r["impl"]: r["label"] for r in rows}  # as run (--baseline may rename)
    ours = [k for k in present if k != "upstream"]
    lines += ["", "| scenario | N | metric | " + " | ".join(label[k] for k in present)
              + "".join(f" | upstream / {label[k]}" for k in ours if "upstream" in present)
              + " | failed (" + " / ".join(label[k] for k in present) + ") |",
              "|---|---:|---|" + "---:|" * len(present)
              + "---:|" * (len(ours) if "upstream" in present else 0) + "---|"]
    for (kind, n), d in by.items():
        fld, metric, unit = (("latency_ms_p50", "p50 ADD latency", "ms") if kind == "seq"
                             else ("wall_s_median", "wall time", "s"))

        def cell(k):
            return f"{d[k][fld]:.2f} {unit}" if k in d else "–"

        def ratio(a, b):
            if a in d and b in d and d[b][fld] > 0:
                return f"{d[a][fld] / d[b][fld]:.1f}x"
            return "–"

        failed = " / ".join(str(d[k]["failures"]) if k in d else "–" for k in present)
        ratios = "".join(f" | {ratio('upstream', k)}" for k in ours if "upstream" in present)
        lines.append(f"| {scenario_title(kind)} | {n} | {metric} | "
                     + " | ".join(cell(k) for k in present) + f"{ratios} | {failed} |")
    return "\n".join(lines)


def ours_source(sh):
    """Which commit our binary was built from: bench/build.sh --from-head
    leaves BINARY.commit next to it; otherwise the work tree's HEAD."""
    stamp = Path(str(IMPLS["ours"]["binary"]) + ".commit")
    if stamp.exists():
        return {"git_commit": stamp.read_text().strip(), "git_dirty": False,
                "ours_built_from": "git archive of that commit"}
    return {"git_commit": sh("git", "rev-parse", "--short", "HEAD"),
            "git_dirty": bool(sh("git", "status", "--porcelain", "--untracked-files=no", "src")),
            "ours_built_from": "work tree"}


def environment(kube):
    def sh(*cmd):
        try:
            return subprocess.run(cmd, capture_output=True, text=True, timeout=60,
                                  cwd=ROOT).stdout.strip()
        except (OSError, subprocess.TimeoutExpired):
            return ""
    cpu = ""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    mem = ""
    try:
        kb = int(Path("/proc/meminfo").read_text().split("\n")[0].split()[1])
        mem = f"{kb / 1024 / 1024:.1f} GiB"
    except (OSError, ValueError, IndexError):
        pass
    upstream_version = ""
    if shutil.which("go") and IMPLS["upstream"]["binary"].exists():
        for line in sh("go", "version", "-m", str(IMPLS["upstream"]["binary"])).splitlines():
            parts = line.split()
            if len(parts) >= 3 and parts[0] in ("mod", "dep") and parts[1] == "github.com/k8snetworkplumbingwg/whereabouts":
                upstream_version = parts[2]
    kv = kube.run("version", "-o", "json", check=False).stdout
    try:
        kv = json.loads(kv)
        kver = {"client": kv.get("clientVersion", {}).get("gitVersion"),
                "server": kv.get("serverVersion", {}).get("gitVersion")}
    except ValueError:
        kver = {}
    return {
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
        "nproc": os.cpu_count(),
        "cpu": cpu,
        "memory": mem,
        "kernel": platform.release(),
        "python": platform.python_version(),
        **ours_source(sh),
        "upstream_module_version": upstream_version,
        "kubernetes": kver,
    }


# ---------------------------------------------------------------------- main


ORIG_AUTOGROUP_NICE = {}


def set_nice(value):
    """Gives this process (the plugins inherit it), our kube-apiserver and our
    etcd the nice value `value`. With autogroup scheduling (Linux default;
    /proc/sys/kernel/sched_autogroup_enabled) CPU is first shared between
    sessions, so the session's autogroup nice is what counts; the per-thread
    nice is set too for kernels without autogroup. None restores what was
    there before (per-thread nice back to 0)."""
    for name, pid in [("this process", os.getpid()), *CLUSTER_PIDS.items()]:
        n = 0
        for tid in os.listdir(f"/proc/{pid}/task"):
            try:
                os.setpriority(os.PRIO_PROCESS, int(tid), 0 if value is None else value)
                n += 1
            except OSError:
                pass
        group = ""
        try:
            ag = Path(f"/proc/{pid}/autogroup")
            if value is None:  # restore
                value_here = ORIG_AUTOGROUP_NICE.get(pid, 0)
            else:
                m = re.search(r"nice (-?\d+)", ag.read_text())
                ORIG_AUTOGROUP_NICE.setdefault(pid, int(m.group(1)) if m else 0)
                value_here = value
            ag.write_text(str(value_here))
            group = Path(f"/proc/{pid}/autogroup").read_text().strip()
        except OSError:
            pass
        log(f"nice {'restored' if value is None else value}: {name} ({n} threads; {group or 'no autogroup'})")


def cluster(cmd, state):
    env = dict(os.environ, WHEREABOUTS_E2E_STATE=state)
    r = subprocess.run([str(CLUSTER_SH), cmd], env=env, stdout=subprocess.PIPE, text=True,
                       timeout=900)
    if r.returncode != 0:
        raise RuntimeError(f"e2e/cluster.sh {cmd} failed (rc={r.returncode})")
    return r.stdout.strip().splitlines()[-1] if r.stdout.strip() else ""


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--kubeconfig", help="use this cluster instead of starting one with e2e/cluster.sh")
    ap.add_argument("--state", default=STATE_DEFAULT,
                    help=f"WHEREABOUTS_E2E_STATE for e2e/cluster.sh (default {STATE_DEFAULT})")
    ap.add_argument("--keep-cluster", action="store_true", help="do not stop the cluster we started")
    ap.add_argument("--kubectl", default=str(KUBECTL_DEFAULT))
    ap.add_argument("--impls", default="ours,upstream")
    ap.add_argument("--ours", help="path of our binary (default target/release/whereabouts)")
    ap.add_argument("--upstream", help="path of upstream's binary (default bench/bin/whereabouts-upstream)")
    ap.add_argument("--baseline", metavar="PATH[=LABEL]",
                    help="an earlier build of our plugin, run as implementation ours-baseline")
    ap.add_argument("--operator", help="path of our operator binary, for ours-agent "
                                       "(default target/release/whereabouts-operator)")
    ap.add_argument("--baseline-operator", metavar="PATH[=LABEL]",
                    help="the operator binary of the --baseline build: runs implementation "
                         "ours-agent-baseline (the baseline plugin with its own node agent)")
    ap.add_argument("--seq", type=int, default=100, help="sequential ADDs (default 100; 0 skips)")
    ap.add_argument("--concurrency", default="50,100,200")
    ap.add_argument("--scenarios", default="seq,conc-v4,conc-ds")
    ap.add_argument("--repeat", type=int, default=1,
                    help="runs of every scenario for ours (default 1)")
    ap.add_argument("--upstream-repeat", type=int, default=1,
                    help="runs of every scenario for upstream (default 1: it is slow)")
    ap.add_argument("--timeout", type=float, default=300.0, help="deadline per scenario, s")
    ap.add_argument("--quiet-wait", type=float, default=30.0,
                    help="before each run wait at most this long (s) for the machine to be quiet; 0 = never wait")
    ap.add_argument("--quiet-cores", type=float, default=0.3,
                    help="'quiet' = other processes use fewer cores than this (default 0.3)")
    ap.add_argument("--nice", type=int, default=0,
                    help="run the plugins, kube-apiserver and etcd at this nice value (e.g. -10, needs root) "
                         "so that other work on a shared machine disturbs the measurement less")
    ap.add_argument("--out", default=str(BENCH / "results"))
    ap.add_argument("--render", metavar="RESULTS_JSON",
                    help="only print the tables of an earlier run's JSON")
    args = ap.parse_args()
    if args.render:
        print(markdown(json.loads(Path(args.render).read_text())["results"]))
        return

    if args.ours:
        IMPLS["ours"]["binary"] = Path(args.ours).resolve()
        IMPLS["ours-agent"]["binary"] = Path(args.ours).resolve()
    if args.baseline:
        path, _, label = args.baseline.partition("=")
        IMPLS["ours-baseline"]["binary"] = Path(path).resolve()
        if label:
            IMPLS["ours-baseline"]["label"] = label
    if args.operator:
        IMPLS["ours-agent"]["agent"] = Path(args.operator).resolve()
    if args.baseline_operator:
        if not args.baseline:
            sys.exit("--baseline-operator needs --baseline (the plugin of the same build)")
        path, _, label = args.baseline_operator.partition("=")
        IMPLS["ours-agent-baseline"]["agent"] = Path(path).resolve()
        IMPLS["ours-agent-baseline"]["binary"] = IMPLS["ours-baseline"]["binary"]
        if label:
            IMPLS["ours-agent-baseline"]["label"] = label
    if args.upstream:
        IMPLS["upstream"]["binary"] = Path(args.upstream).resolve()
    impls = [s for s in args.impls.split(",") if s]
    for k in impls:
        if k not in IMPLS:
            sys.exit(f"unknown implementation {k!r}; known: {', '.join(IMPLS)}")
        if IMPLS[k]["binary"] is None or not IMPLS[k]["binary"].exists():
            sys.exit(f"{k}: binary {IMPLS[k]['binary']} not found (see bench/README.md)")
    kinds = [s for s in args.scenarios.split(",") if s]
    ns_conc = [int(x) for x in args.concurrency.split(",") if x]

    started = False
    kubeconfig = args.kubeconfig
    if not kubeconfig:
        log(f"starting the control plane: WHEREABOUTS_E2E_STATE={args.state} e2e/cluster.sh up")
        kubeconfig = cluster("up", args.state)
        started = True
    kube = Kube(args.kubectl, kubeconfig)
    for comp in ("kube-apiserver", "etcd"):
        pidfile = Path(args.state) / f"{comp}.pid"
        if pidfile.exists() and Path(os.path.realpath(kubeconfig)).parent == Path(args.state):
            CLUSTER_PIDS[comp] = int(pidfile.read_text().strip())
    if args.nice:
        set_nice(args.nice)
    workroot = tempfile.mkdtemp(prefix="wa-bench-")
    records = []
    env = {}
    try:
        kube.run("apply", "-f", str(ROOT / "crds"))
        kube.run("wait", "--for=condition=Established", "--timeout=60s",
                 "crd/ippools.whereabouts.cni.cncf.io",
                 "crd/overlappingrangeipreservations.whereabouts.cni.cncf.io")
        env = environment(kube)
        env["nice"] = args.nice
        log(f"environment: {json.dumps(env)}")
        # Scenario-major order, implementations interleaved within a
        # repetition, so slow drift of the machine hits all of them alike.
        plan = []
        for kind in kinds:
            sizes = ([args.seq] if args.seq > 0 else []) if kind == "seq" else ns_conc
            for n in sizes:
                for rep in range(max(args.repeat, args.upstream_repeat)):
                    for k in impls:
                        reps = args.upstream_repeat if k == "upstream" else args.repeat
                        if rep < reps:
                            plan.append((k, kind, n))
        log(f"{len(plan)} runs planned")
        t_all = time.monotonic()
        for k, kind, n in plan:
            records.append(run_scenario(kube, k, kind, n, workroot, args.timeout,
                                        (args.quiet_wait, args.quiet_cores) if args.quiet_wait > 0 else None))
        env["total_runtime_s"] = time.monotonic() - t_all
    except BaseException:
        kill_live()
        raise
    finally:
        if records:
            out = Path(args.out)
            out.mkdir(parents=True, exist_ok=True)
            stamp = datetime.datetime.now(datetime.timezone.utc).strftime("%Y%m%dT%H%M%SZ")
            path = out / f"cni-{stamp}.json"
            doc = {"environment": env, "workdir": workroot, "args": vars(args),
                   "summary": aggregate(records), "results": records}
            path.write_text(json.dumps(doc, indent=2))
            (out / "cni-latest.json").write_text(json.dumps(doc, indent=2))
            log(f"wrote {path} (per-process outputs and plugin logs kept in {workroot})")
            print(markdown(records))
        if args.nice:
            set_nice(None)  # the control plane may outlive us (--kubeconfig, --keep-cluster)
        if started and not args.keep_cluster:
            log("stopping the control plane")
            cluster("down", args.state)


if __name__ == "__main__":
    main()
