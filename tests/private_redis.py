"""A redis-server of a test's own, on a free port, nothing persisted, optionally with a password (AUTH): for tests
that restart Redis or need settings the shared one (127.0.0.1:6379) does not have."""

from __future__ import annotations

import shutil
import signal
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis

from adaserve.server_process import free_port


class PrivateRedis:
    """A redis-server of this test's own, on a free port, with nothing persisted; ``restart`` loses all."""

    def __init__(self, tmp: Path, *, password: str | None = None) -> None:
        binary = shutil.which("redis-server")
        if binary is None:
            pytest.skip("redis-server not installed: this test runs a Redis of its own")
        self.binary, self.tmp, self.port, self.password = binary, tmp, free_port(), password
        self.proc: subprocess.Popen[bytes] | None = None
        self.start()

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> None:
        self.proc = subprocess.Popen([self.binary, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "",
                                      "--appendonly", "no", "--dir", str(self.tmp),
                                      *(["--requirepass", self.password] if self.password else [])],
                                     stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        client = redis.Redis.from_url(self.url, password=self.password)
        deadline = time.monotonic() + 10
        while True:
            try:
                client.ping()
                break
            except redis.ConnectionError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.05)
        client.close()

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait()

    def restart(self) -> None:
        self.stop()
        self.start()


def private_redis(tmp_path_factory: pytest.TempPathFactory, name: str, *,
                  password: str | None = None) -> Iterator[PrivateRedis]:
    """A module fixture's body: a private Redis in a fresh folder ``name``, stopped afterwards."""
    r = PrivateRedis(tmp_path_factory.mktemp(name), password=password)
    try:
        yield r
    finally:
        r.stop()
