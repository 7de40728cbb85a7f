"""The engine in a background thread, fed from any other thread (a web server's event loop, a CLI).

The thread owns the engine: callers never touch it directly, they post commands (``submit``,
``abort``) that the thread applies between steps. Each request's events go to the callback given at
submission, called on the engine thread; an asyncio server forwards them with
``loop.call_soon_threadsafe``.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass

from adaserve.engine.engine import Engine, TokenEvent
from adaserve.engine.request import Request

log = logging.getLogger(__name__)

EventCallback = Callable[[TokenEvent], None]


@dataclass
class _Submit:
    req: Request
    callback: EventCallback


@dataclass
class _Abort:
    request_id: str


class EngineLoop:
    def __init__(self, engine: Engine, *, idle_wait_s: float = 0.01) -> None:
        self.engine = engine
        self._inbox: list[_Submit | _Abort] = []
        self._callbacks: dict[str, EventCallback] = {}
        self._cv = threading.Condition()
        self._stopping = False
        self._idle_wait_s = idle_wait_s
        self._thread = threading.Thread(target=self._run, name="adaserve-engine", daemon=True)
        self.error: BaseException | None = None

    def start(self) -> EngineLoop:
        self._thread.start()
        return self

    def stop(self, timeout: float | None = 10.0) -> None:
        with self._cv:
            self._stopping = True
            self._cv.notify()
        self._thread.join(timeout)

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    def submit(self, req: Request, callback: EventCallback) -> None:
        """Queue ``req``; raises ValueError at once if the engine could never serve it."""
        self.engine.check_request(req)  # the one validation; read-only, so safe from this thread
        with self._cv:
            if self._stopping:
                raise RuntimeError("engine loop is stopping")
            self._inbox.append(_Submit(req, callback))
            self._cv.notify()

    def abort(self, request_id: str) -> None:
        with self._cv:
            self._inbox.append(_Abort(request_id))
            self._cv.notify()

    def _drain_inbox(self) -> None:
        with self._cv:
            inbox, self._inbox = self._inbox, []
        for cmd in inbox:
            if isinstance(cmd, _Submit):
                try:
                    self.engine._enqueue(cmd.req)  # checked in submit; only a clashing id can fail here
                except ValueError as e:
                    log.warning("request %s refused: %s", cmd.req.request_id, e)
                    cmd.callback(TokenEvent(cmd.req.request_id, [], True, "error"))
                    continue
                self._callbacks[cmd.req.request_id] = cmd.callback
            elif self.engine.abort(cmd.request_id):
                cb = self._callbacks.pop(cmd.request_id, None)
                if cb is not None:
                    cb(TokenEvent(cmd.request_id, [], True, "abort"))

    def _run(self) -> None:
        try:
            while True:
                self._drain_inbox()
                if not self.engine.has_work:
                    with self._cv:
                        if self._stopping:
                            return
                        if not self._inbox:
                            self._cv.wait(self._idle_wait_s)
                    continue
                for ev in self.engine.step():
                    cb = self._callbacks.get(ev.request_id)
                    if ev.finished:
                        self._callbacks.pop(ev.request_id, None)
                    if cb is not None:
                        cb(ev)
        except BaseException as e:  # surface engine crashes to whoever watches the loop
            log.exception("engine loop crashed")
            self.error = e
            for rid, cb in list(self._callbacks.items()):
                cb(TokenEvent(rid, [], True, "error"))
            self._callbacks.clear()
