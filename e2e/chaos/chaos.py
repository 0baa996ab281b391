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
import ipaddress
import json
import os
import random
import subprocess
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import (  # noqa: E402
    ADD_TRIES, API_FAULTS, CLUSTER_SH, EVICT_SHARE, EVICTION_GRACE_S, EVICTION_NODE, IFNAME,
    LOG_FILE, MEMBERS, NETWORK, NETWORK_B, NETWORK_B_MEMBERS, NETWORK_B_SHARE, NETWORK_C,
    NETWORK_C_SHARE, NETWORK_S, NETWORK_S_SHARE, PLUGIN_KILL_P, RANGES, RELEASE, ROOT, SHARED_NAME,
    SLICE_SIZE, DEL_RETRY_S, V4_B, V4_S, Counter, log)
from fleet import Fleet  # noqa: E402
from invariants import check_round, panics  # noqa: E402
from ledger import selftest  # noqa: E402
from kube import Kube  # noqa: E402
from report import summary, violation_list  # noqa: E402


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
        if pod.get("net") == NETWORK_S:
            pod["node"] = f"chaos-{member}"  # the node it runs on: its slice pool
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
            "target": {"apiVersion": "v1", "kind": "Node",
                       "name": att.get("node", EVICTION_NODE)}}, allow=(409,))
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
            sliced = self.rng_for(f"{p['name']}-sliced").random() < NETWORK_S_SHARE
            if p["net"] == NETWORK and self.fleet.args.sliced and sliced:
                p["net"] = NETWORK_S
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
    ap.add_argument("--sliced", action="store_true",
                    help=f"also a network in node slices ({NETWORK_S}, {V4_S} in {SLICE_SIZE}); "
                         "every member a node of its own")
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
    for node in fleet.nodes:
        kube.ok("DELETE", f"/api/v1/nodes/{node}", allow=(404,))
        kube.ok("DELETE", f"/apis/coordination.k8s.io/v1/namespaces/kube-node-lease/leases/{node}",
                allow=(404,))
    # Kept only for a post-mortem: a 20-round history runs to hundreds of megabytes.
    for f in work.glob("history-*.json"):
        f.unlink()
    log(f"no violations; logs in {work}")


if __name__ == "__main__":
    main()
