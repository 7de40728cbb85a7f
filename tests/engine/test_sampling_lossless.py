"""Speculative sampling is distribution-preserving.

On a vocabulary of 8 we compute the target's exact distribution of the 2nd and 3rd generated tokens
(64 outcomes, marginalising the 1st) and compare it with the empirical distribution of thousands of
seeded speculative runs (a draft that disagrees often, so both acceptance and rejection paths run).
Pearson's chi-square test must not reject at p < 1e-3; as a power check, the same samples must be
rejected against the draft's distribution.
"""

from __future__ import annotations

import itertools
from pathlib import Path

import numpy as np
import pytest
import torch
from scipy import stats

from adaserve.engine.engine import Engine
from adaserve.engine.request import Request
from adaserve.engine.speculation.sampling import SamplingParams, processed_probs
from tests.engine.helpers import engine
from tests.models import make_checkpoint

V = 8
PROMPT = [3, 5, 2, 7]
N = 3000
SMALL = dict(vocab_size=V, hidden_size=32, intermediate_size=64, num_attention_heads=2, num_key_value_heads=1,
             eos_token_id=None, bos_token_id=None)


@pytest.fixture(scope="module")
def pair(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    d = tmp_path_factory.mktemp("small")
    return (make_checkpoint(d / "t", "llama", seed=10, **SMALL),
            make_checkpoint(d / "d", "llama", seed=11, num_hidden_layers=1, **SMALL))


def exact_joint(path: Path, params: SamplingParams) -> np.ndarray:
    """P(y2, y3) under the processed distribution, summing over y1: a [V, V] table."""
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()

    def dist(ctx: list[int]) -> np.ndarray:
        with torch.no_grad():
            logits = hf(torch.tensor([PROMPT + ctx])).logits[0, -1:]
        return processed_probs(logits, params)[0].numpy()

    joint = np.zeros((V, V))
    p1 = dist([])
    for y1 in range(V):
        p2 = dist([y1])
        for y2 in range(V):
            joint[y2] += p1[y1] * p2[y2] * dist([y1, y2])
    return joint


def seeded_pairs(eng: Engine, params: SamplingParams, n: int) -> tuple[list[Request], np.ndarray]:
    """Serve ``n`` requests of ``params`` seeded 0..n-1 together: the requests, and counts of their (second,
    third) output tokens, the joint the exact distribution is compared with."""
    reqs = [Request(f"s{seed}", PROMPT, SamplingParams(**{**params.__dict__, "seed": seed})) for seed in range(n)]
    for r in reqs:
        eng.add_request(r)
    while eng.has_work:
        eng.step()
    counts = np.zeros((V, V), np.int64)
    for r in reqs:
        assert len(r.output_ids) == 3
        counts[r.output_ids[1], r.output_ids[2]] += 1
    return reqs, counts


def chi2_pvalue(counts: np.ndarray, probs: np.ndarray) -> float:
    expected = probs.ravel() * counts.sum()
    observed = counts.ravel().astype(float)
    order = np.argsort(expected)
    # merge the smallest cells until every merged cell expects >= 5 samples
    obs_m, exp_m, acc_o, acc_e = [], [], 0.0, 0.0
    for i in order:
        acc_o, acc_e = acc_o + observed[i], acc_e + expected[i]
        if acc_e >= 5:
            obs_m.append(acc_o)
            exp_m.append(acc_e)
            acc_o = acc_e = 0.0
    if acc_e > 0:
        obs_m[-1] += acc_o
        exp_m[-1] += acc_e
    return float(stats.chisquare(obs_m, exp_m).pvalue)


@pytest.mark.parametrize(
    "params",
    [SamplingParams(max_tokens=3, temperature=1.0, ignore_eos=True),
     SamplingParams(max_tokens=3, temperature=0.7, top_k=5, top_p=0.9, ignore_eos=True)],
    ids=["t1", "t0.7-topk5-topp0.9"],
)
def test_speculative_sampling_matches_target_distribution(pair: tuple[Path, Path], params: SamplingParams) -> None:
    target, draft = pair
    eng = engine(target, draft, "beam:2,2", budget=4096, prefill_chunk=8192, max_batch=1024)
    reqs, counts = seeded_pairs(eng, params, N)
    accepted = sum(sum(r.metrics.accepted_per_step) for r in reqs)
    assert 0 < accepted < 2 * N  # both acceptance and rejection happened

    assert chi2_pvalue(counts, exact_joint(target, params)) > 1e-3
    assert chi2_pvalue(counts, exact_joint(draft, params)) < 1e-6  # the test can tell distributions apart


@pytest.mark.parametrize("static", [False, True], ids=["eager", "static"])
def test_seeded_sampling_equals_plain_decoding(pair: tuple[Path, Path], static: bool) -> None:
    """Each emitted token is one draw from the target with the request's generator, so a seeded
    speculative run reproduces a seeded non-speculative run exactly (``static``: both on model/static.py)."""
    target, draft = pair
    outs = {}
    for policy in ["incremental", "beam:3,2"]:
        eng = engine(target, draft, policy, budget=64, static_shapes=static)
        reqs = [Request(f"{s}", PROMPT, SamplingParams(max_tokens=12, temperature=1.0, seed=s, ignore_eos=True))
                for s in range(16)]
        for r in reqs:
            eng.add_request(r)
        while eng.has_work:
            eng.step()
        outs[policy] = [r.output_ids for r in reqs]
    assert outs["incremental"] == outs["beam:3,2"]
    assert len({tuple(o) for o in outs["incremental"]}) > 1  # seeds really differ


def test_greedy_is_argmax() -> None:
    logits = torch.tensor([[0.1, 3.0, -1.0, 2.9]])
    p = processed_probs(logits, SamplingParams(temperature=1.0, top_k=2))
    assert p[0, 0] == 0 and p[0, 2] == 0
    assert np.isclose(float(p.sum()), 1.0)
    assert list(itertools.compress(range(4), (p[0] > 0).tolist())) == [1, 3]
