"""Every attachment's lifetime during a chaos run, to find duplicates that no round's end sees.

The round-end check compares the attachments alive at that moment. A pod given an address that
another pod still held, where one of the two went away before the round ended, would pass it.
The ledger records, for every successful ADD, the moment its answer came back, and for its
attachment the moment its release began (the DEL's first try, or the Pod delete of a pod that
vanished without one). An address can only be handed out again after its release is done, which
is after that release began; so two attachments of one address whose spans overlap held it at
the same time: a duplicate, whenever it happened.

Python standard library only.
"""

import threading
import time


class Ledger:
    def __init__(self):
        self.lock = threading.Lock()
        self.spans = {}  # (pod, container id) -> {"ips", "added", "released"}
        self.reported = set()

    def added(self, pod, cid, ips):
        """The ADD of `pod`'s container `cid` answered with `ips`."""
        with self.lock:
            self.spans[(pod, cid)] = {"ips": list(ips), "added": time.monotonic(),
                                      "released": None}

    def releasing(self, pod, cid):
        """The release of that attachment begins (from now on the address may be freed)."""
        with self.lock:
            span = self.spans.get((pod, cid))
            if span is not None and span["released"] is None:
                span["released"] = time.monotonic()

    def overlaps(self):
        """Duplicates not reported before, as text, where at least one of the two attachments
        has begun its release (two that are both still alive are the round-end check's)."""
        with self.lock:
            by_ip = {}
            for key, span in self.spans.items():
                for ip in span["ips"]:
                    by_ip.setdefault(ip, []).append((span["added"], span["released"], key))
            found = []
            for ip, spans in by_ip.items():
                found += self._overlaps_of(ip, sorted(spans, key=lambda s: s[0]))
            return found

    def _overlaps_of(self, ip, spans):
        found = []
        for i, (added_a, released_a, a) in enumerate(spans):
            for added_b, released_b, b in spans[i + 1:]:
                # Sorted by start: b began after a; they overlap when a had not begun its release.
                if released_a is not None and released_a <= added_b:
                    continue
                if released_a is None and released_b is None:
                    continue
                if (ip, a, b) in self.reported:
                    continue
                self.reported.add((ip, a, b))
                gap = added_b - added_a
                found.append(f"{ip} given to {b[0]} ({b[1]}) {gap:.2f} s after {a[0]} ({a[1]}), "
                             f"whose release began "
                             f"{'never' if released_a is None else f'{released_a - added_b:.2f} s later'}")
        return found


def selftest():
    """The ledger must see an overlap and must not see a reuse after a release: checked at the
    start of every run, so that a change here cannot make the check blind unnoticed."""
    ledger = Ledger()
    ledger.added("a", "c1", ["10.0.0.1"])
    ledger.releasing("a", "c1")
    time.sleep(0.001)
    ledger.added("b", "c2", ["10.0.0.1"])  # after a's release began: fine
    ledger.added("c", "c3", ["10.0.0.2"])
    ledger.added("d", "c4", ["10.0.0.2"])  # both live: the round end's to report
    assert ledger.overlaps() == [], ledger.overlaps()
    ledger.releasing("d", "c4")
    found = ledger.overlaps()
    assert len(found) == 1 and found[0].startswith("10.0.0.2 given to d"), found
    assert ledger.overlaps() == [], "reported twice"
