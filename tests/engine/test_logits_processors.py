"""logit_bias, min_tokens, stop_token_ids and the penalties (logits_processors.py): vLLM's formulas, applied at
every tree node with that node's own path as output so far, so that speculative greedy output equals plain
greedy output with each of them, and seeded sampling equals plain seeded sampling token for token."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from adaserve.engine.model.tree import TokenTree
from adaserve.engine.request import Request
from adaserve.engine.speculation.logits_processors import path_tokens, process_tree_logits
from adaserve.engine.speculation.sampling import SamplingParams
from tests.engine.helpers import engine
from tests.servers import demo_pair

# 'def reverse_list(items):\n    """Return the items in reverse order."""\n    result = []\n    for' in the demo
# pair's tokenizer: Python, which it was trained on, where its draft agrees with its target often enough for
# speculation to be tested
PROMPT = [0, 531, 315, 3075, 64, 508, 9, 1409, 290, 278, 433, 1094, 334, 2303, 325, 315, 3075, 1977, 911, 278, 769,
          280, 987, 278, 381]
LENGTH = 32


def vllm_penalties(logits: torch.Tensor, prompt: list[int], outputs: list[list[int]], presence: float,
                   frequency: float, repetition: float) -> torch.Tensor:
    """vLLM's ``apply_penalties`` (model_executor/layers/utils.py), row by row as it reads: one row per
    sequence, ``outputs[i]`` that row's output tokens."""
    rows = []
    for i, out in enumerate(outputs):
        x = logits[i].float().clone()
        counts = torch.zeros_like(x)
        for t in out:
            counts[t] += 1
        seen = counts > 0
        for t in prompt:
            seen[t] = True
        rep = torch.where(seen, torch.tensor(repetition), torch.tensor(1.0))
        x = torch.where(x > 0, x / rep, x * rep)
        x -= frequency * counts
        x -= presence * (counts > 0).float()
        rows.append(x)
    return torch.stack(rows)


def test_penalties_equal_vllm_at_every_tree_node() -> None:
    torch.manual_seed(0)
    vocab = 50
    tree = TokenTree.from_lists([7, 3, 9, 3, 7, 11], [-1, 0, 0, 1, 3, 2])
    logits = torch.randn(tree.size, vocab) * 3
    prompt, before = [1, 2, 3, 40], [7, 8, 8, 3]
    params = SamplingParams(presence_penalty=0.6, frequency_penalty=0.4, repetition_penalty=1.7)
    got = process_tree_logits(logits, tree, params, prompt_ids=prompt, output_ids=before, emitted=len(before),
                              stop_ids=frozenset())
    want = vllm_penalties(logits, prompt, [before + p for p in path_tokens(tree)], 0.6, 0.4, 1.7)
    torch.testing.assert_close(got, want)
    assert path_tokens(tree) == [[], [3], [9], [3, 3], [3, 3, 7], [9, 11]]


def test_logit_bias_and_min_tokens_by_depth() -> None:
    vocab = 10
    tree = TokenTree.chain([4, 5, 6, 7])  # depths 0..3
    logits = torch.zeros(tree.size, vocab)
    params = SamplingParams(max_tokens=8, min_tokens=4, logit_bias=((2, 5.0), (3, -100.0)))
    got = process_tree_logits(logits, tree, params, prompt_ids=[4], output_ids=[], emitted=2,
                              stop_ids=frozenset({1, 9, 10_000}))  # an id past the vocabulary is no stop here
    assert got[:, 2].eq(5.0).all() and got[:, 3].eq(-100.0).all()
    # 2 out before the tree: nodes of depth 0 and 1 draw tokens 3 and 4, held back; from depth 2 on, free
    assert torch.isinf(got[:2, [1, 9]]).all() and torch.isfinite(got[2:, [1, 9]]).all()


def test_no_processor_leaves_the_logits_untouched() -> None:
    logits = torch.randn(3, 8)
    out = process_tree_logits(logits, TokenTree.chain([1, 2, 3]), SamplingParams(), prompt_ids=[1], output_ids=[],
                              emitted=0, stop_ids=frozenset({0}))
    assert out is logits


def test_bad_values_are_refused() -> None:
    for bad in ({"min_tokens": 9, "max_tokens": 8}, {"repetition_penalty": 0.0},
                {"presence_penalty": float("nan")}, {"logit_bias": ((-1, 1.0),)}):
        with pytest.raises(ValueError):
            SamplingParams(**bad)


# ---- lossless under speculation -------------------------------------------------------------------------


