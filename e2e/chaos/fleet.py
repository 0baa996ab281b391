"""The chaos tier's fleet: the namespace and its networks, the Node objects kept Ready, the node
agent, two operator replicas, and the plugin calls of each member. See README.md.

Python standard library only.
"""

import datetime
import json
import os
import signal
import subprocess
import threading
import time

from common import (
    AUDIT_INTERVAL, DELETED_POD_GRACE, EVICTION_NODE, HANG_S, IFNAME, KUBECTL, MEMBERS, NAD_API,
    NETWORK, NETWORK_B, NETWORK_C, NETWORK_S, NODE_HEARTBEAT_S, ORPHAN_CLAIM_AGE, RANGES,
    ROOT, SHARED_NAME, SLICE_SIZE, SLICES_S, STALE_GRACE, log)
from history import History
from ledger import Ledger


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
        self.nodes = [EVICTION_NODE] + [f"chaos-{m}" for m in MEMBERS] * args.sliced

    # ---- setup

    def setup(self):
        self.kube.ok("POST", "/api/v1/namespaces", {"metadata": {"name": self.ns}})
        for node in self.nodes:
            self.kube.ok("POST", "/api/v1/nodes", {"metadata": {"name": node}}, allow=(409,))
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
        upstream_kubeconfig = self.upstream_identity()
        for member in MEMBERS:
            # The node's flat file decides where the plugin logs (ours ignores a network
            # config's log_file; upstream reads it from the flat file as well).
            kubeconfig = upstream_kubeconfig if member == "upstream" else self.kubeconfig
            flat = {"kubernetes": {"kubeconfig": str(kubeconfig)},
                    "log_file": str(self.work / f"{member}-plugin.log")}
            if member == "agent":
                flat["agent_socket"] = str(self.socket)
            elif member == "direct":
                flat["agent_socket"] = ""
            if member != "upstream":
                # Each member is a node of its own: its own bound on plugins at work.
                flat["plugin_slots_dir"] = str(self.work / f"{member}-slots")
            (self.work / f"{member}.conf").write_text(json.dumps(flat))
        networks = ([NETWORK] + [NETWORK_B] * self.args.overlap
                    + [NETWORK_C] * self.args.shared_name + [NETWORK_S] * self.args.sliced)
        for network in networks:
            ranges = {"ipRanges": [{"range": c} for c in RANGES[network]]}
            if network == NETWORK_S:
                ranges["node_slice_size"] = SLICE_SIZE
            elif self.args.shared_name:
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
        if self.args.sliced:
            self.wait_for_slices()

    def upstream_identity(self):
        """Upstream's plugin runs as a service account of its own, with its ClusterRole's rules in
        the pool namespace (its daemonset-install.yaml), as its DaemonSet does; ours keep the
        admin's kubeconfig. With config/rbac/claims-kept.yaml applied, as in an install: its
        deletes of our claims by name are refused. Returns the account's kubeconfig."""
        name, ns_api = "whereabouts-upstream", f"/api/v1/namespaces/{self.ns}"
        rbac = f"/apis/rbac.authorization.k8s.io/v1/namespaces/{self.ns}"
        self.kube.ok("POST", f"{ns_api}/serviceaccounts", {"metadata": {"name": name}})
        rules = [{"apiGroups": ["whereabouts.cni.cncf.io"],
                  "resources": ["ippools", "overlappingrangeipreservations", "nodeslicepools"],
                  "verbs": ["get", "list", "watch", "create", "update", "patch", "delete"]},
                 {"apiGroups": ["coordination.k8s.io"], "resources": ["leases"], "verbs": ["*"]},
                 {"apiGroups": [""], "resources": ["pods"], "verbs": ["get", "list", "watch"]}]
        self.kube.ok("POST", f"{rbac}/roles", {"metadata": {"name": name}, "rules": rules})
        self.kube.ok("POST", f"{rbac}/rolebindings", {
            "metadata": {"name": name},
            "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": name},
            "subjects": [{"kind": "ServiceAccount", "name": name, "namespace": self.ns}]})
        token = self.kube.ok("POST", f"{ns_api}/serviceaccounts/{name}/token", {
            "apiVersion": "authentication.k8s.io/v1", "kind": "TokenRequest",
            "spec": {"expirationSeconds": 86400}})["status"]["token"]
        kubeconfig = self.work / "upstream.kubeconfig"
        subprocess.run(["cp", str(self.kubeconfig), str(kubeconfig)], check=True)
        for args in (["set-credentials", name, f"--token={token}"],
                     ["set-context", "--current", f"--user={name}"]):
            subprocess.run([str(KUBECTL), "--kubeconfig", str(kubeconfig), "config", *args],
                           check=True, capture_output=True)
        subprocess.run([str(KUBECTL), "--kubeconfig", self.args.kubeconfig, "apply", "-f",
                        str(ROOT / "config" / "rbac" / "claims-kept.yaml")],
                       check=True, capture_output=True)
        return kubeconfig

    def wait_for_slices(self):
        """Until the operator's slice planner has given every member's node a slice."""
        path = f"/apis/whereabouts.cni.cncf.io/v1alpha1/namespaces/{self.ns}/nodeslicepools/{NETWORK_S}"
        deadline = time.monotonic() + SLICES_S
        while True:
            status, pool = self.kube.call("GET", path)
            taken = {a.get("nodeName") for a in ((pool or {}).get("status") or {}).get(
                "allocations") or []} if status == 200 else set()
            if all(n in taken for n in self.nodes):
                log(f"slices of {NETWORK_S}: {pool['status']['allocations']}")
                return
            if time.monotonic() > deadline:
                raise RuntimeError(f"no slice for every node of {self.nodes} after {SLICES_S} s: "
                                   f"{status} {pool}")
            time.sleep(0.5)

    def heartbeat_once(self):
        for node in self.nodes:
            self.heartbeat_of(node)

    def heartbeat_of(self, node):
        """What a kubelet does for its node: renews its Lease and reports it Ready."""
        now = datetime.datetime.now(datetime.timezone.utc)
        stamp = now.strftime("%Y-%m-%dT%H:%M:%SZ")
        lease = f"/apis/coordination.k8s.io/v1/namespaces/kube-node-lease/leases/{node}"
        spec = {"holderIdentity": node, "leaseDurationSeconds": 40,
                "renewTime": now.strftime("%Y-%m-%dT%H:%M:%S.%fZ")}
        status, _ = self.kube.call("PATCH", lease, {"spec": spec},
                                   content_type="application/merge-patch+json", deadline_s=5)
        if status == 404:
            self.kube.call("POST", lease.rsplit("/", 1)[0], {
                "metadata": {"name": node}, "spec": spec}, deadline_s=5)
        ready = {"type": "Ready", "status": "True", "reason": "KubeletReady",
                 "lastHeartbeatTime": stamp, "lastTransitionTime": stamp}
        self.kube.call("PATCH", f"/api/v1/nodes/{node}/status",
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
        if "node" in pod:
            env["NODENAME"] = pod["node"]
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
