"""Measure issue 17's refusals against real processes: a worker on the demo pair, gateways, a real Redis.

    .venv/bin/python scripts/hardening-check.py [--redis-url redis://127.0.0.1:6379/0] [--json OUT]

What each bad request or fault gets (status, error code, seconds to the answer), whether the client's keep-alive
connection survived it, and the worker's resident memory before, at its peak during, and after the refusals.
The figures behind docs/gateway.md's status table (docs/results/hardening-check.json); the assertions on the
same behaviour, with generous bounds, are tests/gateway/test_hardening.py.
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import platform
import sys
import tempfile
import threading
import time
import uuid
from pathlib import Path
from typing import Any

import httpx
import redis

from adaserve.server_process import ServerProcess, free_port

ROOT = Path(__file__).resolve().parents[1]
MB = 1024 * 1024
GOOD = b'{"model": "demo", "prompt": "def add(a, b):", "max_tokens": 2, "temperature": 0}'


def start(cmd: list[str], log: Path, env: dict[str, str]) -> ServerProcess:
    port = free_port()
    full = [sys.executable, "-m", "adaserve", *cmd, "--host", "127.0.0.1", "--port", str(port)]
    return ServerProcess.start(full, url=f"http://127.0.0.1:{port}", name=cmd[0], log=log, cwd=ROOT,
                               env={**os.environ, **env})


def wait(server: ServerProcess, path: str, timeout_s: float = 300.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            if httpx.get(server.url + path, timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.25)
    raise SystemExit(f"{server.name} not ready at {server.url}{path}")


def rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return round(int(line.split()[1]) / 1024, 1)
    return float("nan")


class PeakRss:
    """Samples a process's RSS every 10 ms in a thread: the peak between start and stop."""

    def __init__(self, pid: int) -> None:
        self.pid, self.peak, self._stop = pid, 0.0, threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            self.peak = max(self.peak, rss_mb(self.pid))
            time.sleep(0.01)

    def __enter__(self) -> PeakRss:
        self._thread.start()
        return self

    def __exit__(self, *_: object) -> None:
        self._stop.set()
        self._thread.join()


def error_of(r: httpx.Response) -> dict[str, Any]:
    """The gateway's error code, or the worker's detail (its errors have no code)."""
    try:
        doc = r.json()
    except ValueError:
        return {}
    if isinstance(doc, dict) and isinstance(doc.get("error"), dict):
        return {"code": doc["error"].get("code")}
    return {"detail": doc["detail"][:120]} if isinstance(doc, dict) and "detail" in doc else {}


def timed(method: str, url: str, **kw: Any) -> dict[str, Any]:
    t0 = time.monotonic()
    r = httpx.request(method, url, timeout=120, **kw)
    return {"status": r.status_code, **(error_of(r) if r.status_code >= 400 else {}),
            "seconds": round(time.monotonic() - t0, 3),
            **({"retry_after": r.headers["Retry-After"]} if "Retry-After" in r.headers else {})}


def keep_alive(url: str, path: str, bad: bytes, good: bytes) -> dict[str, Any]:
    u = httpx.URL(url)
    conn = http.client.HTTPConnection(u.host, u.port, timeout=120)
    try:
        t0 = time.monotonic()
        conn.request("POST", path, body=bad, headers={"content-type": "application/json"})
        r1 = conn.getresponse()
        body = json.loads(r1.read())
        took = time.monotonic() - t0
        sock = conn.sock
        conn.request("POST", path, body=good, headers={"content-type": "application/json"})
        r2 = conn.getresponse()
        r2.read()
        err = body.get("error", {}) if isinstance(body.get("error"), dict) else {}
        return {"status": r1.status, "code": err.get("code"), "message": err.get("message") or body.get("detail"),
                "seconds": round(took, 3), "next_request_status": r2.status,
                "same_connection": sock is not None and conn.sock is sock}
    finally:
        conn.close()


def big(n_bytes: int) -> bytes:
    head, tail = b'{"model": "demo", "prompt": "', b'"}'
    return head + b"a" * (n_bytes - len(head) - len(tail)) + tail


