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
is never starved.

TTFT. Holding prompt tokens back delays first tokens: on the replayed rps 4.8 trace the rule alone left
about 10 of the 64 running slots prefilling and added 2.7 s to a request's time to first token
(docs/benchmarks.md). So the rule also keeps the requests being prefilled on their TTFT targets. Prompt
chunks are filled in admission order, so request j's first token comes with the iteration that completes
the C_j prompt tokens of the requests before it and its own:

    C_j          the prompt tokens still to prefill of request j and of those ahead of it
    left_j       seconds until j's TTFT target (arrival + target - now)
    on time(p)   ceil(C_j / p) * t_iter(p) <= left_j
    ttft floor   min { p on the grid : on time(p) for every j that is on time with max }
    chunk        max(TPOT chunk above, ttft floor)

A request late even at ``max`` does not hold the chunk up (as a decoding request no chunk can save); when
both kinds of target cannot be met, the first token's wins: a TTFT missed is a miss, while a decoding
request pushed back by one iteration can still make its mean TPOT. Pure: the engine hands in the numbers.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

from adaserve.engine.speculation.selection import slo_requirement

__all__ = ["DecodingSLO", "PrefillTTFT", "RecentIteration", "chunk_grid", "recent_figures", "slo_prefill_chunk",
           "ttft_floor", "ttft_left_s"]


@dataclass(frozen=True)
class DecodingSLO:
    """A decoding request's TPOT position: time since its first token, tokens since, its TPOT target."""

    elapsed_s: float
    tokens_so_far: int
    tpot_slo_s: float


@dataclass(frozen=True)
class PrefillTTFT:
    """A request being prefilled, in prefill order: prompt tokens not yet in the KV, and seconds until its
    TTFT target (negative: already late; inf: it has none, and only its tokens count, for those behind it)."""

    remaining: int
    left_s: float


def ttft_left_s(arrival_s: float, ttft_target_ms: float | None, now_s: float) -> float:
    """Seconds until a request's TTFT target (arrival + target); inf without a target."""
    return math.inf if ttft_target_ms is None else arrival_s + ttft_target_ms / 1e3 - now_s


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


def ttft_floor(prefilling: Sequence[PrefillTTFT], grid: Sequence[int], t_iter: Callable[[int], float]) -> int:
    """The smallest chunk of ``grid`` (largest first, as chunk_grid) that keeps every prefilling request on its
    TTFT target that the largest keeps there (module docstring); 0 when there is none to keep."""
    ahead, cum = 0, []
    for r in prefilling:
        ahead += max(0, r.remaining)
        cum.append(ahead)

    def on_time(j: int, p: int) -> bool:
        return -(-cum[j] // p) * t_iter(p) <= prefilling[j].left_s

    keep = [j for j, r in enumerate(prefilling) if math.isfinite(r.left_s) and cum[j] > 0 and on_time(j, grid[0])]
    if not keep:
        return 0
    for p in reversed(grid):  # smallest first: the first that keeps them all on time
        if all(on_time(j, p) for j in keep):
            return p
    return grid[0]  # unreachable: the largest keeps them by definition


def slo_prefill_chunk(decoding: Sequence[DecodingSLO], *, min_chunk: int, max_chunk: int,
                      t_iter: Callable[[int], float], tokens_per_iter: float,
                      prefilling: Sequence[PrefillTTFT] = ()) -> int:
    """The prompt tokens this iteration may carry (see the module docstring).

    ``t_iter(p)``: predicted seconds of an iteration carrying p prompt tokens; ``tokens_per_iter``: what
    one decoding request emits per iteration (>= 1: the bonus token); ``prefilling``: the requests being
    prefilled that have a TTFT target, in prefill order. With no decoding request, or none that any chunk
    could keep on its SLO, ``max_chunk``; never below what keeps the prefilling requests on their TTFT.
    """
    grid = chunk_grid(min_chunk, max_chunk)
    if tokens_per_iter < 1:
        raise ValueError(f"tokens_per_iter must be >= 1 (every iteration emits the bonus token), got {tokens_per_iter}")
    return max(_tpot_chunk(decoding, grid, t_iter, tokens_per_iter), ttft_floor(prefilling, grid, t_iter))


def _tpot_chunk(decoding: Sequence[DecodingSLO], grid: Sequence[int], t_iter: Callable[[int], float],
                tokens_per_iter: float) -> int:
    """The largest chunk of ``grid`` that keeps every savable decoding request on its TPOT (module docstring)."""
    min_chunk, max_chunk = grid[-1], grid[0]
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
