#!/usr/bin/env python3
"""The chaos tier: rounds of ADD and DEL bursts from a mixed fleet, with faults injected, and the
invariants checked after every round. See e2e/chaos/README.md; figures in docs/reliability.md.

One round, on one dual-stack network (one IPv4 and one IPv6 pool); with --overlap also on a second
network whose IPv4 range overlaps the first's (its own NAD and pool, the same addresses); with
--shared-name every NAD names one `network_name`, and a third NAD shares the first's pools:
  * new Pod objects are created, and each gets an ADD from a fleet member picked at random: our
    plugin through the node agent, our plugin on its own, or upstream's v0.9.2 plugin;
  * at the same time about half of the live pods go away: most with a DEL and then the Pod
    delete, some with only the Pod delete (a node that vanished), which the operator must clean;
  * faults during the burst: kill -9 of random plugin processes mid-call, of the node agent
    (restarted at once), of the operator leader (a standby takes over, a new standby starts), and
    one API-side fault (API server crash-restart, etcd crash-restart or restart, API server paused);
  * the runtime behaves as the CNI spec says: a failed ADD is followed by DEL, a DEL is retried
    until it succeeds, and the sandbox is retried with a new container id (3 tries, then the pod
    is deleted).
Then the invariants: no address held by two live attachments (pool entries and overlapping-range
reservations), nor by two attachments at any moment of the burst (ledger.py), every live
attachment's addresses present in the pool and reserved; after the operator converges, no pool
entry and no reservation without its live attachment.

Python standard library only.
"""

import argparse
import datetime
import ipaddress
import json
import os
import random
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from history import History  # noqa: E402
from invariants import check_round, panics  # noqa: E402
from ledger import Ledger, selftest  # noqa: E402
from kube import Kube  # noqa: E402
from report import summary, violation_list  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
CLUSTER_SH = ROOT / "e2e" / "cluster.sh"
KUBECTL = ROOT / "e2e" / "bin" / "kubectl"
RELEASE = ROOT / "target" / "x86_64-unknown-linux-musl" / "release"
NAD_API = "/apis/k8s.cni.cncf.io/v1"
NETWORK = "chaosnet"
IFNAME = "net1"
V4, V6 = "10.77.0.0/22", "fd00:77::/64"
# A second network over part of the first one's IPv4 range (another NAD, another pool, the same
# addresses): only the overlapping-range reservations keep the two pools from handing an address
# out twice, with upstream's plugin in the fleet too.
NETWORK_B, V4_B = "chaosnet-b", "10.77.0.0/23"
NETWORK_B_SHARE = 0.3  # share of new pods attached to it
# Upstream's plugin attaches only to the first network. Even there, with the second network's
# claims among the lowest addresses, upstream's v0.9.2 retries each reserved address in turn
# (`IPAM error updating pool (attempt: 28)`), runs into its own deadlines and past HANG_S: so the
# second network is opt-in (--overlap), not part of the smoke run. Its pods are ours only.
NETWORK_B_MEMBERS = ("agent", "direct")
# With --shared-name: one `network_name` in every NAD (pools and reservations are named after it),
# and a third NAD of the same ranges as the first, so two NADs write the same pools and the
# operator must map both NADs' pods (network-status) to them.
SHARED_NAME, NETWORK_C = "chaosshared", "chaosnet-c"
NETWORK_C_SHARE = 0.3
RANGES = {NETWORK: [V4, V6], NETWORK_B: [V4_B], NETWORK_C: [V4, V6]}
MEMBERS = ("agent", "direct", "upstream")
API_FAULTS = ("apiserver-crash", "etcd-crash", "etcd-restart", "apiserver-pause")

