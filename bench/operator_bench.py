#!/usr/bin/env python3
"""Operator benchmark: release of 1000 pods' addresses, API requests, RSS with 10,000 cached pods.

Per run (``--runs``):
  1. namespace ``bench`` (+ ServiceAccount ``default``), N pods (Pending: no scheduler);
  2. one address per pod from the real CNI plugin (``CNI_COMMAND=ADD``, bounded parallelism),
     checked: pool ``10.100.0.0-20`` holds N entries and N OverlappingRangeIPReservations exist;
  3. ``whereabouts-operator run --pool-namespace bench --leader-election=false``, wait /readyz;
  4. apiserver_request_total scraped before/after; all N pods deleted with ONE deletecollection
     request; pool and reservations polled every 200 ms until empty -> time until every address
     is free; operator's whereabouts_releases_total and VmHWM/VmRSS;
  5. (``--rss-pods``) M pods with a ~300-byte network-status annotation and labels in namespace
     ``bench-rss``; operator VmRSS once the cache has them (RSS stable); then deleted again, with
     the API requests the operator made for those M allocation-less deletions.

Without ``--kubeconfig`` it starts a private control plane
(WHEREABOUTS_E2E_STATE=/tmp/wa-opbench-state e2e/cluster.sh up) and stops it at the end
(unless --keep-cluster). Everything is bounded by timeouts; results go to stdout (Markdown-ish
summary) and bench/results/operator-<UTC>.json.

Only the Python standard library is used; API calls go straight to the API server with the
admin kubeconfig's client certificate (no kubectl process per poll).
"""

import argparse
import base64
import concurrent.futures as cf
import http.client
import json
import os
import re
import shutil
import signal
import socket
import ssl
import subprocess
import sys
import tempfile
import threading
import time
import urllib.parse

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
KUBECTL = os.path.join(REPO, "e2e", "bin", "kubectl")
STATE = os.environ.get("WHEREABOUTS_E2E_STATE", "/tmp/wa-opbench-state")
GROUP = "/apis/whereabouts.cni.cncf.io/v1alpha1"
NS = "bench"
RSS_NS = "bench-rss"
RANGE = "10.100.0.0/20"
POOL = "10.100.0.0-20"
WATCHED = ("pods", "ippools", "overlappingrangeipreservations", "events", "leases")


def log(*a):
    print(f"[{time.strftime('%H:%M:%S')}]", *a, file=sys.stderr, flush=True)


def loadavg():
    with open("/proc/loadavg") as f:
        return " ".join(f.read().split()[:3])


# ---------------------------------------------------------------- API client (stdlib only)

class Api:
    def __init__(self, kubeconfig, tmp):
        cfg = json.loads(subprocess.run(
            [KUBECTL, "--kubeconfig", kubeconfig, "config", "view", "--raw", "--minify", "-o", "json"],
            check=True, capture_output=True, timeout=30).stdout)
        cluster = cfg["clusters"][0]["cluster"]
        user = cfg["users"][0]["user"]
        u = urllib.parse.urlparse(cluster["server"])
        self.host, self.port = u.hostname, u.port or 443
        paths = {}
        for key, name in (("certificate-authority-data", "ca.crt"),
                          ("client-certificate-data", "client.crt"),
                          ("client-key-data", "client.key")):
            p = os.path.join(tmp, name)
            with open(p, "wb") as f:
                f.write(base64.b64decode(user.get(key) or cluster[key]))
            paths[name] = p
        self.ctx = ssl.create_default_context(cafile=paths["ca.crt"])
        self.ctx.load_cert_chain(paths["client.crt"], paths["client.key"])
        self.local = threading.local()
        self.counts = {}  # (resource, VERB) -> our own requests, subtracted from the diffs
        self.lock = threading.Lock()

    def _conn(self):
        c = getattr(self.local, "conn", None)
        if c is None:
            c = http.client.HTTPSConnection(self.host, self.port, context=self.ctx, timeout=60)
            self.local.conn = c
        return c

    def req(self, method, path, body=None, count=None, ctype="application/json"):
        if count:
            with self.lock:
                self.counts[count] = self.counts.get(count, 0) + 1
        data = json.dumps(body).encode() if body is not None and not isinstance(body, bytes) else body
        headers = {"Accept": "application/json"}
        if data is not None:
            headers["Content-Type"] = ctype
        for attempt in range(3):
            c = self._conn()
            try:
                c.request(method, path, body=data, headers=headers)
                r = c.getresponse()
                raw = r.read()
                return r.status, raw
            except (http.client.HTTPException, OSError):
                c.close()
                self.local.conn = None
                if attempt == 2:
                    raise
                time.sleep(0.2)

    def json(self, method, path, body=None, count=None, ok=(200, 201)):
        st, raw = self.req(method, path, body, count)
        if st not in ok:
            raise RuntimeError(f"{method} {path}: {st} {raw[:300]!r}")
        return json.loads(raw) if raw else None

    def metrics(self):
        st, raw = self.req("GET", "/metrics")
        if st != 200:
            raise RuntimeError(f"/metrics: {st}")
        return raw.decode()


