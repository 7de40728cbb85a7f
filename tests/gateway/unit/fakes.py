"""Test doubles: a worker list that the test controls (directory.Source), and registration documents."""

from __future__ import annotations

import copy
from typing import Any

from adaserve.contract.registration import Registration, parse_registration


def registration(worker_id: str, *, status: str = "ready", model: str | None = "m", max_active: int = 4,
                 active: int = 0, by_class: dict[str, int] | None = None, **top: Any) -> dict[str, Any]:
    """A worker without a cost model yet (judged by free slots); ``top`` overrides top-level fields."""
    return {"schema": 1, "worker_id": worker_id, "address": f"http://{worker_id}:8000", "status": status,
            "models": {"name": model}, "capacity": {"max_active_requests": max_active},
            "load": {"active": active, "active_by_class": by_class or {}},
            "acceptance": {"steps": 0, "mean_accepted_per_verification": 0.0, "acceptance_rate": 0.0}, **top}


def curve(*points: tuple[int, float, float]) -> dict[str, Any]:
    """A ``measured`` section: (requests, iteration ms, tokens per request) points of 32 iterations each."""
    return {"iterations": [{"requests": n, "steps": 32, "iteration_ms": ms, "tokens_verified": n,
                            "tokens_per_request": e} for n, ms, e in points]}


class FakeSource:
    """directory.Source over documents the test sets, parsed as the real sources parse them (what is not a
    registration is left out); ``error`` makes the next reads fail."""

    def __init__(self, docs: list[dict[str, Any]] | None = None) -> None:
        self.docs = docs or []
        self.error: Exception | None = None
        self.reads = 0
        self.closed = False

    async def read(self) -> list[Registration]:
        self.reads += 1
        if self.error is not None:
            raise self.error
        return [r for r in map(parse_registration, copy.deepcopy(self.docs)) if r is not None]

    async def close(self) -> None:
        self.closed = True