ADD_TRIES = 3  # sandbox attempts before the pod is given up (deleted)
# A share of the pods that go with a DEL are evicted first (what `kubectl drain` and the
# autoscaler do): bound to EVICTION_NODE, evicted with a grace period, and DELed only after
# EVICTION_GRACE_S: in between their containers run and the operator must keep their addresses
# (the ledger would see a duplicate). EVICTION_NODE is a Node object kept Ready by the driver
# (its Lease and Ready condition renewed every few seconds, as a kubelet does), as a drained
# node is: PodGC would fail and delete at once the pods of a node that has no object, freeing
# their addresses before the driver's DEL, and a NotReady node makes the operator hold a
# force-deleted pod's addresses until it is Ready again (upstream's DEL reports success even when
# it removed nothing, so such a pod would hold them for good). On a Ready node the operator frees
# what the DEL left once DELETED_POD_GRACE has passed.
EVICT_SHARE = 0.25
EVICTION_GRACE_S = (1.0, 4.0)
EVICTION_NODE = "chaos-node"
NODE_HEARTBEAT_S = 5
DELETED_POD_GRACE = "5s"  # the operator's, shortened as its audit is
PLUGIN_KILL_P = 0.08  # share of plugin processes killed mid-call
HANG_S = 150  # a plugin call running longer than this is a hang (a violation)
DEL_RETRY_S = 180  # a DEL not done by then is stuck (a violation)
AUDIT_INTERVAL, STALE_GRACE = "2s", "5s"  # the operator's, shortened for the test
# The youngest orphan claim the operator sweeps: shortened too, so that a killed plugin's claim is
# gone within CONVERGE_S, but still above the longest an ADD of this tier holds a claim unrecorded
# (API pauses of at most 6 s, restarts of seconds); the default is 3 minutes.
ORPHAN_CLAIM_AGE = "45s"


LOG_FILE = []  # the run's chaos.log, once its folder exists


def log(msg):
    line = f"[chaos] {msg}"
    print(line, file=sys.stderr, flush=True)
    if LOG_FILE:
        with open(LOG_FILE[0], "a") as f:
            f.write(line + "\n")


