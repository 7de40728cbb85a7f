"""A server in a child process: start it, wait until it answers 200 at a path, stop it with SIGTERM.

``adaserve up`` runs its worker this way, ``adaserve loadtest --up`` runs ``adaserve up`` this way, and the
tests run real workers and gateways this way. SIGTERM is how the services expect to be stopped (a worker
drains, a gateway shuts down gracefully, both exit 0); SIGKILL follows only when that takes too long.
No torch here: the CLI modules that import it must stay light.
"""

from __future__ import annotations

import asyncio
import signal
import socket
import subprocess
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import httpx

PROBE_TIMEOUT_S = 2.0  # one poll; a loading worker still answers its probes at once


def free_port(host: str = "127.0.0.1") -> int:
    """A port nothing listens on now (something else may still take it before the server binds it)."""
    with socket.socket() as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


class NotReady(Exception):
    """The server exited before it was ready (``returncode`` is its status), or was not ready in time (None)."""

    def __init__(self, message: str, *, returncode: int | None = None) -> None:
        super().__init__(message)
        self.returncode = returncode


@dataclass
class ServerProcess:
    proc: subprocess.Popen[bytes]
    url: str  # where it serves, no trailing slash
    name: str = "the server"  # in messages: "the worker exited with status 2 before it was ready"

    @classmethod
    def start(cls, cmd: Sequence[str], *, url: str, name: str, env: Mapping[str, str] | None = None,
              cwd: Path | None = None, log: Path | None = None, stdout: int | None = None) -> ServerProcess:
        """Run ``cmd``. Its stdout and stderr go to the file ``log`` if given; else stdout to ``stdout``
        (None: this process's own, or e.g. subprocess.DEVNULL) and stderr to this process's."""
        if log is not None:
            with log.open("wb") as out:  # the child keeps its own copy of the descriptor
                proc = subprocess.Popen(list(cmd), stdout=out, stderr=subprocess.STDOUT, env=env, cwd=cwd)
        else:
            proc = subprocess.Popen(list(cmd), stdout=stdout, env=env, cwd=cwd)
        return cls(proc, url.rstrip("/"), name)

    async def wait_ready(self, path: str = "/readyz", *, timeout_s: float, interval_s: float = 0.25,
                         give_up: Callable[[], bool] | None = None,
                         on_answer: Callable[[httpx.Response], None] | None = None) -> bool:
        """Poll ``url + path`` until it answers 200 (True), or ``give_up()`` turns true first (False).

        Raises NotReady when the process exits first or ``timeout_s`` passes. ``on_answer`` sees every
        answer that is not 200 (a worker's 503 says ``loading``).
        """
        deadline = time.monotonic() + timeout_s
        async with httpx.AsyncClient(timeout=PROBE_TIMEOUT_S) as client:
            while True:
                if self.proc.poll() is not None:
                    raise NotReady(f"{self.name} exited with status {self.proc.returncode} before it was ready "
                                   "(its output says why)", returncode=self.proc.returncode)
                if give_up is not None and give_up():
                    return False
                try:
                    answer = await client.get(self.url + path)
                except httpx.HTTPError:  # not listening yet
                    pass
                else:
                    if answer.status_code == 200:
                        return True
                    if on_answer is not None:
                        on_answer(answer)
                if time.monotonic() > deadline:
                    raise NotReady(f"{self.name} was not ready after {timeout_s:.0f}s")
                await asyncio.sleep(interval_s)

    def wait_ready_blocking(self, path: str = "/readyz", *, timeout_s: float, interval_s: float = 0.25,
                            on_answer: Callable[[httpx.Response], None] | None = None) -> None:
        """``wait_ready`` for callers without an event loop of their own."""
        asyncio.run(self.wait_ready(path, timeout_s=timeout_s, interval_s=interval_s, on_answer=on_answer))

    def stop(self, timeout_s: float = 60.0) -> int:
        """SIGTERM, up to ``timeout_s`` to exit, then SIGKILL. Returns the exit status (negative: a signal)."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            return self.proc.wait()
