"""Every policy is lossless under continuous batching, and AdaServe gives tight SLOs more tokens."""

from __future__ import annotations

import random
import threading
from pathlib import Path

import numpy as np
import pytest

from adaserve.engine.loop import EngineLoop
from adaserve.engine.request import Request
from adaserve.engine.speculation.policies import POLICY_NAMES, make_policy
from adaserve.engine.speculation.sampling import SamplingParams
from adaserve.engine.speculation.speculate import DraftInput, beam_search
from tests.engine.helpers import engine, hf_greedy, outputs, runner

POLICIES = ["adaserve", "incremental", "chain:3", "specinfer", "smartspec", "equal-greedy", "global-greedy"]
SLOS = [None, 5.0, 50.0, 1000.0]


def mixed_workload(n: int, seed: int) -> list[Request]:
    rng = random.Random(seed)
    return [Request(f"r{i}", [rng.randrange(2, 97) for _ in range(rng.randrange(1, 30))],
                    SamplingParams(max_tokens=rng.randrange(2, 30), ignore_eos=True), tpot_slo_ms=rng.choice(SLOS))
            for i in range(n)]


@pytest.fixture(scope="module")
def references(target_dir: Path) -> dict[str, list[int]]:
    return {r.request_id: hf_greedy(target_dir, r.prompt_ids, r.params.max_tokens) for r in mixed_workload(12, 3)}


def test_policy_names_all_resolve() -> None:
    for name in POLICIES:
        assert make_policy(name).name in name
    with pytest.raises(ValueError, match="unknown policy"):
        make_policy("nope")
    with pytest.raises(ValueError, match="bad policy"):
        make_policy("chain:x")
    examples = {"chain:K": "chain:3", "beam:D,W": "beam:3,2"}  # the listed forms of parametrised policies
    for name in POLICY_NAMES:  # every name the error messages offer builds
        assert make_policy(examples.get(name, name)).name.startswith(name.split(":")[0])


@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("draft", ["random", "self"])
@pytest.mark.parametrize("static", [False, True], ids=["eager", "static"])
def test_every_policy_is_lossless_with_arrivals_and_aborts(policy: str, draft: str, static: bool, target_dir: Path,
                                                           draft_dir: Path, references) -> None:
    """``static``: both models' decode-sized forwards on padded static buffers (model/static.py)."""
    eng = engine(target_dir, target_dir if draft == "self" else draft_dir, policy, budget=20, prefill_chunk=24,
                 static_shapes=static)
    reqs = mixed_workload(12, 3)
    queue = list(reqs)
    aborted: set[str] = set()
    step = 0
    while queue or eng.has_work:
        if queue and step % 2 == 0:  # arrivals while others are mid-generation
            eng.add_request(queue.pop(0))
        if step in (6, 11):  # abort whoever has decoded the most so far
            victim = max(eng.running, key=lambda r: len(r.output_ids))
            eng.abort(victim.request_id)
            aborted.add(victim.request_id)
        eng.step()
        step += 1
    assert len(aborted) == 2
    for r in reqs:
        ref = references[r.request_id]
        if r.request_id in aborted:
            assert r.finish_reason == "abort"
            assert r.output_ids == ref[: len(r.output_ids)]
        else:
            assert r.output_ids == ref, (policy, r.request_id)
    assert eng.target.cache.free_pages == eng.target.cache.num_pages
    if eng.draft is not None:
        assert eng.draft.cache.free_pages == eng.draft.cache.num_pages
    assert eng.reserved == [0, 0]
    if draft == "self" and policy not in ("incremental",):
        assert sum(m.tokens_accepted for m in eng.history) > 0


@pytest.mark.parametrize("budget_rule", ["slo", "knee"])
def test_budget_rules_are_lossless(budget_rule: str, target_dir: Path, references) -> None:
    """The SLO budget rule (iteration_budget.slo_budget) and the fixed knee only change how much is verified."""
    eng = engine(target_dir, target_dir, "adaserve", budget=20, prefill_chunk=24, budget_rule=budget_rule)
    reqs = mixed_workload(12, 3)
    assert outputs(eng, reqs) == [references[r.request_id] for r in reqs]
    assert sum(m.tokens_accepted for m in eng.history) > 0
    if budget_rule == "slo":  # B moves with the batch's SLOs, from the roots up, never past the candidates
        spec = [m for m in eng.history if m.depth]
        assert spec and all(m.n_decode <= m.budget for m in spec)
        assert len({m.budget for m in spec}) > 1


@pytest.mark.parametrize("draft", ["random", "self"])
def test_the_slo_depth_rule_is_lossless(draft: str, target_dir: Path, draft_dir: Path, references) -> None:
    """The SLO-first shape (adaptive.slo_shape) reads each request's SLO line and own chain rate; it only changes
    how deep the chains are drafted."""
    from adaserve.engine.config import EngineConfig
    from adaserve.engine.engine import Engine
    from adaserve.engine.speculation.adaptive import AdaptiveConfig

    cfg = EngineConfig(policy="adaserve", budget=20, prefill_chunk=24,
                       adaptive=AdaptiveConfig(d_min=0, d_max=8, w_max=1, depth_rule="slo"))
    eng = Engine(runner(target_dir), runner(target_dir if draft == "self" else draft_dir), cfg)
    reqs = mixed_workload(12, 3)
    assert outputs(eng, reqs) == [references[r.request_id] for r in reqs]
    assert all(m.width <= 1 for m in eng.history)
    if draft == "self":  # every token accepted: the chains go deep
        assert max(m.depth for m in eng.history) > 2


