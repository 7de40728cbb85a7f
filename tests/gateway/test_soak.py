"""Soak: mixed traffic through a gateway for a while (``ADASERVE_SOAK_S``, default 600 s) while a worker is
killed (SIGKILL) and replaced a third of the way in, and Redis is restarted two thirds of the way in. Asserts
that no request is lost (every one gets a whole answer: a finish reason, usage that adds up, and for the
greedy ones the exact text of an unbroken run) and that the gateway's memory is stable. Clients are the
official ``openai`` client with its default retries (2, honouring Retry-After), as applications run it; every
answer other than 200 that it saw, retried or not, is counted and reported.

Not in the default run (marker ``soak``, skipped unless selected with ``-m soak``); see docs/gateway.md:

    ADASERVE_SOAK_S=600 ADASERVE_SOAK_JSON=docs/results/soak.json .venv/bin/pytest -m soak tests/gateway/test_soak.py

Redis is a private ``redis-server`` on a free port (restarting the shared one is not this test's to do).
"""

from __future__ import annotations

import json
import os
import random
import signal
import threading
import time
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from tests.gateway.test_failover import Fleet
from tests.gateway.test_gateway import LAX
from tests.private_redis import PrivateRedis
from tests.servers import GatewayProcess, metric, scrape, start_gateway

pytestmark = pytest.mark.soak

DURATION_S = float(os.environ.get("ADASERVE_SOAK_S", "600"))
CLIENTS = int(os.environ.get("ADASERVE_SOAK_CLIENTS", "4"))
# memory after the run may exceed memory after warm-up by at most this much (allocator arenas, caches that fill
# once): a leak of ~35 kB per request (a request's text and records several times over) would exceed it in the
# ~1,200 requests of a 10-minute run here; a smaller leak needs a longer run (or a lower bound) to show
RSS_SLACK_MB = 40.0

GREEDY = [("completion", "def read_config(path):"), ("chat", "Write a function that reverses a string."),
          ("completion", "class Stack:")]
SAMPLED = ["import os\n", "def main():", "for i in range(10):"]


@pytest.fixture(autouse=True)
def _selected(request: pytest.FixtureRequest) -> None:
    if "soak" not in (request.config.option.markexpr or ""):
        pytest.skip("soak test: run with -m soak (ADASERVE_SOAK_S sets its length)")


def rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise AssertionError(f"no VmRSS for {pid}")


@dataclass
class Tally:
    sent: int = 0
    answered: int = 0
    lost: list[str] = field(default_factory=list)
    kinds: Counter[str] = field(default_factory=Counter)
    statuses: Counter[int] = field(default_factory=Counter)  # every HTTP answer the clients got, retries included
    lock: threading.Lock = field(default_factory=threading.Lock)


def ask(c: openai.OpenAI, spec: dict[str, Any]) -> tuple[str, str | None, Any]:
    """One request as the spec says: (text, finish reason, usage)."""
    kind, stream, params = spec["kind"], spec["stream"], spec["params"]
    create = c.chat.completions.create if kind == "chat" else c.completions.create
    body = {"messages": [{"role": "user", "content": spec["prompt"]}]} if kind == "chat" else {"prompt": spec["prompt"]}
    if not stream:
        got = create(model="demo", **body, **params)
        choice = got.choices[0]
        return (choice.message.content or "" if kind == "chat" else choice.text), choice.finish_reason, got.usage
    parts, finish, usage = [], None, None
    for chunk in create(model="demo", stream=True, stream_options={"include_usage": True}, **body, **params):
        usage = chunk.usage or usage
        for ch in chunk.choices:
            parts.append((ch.delta.content if kind == "chat" else ch.text) or "")
            finish = ch.finish_reason or finish
    return "".join(parts), finish, usage


def spec_for(rng: random.Random) -> dict[str, Any]:
    stream = rng.random() < 0.6
    cls = rng.choice(["coding", "chat", "summarization"])
    if rng.random() < 0.5:
        kind, prompt = rng.choice(GREEDY)
        return {"kind": kind, "prompt": prompt, "stream": stream, "greedy": True,
                "params": {"max_tokens": 96, "temperature": 0, "extra_body": {"ignore_eos": True},
                           "extra_headers": {"X-SLO-Class": cls}}}
    params: dict[str, Any] = {"max_tokens": rng.choice([8, 32, 64, 160]), "temperature": rng.choice([0.7, 1.0]),
                              "extra_headers": {"X-SLO-Class": cls}}
    if rng.random() < 0.3:
        params["stop"] = ["\n\n"]
    if rng.random() < 0.5:
        params["seed"] = rng.randrange(1 << 30)
    return {"kind": rng.choice(["completion", "chat"]), "prompt": rng.choice(SAMPLED), "stream": stream,
            "greedy": False, "params": params}


def check(spec: dict[str, Any], text: str, finish: str | None, usage: Any, want: dict[tuple[str, str], str]) -> str:
    """'' when the answer is whole, else what is wrong with it."""
    limit = spec["params"]["max_tokens"]
    if finish not in ("stop", "length"):
        return f"finish_reason {finish!r}"
    if usage is None or not 0 < usage.completion_tokens <= limit or usage.prompt_tokens <= 0:
        return f"usage {usage}"
    if finish == "length" and usage.completion_tokens != limit:
        return f"length after {usage.completion_tokens} of {limit} tokens"
    if spec["greedy"] and text != want[(spec["kind"], spec["prompt"])]:
        return f"greedy text differs from an unbroken run: {text[:80]!r}"
    return ""