def chunks(payload: bytes) -> Any:
    return (payload[i:i + MB] for i in range(0, len(payload), MB))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--redis-url", default="redis://127.0.0.1:6379/0")
    p.add_argument("--json", type=Path)
    a = p.parse_args()
    r = redis.Redis.from_url(a.redis_url, decode_responses=True)
    prefix = f"adaserve-hardening-{uuid.uuid4().hex[:8]}"
    tmp = Path(tempfile.mkdtemp(prefix="hardening-"))
    demo = ROOT / "models" / "demo"
    procs: list[ServerProcess] = []
    out: dict[str, Any] = {"machine": f"{platform.machine()}, {os.cpu_count()} cores", "model": "demo pair"}
    try:
        worker = start(["worker", "--target", str(demo / "target"), "--draft", str(demo / "draft"), "--budget", "8",
                        "--redis-url", a.redis_url, "--worker-id", "w-check", "--model-name", "demo"],
                       tmp / "worker.log", {"ADASERVE_REDIS_PREFIX": prefix, "ADASERVE_TORCH_THREADS": "1"})
        procs.append(worker)
        wait(worker, "/readyz")
        keys = tmp / "keys.json"
        ka, kb = "sk-team-a-0123456789", "sk-team-b-0123456789"
        keys.write_text(json.dumps({"keys": [{"key": ka, "name": "team-a"}, {"key": kb, "name": "team-b"}]}))
        gw = start(["gateway", "--redis-url", a.redis_url, "--redis-prefix", prefix], tmp / "gw.log", {})
        procs.append(gw)
        wait(gw, "/readyz", 60)
        g, w = gw.url, worker.url
        pid = worker.proc.pid
        httpx.post(f"{w}/v1/generate", json={"prompt": "def", "max_tokens": 8}, timeout=60)  # settle allocations
        out["worker_rss_mb_before"] = rss_mb(pid)

        surrogate = b'{"model": "demo", "prompt": "\\ud800", "max_tokens": 4}'
        chat_good = b'{"model": "demo", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}'
        out["surrogate"] = {
            "gateway_completions": keep_alive(g, "/v1/completions", surrogate, GOOD),
            "gateway_chat": keep_alive(g, "/v1/chat/completions",
                                       b'{"model": "demo", "messages": [{"role": "user", "content": "\\ud800"}]}',
                                       chat_good),
            "gateway_streaming": keep_alive(g, "/v1/completions", surrogate[:-1] + b', "stream": true}', GOOD),
            "worker": keep_alive(w, "/v1/generate", b'{"prompt": "\\ud800"}', b'{"prompt": "def", "max_tokens": 2}'),
        }
        with PeakRss(pid) as peak:
            body20 = big(20 * MB)
            out["body_20mb"] = {
                "gateway_content_length": timed("POST", f"{g}/v1/completions", content=body20),
                "gateway_chunked": timed("POST", f"{g}/v1/completions", content=chunks(body20)),
                "worker_content_length": timed("POST", f"{w}/v1/generate", content=body20),
                "worker_chunked": timed("POST", f"{w}/v1/generate", content=chunks(body20)),
            }
            prompt4 = {"model": "demo", "prompt": "word " * (800 * 1000), "max_tokens": 4}  # 4,000,000 characters
            out["prompt_4mb_over_context"] = {
                "gateway": timed("POST", f"{g}/v1/completions", json=prompt4),
                "worker": timed("POST", f"{w}/v1/generate", json={k: v for k, v in prompt4.items() if k != "model"}),
            }
        out["worker_rss_mb_peak_during_refusals"] = peak.peak
        time.sleep(1.0)
        out["worker_rss_mb_after"] = rss_mb(pid)

        # records: key A's request, read by A and by B
        kgw = start(["gateway", "--redis-url", a.redis_url, "--redis-prefix", prefix, "--api-keys-file", str(keys)],
                    tmp / "gw-keys.log", {})
        procs.append(kgw)
        wait(kgw, "/readyz", 60)
        made = httpx.post(f"{kgw.url}/v1/completions", content=GOOD, timeout=60,
                          headers={"content-type": "application/json", "Authorization": f"Bearer {ka}"})
        rid = made.headers.get("X-Request-Id", "none")
        time.sleep(0.5)
        out["record"] = {who: timed("GET", f"{kgw.url}/v1/requests/{rid}", headers={"Authorization": f"Bearer {k}"})
                         for who, k in (("own_key", ka), ("other_key", kb))}

        # faults: no worker registered; Redis unreachable
        empty = start(["gateway", "--redis-url", a.redis_url, "--redis-prefix", f"{prefix}-empty"],
                      tmp / "gw-empty.log", {})
        procs.append(empty)
        wait(empty, "/healthz", 60)
        out["no_workers"] = timed("POST", f"{empty.url}/v1/completions", content=GOOD,
                                  headers={"content-type": "application/json"})
        noredis = start(["gateway", "--redis-url", f"redis://127.0.0.1:{free_port()}/0", "--workers", w],
                        tmp / "gw-noredis.log", {})
        procs.append(noredis)
        wait(noredis, "/healthz", 60)
        out["redis_unreachable"] = {"record": timed("GET", f"{noredis.url}/v1/requests/cmpl-123"),
                                    "completion": timed("POST", f"{noredis.url}/v1/completions", content=GOOD,
                                                        headers={"content-type": "application/json"})}
        # the last worker dies (kill -9) while its registration is still live: 503 no_workers, not a wait
        worker.proc.kill()
        worker.proc.wait(10)
        out["last_worker_dead"] = timed("POST", f"{g}/v1/completions", content=GOOD,
                                        headers={"content-type": "application/json"})
        logs = ("worker.log", "gw.log", "gw-keys.log", "gw-empty.log", "gw-noredis.log")
        out["tracebacks_in_logs"] = sum((tmp / f).read_text(errors="replace").count("Traceback") for f in logs)
    finally:
        for proc in reversed(procs):
            proc.stop(30)
        keys_left = list(r.scan_iter(f"{prefix}*"))
        if keys_left:
            r.delete(*keys_left)
    text = json.dumps(out, indent=2)
    print(text)
    if a.json:
        a.json.write_text(text + "\n")


if __name__ == "__main__":
    main()
