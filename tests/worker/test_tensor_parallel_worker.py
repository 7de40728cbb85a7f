"""A worker with ``--tensor-parallel-size 2`` (gloo on the CPU) serving through the gateway, over real HTTP on
loopback, to the official ``openai`` client: its greedy output equals a one-rank worker's, and its other rank
is gone once it stops. A rank that dies takes its worker down: the next forward fails on the closed
connection, the request ends with an error, the worker leaves the registry and exits 2.

The demo pair's target has 4 attention heads and 2 KV heads: each rank holds 2 heads and 1 KV head; the draft
runs whole on rank 0. Both workers take a fixed budget (no profiling) and one torch thread per rank.
"""

from __future__ import annotations

import json
import os
import signal
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest
import redis

from adaserve.contract.registry import worker_key
from adaserve.gateway.slo import DEFAULT_CLASSES
from tests.redis_prefix import REDIS_URL, isolated_redis
from tests.servers import GatewayProcess, Service, demo_pair, start_gateway, start_worker, wait_for

PROMPTS = ("Write a Python function that reverses a list.", "What is the capital of France?")
# targets no busy machine misses: the test is about tokens, not speed
LAX = [c.model_copy(update={"tpot_ms": 1000.0 * c.tpot_ms, "ttft_ms": c.ttft_ms and 60_000.0})
       for c in DEFAULT_CLASSES]


def _children(pid: int) -> set[int]:
    """The processes ``pid`` started (Linux /proc), recursively."""
    out: set[int] = set()
    for task in Path(f"/proc/{pid}/task").glob("*"):
        try:
            kids = {int(k) for k in (task / "children").read_text().split()}
        except OSError:
            continue
        for k in kids:
            out |= {k, *_children(k)}
    return out


def _running(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


@pytest.fixture(scope="module")
def workers(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[int, Service]]:
    target, draft = demo_pair()
    tmp = tmp_path_factory.mktemp("tp-workers")
    procs = {tp: start_worker(target, draft, tmp / f"tp{tp}.log", "--budget", "8", "--model-name", "demo",
                              "--worker-id", f"tp{tp}", "--tensor-parallel-size", str(tp))
             for tp in (1, 2)}
    try:
        for p in procs.values():
            p.wait_ready()
        yield procs
    finally:
        for p in procs.values():
            p.stop()


@pytest.fixture(scope="module")
def gateway(workers: dict[int, Service], tmp_path_factory: pytest.TempPathFactory) -> Iterator[GatewayProcess]:
    """A gateway in front of the two-rank worker only, reading it directly (no Redis)."""
    tmp = tmp_path_factory.mktemp("tp-gw")
    classes = tmp / "lax.json"
    classes.write_text(json.dumps([c.model_dump(by_alias=True, exclude_none=True) for c in LAX]))
    gw = start_gateway(tmp / "gateway.log", "--workers", workers[2].url, "--model-name", "demo",
                       "--slo-classes-file", str(classes), "--default-slo-class", "chat")
    try:
        gw.wait_workers(1)
        yield gw
    finally:
        assert gw.stop() == 0, gw.logs()[-3000:]


def _direct(worker: Service, **body: object) -> dict[str, object]:
    r = httpx.post(f"{worker.url}/v1/generate", json=body, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()


def test_two_rank_worker_serves_the_openai_client_what_one_rank_does(gateway: GatewayProcess,
                                                                      workers: dict[int, Service]) -> None:
    status = httpx.get(f"{workers[2].url}/v1/status", timeout=10).json()
    assert status["status"] == "ready"
    client = openai.OpenAI(base_url=f"{gateway.url}/v1", api_key="none", max_retries=0, timeout=120)
    for prompt in PROMPTS:
        messages = [{"role": "user", "content": prompt}]
        want = _direct(workers[1], messages=messages, max_tokens=24, temperature=0)
        got = client.chat.completions.create(model="demo", messages=messages,  # type: ignore[arg-type]
                                             max_tokens=24, temperature=0)
        assert want["text"] and got.choices[0].message.content == want["text"], (prompt, want, got)
        assert got.usage is not None and got.usage.completion_tokens == 24 == len(want["token_ids"])  # type: ignore[arg-type]
        streamed = "".join(ch.choices[0].delta.content or "" for ch in client.chat.completions.create(
            model="demo", messages=messages, max_tokens=24, temperature=0, stream=True)  # type: ignore[arg-type]
            if ch.choices)
        assert streamed == want["text"]
    got = client.completions.create(model="demo", prompt="def fibonacci(n):", max_tokens=20, temperature=0)
    assert got.choices[0].text == _direct(workers[1], prompt="def fibonacci(n):", max_tokens=20,
                                          temperature=0)["text"]


def test_stopping_the_two_rank_worker_stops_its_other_rank(gateway: GatewayProcess,
                                                           workers: dict[int, Service]) -> None:
    worker = workers[2]
    ranks = _children(worker.proc.pid)
    assert ranks, "the two-rank worker started no rank process"
    assert worker.stop() == 0, worker.logs()[-3000:]
    assert wait_for(lambda: not any(_running(p) for p in ranks), timeout=30), worker.logs()[-3000:]


@pytest.fixture
def rds() -> Iterator[tuple[redis.Redis, str]]:
    yield from isolated_redis("tp-dead")


def test_a_dead_rank_takes_the_worker_down_and_out_of_the_registry(tmp_path: Path,
                                                                   rds: tuple[redis.Redis, str]) -> None:
    target, draft = demo_pair()
    client, prefix = rds
    key = worker_key(prefix, "tp-dead")
    worker = start_worker(target, draft, tmp_path / "tp-dead.log", "--budget", "8", "--worker-id", "tp-dead",
                          "--tensor-parallel-size", "2", "--redis-url", REDIS_URL,
                          env={"ADASERVE_REDIS_PREFIX": prefix, "ADASERVE_HEARTBEAT_S": "0.5",
                               "ADASERVE_REGISTRATION_TTL_S": "30"})  # expiry cannot explain its absence
    try:
        worker.wait_ready()
        assert wait_for(lambda: client.exists(key), timeout=10), worker.logs()[-2000:]
        ranks = [p for p in _children(worker.proc.pid) if b"spawn_main" in Path(f"/proc/{p}/cmdline").read_bytes()]
        assert len(ranks) == 1, ranks  # rank 1 (rank 0 is the worker itself)
        os.kill(ranks[0], signal.SIGKILL)
        start = time.monotonic()
        r = httpx.post(f"{worker.url}/v1/generate", json={"prompt": "hello", "max_tokens": 8}, timeout=60)
        assert r.status_code >= 500 or r.json()["finish_reason"] == "error", r.text
        assert worker.proc.wait(timeout=60) == 2, worker.logs()[-3000:]
        assert time.monotonic() - start < 60
        assert "engine loop stopped" in worker.logs()
        assert not client.exists(key)  # deregistered, not left to expire
    finally:
        if worker.proc.poll() is None:
            worker.stop()
