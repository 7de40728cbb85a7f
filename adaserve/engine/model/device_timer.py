"""Seconds a device spends in timed regions, summed, without making the host wait (issue 30).

On a CPU the region's wall time is exact (every op runs before the call returns). On CUDA a pair of
events brackets the region instead of a ``synchronize``: the events are read once they have completed,
which they have by the time anyone asks (the engine reads the total at the end of an iteration, after
its one copy of the verification draws has waited for the device anyway). A pair still running is left
for a later read, never waited for.

May import: torch only.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager

import torch


class DeviceTimer:
    def __init__(self) -> None:
        self._done = 0.0
        self._pending: list[tuple[torch.cuda.Event, torch.cuda.Event]] = []

    @contextmanager
    def region(self, device: torch.device) -> Iterator[None]:
        if device.type != "cuda":
            t0 = time.perf_counter()
            yield
            self._done += time.perf_counter() - t0
            return
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        yield
        end.record()
        self._pending.append((start, end))

    @property
    def seconds(self) -> float:
        """Every completed region's seconds, summed (regions still on the device count at a later read)."""
        running = []
        for start, end in self._pending:
            if end.query():
                self._done += start.elapsed_time(end) / 1e3
            else:
                running.append((start, end))
        self._pending = running
        return self._done