def client_loop(c: openai.OpenAI, seed: int, until: float, tally: Tally, want: dict[tuple[str, str], str]) -> None:
    rng = random.Random(seed)
    while time.monotonic() < until:
        spec = spec_for(rng)
        with tally.lock:
            tally.sent += 1
            tally.kinds[f"{spec['kind']}{'-stream' if spec['stream'] else ''}"] += 1
        try:
            problem = check(spec, *ask(c, spec), want)
        except openai.APIError as e:
            problem = f"{type(e).__name__}: {e}"
        with tally.lock:
            if problem:
                tally.lost.append(f"{spec['kind']} stream={spec['stream']}: {problem}")
            else:
                tally.answered += 1


@pytest.fixture
def private_redis(tmp_path: Path) -> Iterator[PrivateRedis]:
    r = PrivateRedis(tmp_path)
    try:
        yield r
    finally:
        r.stop()


def test_soak(private_redis: PrivateRedis, tmp_path: Path) -> None:
    fleet = Fleet(tmp_path, "soak", redis_url=private_redis.url)
    gw: GatewayProcess | None = None
    try:
        for w in [fleet.start(), fleet.start()]:
            w.wait_ready()
        classes = tmp_path / "lax.json"
        classes.write_text("[" + ",".join(c.model_dump_json(by_alias=True, exclude_none=True) for c in LAX) + "]")
        # pinned to the one model served, as a deployment's gateway usually is
        gw = start_gateway(tmp_path / "gateway.log", "--redis-url", private_redis.url, "--redis-prefix", "soak",
                           "--slo-classes-file", str(classes), "--default-slo-class", "chat", "--model-name", "demo")
        gw.wait_workers(2)
        tally = Tally()

        def seen(response: httpx.Response) -> None:
            with tally.lock:
                tally.statuses[response.status_code] += 1

        c = openai.OpenAI(base_url=f"{gw.url}/v1", api_key="none", timeout=300,
                          http_client=httpx.Client(event_hooks={"response": [seen]}, timeout=300))
        want = {}
        for kind, prompt in GREEDY:
            spec = {"kind": kind, "prompt": prompt, "stream": False,
                    "params": {"max_tokens": 96, "temperature": 0, "extra_body": {"ignore_eos": True}}}
            want[(kind, prompt)] = ask(c, spec)[0]

        start = time.monotonic()
        until = start + DURATION_S
        tally.statuses.clear()
        threads = [threading.Thread(target=client_loop, args=(c, i, until, tally, want), daemon=True)
                   for i in range(CLIENTS)]
        for t in threads:
            t.start()
        rss: list[tuple[float, float]] = []  # (seconds in, gateway RSS MB)
        events: list[str] = []
        killed = restarted_redis = False
        while time.monotonic() < until:
            now = time.monotonic() - start
            rss.append((round(now, 1), rss_mb(gw.proc.pid)))
            if not killed and now >= DURATION_S / 3:
                victim = fleet.live()[0]
                victim.proc.send_signal(signal.SIGKILL)
                victim.proc.wait()
                events.append(f"{now:.0f}s: SIGKILL a worker")
                fleet.start().wait_ready()
                events.append(f"{time.monotonic() - start:.0f}s: its replacement ready")
                killed = True
            elif not restarted_redis and now >= 2 * DURATION_S / 3:
                private_redis.restart()
                events.append(f"{now:.0f}s: Redis restarted (empty)")
                restarted_redis = True
            time.sleep(2.0)
        for t in threads:
            t.join(300)
        assert not any(t.is_alive() for t in threads), "a client is stuck"
        samples = scrape(gw.url)
        continued = sum(metric(samples, "adaserve_gateway_retries_total", slo_class=k.name) for k in LAX)
        # warm-up: the first tenth of the run (imports, pools, caches that fill once)
        warm = [m for s, m in rss if s >= DURATION_S / 10]
        figures = {
            "duration_s": DURATION_S, "clients": CLIENTS, "requests": tally.sent, "answered": tally.answered,
            "lost": len(tally.lost), "lost_examples": tally.lost[:10], "by_kind": dict(tally.kinds),
            "http_statuses": {str(k): v for k, v in sorted(tally.statuses.items())},
            "retried_or_continued": continued, "events": events,
            "gateway_rss_mb": {"after_warmup": round(warm[0], 1), "end": round(rss_mb(gw.proc.pid), 1),
                               "max": round(max(m for _, m in rss), 1)},
            "rss_samples": rss,
        }
        print(json.dumps({k: v for k, v in figures.items() if k != "rss_samples"}, indent=1))
        if out := os.environ.get("ADASERVE_SOAK_JSON"):
            Path(out).write_text(json.dumps(figures, indent=1) + "\n")
        assert killed and restarted_redis
        assert tally.sent > 0 and not tally.lost, tally.lost[:10]
        assert continued >= 1  # the kill cut some answers, and they went on elsewhere
        mem = figures["gateway_rss_mb"]
        assert mem["end"] <= mem["after_warmup"] + RSS_SLACK_MB, mem
    finally:
        if gw is not None:
            gw.stop()
        fleet.stop()
