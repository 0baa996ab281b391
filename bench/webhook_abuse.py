#!/usr/bin/env python3
"""The webhook under abuse: memory and latency under a slowloris, a burst and oversized bodies.

    bench/webhook_abuse.py [--server PATH] [--json]

Serves the real router over the real TLS stack with the production limits and no API server
(`examples/webhook_serve.rs`, built with `cargo build --release --example webhook_serve` unless
--server is given) on 127.0.0.1, and measures (docs/benchmarks.md, "Webhook under abuse"):

1. baseline: p50/p99 of well-behaved requests (4 keep-alive connections, one request at a time
   each, the valid-single fixture) and RSS;
2. slowloris: 500 connections held open for 20 s (250 that never start TLS, 250 that send their
   request head one byte every 0.5 s), each reopened as soon as the server cuts it; the same
   well-behaved requests during it; RSS before/peak/after;
3. burst: 5,000 requests at once, three ways: pipelined 10 each on 500 keep-alive HTTP/1.1
   connections opened beforehand, 100 streams each on 50 HTTP/2 connections (both: what the
   request bound sees), and each on its own new connection (what the connection bound and the TLS
   handshakes see); how many got 200, 503 and no answer within 10 s,
   latency percentiles (request written to response read; for new connections from connect),
   the client's own CPU time (it is on the same cores), RSS peak;
4. oversized bodies: 10 MB and 100 MB declared (head only, then the whole body streamed), and
   100 MB chunked; the status, the bytes the client got to send before the server closed, RSS.

Python 3.11 stdlib (asyncio + ssl); h2load (apt package nghttp2-client) for the HTTP/2 burst
and the new-connection burst when installed. Figures are from this machine; run it on an idle one.
"""

import argparse
import asyncio
import json
import os
import shutil
import pathlib
import ssl
import subprocess
import sys
import tempfile
import time

ROOT = pathlib.Path(__file__).resolve().parent.parent
REVIEW = (ROOT / "tests/fixtures/admission/valid-single.json").read_bytes()


def request(body: bytes, close: bool = False) -> bytes:
    head = (
        "POST /validate HTTP/1.1\r\nHost: webhook\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(body)}\r\n" + ("Connection: close\r\n" if close else "") + "\r\n"
    )
    return head.encode() + body


def rss_kib(pid: int) -> int:
    for line in pathlib.Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    return 0


class Sampler:
    """Samples the server's RSS every 20 ms; `peak()` since the last `reset()`."""

    def __init__(self, pid: int):
        self.pid, self.max = pid, 0
        self.task = asyncio.create_task(self.run())

    async def run(self):
        while True:
            self.max = max(self.max, rss_kib(self.pid))
            await asyncio.sleep(0.02)

    def reset(self):
        self.max = rss_kib(self.pid)

    def peak(self) -> int:
        return max(self.max, rss_kib(self.pid))


