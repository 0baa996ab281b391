"""The chaos tier's settings (networks, fleet, faults, the operator's shortened timings), its log
and its counts. See README.md.

Python standard library only.
"""

import sys
import threading
from pathlib import Path

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
# With --sliced: a network in node slices (`node_slice_size`, IPv4 as upstream's), whole fleet.
# Every member is a node of its own (a Node object kept Ready, `NODENAME` in its plugin's
# environment), the operator's slice planner gives each one a slice, and a pod's calls go to the
# slice pool of the node it was attached on, whichever member's plugin runs its DEL. No
# network_name: its NodeSlicePool is named after the config's name, and it never shares one.
NETWORK_S, V4_S, SLICE_SIZE = "chaosnet-s", "10.78.0.0/21", "/24"
NETWORK_S_SHARE = 0.3
RANGES = {NETWORK: [V4, V6], NETWORK_B: [V4_B], NETWORK_C: [V4, V6], NETWORK_S: [V4_S]}
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
SLICES_S = 60  # the slice planner's time to give every member's node a slice
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
