"""A small Kubernetes API client for the chaos driver: standard library only.

The driver's own calls must survive the faults it injects (the API server restarted or paused,
etcd restarted), so every call is retried on connection errors, timeouts, 429 and 5xx until its
deadline; 4xx answers are returned to the caller, who decides (404 on a delete is success).
"""

import base64
import json
import re
import ssl
import tempfile
import time
import http.client
import urllib.parse
from pathlib import Path


class ApiError(Exception):
    def __init__(self, method, path, status, body):
        super().__init__(f"{method} {path}: HTTP {status}: {body[:300]}")
        self.status = status


def _field(text, key):
    m = re.search(rf"^\s*{re.escape(key)}:\s*(\S+)\s*$", text, re.M)
    if not m:
        raise ValueError(f"kubeconfig: no {key}")
    return m.group(1)


class Kube:
    """The admin identity of e2e/cluster.sh's kubeconfig (inline certificate data)."""

    def __init__(self, kubeconfig, timeout=10.0):
        text = Path(kubeconfig).read_text()
        url = urllib.parse.urlparse(_field(text, "server"))
        self.host, self.port = url.hostname, url.port
        self.timeout = timeout
        self._tmp = tempfile.TemporaryDirectory(prefix="wa-chaos-kube-")
        files = {}
        for key in ("certificate-authority-data", "client-certificate-data", "client-key-data"):
            path = Path(self._tmp.name) / key
            path.write_bytes(base64.b64decode(_field(text, key)))
            files[key] = str(path)
        self.ctx = ssl.create_default_context(cafile=files["certificate-authority-data"])
        self.ctx.load_cert_chain(files["client-certificate-data"], files["client-key-data"])

    def _once(self, method, path, body, content_type):
        conn = http.client.HTTPSConnection(self.host, self.port, context=self.ctx,
                                           timeout=self.timeout)
        try:
            # The API server records managedFields only for a named field manager (user agent).
            headers = {"Accept": "application/json", "User-Agent": "whereabouts-e2e"}
            data = None
            if body is not None:
                data = json.dumps(body).encode()
                headers["Content-Type"] = content_type
            conn.request(method, path, body=data, headers=headers)
            resp = conn.getresponse()
            return resp.status, resp.read().decode(errors="replace")
        finally:
            conn.close()

    def call(self, method, path, body=None, deadline_s=120.0,
             content_type="application/json"):
        """(status, parsed body or text). Retries transport errors, 429 and 5xx."""
        deadline = time.monotonic() + deadline_s
        delay = 0.2
        while True:
            try:
                status, text = self._once(method, path, body, content_type)
                if status < 500 and status != 429:
                    try:
                        return status, json.loads(text) if text else None
                    except ValueError:
                        return status, text
                last = f"HTTP {status}: {text[:200]}"
            except (OSError, http.client.HTTPException) as e:
                last = f"{type(e).__name__}: {e}"
            if time.monotonic() + delay > deadline:
                raise ApiError(method, path, 0, f"gave up after {deadline_s} s: {last}")
            time.sleep(delay)
            delay = min(delay * 2, 2.0)

    def ok(self, method, path, body=None, allow=(), **kw):
        status, doc = self.call(method, path, body, **kw)
        if status >= 400 and status not in allow:
            raise ApiError(method, path, status, json.dumps(doc) if doc is not None else "")
        return doc

    def items(self, path):
        return self.ok("GET", path).get("items") or []

    def healthy(self):
        try:
            status, _ = self._once("GET", "/readyz", None, None)
            return status == 200
        except (OSError, http.client.HTTPException):
            return False
