"""Trust end to end, with real processes: a Redis that requires a password, and a worker that requires the
gateway's token on everything but its probes and metrics (issue 32, Build 5).

A worker and a gateway share a private ``redis-server --requirepass`` (tests/private_redis.py); the official
``openai`` client goes through the gateway, plain HTTP goes to the worker directly. Wrong credentials stop a
worker or a gateway at start with one line, before a worker loads its models.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest
import redis

from adaserve.server_process import free_port
from tests.private_redis import PrivateRedis, private_redis
from tests.servers import ROOT, GatewayProcess, Service, demo_pair, start_gateway, start_worker

PASSWORD = "redis-s3cret"
TOKEN = "worker-t0ken"
PREFIX = "adaserve-trust"


@pytest.fixture(scope="module")
def auth_redis(tmp_path_factory: pytest.TempPathFactory) -> Iterator[PrivateRedis]:
    yield from private_redis(tmp_path_factory, "redis-auth", password=PASSWORD)


@pytest.fixture(scope="module")
def worker(auth_redis: PrivateRedis, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Service]:
    target, draft = demo_pair()
    w = start_worker(target, draft, tmp_path_factory.mktemp("trust-worker") / "worker.log", "--budget", "8",
                     "--redis-url", auth_redis.url, "--worker-id", "w-auth",
                     env={"ADASERVE_REDIS_PASSWORD": PASSWORD, "ADASERVE_AUTH_TOKEN": TOKEN,
                          "ADASERVE_REDIS_PREFIX": PREFIX, "ADASERVE_MODEL_NAME": "demo"})
    try:
        w.wait_ready()
        yield w
    finally:
        assert w.stop() == 0, w.logs()[-3000:]


@pytest.fixture(scope="module")
def gateway(auth_redis: PrivateRedis, worker: Service,
            tmp_path_factory: pytest.TempPathFactory) -> Iterator[GatewayProcess]:
    gw = start_gateway(tmp_path_factory.mktemp("trust-gw") / "gateway.log", "--redis-url", auth_redis.url,
                       "--redis-prefix", PREFIX,
                       env={"ADASERVE_GATEWAY_REDIS_PASSWORD": PASSWORD, "ADASERVE_GATEWAY_WORKER_TOKEN": TOKEN})
    try:
        gw.wait_workers(1)
        yield gw
    finally:
        assert gw.stop() == 0, gw.logs()[-3000:]


def test_a_gateway_serves_through_a_worker_that_requires_its_token_on_a_redis_with_a_password(
        gateway: GatewayProcess, auth_redis: PrivateRedis) -> None:
    with openai.OpenAI(base_url=f"{gateway.url}/v1", api_key="none", max_retries=0, timeout=120) as c:
        out = c.chat.completions.create(model="demo", messages=[{"role": "user", "content": "def add(a, b):"}],
                                        max_tokens=6, temperature=0)
    assert out.choices[0].message.content and out.usage is not None and out.usage.completion_tokens <= 6
    # the registration the gateway routed by is behind the password: without it Redis refuses
    with pytest.raises(redis.AuthenticationError):
        redis.Redis.from_url(auth_redis.url).keys(f"{PREFIX}:*")
    assert redis.Redis.from_url(auth_redis.url, password=PASSWORD).keys(f"{PREFIX}:*")


@pytest.mark.parametrize(("method", "path", "body"), [
    ("POST", "/v1/completions", {"model": "demo", "prompt": "def f():", "max_tokens": 2}),
    ("POST", "/v1/chat/completions", {"model": "demo", "messages": [{"role": "user", "content": "hi"}],
                                      "max_tokens": 2}),
    ("GET", "/v1/models", None),
    ("POST", "/v1/generate", {"prompt": "def f():", "max_tokens": 2}),
    ("DELETE", "/v1/requests/nobody", None),
    ("GET", "/v1/status", None),
])
def test_a_worker_refuses_requests_without_its_token(worker: Service, method: str, path: str,
                                                     body: dict[str, object] | None) -> None:
    with httpx.Client(base_url=worker.url, timeout=120) as http:
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": TOKEN}):  # the last: no scheme
            r = http.request(method, path, json=body, headers=headers)
            assert r.status_code == 401, (headers, r.text)
            if path in ("/v1/completions", "/v1/chat/completions", "/v1/models"):
                assert r.json()["error"]["code"] == "invalid_api_key"  # OpenAI's shape on OpenAI's routes
            else:
                assert "requires its token" in r.json()["detail"]
        r = http.request(method, path, json=body, headers={"Authorization": f"Bearer {TOKEN}"})
        assert r.status_code != 401 and r.status_code < 500, r.text


def test_probes_and_metrics_stay_open(worker: Service) -> None:
    for path in ("/healthz", "/readyz", "/metrics"):
        assert httpx.get(f"{worker.url}{path}", timeout=10).status_code == 200, path


def test_an_openai_client_with_the_token_as_its_key_talks_to_the_worker(worker: Service) -> None:
    with openai.OpenAI(base_url=f"{worker.url}/v1", api_key=TOKEN, max_retries=0, timeout=120) as c:
        assert [m.id for m in c.models.list().data] == ["demo"]
    with openai.OpenAI(base_url=f"{worker.url}/v1", api_key="wrong", max_retries=0, timeout=120) as c, \
            pytest.raises(openai.AuthenticationError):
        c.models.list()


def _run(cmd: list[str], env: dict[str, str], timeout: float = 120) -> tuple[subprocess.CompletedProcess[str], float]:
    start = time.monotonic()
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout, check=False)
    return proc, time.monotonic() - start


@pytest.mark.parametrize("password", ["wrong", None], ids=["wrong password", "no password"])
def test_a_gateway_with_wrong_credentials_stops_at_start_with_one_line(auth_redis: PrivateRedis,
                                                                        password: str | None) -> None:
    env = {**os.environ, "ADASERVE_GATEWAY_REDIS_URL": auth_redis.url, "ADASERVE_GATEWAY_PORT": "0"}
    env.pop("ADASERVE_GATEWAY_REDIS_PASSWORD", None)
    if password is not None:
        env["ADASERVE_GATEWAY_REDIS_PASSWORD"] = password
    proc, _ = _run([sys.executable, "-m", "adaserve.gateway"], env)
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert lines[-1].startswith(f"adaserve: error: Redis at 127.0.0.1:{auth_redis.port} refused the credentials: ")
    assert "ADASERVE_GATEWAY_REDIS_PASSWORD" in lines[-1] and "Traceback" not in proc.stderr
    assert PASSWORD not in proc.stderr


def test_a_worker_with_a_wrong_password_stops_before_loading(auth_redis: PrivateRedis, tmp_path: Path) -> None:
    target, draft = demo_pair()
    env = {**os.environ, "ADASERVE_REDIS_PASSWORD": "wrong", "ADASERVE_TORCH_THREADS": "1"}
    proc, took = _run([sys.executable, "-m", "adaserve", "worker", "--target", str(target), "--draft", str(draft),
                       "--port", str(free_port()), "--redis-url", auth_redis.url, "--budget", "8"], env)
    assert proc.returncode == 2, proc.stderr[-3000:]
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith(f"adaserve: error: Redis at 127.0.0.1:{auth_redis.port} refused the credentials: "), last
    assert "ADASERVE_REDIS_PASSWORD" in last
    assert "ready at" not in proc.stderr and "Traceback" not in proc.stderr
    assert took < 60  # no model was loaded nor profiled first


def test_settings_refuse_a_password_in_the_url_and_in_its_variable(tmp_path: Path) -> None:
    env = {**os.environ, "ADASERVE_GATEWAY_REDIS_URL": "redis://:inurl@127.0.0.1:1/0",
           "ADASERVE_GATEWAY_REDIS_PASSWORD": "invar", "ADASERVE_GATEWAY_WORKERS": ""}
    proc, _ = _run([sys.executable, "-m", "adaserve.gateway"], env)
    assert proc.returncode == 2 and "keep it out of the URL" in proc.stderr.strip().splitlines()[-1], proc.stderr
    assert "invar" not in proc.stderr
