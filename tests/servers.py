"""Real workers and gateways for tests: ``python -m adaserve worker|gateway`` on free loopback ports, each
with its output in a log file, started and stopped as adaserve/server_process.py does for ``adaserve up``."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from adaserve.engine.loading.catalog import DERIVE_FILE, ensure_demo_draft
from adaserve.server_process import NotReady, ServerProcess, free_port

ROOT = Path(__file__).resolve().parents[1]
DEMO = Path(os.environ.get("ADASERVE_TEST_DEMO_DIR", ROOT / "models" / "demo"))  # another pair: set this
MODEL_FILES = ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json")
READY_TIMEOUT_S = 300.0  # the machine is shared: loading and profiling can be slow


def demo_pair(wait_s: float = 600.0) -> tuple[Path, Path]:
    """The demo target/draft pair (the draft built from the target if need be). It may be mid-retraining
    (directories replaced at the end): wait."""
    if (DEMO / "draft" / DERIVE_FILE).is_file():
        ensure_demo_draft(DEMO.parent)
    dirs = (DEMO / "target", DEMO / "draft")
    deadline = time.monotonic() + wait_s
    while True:
        if all((d / f).is_file() for d in dirs for f in MODEL_FILES):
            return dirs
        if not DEMO.exists() or time.monotonic() > deadline:
            pytest.skip(f"demo model pair not found under {DEMO}")
        time.sleep(5)


@dataclass
class Service:
    """A worker or gateway process; failures are assertions that quote the end of its log."""

    server: ServerProcess
    log: Path

    @property
    def url(self) -> str:
        return self.server.url

    @property
    def proc(self) -> subprocess.Popen[bytes]:
        return self.server.proc

    def logs(self) -> str:
        return self.log.read_text(errors="replace")

    def wait_ready(self, path: str = "/readyz", timeout: float = READY_TIMEOUT_S) -> list[str]:
        """Until ``path`` answers 200; returns the states it reported before (a worker: e.g. ['loading'])."""
        seen: list[str] = []

        def note(answer: httpx.Response) -> None:
            try:
                seen.append(str(answer.json()["status"]))
            except (ValueError, KeyError, TypeError):
                seen.append(f"HTTP {answer.status_code}")

        try:
            self.server.wait_ready_blocking(path, timeout_s=timeout, on_answer=note)
        except NotReady as e:
            raise AssertionError(f"{e}:\n{self.logs()[-4000:]}") from None
        return seen

    def stop(self, timeout: float = 60.0) -> int:
        return self.server.stop(timeout)


class GatewayProcess(Service):
    def wait_workers(self, n: int, timeout: float = 30.0) -> None:
        """Until /readyz lists at least ``n`` workers (the gateway re-reads the list every refresh)."""
        deadline = time.monotonic() + timeout
        body: object = None
        while time.monotonic() < deadline:
            r = httpx.get(f"{self.url}/readyz", timeout=2)
            body = r.json()
            if r.status_code == 200 and r.json()["ready_workers"] >= n:
                return
            time.sleep(0.1)
        raise AssertionError(f"gateway sees fewer than {n} workers: {body}\n{self.logs()[-2000:]}")


def start_worker(target: Path, draft: Path, log: Path, *args: str, env: dict[str, str] | None = None) -> Service:
    """A worker starting (not waited for: see ``wait_ready``); one torch thread, as the machine is shared."""
    port = free_port()
    cmd = [sys.executable, "-m", "adaserve", "worker", "--target", str(target), "--draft", str(draft),
           "--host", "127.0.0.1", "--port", str(port), *args]
    server = ServerProcess.start(cmd, url=f"http://127.0.0.1:{port}", name="the worker", log=log, cwd=ROOT,
                                 env={**os.environ, "ADASERVE_TORCH_THREADS": "1", **(env or {})})
    return Service(server, log)


def ready_then_stopped(procs: list[Service]) -> Iterator[list[Service]]:
    """A fixture's body (``yield from``): every process ready, handed over, and all stopped afterwards."""
    try:
        for p in procs:
            p.wait_ready()
        yield procs
    finally:
        for p in procs:
            p.stop()


def start_gateway(log: Path, *args: str, env: dict[str, str] | None = None) -> GatewayProcess:
    """A gateway, up (its /healthz answers) when this returns."""
    port = free_port()
    cmd = [sys.executable, "-m", "adaserve", "gateway", "--host", "127.0.0.1", "--port", str(port), *args]
    server = ServerProcess.start(cmd, url=f"http://127.0.0.1:{port}", name="the gateway", log=log, cwd=ROOT,
                                 env={**os.environ, **(env or {})})
    gw = GatewayProcess(server, log)
    gw.wait_ready("/healthz", timeout=60.0)
    return gw


def sse_events(response: httpx.Response) -> Iterator[dict[str, Any]]:
    """The JSON events of an SSE response, up to ``[DONE]`` (asserted to arrive)."""
    for line in response.iter_lines():
        if not line:
            continue
        assert line.startswith("data: "), line
        data = line.removeprefix("data: ")
        if data == "[DONE]":
            return
        yield json.loads(data)
    raise AssertionError("stream ended without [DONE]")


def scrape(url: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """``/metrics`` parsed by prometheus_client: {(sample name, sorted labels): value}."""
    text = httpx.get(f"{url}/metrics", timeout=10).text
    out = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def metric(samples: dict[tuple[str, tuple[tuple[str, str], ...]], float], name: str, **labels: str) -> float:
    """The sample of ``name`` with exactly ``labels``; 0 when there is none. A worker's ``model_name`` label (on
    every series of it) need not be given: unless asked for, it is not compared."""
    want = tuple(sorted(labels.items()))
    if "model_name" in labels:
        return samples.get((name, want), 0.0)
    for (n, got), value in samples.items():
        if n == name and tuple(kv for kv in got if kv[0] != "model_name") == want:
            return value
    return 0.0


def wait_for(predicate: Any, timeout: float = 30.0, interval: float = 0.1) -> Any:
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value or time.monotonic() > deadline:
            return value
        time.sleep(interval)