async def read_response(reader: asyncio.StreamReader) -> int:
    """Reads one HTTP/1.1 response; returns its status."""
    head = await reader.readuntil(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    status = int(lines[0].split()[1])
    length = 0
    for line in lines[1:]:
        if line.lower().startswith("content-length:"):
            length = int(line.split(":", 1)[1])
    await reader.readexactly(length)
    return status


def pct(values, p):
    if not values:
        return float("nan")
    s = sorted(values)
    return s[min(len(s) - 1, int(round(p / 100 * (len(s) - 1))))]


async def well_behaved(port, ctx, workers=4, per_worker=250):
    """Latencies (ms) of sequential requests on `workers` keep-alive connections."""
    lat, statuses = [], {}

    async def worker():
        reader, writer = await asyncio.open_connection("127.0.0.1", port, ssl=ctx)
        req = request(REVIEW)
        for _ in range(per_worker):
            t = time.perf_counter()
            writer.write(req)
            status = await read_response(reader)
            lat.append((time.perf_counter() - t) * 1000)
            statuses[status] = statuses.get(status, 0) + 1
        writer.close()

    await asyncio.gather(*(worker() for _ in range(workers)))
    return lat, statuses


async def slowloris(port, ctx, stop: asyncio.Event, n=500):
    """Keeps n stalled connections open until `stop`; returns how often the server cut one."""
    cuts = [0]

    async def silent():
        while not stop.is_set():
            try:
                reader, writer = await asyncio.open_connection("127.0.0.1", port)
                done = asyncio.create_task(reader.read(1))
                stopping = asyncio.create_task(stop.wait())
                await asyncio.wait({done, stopping}, return_when=asyncio.FIRST_COMPLETED)
                if done.done():
                    cuts[0] += 1
                done.cancel()
                stopping.cancel()
                writer.close()
            except OSError:
                await asyncio.sleep(0.1)

    async def trickle():
        while not stop.is_set():
            try:
                reader, writer = await asyncio.open_connection("127.0.0.1", port, ssl=ctx)
                writer.write(b"POST /validate HTTP/1.1\r\nHost: webhook\r\nX-Slow: ")
                while not stop.is_set():
                    await asyncio.sleep(0.5)
                    if writer.is_closing() or reader.at_eof():
                        break
                    writer.write(b"a")
                    await writer.drain()
                    if reader.at_eof():
                        break
                    try:
                        if await asyncio.wait_for(reader.read(1), 0.001) == b"":
                            break
                    except asyncio.TimeoutError:
                        pass
                else:
                    writer.close()
                    return
                cuts[0] += 1
                writer.close()
            except (OSError, ssl.SSLError, ConnectionError):
                cuts[0] += 1
                await asyncio.sleep(0.01)

    tasks = [asyncio.create_task(silent()) for _ in range(n // 2)]
    tasks += [asyncio.create_task(trickle()) for _ in range(n - n // 2)]
    await stop.wait()
    for t in tasks:
        t.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
    return cuts[0]


async def burst(port, ctx, n=5000, timeout=10.0):
    """n requests, each on a new connection, all started at once (without h2load; the Python
    client's own TLS handshakes then dominate)."""
    lat, statuses = [], {}
    req = request(REVIEW, close=True)

    async def one():
        t = time.perf_counter()
        try:
            async def go():
                reader, writer = await asyncio.open_connection("127.0.0.1", port, ssl=ctx)
                writer.write(req)
                status = await read_response(reader)
                writer.close()
                return status

            status = await asyncio.wait_for(go(), timeout)
            lat.append((time.perf_counter() - t) * 1000)
        except asyncio.TimeoutError:
            status = "timeout"
        except (OSError, ssl.SSLError, asyncio.IncompleteReadError) as e:
            status = type(e).__name__
        statuses[status] = statuses.get(status, 0) + 1

    t0 = time.perf_counter()
    await asyncio.gather(*(one() for _ in range(n)))
    return lat, statuses, time.perf_counter() - t0


async def oversized(port, ctx, size, send_body, chunked=False):
    """Declares (or chunks) `size` bytes and, if `send_body`, streams them without waiting for an
    answer (as curl does). Returns (answer, bytes written before the server closed, seconds); the
    bytes include what loopback socket buffers absorbed, so they overstate what the server read."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port, ssl=ctx)
    t = time.perf_counter()
    if chunked:
        head = "POST /validate HTTP/1.1\r\nHost: webhook\r\nContent-Type: application/json\r\nTransfer-Encoding: chunked\r\n\r\n"
    else:
        head = f"POST /validate HTTP/1.1\r\nHost: webhook\r\nContent-Type: application/json\r\nContent-Length: {size}\r\n\r\n"
    writer.write(head.encode())
    sent = 0
    response = asyncio.create_task(read_response(reader))
    block = b" " * (64 * 1024)
    framed = f"{len(block):x}\r\n".encode() + block + b"\r\n" if chunked else block
    try:
        while send_body and sent < size and not response.done() and not writer.is_closing():
            writer.write(framed)
            await writer.drain()
            sent += len(block)
    except (OSError, ssl.SSLError, ConnectionError):
        pass
    try:
        status = await asyncio.wait_for(response, 10)
    except Exception as e:  # the server closed before the client could read an answer
        status = f"closed ({type(e).__name__})"
    writer.close()
    return status, sent, time.perf_counter() - t


async def burst_keepalive(port, ctx, conns=500, per_conn=10, timeout=10.0):
    """conns keep-alive connections opened first, then per_conn requests pipelined on each, all
    written at once: conns * per_conn requests in flight, as an API server with many open
    connections would send them."""
    opened = await asyncio.gather(*(asyncio.open_connection("127.0.0.1", port, ssl=ctx) for _ in range(conns)))
    lat, statuses = [], {}
    req = request(REVIEW)

    async def one(reader, writer):
        t = time.perf_counter()
        writer.write(req * per_conn)
        try:
            for _ in range(per_conn):
                status = await asyncio.wait_for(read_response(reader), timeout)
                lat.append((time.perf_counter() - t) * 1000)
                statuses[status] = statuses.get(status, 0) + 1
        except (asyncio.TimeoutError, OSError, ssl.SSLError, asyncio.IncompleteReadError) as e:
            statuses[type(e).__name__] = statuses.get(type(e).__name__, 0) + 1
        writer.close()

    t0 = time.perf_counter()
    await asyncio.gather(*(one(r, w) for r, w in opened))
    return lat, statuses, time.perf_counter() - t0


async def burst_h2load(port, body_file, h1):
    """5,000 requests with h2load (nghttp2-client): over HTTP/2, 50 connections x 100 streams at
    once; with h1, 5,000 new HTTP/1.1 connections of one request each."""
    with tempfile.NamedTemporaryFile(prefix="wa-h2load.", suffix=".log") as log:
        shape = ["--h1", "-c", "5000", "-n", "5000"] if h1 else ["-c", "50", "-m", "100", "-n", "5000"]
        t0 = time.perf_counter()
        proc = await asyncio.create_subprocess_exec(
            "h2load", *shape, "-d", str(body_file), "-H", "content-type: application/json",
            "-T", "10", "-N", "10", "--log-file", log.name, f"https://127.0.0.1:{port}/validate",
            stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT)
        text, _ = await proc.communicate()
        wall = time.perf_counter() - t0
        lat, statuses = [], {}
        for line in pathlib.Path(log.name).read_text().splitlines():
            _, status, micros = line.split("\t")
            statuses[status] = statuses.get(status, 0) + 1
            lat.append(int(micros) / 1000)
        missing = 5000 - sum(statuses.values())
        if missing:
            statuses["no answer"] = missing
        summary = [l.strip() for l in text.decode().splitlines() if l.startswith(("requests:", "status codes:"))]
        return lat, statuses, wall, summary


def mib(kib):
    return f"{kib / 1024:.1f}"


async def main_async(server: pathlib.Path, as_json: bool):
    out = {}
    with tempfile.TemporaryDirectory(prefix="wa-webhook-abuse.") as tmp:
        subprocess.run([ROOT / "webhook-certs/mint.sh", "--ip", "127.0.0.1", "--out", tmp],
                       check=True, capture_output=True)
        ctx = ssl.create_default_context(cafile=f"{tmp}/ca.crt")
        ctx.set_alpn_protocols(["http/1.1"])
        with __import__("socket").socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        proc = subprocess.Popen([server, f"127.0.0.1:{port}", f"{tmp}/tls.crt", f"{tmp}/tls.key"],
                                stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                                env={**os.environ, "RUST_LOG": "error"})
        try:
            line = await asyncio.get_running_loop().run_in_executor(None, proc.stdout.readline)
            assert line.startswith(b"listening"), line
            sampler = Sampler(proc.pid)

            await well_behaved(port, ctx)  # warm-up, discarded
            rss0 = rss_kib(proc.pid)
            lat, st = await well_behaved(port, ctx)
            out["baseline"] = {"p50_ms": pct(lat, 50), "p99_ms": pct(lat, 99), "statuses": st, "rss_mib": mib(rss0)}

            stop = asyncio.Event()
            sampler.reset()
            before = rss_kib(proc.pid)
            loris = asyncio.create_task(slowloris(port, ctx, stop))
            await asyncio.sleep(6)  # all 500 open, the first generation already cut once
            lat, st = await well_behaved(port, ctx)
            await asyncio.sleep(max(0.0, 20 - 6 - sum(lat) / 4000))
            during = sampler.peak()
            stop.set()
            cuts = await loris
            await asyncio.sleep(6)  # the last stalled connections reach their deadlines
            out["slowloris"] = {"p50_ms": pct(lat, 50), "p99_ms": pct(lat, 99), "statuses": st,
                                "rss_before_mib": mib(before), "rss_peak_mib": mib(during),
                                "rss_after_mib": mib(rss_kib(proc.pid)), "server_cuts": cuts}

            body_file = pathlib.Path(tmp) / "review.json"
            body_file.write_bytes(REVIEW)
            bursts = [("burst_keepalive", lambda: burst_keepalive(port, ctx))]
            if shutil.which("h2load"):
                bursts += [("burst_h2", lambda: burst_h2load(port, body_file, h1=False)),
                           ("burst_new_h1", lambda: burst_h2load(port, body_file, h1=True))]
            else:
                bursts += [("burst_new_h1", lambda: burst(port, ctx))]
            for name, run in bursts:
                sampler.reset()
                before = rss_kib(proc.pid)
                c0 = os.times()
                lat, st, wall, *summary = await run()
                c1 = os.times()
                if summary:
                    out.setdefault("h2load_summary", {})[name] = summary[0]
                out[name] = {"statuses": {str(k): v for k, v in st.items()}, "wall_s": round(wall, 2),
                             "p50_ms": pct(lat, 50), "p99_ms": pct(lat, 99), "max_ms": max(lat, default=0),
                             "over_5s": sum(1 for x in lat if x > 5000),
                             "client_cpu_s": round((c1.user - c0.user) + (c1.system - c0.system)
                                                   + (c1.children_user - c0.children_user)
                                                   + (c1.children_system - c0.children_system), 1),
                             "rss_before_mib": mib(before), "rss_peak_mib": mib(sampler.peak()),
                             "rss_after_mib": mib(rss_kib(proc.pid))}
                await asyncio.sleep(2)

            rows = []
            for label, size, send, chunked in [("10 MB declared, head only", 10_000_000, False, False),
                                               ("100 MB declared, head only", 100_000_000, False, False),
                                               ("10 MB declared, body streamed", 10_000_000, True, False),
                                               ("100 MB declared, body streamed", 100_000_000, True, False),
                                               ("100 MB chunked, streamed", 100_000_000, True, True)]:
                sampler.reset()
                status, sent, secs = await oversized(port, ctx, size, send, chunked)
                rows.append({"case": label, "answer": status, "client_sent_bytes": sent,
                             "seconds": round(secs, 3), "rss_peak_mib": mib(sampler.peak())})
            out["oversized"] = rows
            lat, st = await well_behaved(port, ctx, workers=1, per_worker=50)
            out["after"] = {"statuses": st, "rss_mib": mib(rss_kib(proc.pid)),
                            "server_alive": proc.poll() is None}
        finally:
            proc.terminate()
            out["exit_code"] = proc.wait(timeout=20)
    if as_json:
        print(json.dumps(out, indent=2))
        return
    b, s = out["baseline"], out["slowloris"]
    print("| phase | well-behaved p50 (ms) | p99 (ms) | answers | RSS (MiB) |")
    print("|---|---|---|---|---|")
    print(f"| no abuse | {b['p50_ms']:.2f} | {b['p99_ms']:.2f} | {b['statuses']} | {b['rss_mib']} |")
    print(f"| 500-connection slowloris | {s['p50_ms']:.2f} | {s['p99_ms']:.2f} | {s['statuses']} | "
          f"{s['rss_before_mib']} before, {s['rss_peak_mib']} peak, {s['rss_after_mib']} after |")
    print(f"\nslowloris connections cut by the server and reopened: {s['server_cuts']}")
    print("\n| burst of 5,000 | answers | wall (s) | p50 (ms) | p99 (ms) | max (ms) | answered after 5 s | client CPU (s) | RSS before / peak / after (MiB) |")
    print("|---|---|---|---|---|---|---|---|---|")
    for label, key in [("HTTP/1.1: 500 keep-alive connections, 10 pipelined each", "burst_keepalive"),
                       ("HTTP/2 (h2load): 50 connections x 100 streams", "burst_h2"),
                       ("HTTP/1.1: 5,000 new connections at once", "burst_new_h1")]:
        u = out.get(key)
        if u is None:
            continue
        print(f"| {label} | {u['statuses']} | {u['wall_s']} | {u['p50_ms']:.0f} | {u['p99_ms']:.0f} | "
              f"{u['max_ms']:.0f} | {u['over_5s']} | {u['client_cpu_s']} | "
              f"{u['rss_before_mib']} / {u['rss_peak_mib']} / {u['rss_after_mib']} |")
    for key, line in out.get("h2load_summary", {}).items():
        print(f"h2load {key}: {line}")
    print()
    print("| oversized body | answer | bytes written before the server closed | s | RSS peak (MiB) |")
    print("|---|---|---|---|---|")
    for r in out["oversized"]:
        print(f"| {r['case']} | {r['answer']} | {r['client_sent_bytes']:,} | {r['seconds']} | {r['rss_peak_mib']} |")
    a = out["after"]
    print(f"\nafterwards: {a['statuses']}, RSS {a['rss_mib']} MiB, server alive: {a['server_alive']}, "
          f"exit code on SIGTERM: {out['exit_code']}")


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--server", type=pathlib.Path, help="webhook_serve binary (default: build the release example)")
    ap.add_argument("--json", action="store_true", help="print the raw figures as JSON")
    args = ap.parse_args()
    server = args.server
    if server is None:
        subprocess.run(["cargo", "build", "-q", "--release", "--example", "webhook_serve"], cwd=ROOT, check=True)
        server = ROOT / "target/release/examples/webhook_serve"
    asyncio.run(main_async(server, args.json))


if __name__ == "__main__":
    sys.exit(main())
