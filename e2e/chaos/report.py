"""The chaos tier's report: a table per round, totals, latencies and the violations found.

Python standard library only.
"""

import datetime


def violation_list(details):
    """The report's last lines: what went wrong, the first 20 of each kind."""
    if not details:
        return ""
    lines, seen = ["", f"Violations ({len(details)} found):"], {}
    for d in details:
        kind = d.split(":")[0]
        seen[kind] = seen.get(kind, 0) + 1
        if seen[kind] <= 20:
            lines.append(f"- {d[:600]}")
    return "\n".join(lines)


def summary(args, rounds, counts, latencies, crashed, add_tries):
    violations = sum(v for k, v in counts.items() if k.startswith("violation:"))
    conv = [r["converged_s"] for r in rounds if r["converged_s"] is not None]
    takeovers = [t for r in rounds for t in r["takeover_s"]]
    faults = {k[len("fault:"):]: v for k, v in sorted(counts.items()) if k.startswith("fault:")}
    kills = sum(v for k, v in faults.items() if k.startswith("plugin-kill"))
    lines = [
        f"Chaos run: seed {args.seed}, {len(rounds)} rounds, {args.pods} new pods a round, "
        f"{datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC",
        "",
        "| round | API fault | burst s | converged s | live pods | ADDs | DELs | plugin kills | violations |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rounds:
        c = r["counts"]
        k = sum(v for key, v in c.items() if key.startswith("fault:plugin-kill"))
        lines.append(f"| {r['round']} | {r['api_fault']} | {r['burst_s']} | "
                     f"{r['converged_s'] if r['converged_s'] is not None else 'never'} | "
                     f"{r['live']} | {c.get('op:add', 0)} | {c.get('op:del', 0)} | {k} | "
                     f"{len(r['problems'])} |")
    lines += [
        "",
        f"Totals: {counts.get('op:add', 0)} ADDs, {counts.get('op:del', 0)} DELs, "
        f"{counts.get('pods-vanished', 0)} pods deleted without DEL, "
        f"{counts.get('pods-given-up', 0)} pods given up after {add_tries} failed sandboxes; "
        f"faults: {kills} plugin kills, "
        + ", ".join(f"{k} {v}" for k, v in faults.items() if not k.startswith("plugin-kill"))
        + f"; violations: {violations}"
        + (f"; time to converge: max {max(conv):.1f} s, median "
           f"{sorted(conv)[len(conv) // 2]:.1f} s" if conv else "")
        + (f"; operator leader takeover: max {max(takeovers):.1f} s, median "
           f"{sorted(takeovers)[len(takeovers) // 2]:.1f} s" if takeovers else ""),
    ]
    failed = {k: v for k, v in sorted(counts.items()) if "-failed:" in k}
    if failed:
        lines.append("")
        lines.append("Failed calls (retried as the runtime does): "
                     + ", ".join(f"{k} {v}" for k, v in failed.items()))
    lines.append("")
    lines.append("| plugin call | calls | p50 s | max s |")
    lines.append("|---|---|---|---|")
    for k, v in latencies.items():
        lines.append(f"| {k} | {v['n']} | {v['p50']} | {v['max']} |")
    return {"markdown": "\n".join(lines), "violations": violations, "rounds": rounds,
            "counts": counts, "latencies": latencies, "panics": crashed, "seed": args.seed}
