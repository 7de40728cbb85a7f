"""Prefix caching leaves greedy output unchanged for every policy, and skips the cached prefill (issue 34).

Requests share a system prompt and continue each other's conversations (a second turn resends the first's
prompt and answer), arrive while others decode, and, in a small cache, evict each other's cached pages.
Each run is compared token for token with the same run without prefix caching.
"""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch

from adaserve.engine.config import EngineConfig
from adaserve.engine.engine import Engine
from adaserve.engine.request import Request
from adaserve.engine.speculation.sampling import SamplingParams
from tests.engine.helpers import engine, runner

POLICIES = ("incremental", "chain:3", "adaserve", "specinfer")
SYSTEM = [7, 3, 11, 19, 23, 5, 8, 13, 2, 40, 41]  # 11 tokens: two full pages of 4 and a partial one


def conversations(n: int, seed: int) -> list[list[int]]:
    """First-turn prompts: the shared system prompt and a user turn of its own."""
    rng = random.Random(seed)
    return [SYSTEM + [rng.randrange(2, 97) for _ in range(rng.randrange(1, 9))] for _ in range(n)]


def serve(eng: Engine, prompts: list[list[int]], *, max_tokens: int, tag: str, every: int = 2) -> list[Request]:
    """Add the requests one every ``every`` steps (arrivals while others decode) and run until all finish."""
    reqs = [
        Request(
            f"{tag}{i}", p, SamplingParams(max_tokens=max_tokens, ignore_eos=True), tpot_slo_ms=[None, 5.0, 50.0][i % 3]
        )
        for i, p in enumerate(prompts)
    ]
    queue, step = list(reqs), 0
    while queue or eng.has_work:
        if queue and step % every == 0:
            eng.add_request(queue.pop(0))
        eng.step()
        step += 1
    return reqs


def two_turns(eng: Engine, *, n: int = 6, seed: int = 4) -> dict[str, list[int]]:
    """Every conversation's first turn, then (same engine) its second turn: the first's prompt, its answer,
    and a new user turn. The output of both turns, by request id."""
    first = serve(eng, conversations(n, seed), max_tokens=10, tag="t1-")
    rng = random.Random(seed + 1)
    second = serve(
        eng,
        [r.prompt_ids + r.output_ids + [rng.randrange(2, 97) for _ in range(3)] for r in first],
        max_tokens=10,
        tag="t2-",
    )
    return {r.request_id: r.output_ids for r in first + second}


def assert_empty(eng: Engine) -> None:
    for r in [eng.target, *eng.drafts]:
        assert r.cache.free_pages == r.cache.num_pages
    assert eng.reserved == [0] * len(eng.reserved)


@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("draft", ["random", "self"])
def test_greedy_output_is_the_same_with_and_without_prefix_caching(
    policy: str, draft: str, target_dir: Path, draft_dir: Path
) -> None:
    """``self``: the target drafts for itself, so long paths are accepted and compacted past shared pages."""
    d = target_dir if draft == "self" else draft_dir
    runs = {}
    for cached in (False, True):
        eng = engine(target_dir, d, policy, budget=20, prefill_chunk=16, prefix_caching=cached)
        runs[cached] = two_turns(eng)
        assert_empty(eng)
        stats = eng.target.cache.prefix_stats
        if cached:
            # every second turn reuses at least the system prompt's two pages and its first turn's pages
            assert stats.hit_tokens >= 6 * 8 + 5 * 8
            if eng.draft is not None:
                assert eng.draft.cache.prefix_stats.hit_tokens > 0
        else:
            assert stats.queried_tokens == 0
    assert runs[True] == runs[False]


@pytest.mark.parametrize("policy", POLICIES)
def test_eviction_under_memory_pressure_keeps_output_the_same(policy: str, target_dir: Path, draft_dir: Path) -> None:
    def small(path: Path) -> object:
        return runner(path, page_size=4, num_pages=48)  # three requests' worst case at a time

    runs, evictions = {}, 0
    for cached in (False, True):
        cfg = EngineConfig(policy=policy, budget=20, prefill_chunk=16, prefix_caching=cached)
        speculates = policy != "incremental"
        eng = Engine(small(target_dir), small(draft_dir) if speculates else None, cfg)
        runs[cached] = two_turns(eng, n=10, seed=9)
        assert_empty(eng)
        evictions = eng.target.cache.prefix_stats.evictions
    assert evictions > 0
    assert runs[True] == runs[False]


def test_a_second_identical_prompt_prefills_only_its_uncached_tail(target_dir: Path, draft_dir: Path) -> None:
    eng = engine(target_dir, draft_dir, "adaserve", budget=20, prefill_chunk=64)
    prompt = [*SYSTEM, 50, 51, 52, 53, 54]  # 16 tokens: four full pages
    prefilled = []
    for i in range(2):
        before = sum(m.prefill_tokens for m in eng.history)
        (req,) = serve(eng, [prompt], max_tokens=6, tag=f"same{i}-")
        prefilled.append(sum(m.prefill_tokens for m in eng.history) - before)
        assert req.metrics.cached_tokens == 16 - prefilled[-1]
    # the whole prompt is cached, but its last token is recomputed for its logits: its page, 4 tokens
    assert prefilled == [16, 4]


def test_prefix_caching_off_prefills_everything(target_dir: Path, draft_dir: Path) -> None:
    eng = engine(target_dir, draft_dir, "chain:3", prefix_caching=False)
    serve(eng, [SYSTEM * 2] * 2, max_tokens=4, tag="off-")
    assert sum(m.prefill_tokens for m in eng.history) == 2 * 22
    assert eng.target.cache.cached_pages == 0


def test_shared_pages_are_never_written(target_dir: Path) -> None:
    """A finished conversation's cached pages keep their K/V bit for bit while others share and extend them
    (self-drafting: trees verified and compacted right past the shared pages)."""
    eng = engine(target_dir, target_dir, "adaserve", budget=20, prefill_chunk=16)
    (first,) = serve(eng, [[*SYSTEM, 60, 61, 62, 63, 64]], max_tokens=12, tag="a")
    cache = eng.target.cache
    pages = sorted(p for p in range(cache.num_pages) if cache.prefix.is_keyed(p))
    assert len(pages) >= 6
    slots = torch.tensor([p * cache.page_size + i for p in pages for i in range(cache.page_size)])
    k, v = cache.k[:, slots].clone(), cache.v[:, slots].clone()
    follow = [first.prompt_ids + first.output_ids + [70 + i] for i in range(4)] + [[*SYSTEM, 80]] * 2
    serve(eng, follow, max_tokens=12, tag="b", every=1)
    assert cache.prefix_stats.hit_tokens >= 4 * 28 + 2 * 8
    assert all(cache.prefix.is_keyed(p) for p in pages)  # nothing evicted: the comparison below means something
    assert torch.equal(cache.k[:, slots], k) and torch.equal(cache.v[:, slots], v)
