"""Several choices for one OpenAI request (``n``, completions' ``best_of``), at the gateway and at a worker alike.

Each sequence is its own engine request, with its own SLO (the request's class) and its own request id
(``<id>-<i>`` when there are several). Nothing here is new sampling: each sequence is exactly what the target
alone gives for its own seed.

- Seeds: with a ``seed``, sequence i uses ``choice_seed(seed, i)`` = (seed + i) mod 2**63, so an answer is
  reproducible and its choices differ; without one, each sequence draws its own. Greedy sequences are all equal.
- ``best_of``: ``best_of`` sequences are generated and the ``n`` with the highest cumulative log-probability
  (the sum of the reported ``logprob`` of every emitted token: the target's raw row, as ``logprobs`` reports it)
  are returned, best first (``best_of_order``).
- Streamed, each sequence's chunks carry its choice index, interleaved as they come (``merged``).
- The prompt is prefilled per sequence; the engine's prefix cache (on by default) may reuse full pages another
  sequence has already committed. Nothing shares KV for ``n`` beyond that (not measured here).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Sequence
from typing import Any, TypeVar

SEED_SPAN = 2**63  # the contract's seeds are in [0, 2**63)

T = TypeVar("T")


def choice_seed(seed: int | None, index: int) -> int | None:
    """The seed of sequence ``index`` for a request's ``seed`` (None: none given, each draws its own)."""
    return None if seed is None else (seed + index) % SEED_SPAN


def sequence_id(request_id: str, index: int, count: int) -> str:
    """The engine request id of sequence ``index`` of ``count``: the answer's own id when it is the only one."""
    return request_id if count == 1 else f"{request_id}-{index}"


def cumulative_logprob(entries: list[dict[str, Any]] | None) -> float:
    """A sequence's score for ``best_of``: the sum of its tokens' log-probabilities (worker logprobs entries)."""
    return sum(float(e["logprob"]) for e in entries or ())


def best_of_order(scores: Sequence[float], n: int) -> list[int]:
    """The indices of the ``n`` highest ``scores``, highest first; a tie goes to the sequence generated first."""
    return sorted(range(len(scores)), key=lambda i: (-scores[i], i))[:n]


class _End:
    pass


class _Failed:
    def __init__(self, error: BaseException) -> None:
        self.error = error


async def merged(streams: Sequence[AsyncIterator[T]]) -> AsyncIterator[tuple[int, T]]:
    """The items of ``streams`` as they come, each with its stream's index. An exception in one is raised here,
    and leaving early (or failing) cancels the streams still running."""
    queue: asyncio.Queue[tuple[int, Any]] = asyncio.Queue()

    async def pump(index: int, stream: AsyncIterator[T]) -> None:
        try:
            async for item in stream:
                queue.put_nowait((index, item))
        except BaseException as e:  # handed to the consumer, which raises it (never left waiting)
            queue.put_nowait((index, _Failed(e)))
            if not isinstance(e, Exception):
                raise
        else:
            queue.put_nowait((index, _End()))

    tasks = [asyncio.ensure_future(pump(i, s)) for i, s in enumerate(streams)]
    try:
        running = len(tasks)
        while running:
            index, item = await queue.get()
            if isinstance(item, _End):
                running -= 1
            elif isinstance(item, _Failed):
                raise item.error
            else:
                yield index, item
    finally:
        for task in tasks:
            task.cancel()
