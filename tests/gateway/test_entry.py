"""The gateway's two commands, ``python -m adaserve.gateway`` (the container's) and ``adaserve gateway``: the
same options, one-line errors, and a clean start and stop (no workers needed)."""

from __future__ import annotations

import re
import subprocess
import sys

import httpx
import pytest

from adaserve.server_process import ServerProcess, free_port
from tests.servers import ROOT

COMMANDS = {"module": [sys.executable, "-m", "adaserve.gateway"],
            "subcommand": [sys.executable, "-m", "adaserve", "gateway"]}


def options(command: list[str]) -> list[str]:
    out = subprocess.run([*command, "--help"], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    return sorted(set(re.findall(r"--[a-z][a-z-]+", out.stdout)))


def test_both_commands_take_the_same_options() -> None:
    module, subcommand = options(COMMANDS["module"]), options(COMMANDS["subcommand"])
    assert module == subcommand and {"--redis-url", "--workers", "--slo-classes-file", "--help"} <= set(module)


@pytest.mark.parametrize("command", COMMANDS)
@pytest.mark.parametrize(("args", "message"), [
    (["--redis-url", "localhost:6379"], "redis_url (--redis-url or ADASERVE_GATEWAY_REDIS_URL): must start with"),
    (["--workers", "ftp://w"], "worker URL 'ftp://w' must start with http:// or https://"),
    ([], "give redis_url (workers register there) or workers (their URLs)"),
])
def test_bad_settings_are_one_line_and_exit_2(command: str, args: list[str], message: str) -> None:
    env = {"PATH": "/usr/bin:/bin"}  # no ADASERVE_GATEWAY_* from the caller's environment
    done = subprocess.run([*COMMANDS[command], *args], cwd=ROOT, capture_output=True, text=True, timeout=300,
                          env=env)
    assert done.returncode == 2, done.stderr
    assert done.stderr.startswith("adaserve: error: ") and message in done.stderr, done.stderr
    assert "Traceback" not in done.stderr and len(done.stderr.strip().splitlines()) == 1


def test_python_m_adaserve_gateway_serves_and_stops_on_sigterm() -> None:
    port = free_port()
    gateway = ServerProcess.start([*COMMANDS["module"], "--port", str(port), "--workers", "http://127.0.0.1:9"],
                                  url=f"http://127.0.0.1:{port}", name="the gateway", cwd=ROOT,
                                  stdout=subprocess.DEVNULL)
    try:
        gateway.wait_ready_blocking("/healthz", timeout_s=60)
        assert httpx.get(f"{gateway.url}/readyz", timeout=5).status_code == 503  # its one worker is not there
    finally:
        assert gateway.stop(timeout_s=30) == 0