LINE = re.compile(r'^apiserver_request_total\{([^}]*)\} ([0-9.e+]+)$')
LABEL = re.compile(r'(\w+)="([^"]*)"')


def request_counts(text):
    """(group, resource, subresource, verb, code) -> count."""
    out = {}
    for line in text.splitlines():
        m = LINE.match(line)
        if not m:
            continue
        lab = dict(LABEL.findall(m.group(1)))
        key = (lab.get("group", ""), lab.get("resource", ""), lab.get("subresource", ""),
               lab.get("verb", ""), lab.get("code", ""))
        out[key] = out.get(key, 0) + float(m.group(2))
    return out


def diff_counts(before, after, ours):
    """{resource: {VERB: n}} for the resources we watch, minus our own requests."""
    res = {}
    for key, v in after.items():
        d = v - before.get(key, 0)
        if d <= 0:
            continue
        group, resource, sub, verb, code = key
        if resource not in WATCHED:
            continue
        name = resource + (f"/{sub}" if sub else "")
        if resource == "events":
            name = f"events ({group or 'core'})"
        res.setdefault(name, {})
        res[name][verb] = res[name].get(verb, 0) + int(d)
        if not code.startswith("2"):
            res[name][f"{verb} {code}"] = res[name].get(f"{verb} {code}", 0) + int(d)
    for (resource, verb), n in ours.items():
        if resource in res and verb in res[resource]:
            res[resource][verb] -= n
            if res[resource][verb] == 0:
                del res[resource][verb]
    return {k: v for k, v in sorted(res.items()) if v}


# ---------------------------------------------------------------- helpers

def kubectl(kubeconfig, *args, check=True, timeout=120):
    r = subprocess.run([KUBECTL, "--kubeconfig", kubeconfig, *args],
                       capture_output=True, text=True, timeout=timeout)
    if check and r.returncode != 0:
        raise RuntimeError(f"kubectl {' '.join(args)}: {r.stderr.strip()}")
    return r.stdout


def wait_until(what, secs, check, every=0.2):
    deadline = time.monotonic() + secs
    while time.monotonic() < deadline:
        v = check()
        if v:
            return v
        time.sleep(every)
    raise TimeoutError(f"{what}: not within {secs} s")


