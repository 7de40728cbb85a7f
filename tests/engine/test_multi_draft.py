"""Several drafts in one engine: lossless whatever draft speculates, switching mid-request included.

Greedy: the output equals the target's own greedy output with two drafts (a random one that is mostly
rejected and the target itself, always accepted), requests switching draft every slot. Sampling: the
distribution test of test_sampling_lossless.py, with two drafts and a switch at every verification.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from adaserve.engine.config import EngineConfig, MultiDraftConfig
from adaserve.engine.engine import Engine
from adaserve.engine.multi_draft import group_share
from adaserve.engine.request import Request
from adaserve.engine.speculation.draft_bandit import Choice, SlotResult
from adaserve.engine.speculation.sampling import SamplingParams
from tests.engine.helpers import hf_greedy, runner
from tests.engine.test_greedy_generation import run_staggered, workload
from tests.engine.test_sampling_lossless import PROMPT, SMALL, chi2_pvalue, exact_joint, seeded_pairs
from tests.models import make_checkpoint


class Alternate:
    """A selector that switches every request to the next draft at every slot: the most switching."""

    name = "alternate"

    def __init__(self, n: int) -> None:
        self.n, self.seen = n, 0

    def choose(self, c: Choice) -> int:
        return 0 if c.current is None else (c.current + 1) % self.n

    def observe(self, request_id: str, result: SlotResult) -> None:
        self.seen += 1

    def forget(self, request_id: str) -> None:
        return None


def multi_engine(target: Path, drafts: list[Path], policy: str, *, slot_iters: int = 1, alternate: bool = True,
                 **cfg: int | str) -> Engine:
    config = EngineConfig(policy=policy, drafts=MultiDraftConfig(slot_iters=slot_iters), **cfg)
    eng = Engine(runner(target), [runner(d) for d in drafts], config)
    assert eng.pool is not None
    if alternate:
        eng.pool.selector = Alternate(len(drafts))
    return eng


@pytest.fixture(scope="module")
def references(target_dir: Path) -> dict[str, list[int]]:
    return {r.request_id: hf_greedy(target_dir, r.prompt_ids, r.params.max_tokens) for r in workload(10)}


@pytest.mark.parametrize("policy", ["beam:3,2", "chain:3", "adaserve", "specinfer"])
def test_two_drafts_switching_match_target_greedy(target_dir: Path, draft_dir: Path, references,
                                                  policy: str) -> None:
    eng = multi_engine(target_dir, [draft_dir, target_dir], policy, budget=24, prefill_chunk=16)
    reqs = workload(10)
    run_staggered(eng, reqs)
    for r in reqs:
        assert r.output_ids == references[r.request_id], r.request_id
        assert r.finish_reason == "length"
    assert eng.pool is not None and eng.pool.use.switches > 0
    # staggered requests switching every slot: some iterations ran both drafts, and the count says which
    assert 0 < eng.pool.use.mixed_iterations < eng.pool.use.iterations
    # both drafts speculated, and for the same request
    assert any(len(set(r.metrics.drafts_per_step)) == 2 for r in reqs)
    # every draft's KV pages are back, and nothing stays reserved
    assert eng.reserved == [0, 0, 0]
    for d in eng.drafts:
        assert d.cache.free_pages == d.cache.num_pages
    assert eng.target.cache.free_pages == eng.target.cache.num_pages


def test_self_draft_after_switch_is_fully_accepted(target_dir: Path, draft_dir: Path, references) -> None:
    """Switching onto the target-as-draft recomputes its KV for the tokens so far: with a correct
    recompute every chain token it proposes is accepted (a stale or shifted KV would break this)."""
    eng = multi_engine(target_dir, [draft_dir, target_dir], "chain:4", budget=64, prefill_chunk=64)
    reqs = workload(10)
    run_staggered(eng, reqs)
    for r in reqs:
        assert r.output_ids == references[r.request_id]
        steps = list(zip(r.metrics.drafts_per_step, r.metrics.accepted_per_step, r.metrics.verified_per_step,
                         strict=True))
        for arm, acc, ver in steps[:-1]:  # the last may be cut by max_tokens
            if arm == 1:
                assert acc == ver - 1 == 4
    assert eng.pool is not None and eng.pool.use.switch_tokens > 0


@pytest.mark.parametrize("selector", ["ucb", "eps", "length", "d1"])
def test_every_selector_is_lossless(target_dir: Path, draft_dir: Path, references, selector: str) -> None:
    eng = multi_engine(target_dir, [draft_dir, target_dir], f"chain:3@{selector}", alternate=False,
                       budget=24, prefill_chunk=16)
    assert eng.pool is not None and eng.pool.selector.name in (selector, "fixed")
    reqs = workload(10)
    run_staggered(eng, reqs)
    for r in reqs:
        assert r.output_ids == references[r.request_id], r.request_id
    if selector == "d1":
        assert all(set(r.metrics.drafts_per_step) <= {1} for r in reqs)
        assert eng.pool.use.iterations > 0 and eng.pool.use.mixed_iterations == 0


def test_a_draft_groups_cost_is_shared_by_its_members() -> None:
    """A group of one pays for every request it delays; each member of a larger group pays its share;
    a group holding the whole batch delays nobody."""
    assert group_share(20, 1, 0.01) == pytest.approx(19 * 0.01)
    assert group_share(20, 2, 0.01) == pytest.approx(18 * 0.01 / 2)
    assert group_share(20, 10, 0.01) < group_share(20, 2, 0.01) < group_share(20, 1, 0.01)
    assert group_share(20, 20, 0.01) == 0.0


def test_spin_alias_and_single_draft_path(target_dir: Path, draft_dir: Path, references) -> None:
    """``spin`` is chain:4 with the ucb selector; with one draft the engine keeps its single-draft path."""
    eng = multi_engine(target_dir, [draft_dir, target_dir], "spin", alternate=False, budget=24)
    assert eng.pool is not None and eng.pool.selector.name == "ucb"
    single = Engine(runner(target_dir), runner(draft_dir), EngineConfig(policy="spin", budget=24))
    assert single.pool is None and single.reserved == [0, 0]
    reqs = workload(10)
    run_staggered(single, reqs)
    assert all(r.output_ids == references[r.request_id] for r in reqs)


@pytest.fixture(scope="module")
def small_models(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path, Path]:
    d = tmp_path_factory.mktemp("small-multi")
    return (make_checkpoint(d / "t", "llama", seed=10, **SMALL),
            make_checkpoint(d / "d1", "llama", seed=11, num_hidden_layers=1, **SMALL),
            make_checkpoint(d / "d2", "llama", seed=12, num_hidden_layers=1, **SMALL))


def test_sampling_distribution_with_two_switching_drafts(small_models: tuple[Path, Path, Path]) -> None:
    """Tokens 2 and 3 of thousands of seeded runs follow the target's exact distribution, while every
    request changes draft at every verification (slot of one iteration)."""
    target, d1, d2 = small_models
    params = SamplingParams(max_tokens=3, temperature=1.0, ignore_eos=True)
    n = 3000
    eng = multi_engine(target, [d1, d2], "beam:2,2", budget=4096, prefill_chunk=8192, max_batch=1024)
    reqs, counts = seeded_pairs(eng, params, n)
    assert eng.pool is not None and eng.pool.use.switches > 0
    assert any(len(set(r.metrics.drafts_per_step)) == 2 for r in reqs)
    assert chi2_pvalue(counts, exact_joint(target, params)) > 1e-3
    assert chi2_pvalue(counts, exact_joint(d1, params)) < 1e-6  # the test can tell distributions apart


def test_seeded_sampling_with_two_drafts_equals_plain_decoding(small_models: tuple[Path, Path, Path]) -> None:
    target, d1, d2 = small_models
    plain = Engine(runner(target), None, EngineConfig(policy="incremental", budget=64))
    multi = multi_engine(target, [d1, d2], "beam:3,2", budget=64)
    outs = []
    for eng in (plain, multi):
        reqs = [Request(f"{s}", PROMPT, SamplingParams(max_tokens=12, temperature=1.0, seed=s, ignore_eos=True))
                for s in range(16)]
        for r in reqs:
            eng.add_request(r)
        while eng.has_work:
            eng.step()
        outs.append([r.output_ids for r in reqs])
    assert outs[0] == outs[1]
