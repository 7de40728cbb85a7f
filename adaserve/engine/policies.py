"""Decoding policies: how big each request's tree is and which candidate nodes get verified.

A policy answers two questions per iteration: the beam-search shape (depth, width) for the current
number of decoding requests, or None for no speculation; and, given the candidate trees, which nodes
of each to verify. Every policy is lossless: the verification walk guarantees the output, a policy
only changes how many tokens one target forward confirms.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass
from typing import Protocol

from adaserve.engine.request import Request
from adaserve.engine.tree import TokenTree


@dataclass(frozen=True)
class SelectionContext:
    """What a policy may read when selecting: the budget and each request's state."""

    budget: int  # B: tokens one verification may carry, roots included
    depth: int
    now_s: float
    t_iter_s: float  # predicted iteration time


class Policy(Protocol):
    name: str
    max_depth: int
    max_width: int

    def tree_shape(self, n_active: int) -> tuple[int, int] | None: ...

    def select(self, cands: list[TokenTree], reqs: list[Request], ctx: SelectionContext) -> list[list[int]]: ...


def global_top_nodes(cands: list[TokenTree], budget: int) -> list[list[int]]:
    """Roots always; then the globally highest path-probability nodes until ``budget`` tokens.

    Path probabilities strictly decrease from parent to child, so a node is never chosen before its
    parent and every selected tree is connected.
    """
    chosen = [[0] for _ in cands]
    heap = [(-float(t.log_probs[i]), r, i) for r, t in enumerate(cands) for i in range(1, t.size)]
    heapq.heapify(heap)
    left = budget - len(cands)
    while left > 0 and heap:
        _, r, i = heapq.heappop(heap)
        chosen[r].append(i)
        left -= 1
    return [sorted(c) for c in chosen]


@dataclass(frozen=True)
class Incremental:
    """Continuous batching without speculation: one token per request per iteration."""

    name: str = "incremental"
    max_depth: int = 0
    max_width: int = 0

    def tree_shape(self, n_active: int) -> tuple[int, int] | None:
        return None

    def select(self, cands: list[TokenTree], reqs: list[Request], ctx: SelectionContext) -> list[list[int]]:
        return [[0] for _ in cands]


@dataclass(frozen=True)
class FixedBeam:
    """Fixed-shape beam-search trees, verified up to the budget by global path probability."""

    depth: int = 4
    width: int = 2
    name: str = "beam"

    def __post_init__(self) -> None:
        if self.depth < 1 or self.width < 1:
            raise ValueError("beam depth and width must be >= 1")

    @property
    def max_depth(self) -> int:
        return self.depth

    @property
    def max_width(self) -> int:
        return self.width

    def tree_shape(self, n_active: int) -> tuple[int, int] | None:
        return self.depth, self.width

    def select(self, cands: list[TokenTree], reqs: list[Request], ctx: SelectionContext) -> list[list[int]]:
        return global_top_nodes(cands, ctx.budget)


def make_policy(spec: str) -> Policy:
    """Policy by name: ``incremental``, ``beam`` or ``beam:D,W``."""
    name, _, arg = spec.partition(":")
    if name == "incremental" and not arg:
        return Incremental()
    if name == "beam":
        if not arg:
            return FixedBeam()
        try:
            d, w = (int(x) for x in arg.split(","))
        except ValueError:
            raise ValueError(f"policy {spec!r}: expected beam:DEPTH,WIDTH") from None
        return FixedBeam(depth=d, width=w)
    raise ValueError(f"unknown policy {spec!r}; available: incremental, beam, beam:DEPTH,WIDTH")
