"""A worker as the gateway sees it: its registration, its measured curve, this gateway's own load on it and the
correction learnt for it (directory.py builds these; prediction.py and routing.py read them)."""

from __future__ import annotations

from dataclasses import dataclass, field

DRAFT_STEPS = 4  # D when the worker reports none: the engine's default d_max (engine/speculation/adaptive.py)


@dataclass(frozen=True)
class CurvePoint:
    """One point of a worker's measured iteration-time curve (contract: ``IterationPoint``)."""

    requests: int
    steps: int
    iteration_ms: float
    tokens_per_request: float | None = None
    tokens_by_class: dict[str, tuple[float, int]] = field(default_factory=dict)  # class -> (tokens, decodes)
    ms_by_class: dict[str, float] = field(default_factory=dict)  # class -> iteration ms with the class in it


@dataclass(frozen=True)
class WorkerView:
    """A worker as routing sees it: its registration, this gateway's own requests on it, its correction."""

    id: str
    address: str
    status: str
    model: str | None
    max_active: int
    active: int
    active_by_class: dict[str, int] = field(default_factory=dict)
    budget: int | None = None
    target_cost: dict[str, float] | None = None
    draft_cost: dict[str, float] | None = None
    acceptance_rate: float | None = None
    context_per_request: float | None = None  # L as the worker last reported it
    draft_steps: int | None = None  # D as the worker reports it (0: it does not speculate)
    unloaded_tpot_ms: float | None = None  # one target forward of one token (the profile's)
    lone_tpot_ms: float | None = None  # a lone request's TPOT as served, measured at warm-up
    curve: tuple[CurvePoint, ...] = ()  # ascending requests
    class_accepted: dict[str, float] = field(default_factory=dict)  # accepted per verification, per class
    class_ttft_ms: dict[str, float] = field(default_factory=dict)  # least recent TTFT per class, at the worker
    correction: float = 1.0  # k_w: observed / predicted TPOT, learnt by this gateway

    @property
    def free_slots(self) -> int:
        return self.max_active - self.active

    @property
    def depth(self) -> int:
        """D: draft steps per iteration (0 without a draft model)."""
        if self.draft_cost is None:
            return 0
        return DRAFT_STEPS if self.draft_steps is None else self.draft_steps
