"""Registration in a real Redis with the profiled budget, its heartbeat, and SIGTERM drain mid-stream."""

from __future__ import annotations

import json
import os
import shutil
import signal
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import redis

from adaserve.engine.cost.profiler import model_identity
from adaserve.engine.speculation.adaptive import speculation_floor
from tests.redis_prefix import REDIS_URL, isolated_redis
from tests.servers import Service, demo_pair, sse_events, start_worker, wait_for


@pytest.fixture
def redis_prefix() -> Iterator[tuple[redis.Redis, str]]:
    yield from isolated_redis("test")


def registration(r: redis.Redis, prefix: str, worker_id: str) -> dict[str, Any] | None:
    raw = r.get(f"{prefix}:workers:{worker_id}")
    return None if raw is None else json.loads(raw)


def own_profile_cache(tmp_path: Path) -> Path:
    """A profile cache of the test's own, holding the session's built kernels (``native``, ``kernels``: nothing to
    rebuild) and no profile: the worker profiles into it, and the one profile there is its own. The session's cache
    may hold several profiles of one model (workers with other KV sizes probe other CPU contexts: ``ProbePlan.label``
    is part of the key), and a test reading it took whichever the directory listed first."""
    own = tmp_path / "profiles"
    own.mkdir()
    session = Path(os.environ["ADASERVE_CACHE_DIR"])
    for sub in ("native", "kernels"):
        if (session / sub).is_dir():
            shutil.copytree(session / sub, own / sub)
    return own


def cached_knee(cache: Path, target: Path) -> int | None:
    """The knee B the profiler stored for this model in ``cache``; None when the profile was too noisy to cache (a
    busy machine)."""
    ident = model_identity(target)
    profiles = [json.loads(f.read_text())["data"] for f in cache.glob("*.json")]
    knees = [int(p["target"]["budget"]) for p in profiles if p["key"]["model"].startswith(ident)]
    assert len(knees) <= 1, knees  # one worker, one probe plan
    return knees[0] if knees else None


def test_registration_heartbeat_and_sigterm_drain(redis_prefix: tuple[redis.Redis, str], tmp_path: Path) -> None:
    r, prefix = redis_prefix
    target, draft = demo_pair()
    wid = f"w-{uuid.uuid4().hex[:8]}"
    env = {"ADASERVE_REDIS_PREFIX": prefix, "ADASERVE_HEARTBEAT_S": "0.5", "ADASERVE_REGISTRATION_TTL_S": "3",
           "ADASERVE_DRAIN_GRACE_S": "120", "ADASERVE_SLO_CLASSES": json.dumps({"chat": 50.0})}
    # no --budget: the worker profiles this machine, into a cache of this test's own
    cache = own_profile_cache(tmp_path)
    env["ADASERVE_CACHE_DIR"] = str(cache)
    w: Service = start_worker(target, draft, tmp_path / "worker.log", "--redis-url", REDIS_URL,
                                    "--worker-id", wid, env=env)
    try:
        # the server answers while the models load and the device is profiled, but is not ready
        assert "loading" in w.wait_ready()
        reg = registration(r, prefix, wid)
        assert reg is not None, w.logs()[-3000:]
        profile = httpx.get(f"{w.url}/v1/profile", timeout=10).json()
        # the published B is the profile's: its knee, raised to what one request needs to speculate
        assert reg["budget"] == profile["budget"] >= speculation_floor()
        knee = cached_knee(cache, target)
        assert knee is None or reg["budget"] >= knee
        assert reg["budget_source"] == "profile" and reg["cost_model"]["source"] == "profile"
        assert reg["cost_model"]["target"] == profile["cost_model"]["target"]
        assert reg["status"] == "ready" and reg["address"] == w.url and reg["worker_id"] == wid
        assert reg["models"]["target"] == str(target) and reg["models"]["name"] == "target"
        assert reg["models"]["weights"] == "float"  # a float checkpoint, served as it is
        assert r.zscore(f"{prefix}:workers", wid) is not None
        # adaserve's d_max, set from the profiled draft:target cost ratio; the worker holds nothing yet
        assert 2 <= reg["max_depth"] <= 8 and reg["load"]["context_tokens"] == 0
        ttl = r.pttl(f"{prefix}:workers:{wid}")
        assert 0 < ttl <= 3000

        # the heartbeat refreshes it
        first = reg["updated_at"]
        assert wait_for(lambda: (registration(r, prefix, wid) or {}).get("updated_at", 0) > first, timeout=10)

        # a stream in flight when SIGTERM arrives runs to its end
        body = {"prompt": "def main():", "max_tokens": 600, "ignore_eos": True, "stream": True,
                "slo_class": "chat"}
        got: dict[str, Any] = {}
        started = threading.Event()

        def consume() -> None:
            with httpx.stream("POST", f"{w.url}/v1/generate", json=body, timeout=120) as resp:
                events = sse_events(resp)
                got["events"] = [next(events)]
                started.set()
                got["events"] += list(events)

        reader = threading.Thread(target=consume)
        reader.start()
        assert started.wait(60)
        # the request's prompt + output so far, for the gateway's iteration-time estimate
        assert wait_for(lambda: (registration(r, prefix, wid) or {}).get("load", {}).get("context_tokens", 0) > 3,
                        timeout=10)
        w.proc.send_signal(signal.SIGTERM)

        assert wait_for(lambda: httpx.get(f"{w.url}/readyz", timeout=5).status_code == 503, timeout=10)
        assert (registration(r, prefix, wid) or {}).get("status") == "draining"
        refused = httpx.post(f"{w.url}/v1/generate", json={"prompt": "x", "max_tokens": 2}, timeout=10)
        assert refused.status_code == 503 and "retry-after" in refused.headers
        assert httpx.get(f"{w.url}/healthz", timeout=5).status_code == 200
        mid = time.monotonic()

        reader.join(120)
        assert not reader.is_alive()
        events = got["events"]
        assert events[-1]["finish_reason"] == "length", events[-1]
        assert sum(len(e["token_ids"]) for e in events) == body["max_tokens"]
        assert w.proc.wait(60) == 0, w.logs()[-3000:]
        assert time.monotonic() - mid < 60
        assert registration(r, prefix, wid) is None
        assert r.zscore(f"{prefix}:workers", wid) is None
    finally:
        w.stop()