class Counter:
    """Thread-safe counts by key."""

    def __init__(self):
        self.lock = threading.Lock()
        self.counts = {}
        self.times = {}
        self.details = []  # what each violation was, for the report's tail

    def violation(self, kind, detail, n=1):
        """Counts a violation of `kind` and keeps what it was: the report ends with these, so
        that a failed run says why in the last lines a CI log shows."""
        log(f"VIOLATION {kind}: {detail}")
        with self.lock:
            self.counts[f"violation:{kind}"] = self.counts.get(f"violation:{kind}", 0) + n
            self.details.append(f"{kind}: {detail}")

    def add(self, key, n=1):
        with self.lock:
            self.counts[key] = self.counts.get(key, 0) + n

    def snapshot(self):
        with self.lock:
            return dict(self.counts)

    def time(self, key, seconds):
        with self.lock:
            self.times.setdefault(key, []).append(seconds)

    def latencies(self):
        """p50 and max seconds of each kind of call."""
        with self.lock:
            return {k: {"n": len(v), "p50": round(sorted(v)[len(v) // 2], 2),
                        "max": round(max(v), 2)} for k, v in sorted(self.times.items())}


class Fleet:
    """The namespace, the network, the node agent, two operator replicas and the plugins."""

    def __init__(self, kube, args, work):
        self.kube, self.args, self.work = kube, args, work
        self.ns = f"chaos-{args.seed}-{int(time.time()) % 100000}"
        self.kubeconfig = work / "kubeconfig"
        self.socket = work / "agent.sock"
        self.agent = None
        self.agent_starts = 0
        self.operators = {}  # identity -> Popen
        self.operator_starts = 0
        self.live_procs = {}  # id -> (Popen, member, command)
        self.procs_lock = threading.Lock()
        self.netconf = {}
        self.history = None
        self.ledger = Ledger()  # every attachment's span, for duplicates within a burst
        self.stopping = threading.Event()
        self.heartbeat = threading.Thread(target=self.heartbeats, daemon=True)

    # ---- setup

    def setup(self):
        self.kube.ok("POST", "/api/v1/namespaces", {"metadata": {"name": self.ns}})
        self.kube.ok("POST", "/api/v1/nodes", {"metadata": {"name": EVICTION_NODE}}, allow=(409,))
        self.heartbeat_once()
        self.heartbeat.start()
        deadline = time.monotonic() + 60
        while self.kube.call("GET", f"/api/v1/namespaces/{self.ns}/serviceaccounts/default")[0] != 200:
            if time.monotonic() > deadline:
                raise RuntimeError("ServiceAccount default was not created")
            time.sleep(0.2)
        subprocess.run(["cp", self.args.kubeconfig, str(self.kubeconfig)], check=True)
        # Every version of the pools and reservations, for the post-mortem of a violation
        # (e2e/chaos/history.py WORK ADDRESS).
        self.history = History(KUBECTL, self.args.kubeconfig, self.ns, self.work)
        self.history.start()
        subprocess.run([str(KUBECTL), "--kubeconfig", str(self.kubeconfig), "config",
                        "set-context", "--current", f"--namespace={self.ns}"],
                       check=True, capture_output=True)
        for member in MEMBERS:
            # The node's flat file decides where the plugin logs (ours ignores a network
            # config's log_file; upstream reads it from the flat file as well).
            flat = {"kubernetes": {"kubeconfig": str(self.kubeconfig)},
                    "log_file": str(self.work / f"{member}-plugin.log")}
            if member == "agent":
                flat["agent_socket"] = str(self.socket)
            elif member == "direct":
                flat["agent_socket"] = ""
            if member != "upstream":
                # Each member is a node of its own: its own bound on plugins at work.
                flat["plugin_slots_dir"] = str(self.work / f"{member}-slots")
            (self.work / f"{member}.conf").write_text(json.dumps(flat))
        networks = [NETWORK] + [NETWORK_B] * self.args.overlap + [NETWORK_C] * self.args.shared_name
        for network in networks:
            ranges = {"ipRanges": [{"range": c} for c in RANGES[network]]}
            if self.args.shared_name:
                ranges["network_name"] = SHARED_NAME
            for member in MEMBERS:
                ipam = {"type": "whereabouts",
                        "configuration_path": str(self.work / f"{member}.conf"),
                        "log_level": "verbose", **ranges}
                self.netconf[(member, network)] = json.dumps(
                    {"cniVersion": "1.0.0", "name": network, "type": "macvlan", "ipam": ipam})
            nad_ipam = {"type": "whereabouts", **ranges}
            nad = {"cniVersion": "1.0.0", "name": network, "type": "macvlan", "ipam": nad_ipam}
            self.kube.ok("POST", f"{NAD_API}/namespaces/{self.ns}/network-attachment-definitions",
                         {"apiVersion": "k8s.cni.cncf.io/v1", "kind": "NetworkAttachmentDefinition",
                          "metadata": {"name": network}, "spec": {"config": json.dumps(nad)}})
        self.start_agent()
        for _ in range(2):
            self.start_operator()

    def heartbeat_once(self):
        """What a kubelet does for its node: renews its Lease and reports it Ready."""
        now = datetime.datetime.now(datetime.timezone.utc)
        stamp = now.strftime("%Y-%m-%dT%H:%M:%SZ")
        lease = f"/apis/coordination.k8s.io/v1/namespaces/kube-node-lease/leases/{EVICTION_NODE}"
        spec = {"holderIdentity": EVICTION_NODE, "leaseDurationSeconds": 40,
                "renewTime": now.strftime("%Y-%m-%dT%H:%M:%S.%fZ")}
        status, _ = self.kube.call("PATCH", lease, {"spec": spec},
                                   content_type="application/merge-patch+json", deadline_s=5)
        if status == 404:
            self.kube.call("POST", lease.rsplit("/", 1)[0], {
                "metadata": {"name": EVICTION_NODE}, "spec": spec}, deadline_s=5)
        ready = {"type": "Ready", "status": "True", "reason": "KubeletReady",
                 "lastHeartbeatTime": stamp, "lastTransitionTime": stamp}
        self.kube.call("PATCH", f"/api/v1/nodes/{EVICTION_NODE}/status",
                       {"status": {"conditions": [ready]}},
                       content_type="application/strategic-merge-patch+json", deadline_s=5)

    def heartbeats(self):
        while not self.stopping.wait(NODE_HEARTBEAT_S):
            try:
                self.heartbeat_once()
            except Exception as e:  # noqa: BLE001 - an API fault; the next beat tries again
                log(f"node heartbeat failed: {e}")

    def start_agent(self):
        self.agent_starts += 1
        out = open(self.work / "agent.log", "ab")
        self.agent = subprocess.Popen(
            [str(self.args.operator), "agent", "--socket", str(self.socket),
             "--admin-addr", "127.0.0.1:0",
             "--kubeconfig", str(self.kubeconfig), "--serves-kubeconfig", str(self.kubeconfig)],
            stdout=out, stderr=out, env={**os.environ, "RUST_LOG": "info"})
        out.close()
        deadline = time.monotonic() + 20
        while not self.socket.exists():
            if self.agent.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError("the node agent did not start: see agent.log")
            time.sleep(0.02)

    def start_operator(self):
        self.operator_starts += 1
        ident = f"op-{self.operator_starts}"
        out = open(self.work / f"{ident}.log", "ab")
        self.operators[ident] = subprocess.Popen(
            [str(self.args.operator), "run", "--admin-addr=127.0.0.1:0",
             f"--pool-namespace={self.ns}", "--leader-election=true",
             f"--audit-interval={AUDIT_INTERVAL}", f"--stale-grace={STALE_GRACE}",
             f"--orphan-claim-age={ORPHAN_CLAIM_AGE}",
             f"--deleted-pod-grace={DELETED_POD_GRACE}"],
            stdout=out, stderr=out,
            env={**os.environ, "KUBECONFIG": self.args.kubeconfig, "POD_NAME": ident,
                 "RUST_LOG": "info"})
        out.close()

    def teardown(self):
        self.stopping.set()
        if self.history is not None:
            self.history.stop()
        for p in [self.agent, *self.operators.values()]:
            if p is not None and p.poll() is None:
                p.terminate()
                try:
                    p.wait(timeout=30)
                except subprocess.TimeoutExpired:
                    p.kill()

    # ---- faults on our own processes

    def kill_agent(self):
        self.agent.kill()
        self.agent.wait()
        self.start_agent()

    def leader(self):
        """The identity in the operators' Lease, if the API answers."""
        status, lease = self.kube.call(
            "GET", f"/apis/coordination.k8s.io/v1/namespaces/{self.ns}/leases/whereabouts-operator")
        return (lease or {}).get("spec", {}).get("holderIdentity") if status == 200 else None

    def live_leader(self, timeout):
        """The running replica that holds the Lease, waiting up to `timeout` s for one."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            holder = self.leader()
            proc = self.operators.get(holder)
            if proc is not None and proc.poll() is None:
                return holder
            time.sleep(0.2)
        return None

    def kill_leader(self):
        """kill -9 of the replica holding the Lease; a new standby starts (as a Deployment's).
        Returns the seconds until a surviving replica held the Lease, or None."""
        holder = self.live_leader(60)
        if holder is None:
            return None
        proc = self.operators.pop(holder)
        proc.kill()
        proc.wait()
        killed = time.monotonic()
        self.start_operator()
        if self.live_leader(120) is None:
            return None
        return time.monotonic() - killed

    # ---- plugins

    def plugin(self, member, command, pod, container_id, kill_after, counts):
        """Runs one CNI call; returns (rc, stdout, stderr, killed_by_us)."""
        binary = self.args.upstream if member == "upstream" else self.args.plugin
        env = {
            "PATH": "/usr/bin:/bin", "CNI_COMMAND": command, "CNI_CONTAINERID": container_id,
            "CNI_NETNS": f"/var/run/netns/{pod['name']}", "CNI_IFNAME": IFNAME,
            "CNI_PATH": "/opt/cni/bin",
            # The node's whereabouts directory: the flat files' (a network config may name
            # files there only).
            "WHEREABOUTS_CONF_DIR": str(self.work),
            "CNI_ARGS": f"IgnoreUnknown=1;K8S_POD_NAMESPACE={self.ns};K8S_POD_NAME={pod['name']};"
                        f"K8S_POD_UID={pod['uid']};K8S_POD_INFRA_CONTAINER_ID={container_id}",
        }
        started = time.monotonic()
        p = subprocess.Popen([str(binary)], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, env=env)
        killed = threading.Event()
        timer = None
        if kill_after is not None:
            def kill():
                if p.poll() is None:
                    killed.set()
                    p.kill()
            timer = threading.Timer(kill_after, kill)
            timer.start()
        try:
            conf = self.netconf[(member, pod.get("net", NETWORK))]
            out, err = p.communicate(conf.encode(), timeout=HANG_S)
        except subprocess.TimeoutExpired:
            p.kill()
            out, err = p.communicate()
            counts.violation("hang", f"{member} {command} {pod['name']} {container_id} ran over {HANG_S} s")
        finally:
            if timer is not None:
                timer.cancel()
        counts.time(f"{member}:{command}:{'ok' if p.returncode == 0 else 'failed'}",
                    time.monotonic() - started)
        err = err.decode(errors="replace")
        if "panicked at" in err:
            counts.violation("panic", f"{member} {command}: {err[-800:]}")
        if killed.is_set() and p.returncode == -signal.SIGKILL:
            counts.add(f"fault:plugin-kill:{member}:{command}")
            return p.returncode, b"", err, True
        return p.returncode, out, err, False


class Round:
    """One burst: new pods attached, old ones detached, faults, then the checks."""

    def __init__(self, fleet, number, seed, live, counts):
        self.fleet, self.number = fleet, number
        # Decisions made before the burst come from one generator; each workflow thread gets its
        # own, so the decisions of a seed do not depend on thread scheduling.
        self.base = f"{seed}-{number}"
        self.rng = random.Random(self.base)
        self.live = live  # pod name -> attachment dict, shared across rounds
        self.counts = counts
        self.lock = threading.Lock()
        self.takeovers = []  # seconds from the leader's kill to a survivor holding the Lease

    def member(self, rng=None, network=NETWORK):
        members = NETWORK_B_MEMBERS if network == NETWORK_B else MEMBERS
        return (rng or self.rng).choice(members)

    def rng_for(self, name):
        return random.Random(f"{self.base}-{name}")

    def kill_after(self, rng=None):
        rng = rng or self.rng
        if rng.random() < PLUGIN_KILL_P:
            return rng.uniform(0.005, 0.4)
        return None

    # ---- the runtime's side of the CNI spec

    def attach(self, pod, member, plans):
        """ADD, with DEL after every failed ADD and a new sandbox up to ADD_TRIES times."""
        for attempt, kill_after in enumerate(plans):
            cid = f"c{self.number}-{pod['name']}-{attempt}"
            self.counts.add("op:add")
            rc, out, err, killed = self.fleet.plugin(member, "ADD", pod, cid, kill_after,
                                                      self.counts)
            if rc == 0:
                try:
                    ips = [str(ipaddress.ip_interface(i["address"]).ip)
                           for i in json.loads(out)["ips"]]
                except (ValueError, KeyError) as e:
                    self.counts.violation("bad-result", f"ADD from {member}: {e}: {out[:300]!r}")
                    ips = []
                if len(ips) == len(RANGES[pod.get("net", NETWORK)]):
                    self.fleet.ledger.added(pod["name"], cid, ips)
                    with self.lock:
                        self.live[pod["name"]] = {**pod, "cid": cid, "member": member, "ips": ips}
                    self.annotate(pod, ips)
                    return
                self.counts.violation("bad-result", f"ADD from {member} gave {ips} for "
                                      f"{pod['name']} {cid}")
            elif not killed:
                self.counts.add(f"add-failed:{member}:{error_kind(out, err)}")
            self.detach_cni(pod, member, cid)
        self.counts.add("pods-given-up")
        self.delete_pod(pod)

    def detach_cni(self, pod, member, cid):
        """DEL until it succeeds (the runtime never gives up on a DEL)."""
        rng = self.rng_for(f"{cid}-del")
        deadline = time.monotonic() + DEL_RETRY_S
        delay = 0.2
        while True:
            self.counts.add("op:del")
            rc, out, err, killed = self.fleet.plugin(member, "DEL", pod, cid,
                                                      self.kill_after(rng), self.counts)
            if rc == 0:
                return
            if not killed:
                self.counts.add(f"del-failed:{member}:{error_kind(out, err)}")
            if time.monotonic() > deadline:
                self.counts.violation("stuck-del", f"{member} {pod['name']} {cid} after "
                                      f"{DEL_RETRY_S} s: {out[:300]!r} {err[-300:]}")
                return
            time.sleep(delay)
            delay = min(delay * 2, 3.0)

    def detach(self, att, with_del, member):
        if with_del and self.rng_for(f"{att['name']}-evict").random() < EVICT_SHARE:
            self.evict(att)
        self.fleet.ledger.releasing(att["name"], att["cid"])
        if with_del:
            self.detach_cni(att, member, att["cid"])
        else:
            self.counts.add("pods-vanished")
        self.delete_pod(att)

    def evict(self, att):
        """A graceful eviction through the Eviction API, then the grace period during which the
        pod's containers still run (its DEL comes after)."""
        pods = f"/api/v1/namespaces/{self.fleet.ns}/pods/{att['name']}"
        # (409: bound in an earlier round's try, whose eviction failed.)
        self.fleet.kube.ok("POST", f"{pods}/binding", {
            "apiVersion": "v1", "kind": "Binding", "metadata": {"name": att["name"]},
            "target": {"apiVersion": "v1", "kind": "Node", "name": EVICTION_NODE}}, allow=(409,))
        self.fleet.kube.ok("POST", f"{pods}/eviction", {
            "apiVersion": "policy/v1", "kind": "Eviction",
            "metadata": {"name": att["name"], "namespace": self.fleet.ns},
            "deleteOptions": {"gracePeriodSeconds": 60}})
        self.counts.add("pods-evicted")
        time.sleep(self.rng_for(f"{att['name']}-grace").uniform(*EVICTION_GRACE_S))

    def annotate(self, pod, ips):
        """The network-status Multus writes once the pod's networks are attached."""
        network = pod.get("net", NETWORK)
        status = [{"name": f"{self.fleet.ns}/{network}", "interface": IFNAME, "ips": ips,
                   "default": False}]
        body = {"metadata": {"annotations": {
            "k8s.v1.cni.cncf.io/network-status": json.dumps(status)}}}
        self.fleet.kube.ok("PATCH", f"/api/v1/namespaces/{self.fleet.ns}/pods/{pod['name']}",
                           body, content_type="application/merge-patch+json")

    def delete_pod(self, pod):
        with self.lock:
            self.live.pop(pod["name"], None)
        self.fleet.kube.ok("DELETE", f"/api/v1/namespaces/{self.fleet.ns}/pods/{pod['name']}",
                           {"gracePeriodSeconds": 0}, allow=(404,))

    def create_pods(self, count):
        pods = []
        for i in range(count):
            name = f"p{self.number}-{i}"
            doc = self.fleet.kube.ok("POST", f"/api/v1/namespaces/{self.fleet.ns}/pods", {
                "metadata": {"name": name},
                "spec": {"containers": [{"name": "c", "image": "localhost/busybox:latest"}],
                         "automountServiceAccountToken": False}})
            pods.append({"name": name, "uid": doc["metadata"]["uid"]})
        return pods

    # ---- faults

    def api_fault(self, kind):
        verb = {"apiserver-crash": ["restart", "kube-apiserver", "--crash"],
                "etcd-crash": ["restart", "etcd", "--crash"],
                "etcd-restart": ["restart", "etcd"],
                "apiserver-pause": ["pause", "kube-apiserver",
                                    f"{self.rng.uniform(3, 6):.1f}"]}[kind]
        r = subprocess.run([str(CLUSTER_SH), *verb], capture_output=True, text=True,
                           env={**os.environ, "WHEREABOUTS_E2E_STATE": self.fleet.args.state})
        if r.returncode != 0:
            raise RuntimeError(f"cluster.sh {' '.join(verb)} failed: {r.stderr[-1500:]}")
        self.counts.add(f"fault:{kind}")

    def faults(self, api_kind):
        """The round's process and API faults, each from its own thread at a random moment."""
        plan = {"api": self.rng.uniform(0.3, 4.0), "agent": self.rng.uniform(0.2, 5.0),
                "leader": self.rng.uniform(0.2, 6.0)}
        started = time.monotonic()

        def at(what, delay):
            time.sleep(delay)
            try:
                if what == "api":
                    self.api_fault(api_kind)
                elif what == "agent":
                    self.fleet.kill_agent()
                    self.counts.add("fault:agent-kill")
                else:
                    took = self.fleet.kill_leader()
                    if took is None:
                        self.counts.violation("no-leader-takeover", "no surviving operator replica "
                                              f"took the Lease after {time.monotonic() - started:.1f} s")
                    else:
                        self.counts.add("fault:leader-kill")
                        self.takeovers.append(took)
            except Exception as e:  # noqa: BLE001 - reported, and the round counts it
                self.counts.add("driver-error:fault")
                log(f"fault {what} failed: {e}")

        threads = [threading.Thread(target=at, args=item) for item in plan.items()]
        for t in threads:
            t.start()
        for t in threads:
            t.join()

    # ---- the round

    def run(self, new_pods, api_kind):
        victims = [a for a in sorted(self.live.values(), key=lambda a: a["name"])
                   if self.rng.random() < 0.5]
        pods = self.create_pods(new_pods)
        for p in pods:
            overlap = self.fleet.args.overlap and self.rng.random() < NETWORK_B_SHARE
            p["net"] = NETWORK_B if overlap else NETWORK
            # (Its own generator: a seed's other decisions stay as they were without the option.)
            shared = self.rng_for(f"{p['name']}-shared").random() < NETWORK_C_SHARE
            if p["net"] == NETWORK and self.fleet.args.shared_name and shared:
                p["net"] = NETWORK_C
        plans = {p["name"]: (self.member(network=p["net"]),
                             [self.kill_after() for _ in range(ADD_TRIES)])
                 for p in pods}
        # Most pods are deleted after a DEL; some vanish with their node, without one. A node
        # upgraded or downgraded since the ADD runs another member's plugin for the DEL.
        dels = {a["name"]: (self.rng.random() < 0.8,
                            a["member"] if self.rng.random() < 0.7
                            else self.member(network=a.get("net", NETWORK)))
                for a in victims}
        threads = [threading.Thread(target=self.attach, args=(p, *plans[p["name"]]))
                   for p in pods]
        threads += [threading.Thread(target=self.detach, args=(a, *dels[a["name"]]))
                    for a in victims]
        self.rng.shuffle(threads)
        fault_thread = threading.Thread(target=self.faults, args=(api_kind,))
        started = time.monotonic()
        fault_thread.start()
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        fault_thread.join()
        return time.monotonic() - started


def error_kind(out, err):
    """A short class of a failed call, for the counts: the CNI code if it printed one."""
    try:
        return f"code-{json.loads(out)['code']}"
    except (ValueError, KeyError, TypeError):
        return "no-result"


# ------------------------------------------------------------------- main


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rounds", type=int, default=20)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--pods", type=int, default=150, help="new pods per round")
    ap.add_argument("--overlap", action="store_true",
                    help=f"also a second network ({NETWORK_B}, {V4_B}) over the first's addresses")
    ap.add_argument("--shared-name", action="store_true",
                    help=f"every NAD names network_name {SHARED_NAME}; a third NAD "
                         f"({NETWORK_C}) shares the first's pools")
    ap.add_argument("--kubeconfig", required=True, help="admin kubeconfig of e2e/cluster.sh")
    ap.add_argument("--state", required=True, help="the cluster's WHEREABOUTS_E2E_STATE")
    ap.add_argument("--plugin", type=Path, default=RELEASE / "whereabouts")
    ap.add_argument("--operator", type=Path, default=RELEASE / "whereabouts-operator")
    ap.add_argument("--upstream", type=Path,
                    default=ROOT / "bench" / "bin" / "whereabouts-upstream")
    ap.add_argument("--work", type=Path, default=None, help="logs (default: a new /tmp folder)")
    ap.add_argument("--json", type=Path, default=None, help="write the figures here")
    args = ap.parse_args()
    selftest()
    for b in (args.plugin, args.operator, args.upstream):
        if not b.is_file():
            sys.exit(f"[chaos] {b}: not found (make release; bench/build.sh --upstream-only)")
    work = args.work or Path(f"/tmp/wa-chaos-{args.seed}-{int(time.time())}")
    work.mkdir(parents=True, exist_ok=True)
    LOG_FILE.append(work / "chaos.log")
    kube = Kube(args.kubeconfig)
    fleet = Fleet(kube, args, work)
    log(f"seed {args.seed}, {args.rounds} rounds of {args.pods} new pods; logs in {work}")
    fleet.setup()
    live, counts, rounds = {}, Counter(), []
    try:
        for n in range(args.rounds):
            api_kind = API_FAULTS[(args.seed + n) % len(API_FAULTS)]
            before = counts.snapshot()
            rnd = Round(fleet, n, args.seed, live, counts)
            burst = rnd.run(args.pods, api_kind)
            converged, problems = check_round(kube, fleet, live, counts,
                                             SHARED_NAME if args.shared_name else "")
            after = counts.snapshot()
            delta = {k: after[k] - before.get(k, 0) for k in after if after[k] != before.get(k, 0)}
            rounds.append({"round": n, "burst_s": round(burst, 1), "api_fault": api_kind,
                           "converged_s": None if converged is None else round(converged, 1),
                           "takeover_s": [round(t, 1) for t in rnd.takeovers],
                           "live": len(live), "counts": delta, "problems": problems})
            log(f"round {n}: burst {burst:.1f} s, {api_kind}, converged "
                f"{'never' if converged is None else f'{converged:.1f} s'}, {len(live)} live, "
                f"{len(problems)} violations; {json.dumps(delta, sort_keys=True)}")
    finally:
        fleet.teardown()
    crashed = panics(work)
    for name in crashed:
        counts.violation("panic-in-log", name)
    report = summary(args, rounds, counts.snapshot(), counts.latencies(), crashed, ADD_TRIES)
    report["markdown"] += violation_list(counts.details)
    print(report["markdown"])
    if args.json:
        args.json.write_text(json.dumps({k: v for k, v in report.items()}, indent=1))
    if report["violations"]:
        log(f"{report['violations']} violations (seed {args.seed}); logs in {work}; the writes "
            f"of an address: python3 e2e/chaos/history.py {work} ADDRESS")
        sys.exit(1)
    kube.ok("DELETE", f"/api/v1/namespaces/{fleet.ns}", allow=(404,))
    kube.ok("DELETE", f"/api/v1/nodes/{EVICTION_NODE}", allow=(404,))
    kube.ok("DELETE", f"/apis/coordination.k8s.io/v1/namespaces/kube-node-lease/leases/{EVICTION_NODE}",
            allow=(404,))
    # Kept only for a post-mortem: a 20-round history runs to hundreds of megabytes.
    for f in work.glob("history-*.json"):
        f.unlink()
    log(f"no violations; logs in {work}")


if __name__ == "__main__":
    main()
