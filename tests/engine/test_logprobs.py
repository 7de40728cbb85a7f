"""Log-probabilities of emitted tokens (speculation/logprobs.py): the target's raw distribution (after the grammar's
mask, before processors and temperature, vLLM's default), at each token's own context, so a speculative request
reports what plain decoding reports, and what transformers' own forward gives."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from adaserve.engine.loading.loader import load_tokenizer
from adaserve.engine.request import Request
from adaserve.engine.speculation.grammar import JSON_OBJECT, GrammarCompiler
from adaserve.engine.speculation.logprobs import FLOOR, TokenLogprob
from adaserve.engine.speculation.sampling import SamplingParams
from tests.engine.helpers import engine
from tests.engine.test_logits_processors import PROMPT
from tests.servers import demo_pair

LENGTH = 24
TOP = 5


@pytest.fixture(scope="module")
def pair() -> tuple[Path, Path]:
    return demo_pair()


def run(pair: tuple[Path, Path], policy: str, params: SamplingParams) -> tuple[Request, list[TokenLogprob]]:
    eng = engine(pair[0], pair[1], policy, budget=24, prefill_chunk=16)
    eng.grammars = GrammarCompiler.from_hf(load_tokenizer(pair[0]), vocab_size=4096, stop_ids=eng.stop_ids)
    req = Request("r", PROMPT, params)
    eng.add_request(req)
    lps: list[TokenLogprob] = []
    while eng.has_work:
        for ev in eng.step():
            assert ev.logprobs is not None and len(ev.logprobs) == len(ev.new_tokens)
            assert [x.token for x in ev.logprobs] == ev.new_tokens
            lps += ev.logprobs
    return req, lps


def hf_logprobs(path: Path, prompt: list[int], output: list[int]) -> torch.Tensor:
    """[len(output), V]: transformers' log-softmax at each output token's context, in one forward."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    with torch.no_grad():
        logits = model(torch.tensor([prompt + output])).logits[0, len(prompt) - 1 : -1]
    return torch.log_softmax(logits, -1)


@pytest.mark.parametrize("policy", ["chain:4", "adaserve"])
def test_greedy_logprobs_under_speculation_equal_plain_and_transformers(pair: tuple[Path, Path], policy: str) -> None:
    params = SamplingParams(max_tokens=LENGTH, ignore_eos=True, logprobs=TOP)
    plain, plain_lps = run(pair, "incremental", params)
    spec, spec_lps = run(pair, policy, params)
    assert spec.output_ids == plain.output_ids and sum(spec.metrics.accepted_per_step) > 0
    ref = hf_logprobs(pair[0], PROMPT, plain.output_ids)
    for i, (a, b) in enumerate(zip(plain_lps, spec_lps, strict=True)):
        assert a.top[0][0] == a.token == b.top[0][0]  # greedy: the emitted token is the row's top-1
        assert len(a.top) == TOP and [t for t, _ in a.top] == [t for t, _ in b.top]
        assert b.logprob == pytest.approx(a.logprob, abs=1e-4)
        assert b.logprob == pytest.approx(float(ref[i, b.token]), abs=1e-3)
        want = torch.topk(ref[i], TOP)
        assert [v for _, v in b.top] == pytest.approx(want.values.tolist(), abs=1e-3)


def test_logprobs_are_raw_under_processors_and_temperature(pair: tuple[Path, Path]) -> None:
    """Penalties, bias and temperature change what is drawn, not what is reported (vLLM's raw_logprobs); seeded, the
    speculative run reports the plain run's numbers."""
    params = SamplingParams(max_tokens=LENGTH, ignore_eos=True, logprobs=0, temperature=1.3, seed=5,
                            presence_penalty=1.0, logit_bias=((PROMPT[-1], 3.0),))
    plain, plain_lps = run(pair, "incremental", params)
    spec, spec_lps = run(pair, "chain:4", params)
    assert spec.output_ids == plain.output_ids
    ref = hf_logprobs(pair[0], PROMPT, plain.output_ids)
    for i, (a, b) in enumerate(zip(plain_lps, spec_lps, strict=True)):
        assert a.top == [] and b.logprob == pytest.approx(a.logprob, abs=1e-4)
        assert b.logprob == pytest.approx(float(ref[i, b.token]), abs=1e-3)


def test_logprobs_under_a_grammar_are_of_the_masked_distribution(pair: tuple[Path, Path]) -> None:
    params = SamplingParams(max_tokens=LENGTH, logprobs=TOP, grammar=JSON_OBJECT)
    plain, plain_lps = run(pair, "incremental", params)
    spec, spec_lps = run(pair, "adaserve", params)
    assert spec.output_ids == plain.output_ids
    compiler = GrammarCompiler.from_hf(load_tokenizer(pair[0]), vocab_size=4096, stop_ids=[1])
    state = compiler.start(JSON_OBJECT)
    allowed = state.allowed([tuple(plain.output_ids[:i]) for i in range(len(plain.output_ids))])
    ref = hf_logprobs(pair[0], PROMPT, plain.output_ids).masked_fill(~allowed, float("-inf"))
    ref = torch.log_softmax(ref, -1)
    for i, (a, b) in enumerate(zip(plain_lps, spec_lps, strict=True)):
        assert a.top[0][0] == a.token
        assert b.logprob == pytest.approx(float(ref[i, b.token]), abs=1e-3)
        assert all(bool(allowed[i, t]) or v == FLOOR for t, v in b.top)  # refused: -inf, reported as vLLM does
    # the mask matters: the first token's raw log-probability is well below its masked one
    raw = hf_logprobs(pair[0], PROMPT, plain.output_ids)
    assert float(raw[0, plain.output_ids[0]]) < spec_lps[0].logprob - 1.0


def test_no_logprobs_unless_asked(pair: tuple[Path, Path]) -> None:
    eng = engine(pair[0], pair[1], "chain:4", budget=24)
    eng.add_request(Request("r", PROMPT, SamplingParams(max_tokens=4)))
    while eng.has_work:
        assert all(ev.logprobs is None for ev in eng.step())
    with pytest.raises(ValueError, match="logprobs"):
        SamplingParams(logprobs=21)