def ensure_namespace(api, ns):
    def gone_or_active():
        st, raw = api.req("GET", f"/api/v1/namespaces/{ns}")
        return st if st == 404 or "deletionTimestamp" not in json.loads(raw)["metadata"] else None

    st = wait_until(f"namespace {ns} of an earlier run terminated", 180, gone_or_active, 1)
    if st == 404:
        api.json("POST", "/api/v1/namespaces", {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": ns}})
    st, _ = api.req("GET", f"/api/v1/namespaces/{ns}/serviceaccounts/default")
    if st == 404:
        api.req("POST", f"/api/v1/namespaces/{ns}/serviceaccounts",
                {"apiVersion": "v1", "kind": "ServiceAccount", "metadata": {"name": "default"}})


def pod_obj(ns, name, annotations=None, labels=None):
    md = {"name": name, "namespace": ns}
    if annotations:
        md["annotations"] = annotations
    if labels:
        md["labels"] = labels
    return {"apiVersion": "v1", "kind": "Pod", "metadata": md,
            "spec": {"automountServiceAccountToken": False,
                     "containers": [{"name": "c", "image": "registry.invalid/pause"}]}}


def create_pods(api, ns, names, parallel, make=None):
    """Creates pods with `parallel` connections; returns name -> uid."""
    make = make or (lambda n: pod_obj(ns, n))

    def one(n):
        return n, api.json("POST", f"/api/v1/namespaces/{ns}/pods", make(n))["metadata"]["uid"]

    with cf.ThreadPoolExecutor(parallel) as ex:
        return dict(ex.map(one, names))


def count_pods(api, ns):
    c = ("pods", "LIST")
    items = api.json("GET", f"/api/v1/namespaces/{ns}/pods?limit=500", count=c)
    n = len(items["items"])
    cont = items["metadata"].get("continue")
    while cont:
        items = api.json("GET", f"/api/v1/namespaces/{ns}/pods?limit=500&continue={urllib.parse.quote(cont)}", count=c)
        n += len(items["items"])
        cont = items["metadata"].get("continue")
    return n


def pool_state(api, count=None):
    st, raw = api.req("GET", f"{GROUP}/namespaces/{NS}/ippools/{POOL}",
                      count=("ippools", "GET") if count else None)
    allocs = len(json.loads(raw)["spec"].get("allocations") or {}) if st == 200 else 0
    res = api.json("GET", f"{GROUP}/namespaces/{NS}/overlappingrangeipreservations",
                   count=("overlappingrangeipreservations", "LIST") if count else None)
    return allocs, len(res["items"])


def proc_status(pid):
    out = {}
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                k, _, v = line.partition(":")
                if k in ("VmHWM", "VmRSS"):
                    out[k] = round(int(v.split()[0]) / 1024, 1)  # MiB
    except FileNotFoundError:
        pass
    return out


def free_port():
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    p = s.getsockname()[1]
    s.close()
    return p


def http_get(port, path, timeout=5):
    try:
        c = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
        c.request("GET", path)
        r = c.getresponse()
        return r.status, r.read().decode()
    except OSError:
        return None, ""


def operator_metric(text, name):
    out = {}
    for line in text.splitlines():
        if line.startswith(name):
            k, _, v = line.rpartition(" ")
            out[k] = float(v)
    return out


class Operator:
    def __init__(self, binary, kubeconfig, logpath):
        self.port = free_port()
        self.logpath = logpath
        env = dict(os.environ, KUBECONFIG=kubeconfig, RUST_LOG="info", NO_COLOR="1")
        self.proc = subprocess.Popen(
            [binary, "run", f"--admin-addr=127.0.0.1:{self.port}", f"--pool-namespace={NS}",
             "--leader-election=false"],
            env=env, stdout=subprocess.DEVNULL, stderr=open(logpath, "w"))
        started = time.monotonic()

        def ready():
            if self.proc.poll() is not None:
                raise RuntimeError(f"operator exited: {self.log()[-2000:]}")
            st, body = http_get(self.port, "/readyz", 2)
            return st == 200 and body.strip() == "ok"

        wait_until("operator /readyz", 120, ready)
        self.ready_s = time.monotonic() - started

    def metrics(self):
        return http_get(self.port, "/metrics")[1]

    def status(self):
        return proc_status(self.proc.pid)

    def log(self):
        with open(self.logpath) as f:
            return re.sub(r"\x1b\[[0-9;]*m", "", f.read())

    def problems(self):
        return [l for l in self.log().splitlines() if re.search(r"\b(WARN|ERROR)\b", l)]

    def stop(self):
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)


# ---------------------------------------------------------------- phases

def allocate(args, api, uids, conf):
    # The node's whereabouts directory is the one holding the flat file the config names.
    node_dir = os.path.dirname(conf["ipam"]["configuration_path"])
    env_base = dict(os.environ, CNI_COMMAND="ADD", CNI_IFNAME="net1", CNI_NETNS="/x", CNI_PATH="/x",
                    WHEREABOUTS_CONF_DIR=node_dir)
    stdin = json.dumps(conf).encode()

    def one(name):
        env = dict(env_base, CNI_CONTAINERID=f"c-{name}",
                   CNI_ARGS=f"IgnoreUnknown=1;K8S_POD_NAMESPACE={NS};K8S_POD_NAME={name};K8S_POD_UID={uids[name]}")
        t = time.monotonic()
        r = subprocess.run([args.plugin], input=stdin, env=env, capture_output=True, timeout=120)
        ok = r.returncode == 0 and b'"ips"' in r.stdout
        return name, ok, time.monotonic() - t, (r.stdout + r.stderr)[-300:].decode(errors="replace")

    t0 = time.monotonic()
    with cf.ThreadPoolExecutor(args.parallel) as ex:
        results = list(ex.map(one, sorted(uids)))
    took = time.monotonic() - t0
    failed = [(n, out) for n, ok, _, out in results if not ok]
    lat = sorted(x[2] for x in results)
    return {"seconds": round(took, 2), "failed": len(failed), "failed_samples": failed[:3],
            "p50_ms": round(lat[len(lat) // 2] * 1000, 1), "p99_ms": round(lat[int(len(lat) * 0.99) - 1] * 1000, 1)}


def release_run(args, api, kubeconfig_admin, tmp, run_no):
    r = {"run": run_no, "load_start": loadavg()}
    ensure_namespace(api, NS)
    # Leftovers of an earlier run: no pods, an empty pool, no reservations.
    if count_pods(api, NS):
        api.req("DELETE", f"/api/v1/namespaces/{NS}/pods")
        wait_until("old pods gone", 120, lambda: count_pods(api, NS) == 0, 1)
    api.req("DELETE", f"{GROUP}/namespaces/{NS}/ippools/{POOL}")
    api.req("DELETE", f"{GROUP}/namespaces/{NS}/overlappingrangeipreservations")

    kc = os.path.join(tmp, "bench.kubeconfig")
    shutil.copy(kubeconfig_admin, kc)
    kubectl(kc, "config", "set-context", "--current", f"--namespace={NS}")
    flat = os.path.join(tmp, "whereabouts.conf")
    with open(flat, "w") as f:
        json.dump({"kubernetes": {"kubeconfig": kc}}, f)
    conf = {"cniVersion": "1.0.0", "name": "bench", "type": "bridge",
            "ipam": {"type": "whereabouts", "range": RANGE, "configuration_path": flat}}

    names = [f"p-{i}" for i in range(args.pods)]
    t = time.monotonic()
    uids = create_pods(api, NS, names, 8)
    r["create_pods_s"] = round(time.monotonic() - t, 2)
    log(f"run {run_no}: {len(uids)} pods created in {r['create_pods_s']} s; allocating (x{args.parallel})")
    r["cni_add"] = allocate(args, api, uids, conf)
    log(f"run {run_no}: CNI ADD {r['cni_add']}")
    allocs, res = pool_state(api)
    r["allocated"], r["reservations"] = allocs, res
    if r["cni_add"]["failed"] or allocs != args.pods or res != args.pods:
        raise RuntimeError(f"allocation check failed: {allocs} entries, {res} reservations, {r['cni_add']}")

    op = Operator(args.operator, kubeconfig_admin, os.path.join(tmp, f"operator-{run_no}.log"))
    try:
        r["operator_ready_s"] = round(op.ready_s, 2)
        time.sleep(3)  # start-up audit and NAD pass done
        r["rss_before_mib"] = op.status()
        api.counts.clear()
        m_before = request_counts(api.metrics())
        rel_before = operator_metric(op.metrics(), "whereabouts_releases_total")

        r["load_at_delete"] = loadavg()
        wall0 = time.time()
        t0 = time.monotonic()
        st, raw = api.req("DELETE", f"/api/v1/namespaces/{NS}/pods", count=("pods", "DELETE"))
        if st != 200:
            raise RuntimeError(f"deletecollection: {st} {raw[:200]!r}")
        r["deletecollection_returned_s"] = round(time.monotonic() - t0, 2)
        samples, peak = [], {}
        deadline = t0 + args.timeout
        done = None
        while time.monotonic() < deadline:
            now = time.monotonic() - t0
            allocs, res = pool_state(api, count=True)
            samples.append((round(now, 2), allocs, res))
            s = op.status()
            peak = {k: max(peak.get(k, 0), v) for k, v in s.items()}
            if allocs == 0 and res == 0:
                done = now
                break
            time.sleep(0.2)
        r["all_free_s"] = round(done, 2) if done is not None else None
        r["samples"] = samples
        left = samples[-1][1:] if samples else None
        if done is None:
            log(f"run {run_no}: NOT all free after {args.timeout} s: {left}")
        else:
            log(f"run {run_no}: all {args.pods} addresses free after {done:.2f} s")
        r["load_after"] = loadavg()
        time.sleep(3)  # trailing events
        r["api_requests"] = diff_counts(m_before, request_counts(api.metrics()), api.counts)
        r["our_requests_subtracted"] = {f"{k[0]} {k[1]}": v for k, v in api.counts.items()}
        rel_after = operator_metric(op.metrics(), "whereabouts_releases_total")
        r["releases_total"] = {k: v - rel_before.get(k, 0) for k, v in rel_after.items()}
        r["release_errors"] = operator_metric(op.metrics(), "whereabouts_release_errors_total")
        r["rss_after_mib"] = op.status()
        r["rss_peak_sampled_mib"] = peak
        stamps = released_stamps(op.log())
        r["released_log_lines"] = len(stamps)
        if stamps:  # operator-side: first and last "released" log line after the deletion request
            r["operator_first_release_s"] = round(stamps[0] - wall0, 2)
            r["operator_last_release_s"] = round(stamps[-1] - wall0, 2)

        if args.rss_pods and (run_no == 1 or args.rss_every_run):
            r["rss"] = rss_phase(args, api, op, run_no)
        r["operator_problems"] = op.problems()[:20]
        r["operator_problem_count"] = len(op.problems())
    finally:
        op.stop()
        r["operator_log"] = op.logpath
    return r


def released_stamps(text):
    import datetime
    out = []
    for l in text.splitlines():
        m = re.match(r"(\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d+)Z\s+INFO .*: released ", l)
        if m:
            out.append(datetime.datetime.fromisoformat(m.group(1)[:26]).replace(tzinfo=datetime.timezone.utc).timestamp())
    return sorted(out)


def annotation(i):
    # Multus network-status of a pod with a primary and one secondary network (~300 bytes).
    a, b = divmod(i, 250)
    return json.dumps([
        {"name": "cluster-default", "interface": "eth0", "ips": [f"10.244.{a}.{b + 2}"],
         "mac": "0a:58:0a:f4:00:09", "default": True, "dns": {}},
        {"name": f"{RSS_NS}/macvlan-net", "interface": "net1", "ips": [f"10.200.{a}.{b + 2}"],
         "mac": "ee:7f:3a:12:9c:41", "dns": {}, "gateway": ["10.200.0.1"]},
    ], separators=(",", ":"))


def rss_phase(args, api, op, run_no):
    r = {"pods": args.rss_pods, "load_start": loadavg()}
    ensure_namespace(api, RSS_NS)
    r["rss_before_mib"] = op.status()
    names = [f"r-{i}" for i in range(args.rss_pods)]

    def make(n):
        i = int(n[2:])
        return pod_obj(RSS_NS, n, {"k8s.v1.cni.cncf.io/network-status": annotation(i)},
                       {"app": f"app-{i % 50}", "pod-template-hash": f"{i % 50:05x}7f9c",
                        "tier": "backend", "version": "v1"})

    t = time.monotonic()
    create_pods(api, RSS_NS, names, 8, make)
    r["create_s"] = round(time.monotonic() - t, 1)
    log(f"run {run_no}: {args.rss_pods} pods created in {r['create_s']} s; waiting for RSS to settle")
    # The operator has no cached-pod gauge: wait until RSS has not grown for 5 s (max 60 s).
    hist, stable_since, last = [], time.monotonic(), 0
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        s = op.status()
        hist.append(s.get("VmRSS"))
        if s.get("VmRSS", 0) > last + 0.5:
            last, stable_since = s.get("VmRSS", 0), time.monotonic()
        elif time.monotonic() - stable_since >= 5:
            break
        time.sleep(0.5)
    st, body = http_get(op.port, "/readyz")
    r["readyz"] = body.strip()
    r["rss_with_pods_mib"] = op.status()
    r["load_at_rss"] = loadavg()
    log(f"run {run_no}: RSS with {args.rss_pods} cached pods: {r['rss_with_pods_mib']} (load {r['load_at_rss']})")

    # Delete them all: allocation-less deletions must cost the operator no API requests.
    api.counts.clear()
    m_before = request_counts(api.metrics())
    t0 = time.monotonic()
    api.req("DELETE", f"/api/v1/namespaces/{RSS_NS}/pods", count=("pods", "DELETE"))
    wait_until("rss pods gone", 300, lambda: count_pods(api, RSS_NS) == 0, 1)
    r["delete_s"] = round(time.monotonic() - t0, 1)
    time.sleep(5)
    r["api_requests_on_delete"] = diff_counts(m_before, request_counts(api.metrics()), api.counts)
    r["our_requests_subtracted"] = {f"{k[0]} {k[1]}": v for k, v in api.counts.items()}
    r["rss_after_delete_mib"] = op.status()
    return r


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--kubeconfig", help="admin kubeconfig of a running cluster (default: start a private one)")
    ap.add_argument("--keep-cluster", action="store_true")
    ap.add_argument("--pods", type=int, default=1000)
    ap.add_argument("--rss-pods", type=int, default=10000, help="0 to skip the RSS phase")
    ap.add_argument("--rss-every-run", action="store_true")
    ap.add_argument("--runs", type=int, default=1)
    ap.add_argument("--parallel", type=int, default=4, help="concurrent CNI ADDs (16 took 13 min for 1000)")
    ap.add_argument("--timeout", type=float, default=600, help="max seconds to wait for release")
    ap.add_argument("--operator", default=os.path.join(REPO, "target/release/whereabouts-operator"))
    ap.add_argument("--plugin", default=os.path.join(REPO, "target/release/whereabouts"))
    ap.add_argument("--out", default=os.path.join(REPO, "bench/results", f"operator-{time.strftime('%Y%m%dT%H%M%SZ', time.gmtime())}.json"))
    args = ap.parse_args()

    started_cluster = False
    kubeconfig = args.kubeconfig
    env = dict(os.environ, WHEREABOUTS_E2E_STATE=STATE)
    if not kubeconfig:
        out = subprocess.run([os.path.join(REPO, "e2e/cluster.sh"), "up"], env=env,
                             capture_output=True, text=True, timeout=3600)
        if out.returncode != 0:
            sys.exit(f"cluster.sh up failed: {out.stderr[-2000:]}")
        kubeconfig = out.stdout.strip().splitlines()[-1]
        started_cluster = True
    tmp = tempfile.mkdtemp(prefix="opbench-")
    result = {"date_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "pods": args.pods,
              "rss_pods": args.rss_pods, "parallel": args.parallel,
              "commit": subprocess.run(["git", "-C", REPO, "rev-parse", "--short", "HEAD"],
                                       capture_output=True, text=True).stdout.strip(),
              "nproc": os.cpu_count(), "runs": []}
    try:
        kubectl(kubeconfig, "apply", "-f", os.path.join(REPO, "crds"))
        kubectl(kubeconfig, "wait", "--for=condition=Established", "--timeout=60s",
                "crd/ippools.whereabouts.cni.cncf.io", "crd/overlappingrangeipreservations.whereabouts.cni.cncf.io")
        result["server_version"] = json.loads(kubectl(kubeconfig, "version", "-o", "json")).get("serverVersion", {}).get("gitVersion")
        api = Api(kubeconfig, tmp)
        for i in range(1, args.runs + 1):
            try:
                result["runs"].append(release_run(args, api, kubeconfig, tmp, i))
            except Exception as e:  # keep what the other runs measured
                log(f"run {i} failed: {e}")
                result["runs"].append({"run": i, "error": str(e)})
        # Leave nothing behind in the cluster.
        for ns in (NS, RSS_NS):
            api.req("DELETE", f"/api/v1/namespaces/{ns}")
    finally:
        os.makedirs(os.path.dirname(args.out), exist_ok=True)
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)
        if started_cluster and not args.keep_cluster:
            subprocess.run([os.path.join(REPO, "e2e/cluster.sh"), "down"], env=env, timeout=120)

    for r in result["runs"]:
        if "error" in r:
            print(f"run {r['run']}: ERROR {r['error']}")
            continue
        print(f"## run {r['run']} (load at delete {r['load_at_delete']})")
        print(f"- CNI ADD x{args.pods} ({args.parallel} parallel): {r['cni_add']['seconds']} s, "
              f"p50 {r['cni_add']['p50_ms']} ms, p99 {r['cni_add']['p99_ms']} ms, failed {r['cni_add']['failed']}")
        print(f"- all {args.pods} addresses free after: {r['all_free_s']} s "
              f"(deletecollection returned after {r['deletecollection_returned_s']} s)")
        print(f"- operator log: first/last 'released' line at {r.get('operator_first_release_s')} / {r.get('operator_last_release_s')} s ({r['released_log_lines']} lines)")
        print(f"- whereabouts_releases_total delta: {r['releases_total']}; errors: {r['release_errors']}")
        print(f"- operator RSS before/peak/after (MiB): {r['rss_before_mib']} / {r['rss_peak_sampled_mib']} / {r['rss_after_mib']}")
        print(f"- API requests during release (ours subtracted): {json.dumps(r['api_requests'])}")
        if "rss" in r:
            s = r["rss"]
            print(f"- RSS with {s['pods']} pods cached: {s['rss_with_pods_mib']} (before {s['rss_before_mib']}, load {s['load_at_rss']})")
            print(f"- API requests while deleting those {s['pods']}: {json.dumps(s['api_requests_on_delete'])}")
        print(f"- operator WARN/ERROR lines: {r['operator_problem_count']}")
        for l in r["operator_problems"][:5]:
            print(f"    {l}")
    print(f"results: {args.out}")


if __name__ == "__main__":
    main()