def run(target: Path, draft: Path, policy: str, params: SamplingParams, *, eos: int | None = None,
        prompt: list[int] = PROMPT) -> Request:
    eng = engine(target, draft, policy, budget=24, prefill_chunk=16)
    if eos is not None:
        eng.stop_ids = frozenset({eos})  # an end-of-sequence token the model emits mid-output
    req = Request("r", prompt, params)
    eng.add_request(req)
    while eng.has_work:
        eng.step()
    return req


@pytest.fixture(scope="module")
def pair() -> tuple[Path, Path]:
    return demo_pair()


@pytest.fixture(scope="module")
def plain(pair: tuple[Path, Path]) -> list[int]:
    """The demo target's greedy output with no processor (and no stop)."""
    return run(pair[0], pair[1], "incremental", SamplingParams(max_tokens=LENGTH, ignore_eos=True)).output_ids


def cases(plain: list[int]) -> dict[str, tuple[SamplingParams, int | None]]:
    """Each processor set up to change the demo target's greedy output (the test checks it does)."""
    early = plain[3]
    common = dict(max_tokens=LENGTH, ignore_eos=True)
    return {
        "logit_bias": (SamplingParams(**common, logit_bias=((plain[0], -100.0), (plain[5], 4.0))), None),
        "stop_token_ids": (SamplingParams(max_tokens=LENGTH, stop_token_ids=(early,), ignore_eos=True), None),
        "min_tokens": (SamplingParams(max_tokens=LENGTH, min_tokens=12, stop_token_ids=(plain[8],)), early),
        "presence_penalty": (SamplingParams(**common, presence_penalty=1.5), None),
        "frequency_penalty": (SamplingParams(**common, frequency_penalty=1.0), None),
        "repetition_penalty": (SamplingParams(**common, repetition_penalty=1.8), None),
        "all": (SamplingParams(max_tokens=LENGTH, min_tokens=6, stop_token_ids=(plain[9],), presence_penalty=0.5,
                               frequency_penalty=0.3, repetition_penalty=1.2, logit_bias=((plain[1], -2.0),)),
                early),
    }


@pytest.mark.parametrize("name", ["logit_bias", "stop_token_ids", "min_tokens", "presence_penalty",
                                  "frequency_penalty", "repetition_penalty", "all"])
@pytest.mark.parametrize("policy", ["chain:4", "adaserve"])
@pytest.mark.parametrize("draft", ["demo", "self"])
def test_speculative_greedy_equals_plain_greedy(pair: tuple[Path, Path], plain: list[int], name: str,
                                                policy: str, draft: str) -> None:
    """``self``: the target drafts for itself, so a draft path holds the target's own unprocessed greedy tokens,
    repeats included; a verification that penalized a node by the output before the tree only, not by its
    path, fails here (checked: presence and frequency penalties fail with every policy, repetition with
    adaserve)."""
    params, eos = cases(plain)[name]
    reference = run(*pair, "incremental", params, eos=eos)
    assert reference.output_ids != plain, "the processor changed nothing: the test would prove nothing"
    spec = run(pair[0], pair[1] if draft == "demo" else pair[0], policy, params, eos=eos)
    assert spec.output_ids == reference.output_ids
    assert spec.finish_reason == reference.finish_reason
    assert sum(spec.metrics.accepted_per_step) > 0, "no draft token accepted: nothing speculative was checked"
    if params.min_tokens:
        assert len(spec.output_ids) >= params.min_tokens
        stops = set(params.stop_token_ids) | ({eos} if eos is not None else set())
        assert not stops & set(spec.output_ids[: params.min_tokens - 1])


def test_seeded_sampling_with_processors_equals_plain(pair: tuple[Path, Path], plain: list[int]) -> None:
    params = SamplingParams(max_tokens=LENGTH, temperature=0.8, seed=7, ignore_eos=True, min_tokens=4,
                            presence_penalty=0.4, frequency_penalty=0.2, repetition_penalty=1.1,
                            logit_bias=((plain[2], 1.5),))
    outs = [run(*pair, policy, params).output_ids for policy in ("incremental", "chain:4", "adaserve")]
    assert outs[0] == outs[1] == outs[2]


def test_a_continuation_counts_its_earlier_tokens_as_output(pair: tuple[Path, Path]) -> None:
    """A request resumed after k tokens (a failover) penalizes them as the unbroken run did."""
    params = SamplingParams(max_tokens=LENGTH, ignore_eos=True, presence_penalty=1.0, frequency_penalty=0.5)
    whole = run(*pair, "chain:4", params).output_ids
    k = 7
    eng = engine(*pair, "chain:4", budget=24, prefill_chunk=16)
    req = Request("c", PROMPT + whole[:k], SamplingParams(**{**params.__dict__, "max_tokens": LENGTH - k}))
    req.resumed = k
    eng.add_request(req)
    while eng.has_work:
        eng.step()
    assert whole[:k] + req.output_ids == whole
