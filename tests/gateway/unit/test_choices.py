"""contract/choices.py: the pure steps of n > 1 and best_of (seeds, ids, ranking) and the merge of streams."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import aclosing

import pytest

from adaserve.contract.choices import best_of_order, choice_seed, cumulative_logprob, merged, sequence_id


def test_choice_seeds_are_the_seed_plus_the_index() -> None:
    assert [choice_seed(10, i) for i in range(3)] == [10, 11, 12]
    assert choice_seed(2**63 - 1, 1) == 0 and choice_seed(None, 2) is None


def test_sequence_ids() -> None:
    assert sequence_id("cmpl-a", 0, 1) == "cmpl-a"
    assert [sequence_id("cmpl-a", i, 2) for i in range(2)] == ["cmpl-a-0", "cmpl-a-1"]


def test_best_of_keeps_the_n_most_likely_best_first() -> None:
    entries = [[{"logprob": -1.0}, {"logprob": -2.0}], [{"logprob": -0.5}], [{"logprob": -9999.0}], []]
    scores = [cumulative_logprob(e) for e in entries]
    assert scores == [-3.0, -0.5, -9999.0, 0.0]
    assert best_of_order(scores, 2) == [3, 1]  # an empty sequence has probability 1
    assert best_of_order(scores, 4) == [3, 1, 0, 2]
    assert best_of_order([-1.0, -1.0, -2.0], 2) == [0, 1]  # a tie goes to the one generated first
    assert best_of_order([-3.0, -1.0, -2.0], 1) == [1]  # not the first, not the last: the highest


async def _items(values: list[int], delay: float, fail: bool = False) -> AsyncIterator[int]:
    for v in values:
        await asyncio.sleep(delay)
        yield v
    if fail:
        raise ValueError("lost")


def test_merged_interleaves_with_indices_and_raises_a_failure() -> None:
    async def run() -> list[tuple[int, int]]:
        return [x async for x in merged([_items([1, 2, 3], 0.01), _items([10, 20], 0.015)])]

    out = asyncio.run(run())
    assert sorted(out) == [(0, 1), (0, 2), (0, 3), (1, 10), (1, 20)]
    assert [v for i, v in out if i == 0] == [1, 2, 3] and out[0] == (0, 1)

    async def failing() -> list[tuple[int, int]]:
        return [x async for x in merged([_items([1], 0.0, fail=True), _items(list(range(100)), 0.05)])]

    with pytest.raises(ValueError, match="lost"):
        asyncio.run(failing())


def test_leaving_merged_early_cancels_the_streams_still_running() -> None:
    closed: list[int] = []

    async def endless(i: int) -> AsyncIterator[int]:
        try:
            while True:
                await asyncio.sleep(0.005)
                yield i
        finally:
            closed.append(i)

    async def run() -> None:
        async with aclosing(merged([endless(0), endless(1)])) as both:
            async for _ in both:
                break
        await asyncio.sleep(0.05)  # the cancelled pumps run their clean-up
        assert sorted(closed) == [0, 1]  # now, not when the loop shuts down

    asyncio.run(run())
