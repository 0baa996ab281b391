"""The chaos tier's invariants, checked after every round (see README.md, "Invariants").

Python standard library only.
"""

import ipaddress
import time

GROUP = "/apis/whereabouts.cni.cncf.io/v1alpha1"
CONVERGE_S = 120  # pools must hold only live attachments within this time after a round

def cluster_state(kube, ns, network_name=""):
    """Pool entries (ip -> [(podref, containerid)]) and reservations (ip -> podref); reservations
    are named `[<network_name>-]<address>`."""
    entries = {}
    for pool in kube.items(f"{GROUP}/namespaces/{ns}/ippools"):
        net = ipaddress.ip_network(pool["spec"]["range"], strict=False)
        for off, a in (pool["spec"].get("allocations") or {}).items():
            ip = str(net.network_address + int(off))
            entries.setdefault(ip, []).append((a.get("podref"), a.get("id")))
    resv = {}
    for r in kube.items(f"{GROUP}/namespaces/{ns}/overlappingrangeipreservations"):
        name = r["metadata"]["name"]
        if network_name:
            name = name.removeprefix(f"{network_name}-")
        ip = str(ipaddress.ip_address(name.replace("-", ":") if "." not in name else name))
        resv[ip] = r["spec"].get("podref")
    return entries, resv


def safety(live, ns, entries, resv):
    """Violations that must never happen, at any moment: duplicates and lost addresses. Returns
    (problems, unclaimed): `unclaimed` are upstream's attachments whose reservation is missing,
    which are not violations yet but work the audit must finish: upstream's v0.9.2 ADD that finds
    a reservation of its own pod on its first range (a killed DEL of an earlier sandbox left it)
    reuses it and then creates none for its later ranges, and the audit re-creates them
    (tests/e2e/claims.rs, `upstreams_second_range_left_unclaimed_...`)."""
    problems, unclaimed = [], []
    holders = {}
    for att in live.values():
        for ip in att["ips"]:
            holders.setdefault(ip, []).append(att["name"])
    for ip, names in holders.items():
        if len(names) > 1:
            problems.append(f"duplicate: {ip} held by {names}")
    for att in live.values():
        ref = f"{ns}/{att['name']}"
        for ip in att["ips"]:
            if (ref, att["cid"]) not in entries.get(ip, []):
                problems.append(f"missing-in-pool: {ip} of {ref} ({att['member']}, {att['cid']}); "
                                f"pool has {entries.get(ip)}")
            if resv.get(ip) is None and att["member"] == "upstream":
                unclaimed.append(f"unclaimed upstream entry {ip} of {ref}")
            elif resv.get(ip) != ref:
                problems.append(f"missing-reservation: {ip} of {ref} ({att['member']}); "
                                f"reserved for {resv.get(ip)}")
    return problems, unclaimed


def leaks(live, ns, entries, resv):
    """What the operator must have cleaned once it converged: entries and reservations that no
    live attachment holds."""
    held = {(f"{ns}/{a['name']}", a["cid"]) for a in live.values()}
    live_refs = {f"{ns}/{a['name']}" for a in live.values()}
    out = []
    for ip, owners in entries.items():
        out += [f"pool entry {ip} {o}" for o in owners if o not in held]
    out += [f"reservation {ip} {ref}" for ip, ref in resv.items() if ref not in live_refs]
    return out


def check_round(kube, fleet, live, counts, network_name=""):
    """Safety now; then waits for convergence. Returns (seconds to converge or None, problems)."""
    entries, resv = cluster_state(kube, fleet.ns, network_name)
    problems, _ = safety(live, fleet.ns, entries, resv)
    started = time.monotonic()
    while True:
        entries, resv = cluster_state(kube, fleet.ns, network_name)
        left = leaks(live, fleet.ns, entries, resv) + safety(live, fleet.ns, entries, resv)[1]
        if not left:
            converged = time.monotonic() - started
            break
        if time.monotonic() - started > CONVERGE_S:
            converged = None
            problems += [f"leak: {x}" for x in left[:20]]
            counts.violation("leak", f"{len(left)} left after {CONVERGE_S} s: {left[:5]}", len(left))
            break
        time.sleep(1)
    # The operator must not have freed anything live while converging.
    problems += safety(live, fleet.ns, entries, resv)[0]
    # Nor any two attachments have held one address at once during the burst.
    problems += [f"duplicate-in-burst: {d}" for d in fleet.ledger.overlaps()]
    problems = sorted(set(problems))
    for p in problems:
        if not p.startswith("leak:"):
            counts.violation(p.split(":")[0], p.split(":", 1)[1].strip())
    return converged, problems


def panics(work):
    found = []
    for f in sorted(work.glob("*.log")):
        text = f.read_text(errors="replace")
        if "panicked at" in text:
            found.append(f.name)
    return found
