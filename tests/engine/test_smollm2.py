"""The default model, SmolLM2-135M-Instruct from its GGUF file, with the distilled draft.

The engine's greedy output equals transformers' own greedy ``generate`` on the same dequantised
weights, for every policy; its chat answer to a factual question is right. About a minute on 2 cores
(the GGUF conversion, ~20 s, happens once per test session into the session's cache).
"""

from __future__ import annotations

import pytest
import torch

from adaserve.engine.build import build_engine
from adaserve.engine.loading import catalog
from adaserve.engine.request import Request
from adaserve.engine.speculation.sampling import SamplingParams
from tests.engine.helpers import use_cpu_kernels
from tests.models import smollm2_pair

PROMPTS = ("What is the capital of France?", "Write a Python function that reverses a list.")
POLICIES = ("incremental", "adaserve", "chain:4", "specinfer", "smartspec", "equal-greedy", "global-greedy")
NEW_TOKENS = 24


@pytest.fixture(scope="module")
def pair() -> catalog.ModelPair:
    return smollm2_pair()


@pytest.fixture(scope="module")
def chats(pair: catalog.ModelPair) -> list[list[int]]:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(pair.target))
    out = []
    for p in PROMPTS:
        ids = tok.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True, tokenize=True)
        out.append(list(ids["input_ids"] if hasattr(ids, "keys") else ids))
    return out


@pytest.fixture(scope="module")
def reference(pair: catalog.ModelPair, chats: list[list[int]]) -> list[list[int]]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(pair.target), dtype=torch.float32).eval()
    eos = model.generation_config.eos_token_id
    out = []
    for ids in chats:
        gen = model.generate(torch.tensor([ids]), max_new_tokens=NEW_TOKENS, do_sample=False, pad_token_id=eos)
        out.append(gen[0, len(ids):].tolist())
    return out


def test_converted_directory_is_a_plain_checkpoint(pair: catalog.ModelPair) -> None:
    assert (pair.target / "config.json").is_file() and (pair.target / "model.safetensors").is_file()
    assert "im_start" in (pair.target / "chat_template.jinja").read_text()
    assert pair.draft is not None and (pair.draft / "model.safetensors").is_file()


def test_chat_answer_names_paris(pair: catalog.ModelPair, reference: list[list[int]]) -> None:
    from transformers import AutoTokenizer

    text = AutoTokenizer.from_pretrained(str(pair.target)).decode(reference[0], skip_special_tokens=True)
    assert "Paris" in text


@pytest.mark.parametrize("policy", POLICIES)
def test_every_policy_matches_transformers_greedy(pair: catalog.ModelPair, chats: list[list[int]],
                                                  reference: list[list[int]], policy: str) -> None:
    built = build_engine(target=pair.target, draft=pair.draft, policy=policy, budget=64, profile=False,
                         progress=False)
    reqs = [Request(f"r{i}", ids, SamplingParams(max_tokens=NEW_TOKENS)) for i, ids in enumerate(chats)]
    built.engine.run([(0.0, r) for r in reqs])
    for r, ref in zip(reqs, reference, strict=True):
        if r.finish_reason == "length":
            assert r.output_ids == ref
        else:  # an EOS ended the engine's request; transformers pads after it with the same id
            assert r.finish_reason == "stop" and r.output_ids == ref[: len(r.output_ids)]
            assert set(ref[len(r.output_ids):]) <= {r.output_ids[-1]}
    if policy != "incremental":
        accepted = sum(sum(r.metrics.accepted_per_step) for r in reqs)
        assert accepted > 0, "the distilled draft should be accepted at least sometimes"



@pytest.mark.parametrize("kernels", ["torch", "native"])
def test_int4_speculation_on_a_batch_equals_plain_decoding(kernels: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """The default CPU serving path (the shipped GGUF as int4) on a batch of chat and coding requests: greedy output
    with speculation equals plain decoding's, request by request, on torch's kernels and the integer ones. Before
    every row of attention was one function of its own keys on a CPU (float64 SDPA sums, attention/base.py; the
    integer kernels' own attend.c), a verified row's attention moved by ~1e-7 against the same row decoded alone,
    the quantized layers' input rounding turned that into a step, and 4-6 of these 16 requests parted within 48
    tokens (adaserve/bench/lossless_batch.py; scripts/lossless-batch.py reports the same batch)."""
    from adaserve.bench.lossless_batch import batch_prompts, decode_batch

    use_cpu_kernels(kernels, monkeypatch)
    pair = catalog.resolve(catalog.DEFAULT_MODEL, progress=False, weights="int4")
    outcome = decode_batch(pair, batch_prompts(pair, 16), ("chain:4", "adaserve"), weights="int4", tokens=48)
    assert outcome.accepted["chain:4"] > 0 and outcome.accepted["adaserve"] > 0
    for policy, parted in outcome.parted().items():
        assert not parted, f"{policy} parted from plain decoding on requests {parted}"


def test_named_model_resolves_to_the_same_directories(pair: catalog.ModelPair) -> None:
    again = catalog.resolve(catalog.DEFAULT_MODEL, progress=False)
    assert again == pair
    assert catalog.model_dir(str(catalog.smollm2_gguf()), progress=False) == pair.target


SCHEMA = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 40},
                                           "country": {"type": "string", "maxLength": 40},
                                           "population_millions": {"type": "number"}},
          "required": ["city", "country", "population_millions"], "additionalProperties": False}


def test_a_json_schema_gives_schema_valid_json_losslessly(pair: catalog.ModelPair) -> None:
    """Issue 33's done-when on the default model: response_format json_schema (the engine's grammar) gives JSON the
    schema validates, and speculation (adaserve with the distilled draft) emits exactly the constrained target's
    greedy output."""
    import json

    import jsonschema
    from transformers import AutoTokenizer

    from adaserve.engine.speculation.grammar import GrammarSpec

    tok = AutoTokenizer.from_pretrained(str(pair.target))
    ids = tok.apply_chat_template([{"role": "user", "content": "Give the capital of France as JSON with its city, "
                                    "country and population in millions."}], add_generation_prompt=True,
                                  tokenize=True)
    ids = list(ids["input_ids"] if hasattr(ids, "keys") else ids)
    params = SamplingParams(max_tokens=80, grammar=GrammarSpec("json", json.dumps(SCHEMA)))
    outs = {}
    for policy in ("incremental", "adaserve"):
        built = build_engine(target=pair.target, draft=pair.draft, policy=policy, budget=64, profile=False,
                             progress=False)
        req = Request("j", ids, params)
        built.engine.run([(0.0, req)])
        outs[policy] = req
    assert outs["adaserve"].output_ids == outs["incremental"].output_ids
    assert sum(outs["adaserve"].metrics.accepted_per_step) > 0
    assert outs["incremental"].finish_reason == "stop"
    doc = json.loads(tok.decode(outs["incremental"].output_ids, skip_special_tokens=True))
    jsonschema.validate(doc, SCHEMA)
    assert doc["city"] == "Paris"
