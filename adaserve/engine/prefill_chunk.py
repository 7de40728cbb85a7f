"""How many prompt tokens this iteration carries: a fixed chunk, or one sized by the decoding requests' SLOs.

Chunked prefill puts up to ``prefill_chunk`` prompt tokens in the same target forward as every
verification tree. In the simulated paper setting (docs/benchmarks.md) that chunk rode 90% of the
iterations at 80 req/s, 229 prompt tokens beside 211 verified ones, and made an iteration 97 ms against
24 ms for a one-token forward: the decoding requests' TPOT is then set by the chunk, whatever the
policy chooses to verify.

The SLO rule (``EngineConfig.prefill_rule = "slo"``) charges the chunk to the iteration time the
requests' requirements are computed with, A(r) = (l_r + t_iter) / tpot_r - o_r (selection.py), and
picks the largest chunk on the grid max, max/2, ..., min with which every decoding request that can be
on its SLO this iteration with the smallest chunk still is:

    e          tokens a decoding request emits per iteration (recent accepted per request, + the bonus)
    t_iter(p)  predicted iteration with p prompt tokens in the forward
    savable    { r : A(r; t_iter(min)) <= e }         (a request behind even then is not one the chunk saves)
    chunk      max { p on the grid : A(r; t_iter(p)) <= e for every r in savable }

So the chunk shrinks when requests are near their SLO and grows back to ``max`` when they have slack
(A(r) is negative for a request ahead of its SLO); the smallest chunk keeps prefill moving, so the queue
is never starved. Pure: the engine hands in the numbers.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

from adaserve.engine.speculation.selection import slo_requirement

__all__ = ["DecodingSLO", "RecentIteration", "chunk_grid", "recent_figures", "slo_prefill_chunk"]


@dataclass(frozen=True)
class DecodingSLO:
    """A decoding request's TPOT position: time since its first token, tokens since, its TPOT target."""

    elapsed_s: float
    tokens_so_far: int
    tpot_slo_s: float


class RecentIteration(Protocol):
    """What the rule reads of a past iteration (engine.StepMetrics; the replay clock's own record)."""

    @property
    def n_decode(self) -> int: ...

    @property
    def tokens_accepted(self) -> int: ...

    @property
    def tokens_verified(self) -> int: ...

    @property
    def host_s(self) -> float: ...


def recent_figures(recent: Sequence[RecentIteration], n_decoding: int) -> tuple[float, float, float]:
    """(tokens a decoding request emits per iteration, tokens verified per iteration, draft and scheduler
    seconds per iteration) over the recent iterations that decoded; with none, (1, n_decoding, 0)."""
    decoded = [m for m in recent if m.n_decode]
    n_dec = sum(m.n_decode for m in decoded)
    per_req = 1.0 + (sum(m.tokens_accepted for m in decoded) / n_dec if n_dec else 0.0)
    verify = sum(m.tokens_verified for m in decoded) / len(decoded) if decoded else float(n_decoding)
    host = sum(m.host_s for m in decoded) / len(decoded) if decoded else 0.0
    return per_req, verify, host


def chunk_grid(min_chunk: int, max_chunk: int) -> list[int]:
    """max, max/2, max/4, ... down to min (min always included), largest first."""
    if min_chunk < 1 or max_chunk < min_chunk:
        raise ValueError(f"need 1 <= min_chunk <= max_chunk, got {min_chunk}, {max_chunk}")
    out, p = [], max_chunk
    while p > min_chunk:
        out.append(p)
        p //= 2
    return [*out, min_chunk]


def slo_prefill_chunk(decoding: Sequence[DecodingSLO], *, min_chunk: int, max_chunk: int,
                      t_iter: Callable[[int], float], tokens_per_iter: float) -> int:
    """The prompt tokens this iteration may carry (see the module docstring).

    ``t_iter(p)``: predicted seconds of an iteration carrying p prompt tokens; ``tokens_per_iter``: what
    one decoding request emits per iteration (>= 1: the bonus token). With no decoding request, or none
    that any chunk could keep on its SLO, ``max_chunk``.
    """
    grid = chunk_grid(min_chunk, max_chunk)
    if tokens_per_iter < 1:
        raise ValueError(f"tokens_per_iter must be >= 1 (every iteration emits the bonus token), got {tokens_per_iter}")
    if not decoding:
        return max_chunk

    def need(r: DecodingSLO, p: int) -> float:
        return slo_requirement(elapsed_s=max(0.0, r.elapsed_s), tokens_so_far=r.tokens_so_far,
                               t_iter_s=max(0.0, t_iter(p)), tpot_slo_s=r.tpot_slo_s)

    savable = [r for r in decoding if need(r, min_chunk) <= tokens_per_iter]
    for p in grid:  # largest first: the first that keeps every savable request on its SLO
        if all(need(r, p) <= tokens_per_iter for r in savable):
            return p
    return min_chunk  # unreachable: every savable request meets min_chunk by definition
