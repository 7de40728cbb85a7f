"""Running a real gateway for tests: ``python -m adaserve gateway`` on a free loopback port."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import httpx

from tests.worker.helpers import ROOT, free_port


@dataclass
class GatewayProcess:
    proc: subprocess.Popen[bytes]
    url: str
    log: Path

    def logs(self) -> str:
        return self.log.read_text(errors="replace")

    def wait_up(self, timeout: float = 60.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise AssertionError(f"gateway exited with {self.proc.returncode}:\n{self.logs()[-4000:]}")
            try:
                if httpx.get(f"{self.url}/healthz", timeout=2).status_code == 200:
                    return
            except httpx.TransportError:
                pass
            time.sleep(0.1)
        raise AssertionError(f"gateway not up after {timeout:.0f}s:\n{self.logs()[-4000:]}")

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

    def stop(self) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            return self.proc.wait()


def start_gateway(log: Path, *args: str, env: dict[str, str] | None = None) -> GatewayProcess:
    port = free_port()
    cmd = [sys.executable, "-m", "adaserve", "gateway", "--host", "127.0.0.1", "--port", str(port), *args]
    with log.open("wb") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env={**os.environ, **(env or {})},
                                cwd=ROOT)
    gw = GatewayProcess(proc, f"http://127.0.0.1:{port}", log)
    gw.wait_up()
    return gw
