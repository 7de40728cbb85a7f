"""The KV cache account returns to empty: rejected tree nodes, finished and aborted requests leak nothing."""

from __future__ import annotations

import random
from pathlib import Path

from adaserve.engine.request import Phase, Request
from adaserve.engine.speculation.sampling import SamplingParams
from tests.engine.helpers import engine


def test_hundreds_of_iterations_with_rejections_leave_the_cache_empty(target_dir: Path, draft_dir: Path) -> None:
    eng = engine(target_dir, draft_dir, "beam:3,2", budget=12, prefill_chunk=8, max_batch=6)
    rng = random.Random(5)
    reqs = []
    for i in range(40):
        prompt = [rng.randrange(2, 97) for _ in range(rng.randrange(1, 30))]
        temp = rng.choice([0.0, 1.0])
        reqs.append(Request(f"r{i}", prompt, SamplingParams(max_tokens=rng.randrange(1, 25), temperature=temp,
                                                            seed=i, ignore_eos=True)))
    queue = list(reqs)
    steps = 0
    aborted = set()
    while queue or eng.has_work:
        if queue and rng.random() < 0.5:
            eng.add_request(queue.pop(0))
        if steps % 17 == 5 and eng.running:  # abort someone mid-generation now and then
            victim = rng.choice(eng.running)
            assert eng.abort(victim.request_id)
            aborted.add(victim.request_id)
        eng.step()
        steps += 1
        for r in eng.running:  # committed KV never runs ahead of the tokens it stands for
            assert r.target_kv.length <= len(r.all_ids)
            assert len(r.target_kv.pages) == eng.target.cache.pages_for(r.target_kv.length)
    assert steps >= 100
    rejected = sum(v - 1 - a for r in reqs
                   for v, a in zip(r.metrics.verified_per_step, r.metrics.accepted_per_step, strict=True))
    assert rejected > 100  # the random draft is mostly wrong: plenty of discarded tree nodes
    assert all(r.phase is Phase.FINISHED for r in reqs)
    assert {r.request_id for r in reqs if r.finish_reason == "abort"} == aborted
    for runner in (eng.target, eng.draft):
        assert runner is not None
        assert runner.cache.free_pages == runner.cache.num_pages
    assert eng.reserved == [0, 0]


def test_admission_waits_for_kv_instead_of_overcommitting(target_dir: Path, draft_dir: Path) -> None:
    from adaserve.engine.config import EngineConfig
    from adaserve.engine.engine import Engine
    from tests.engine.helpers import runner

    small = runner(target_dir, page_size=4, num_pages=30)  # 120 slots: room for two requests at a time
    eng = Engine(small, runner(draft_dir), EngineConfig(policy="beam:2,2", budget=8))
    reqs = [Request(f"r{i}", [5] * 20, SamplingParams(max_tokens=20, ignore_eos=True)) for i in range(5)]
    for r in reqs:
        eng.add_request(r)
    peak = 0
    while eng.has_work:
        eng.step()
        peak = max(peak, len(eng.running))
        assert eng.reserved[0] <= small.cache.num_pages
    assert peak == 2
    assert all(len(r.output_ids) == 20 for r in reqs)
    assert small.cache.free_pages == small.cache.num_pages
