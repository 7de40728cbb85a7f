"""Running real workers for tests: ``python -m adaserve worker`` on a free loopback port."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
import redis
from prometheus_client.parser import text_string_to_metric_families

ROOT = Path(__file__).resolve().parents[2]
DEMO = Path(os.environ.get("ADASERVE_TEST_DEMO_DIR", ROOT / "models" / "demo"))  # another pair: set this
MODEL_FILES = ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json")
READY_TIMEOUT_S = 300.0  # the machine is shared: loading and profiling can be slow


def demo_pair(wait_s: float = 600.0) -> tuple[Path, Path]:
    """The demo target/draft pair. It may be mid-retraining (directories replaced at the end): wait."""
    dirs = (DEMO / "target", DEMO / "draft")
    deadline = time.monotonic() + wait_s
    while True:
        if all((d / f).is_file() for d in dirs for f in MODEL_FILES):
            return dirs
        if not DEMO.exists() or time.monotonic() > deadline:
            pytest.skip(f"demo model pair not found under {DEMO}")
        time.sleep(5)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class WorkerProcess:
    proc: subprocess.Popen[bytes]
    url: str
    log: Path

    def logs(self) -> str:
        return self.log.read_text(errors="replace")

    def wait_ready(self, timeout: float = READY_TIMEOUT_S) -> list[str]:
        """Poll /readyz until 200; returns the states it reported before (e.g. ['loading'])."""
        deadline = time.monotonic() + timeout
        seen: list[str] = []
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise AssertionError(f"worker exited with {self.proc.returncode}:\n{self.logs()[-4000:]}")
            try:
                r = httpx.get(f"{self.url}/readyz", timeout=2)
                if r.status_code == 200:
                    return seen
                seen.append(r.json()["status"])
            except httpx.TransportError:
                pass
            time.sleep(0.25)
        raise AssertionError(f"worker not ready after {timeout:.0f}s:\n{self.logs()[-4000:]}")

    def terminate(self, timeout: float = 60.0) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            return self.proc.wait()


def start_worker(target: Path, draft: Path, log: Path, *args: str, env: dict[str, str] | None = None) -> WorkerProcess:
    port = free_port()
    full_env = {**os.environ, "ADASERVE_TORCH_THREADS": "1", **(env or {})}
    cmd = [sys.executable, "-m", "adaserve", "worker", "--target", str(target), "--draft", str(draft),
           "--host", "127.0.0.1", "--port", str(port), *args]
    with log.open("wb") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=full_env, cwd=ROOT)
    return WorkerProcess(proc, f"http://127.0.0.1:{port}", log)


REDIS_URL = os.environ.get("ADASERVE_TEST_REDIS_URL", "redis://127.0.0.1:6379/0")


def isolated_redis(label: str) -> Iterator[tuple[redis.Redis, str]]:
    """A client and a fresh key prefix; every key under it is deleted afterwards. Skips without Redis."""
    client = redis.Redis.from_url(REDIS_URL, decode_responses=True)
    try:
        client.ping()
    except redis.ConnectionError:
        pytest.skip(f"no Redis at {REDIS_URL}")
    prefix = f"adaserve-{label}-{uuid.uuid4().hex[:12]}"
    try:
        yield client, prefix
    finally:
        keys = list(client.scan_iter(f"{prefix}:*"))
        if keys:
            client.delete(*keys)
        client.close()


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
    return samples.get((name, tuple(sorted(labels.items()))), 0.0)


def wait_for(predicate: Any, timeout: float = 30.0, interval: float = 0.1) -> Any:
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value or time.monotonic() > deadline:
            return value
        time.sleep(interval)
