"""Every version of the chaos namespace's pools and reservations, kept for the post-mortem of a
violation: the checker sees only the state at a round's end, and the API server compacts its
history within minutes, so without this record the write that lost an entry cannot be found.

    python3 e2e/chaos/history.py WORKDIR ADDRESS

prints, in order, each recorded version that changed ADDRESS's pool entry or its reservation, with
the field manager of the write and its time: `whereabouts-upstream` for upstream's plugin,
`whereabouts-plugin`, `whereabouts-agent` or `whereabouts-operator` for ours. It is the object's
most recent manager, whose times count whole seconds: two writers within one second may be
swapped. Reservations are matched with or without a `network_name-` prefix. The recorder is
started by chaos.py (`History`).
"""

import ipaddress
import json
import subprocess
import sys
import threading
from pathlib import Path

RESOURCES = ("ippools", "overlappingrangeipreservations")


class History:
    """kubectl watches of the namespace's pools and reservations, appended to WORK/history-*.json
    as watch events with managed fields; restarted when the API server drops them (its faults),
    so a version written while no watch runs may be missed, never reordered."""

    def __init__(self, kubectl, kubeconfig, ns, work):
        self.command = [str(kubectl), "--kubeconfig", str(kubeconfig), "-n", ns, "get"]
        self.flags = ["--watch", "--output-watch-events", "-o", "json", "--show-managed-fields"]
        self.work = work
        self.stopped = threading.Event()
        self.procs = {}
        self.threads = [threading.Thread(target=self.follow, args=(r,), daemon=True)
                        for r in RESOURCES]

    def start(self):
        for t in self.threads:
            t.start()

    def follow(self, resource):
        with open(self.work / f"history-{resource}.json", "ab") as out:
            while not self.stopped.is_set():
                self.procs[resource] = subprocess.Popen([*self.command, resource, *self.flags],
                                                        stdout=out, stderr=subprocess.DEVNULL)
                self.procs[resource].wait()
                self.stopped.wait(1)

    def stop(self):
        self.stopped.set()
        for p in list(self.procs.values()):
            if p.poll() is None:
                p.terminate()


def events(path):
    """The watch events of one history file (concatenated JSON objects)."""
    if not path.exists():
        return
    text, decoder, i = path.read_text(), json.JSONDecoder(), 0
    while True:
        while i < len(text) and text[i].isspace():
            i += 1
        if i >= len(text):
            return
        try:
            event, i = decoder.raw_decode(text, i)
        except ValueError:
            return  # a line cut off when the watch was stopped
        yield event


def writer(obj):
    fields = sorted(obj["metadata"].get("managedFields") or [], key=lambda f: f.get("time", ""))
    return f"{fields[-1]['manager']} at {fields[-1].get('time')}" if fields else "?"


def report(work, address):
    """Lines for each version that changed `address`'s entry (in any pool whose range holds it)
    or its reservation, in the order of their resourceVersions."""
    return [line for _, line in sorted(changes(work, address))]


def changes(work, address):
    ip = ipaddress.ip_address(address)
    reservation = str(ip) if ip.version == 4 else ip.exploded.replace(":", "-")
    seen = {}
    for event in events(work / "history-ippools.json"):
        pool = event.get("object", {})
        network = ipaddress.ip_network(pool.get("spec", {}).get("range", "0.0.0.0/32"), strict=False)
        if ip not in network:
            continue
        key = str(int(ip) - int(network.network_address))
        entry = (pool["spec"].get("allocations") or {}).get(key)
        name = pool["metadata"]["name"]
        if seen.get(("pool", name)) != entry:
            seen[("pool", name)] = entry
            rv = int(pool["metadata"]["resourceVersion"])
            yield rv, f"rv {rv} pool {name}[{key}] = {entry} ({writer(pool)})"
    for event in events(work / "history-overlappingrangeipreservations.json"):
        claim = event.get("object", {})
        # Named `[<network_name>-]<address>` (IPv6 with `-` for `:`).
        name = claim.get("metadata", {}).get("name", "")
        if name != reservation and not name.endswith(f"-{reservation}"):
            continue
        state = (event["type"], claim.get("spec"), claim["metadata"].get("uid"))
        if seen.get("claim") != state:
            seen["claim"] = state
            rv = int(claim["metadata"]["resourceVersion"])
            yield rv, (f"rv {rv} reservation {event['type']} {claim.get('spec')} "
                       f"uid {claim['metadata'].get('uid')} ({writer(claim)})")


if __name__ == "__main__":
    if len(sys.argv) != 3:
        sys.exit(__doc__)
    for line in report(Path(sys.argv[1]), sys.argv[2]):
        print(line)
