"""uvicorn with a drain on SIGTERM.

Plain uvicorn stops listening the moment SIGTERM arrives, so a load balancer still sending traffic
gets connection errors, and it re-raises the signal when done (exit status 143). Here SIGTERM first
drains: /readyz answers 503, the registration says ``draining``, new requests get 503 with
Retry-After, in-flight requests run to completion (up to the grace period). Then uvicorn's own
graceful shutdown runs and the process exits 0. A second SIGTERM cuts the wait short; SIGINT keeps
uvicorn's behaviour.
"""

from __future__ import annotations

import asyncio
import logging
import signal
import socket
from types import FrameType

import uvicorn

from adaserve.access_log import QuietProbes
from adaserve.worker.runtime import Runtime


class DrainingServer(uvicorn.Server):
    def __init__(self, config: uvicorn.Config, runtime: Runtime) -> None:
        super().__init__(config)
        self.runtime = runtime
        self._loop: asyncio.AbstractEventLoop | None = None
        self._drain: asyncio.Task[None] | None = None
        runtime.on_fatal(self.stop)

    async def serve(self, sockets: list[socket.socket] | None = None) -> None:
        self._loop = asyncio.get_running_loop()
        logging.getLogger("uvicorn.access").addFilter(QuietProbes())
        await super().serve(sockets)

    def stop(self) -> None:
        """Shut down without draining (fatal errors)."""
        self.should_exit = True

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        if sig != signal.SIGTERM or self._loop is None:
            super().handle_exit(sig, frame)
        elif self._drain is None:
            self._loop.call_soon_threadsafe(self._start_drain)
        else:
            self.should_exit = True  # second SIGTERM: stop waiting for in-flight requests

    def _start_drain(self) -> None:
        if self._drain is None:
            self._drain = asyncio.create_task(self._drain_then_exit(), name="adaserve-drain")

    async def _drain_then_exit(self) -> None:
        try:
            await self.runtime.drain(self.runtime.settings.drain_grace_s)
        finally:
            self.should_exit = True