def test_tight_slo_gets_more_verified_tokens(target_dir: Path) -> None:
    """Same batch, same prompts: requests 5 ms behind schedule get deeper trees than relaxed ones.

    A fixed B (the knee rule): with a draft equal to the target every node pays for itself, so the goodput
    rule would raise B until every tree fits and the SLO step would have nothing to decide."""
    eng = engine(target_dir, target_dir, "adaserve", budget=16, budget_rule="knee")
    prompt = [7, 8, 9, 10]
    tight = [Request(f"t{i}", prompt, SamplingParams(max_tokens=40, ignore_eos=True), tpot_slo_ms=0.5)
             for i in range(3)]
    relaxed = [Request(f"x{i}", prompt, SamplingParams(max_tokens=40, ignore_eos=True), tpot_slo_ms=10_000.0)
               for i in range(3)]
    for r in tight + relaxed:
        eng.add_request(r)
    while eng.has_work:
        eng.step()
    shared = [m for m in eng.history if len(m.per_request_verified) == 6]
    assert len(shared) >= 3
    t = np.mean([m.per_request_verified[r.request_id] for m in shared for r in tight])
    x = np.mean([m.per_request_verified[r.request_id] for m in shared for r in relaxed])
    assert t > x
    for m in eng.history:  # budget is never exceeded
        assert m.tokens_verified <= max(m.budget, m.n_decode)
    assert all(m.t_select_s > 0 for m in shared)  # the scheduler's time is measured where it selected


def test_beam_search_shapes(target_dir: Path, draft_dir: Path) -> None:
    draft = runner(draft_dir)
    from adaserve.engine.model.kv_cache import SequenceKV

    inputs = [DraftInput(SequenceKV(), [3, 4, 5]), DraftInput(SequenceKV(), [9])]
    cands = beam_search(draft, inputs, depth=3, width=2)
    for c in cands:
        assert c.size == 1 + 3 * 2
        assert np.bincount(c.depths()).tolist() == [1, 2, 2, 2]
        assert all(c.log_probs[i] < c.log_probs[c.parents[i]] for i in range(1, c.size))
    assert all(x.seq.length == len(x.pending) for x in inputs)  # pending tokens committed, beams dropped
    seen: list[tuple[int, int]] = []
    more = [DraftInput(inputs[0].seq, [6, 7]), DraftInput(inputs[1].seq, [10])]
    beam_search(draft, more, depth=3, width=2, on_forward=lambda rec: seen.append((rec.n_new, rec.n_context)))
    # one record per draft forward: the catch-up tokens first (2 + 1 over 3 + 1 cached), then n * w beams
    # over the prefixes before the roots (4 + 1) and each tree's cached nodes (root, then root + level 1)
    assert seen == [(3, 4), (4, 5 + 2 * 1), (4, 5 + 2 * 3)]
    free_before = draft.cache.free_pages
    static = beam_search(draft, [DraftInput(inputs[1].seq, [11])], depth=0, width=1, expansion=(1, 1, 3, 1))
    assert np.bincount(static[0].depths()).tolist() == [1, 1, 1, 3, 3]
    assert draft.cache.free_pages == free_before


def test_engine_loop_streams_and_aborts_from_another_thread(target_dir: Path, draft_dir: Path) -> None:
    eng = engine(target_dir, draft_dir, "adaserve", budget=16)
    loop = EngineLoop(eng).start()
    done = {k: threading.Event() for k in ("a", "b")}
    got: dict[str, list] = {"a": [], "b": []}

    def on_event(ev) -> None:
        got[ev.request_id].append(ev)
        if ev.finished:
            done[ev.request_id].set()

    loop.submit(Request("a", [5, 6, 7], SamplingParams(max_tokens=12, ignore_eos=True)), on_event)
    loop.submit(Request("b", [5, 6, 7], SamplingParams(max_tokens=400, ignore_eos=True)), on_event)
    assert done["a"].wait(60)
    loop.abort("b")
    assert done["b"].wait(60)
    loop.stop()
    assert sum(len(e.new_tokens) for e in got["a"]) == 12 and got["a"][-1].finish_reason == "length"
    assert got["b"][-1].finish_reason == "abort"
    assert eng.target.cache.free_pages == eng.target.cache.num_pages
    with pytest.raises(ValueError, match="max_tokens"):
        loop.submit(Request("c", [1], SamplingParams(max_tokens=10_000)), on_event)
    assert loop.error is None and not loop.alive


def test_smartspec_recovers_from_an_unlucky_first_step() -> None:
    from adaserve.engine.speculation.smartspec import AcceptanceAverage, best_length

    acc = AcceptanceAverage()
    acc.observe(0, 4)  # nothing accepted in the first speculative step
    assert acc.alpha > 0.4  # the prior still counts: speculation is tried again

    def target(ctx: int, k: int) -> float:
        return 0.025 + 0.0001 * k

    k = best_length(n=1, n_context=0, alpha=acc.alpha, max_k=8, t_target=target, t_draft=lambda c, k: 0.002)
    assert k > 0
