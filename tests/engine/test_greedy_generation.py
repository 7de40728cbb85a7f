"""Speculative greedy output equals the target's own greedy output, token for token."""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from adaserve.engine.request import Request
from adaserve.engine.speculation.sampling import SamplingParams
from tests.engine.helpers import engine, hf_greedy


def workload(n: int, seed: int = 0) -> list[Request]:
    rng = random.Random(seed)
    out = []
    for i in range(n):
        prompt = [rng.randrange(2, 97) for _ in range(rng.randrange(1, 40))]
        out.append(Request(f"r{i}", prompt, SamplingParams(max_tokens=rng.randrange(1, 40), ignore_eos=True)))
    return out


@pytest.fixture(scope="module")
def references(target_dir: Path) -> dict[str, list[int]]:
    return {r.request_id: hf_greedy(target_dir, r.prompt_ids, r.params.max_tokens) for r in workload(10)}


def run_staggered(eng, reqs: list[Request]) -> None:
    """Requests join while others are mid-generation: three arrive at once, then one per step."""
    queue = list(reqs)
    for r in queue[:3]:
        eng.add_request(r)
    queue = queue[3:]
    while queue or eng.has_work:
        if queue:
            eng.add_request(queue.pop(0))
        eng.step()


@pytest.mark.parametrize("policy", ["beam:4,2", "beam:3,3", "beam:2,1", "incremental"])
@pytest.mark.parametrize("static", ["eager", "static", "static-steps"])
def test_random_draft_matches_target_greedy(target_dir: Path, draft_dir: Path, references, policy: str,
                                            static: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """``static``: decode-sized forwards on static buffers; ``static-steps`` with the torch picks a GPU runs, so the
    draft's levels run as its steps (speculation/draft_steps.py), as a GPU replays them."""
    from adaserve.engine.speculation import draft_steps
    from tests.engine.helpers import use_cpu_kernels

    if static == "static-steps":
        use_cpu_kernels("torch", monkeypatch)
    eng = engine(target_dir, draft_dir, policy, budget=24, prefill_chunk=16, static_shapes=static != "eager")
    reqs = workload(10)
    run_staggered(eng, reqs)
    for r in reqs:
        assert r.output_ids == references[r.request_id], r.request_id
        assert r.finish_reason == "length"
    if static == "static-steps" and policy != "incremental":
        assert eng.draft is not None and eng.draft.static is not None
        assert draft_steps._STEPS.get(eng.draft.static)  # the levels ran as steps


def test_self_draft_matches_and_is_accepted(target_dir: Path, references) -> None:
    """Draft = target: output unchanged and every speculated chain token is accepted."""
    depth = 4
    eng = engine(target_dir, target_dir, f"beam:{depth},1", budget=64, prefill_chunk=64)
    reqs = workload(10)
    run_staggered(eng, reqs)
    for r in reqs:
        assert r.output_ids == references[r.request_id]
        steps = r.metrics.accepted_per_step
        verified = r.metrics.verified_per_step
        # a chain of `depth` drafts is fully accepted unless max_tokens cuts the walk short
        for acc, ver in zip(steps[:-1], verified[:-1], strict=True):
            assert acc == ver - 1 == depth
    total_acc = sum(sum(r.metrics.accepted_per_step) for r in reqs)
    total_drafted = sum(sum(v - 1 for v in r.metrics.verified_per_step) for r in reqs)
    assert total_acc >= 0.9 * total_drafted


def test_eos_ends_request_without_bonus(target_dir: Path, draft_dir: Path, references) -> None:
    """Make the 3rd greedy token an EOS: generation stops right after it, in every policy."""
    req0 = workload(10)[4]
    ref = references[req0.request_id]
    assert len(ref) > 3
    stop_token = ref[2]
    for policy in ["beam:4,2", "incremental"]:
        eng = engine(target_dir, draft_dir, policy, budget=16)
        req = Request("x", req0.prompt_ids, SamplingParams(max_tokens=req0.params.max_tokens,
                                                           stop_token_ids=(stop_token,), ignore_eos=True))
        eng.add_request(req)
        while eng.has_work:
            eng.step()
        first = ref.index(stop_token)
        assert req.output_ids == ref[: first + 1]
        assert req.finish_reason == "stop"


def test_stop_string_cuts_tokens_at_the_completing_token(target_dir: Path, draft_dir: Path, references) -> None:
    """A stop string ends the request at the token that completes it: no later token of the same step."""
    req0 = workload(10)[4]
    ref = references[req0.request_id]

    def detok(ids: list[int]) -> str:  # a stand-in tokenizer: one letter per token id
        return "".join(chr(65 + t % 26) for t in ids)

    stop = detok(ref[2:4])
    cut = next(k for k in range(1, len(ref) + 1) if stop in detok(ref[:k]))
    for policy in ["beam:4,2", "incremental"]:
        eng = engine(target_dir, target_dir, policy, budget=32)
        eng.detokenize = detok
        req = Request("s", req0.prompt_ids, SamplingParams(max_tokens=req0.params.max_tokens, stop=(stop,),
                                                           ignore_eos=True))
        eng.add_request(req)
        while eng.has_work:
            eng.step()
        assert req.output_ids == ref[:cut] and req.finish_reason == "stop"
