"""Structured output (speculation/grammar.py): the target's rows masked at every tree node by the grammar after
that node's path, so constrained greedy output with speculation equals constrained greedy output without it, for
every policy; seeded constrained sampling matches token for token, and its distribution is the masked target's
(a chi-square test against the exact distribution, with a power check against the unmasked one)."""

from __future__ import annotations

import json
import re
from pathlib import Path

import llguidance
import numpy as np
import pytest
import torch

from adaserve.engine.engine import Engine
from adaserve.engine.loading.loader import load_tokenizer
from adaserve.engine.model.kv_cache import SequenceKV
from adaserve.engine.model.tree import TokenTree
from adaserve.engine.request import Request
from adaserve.engine.speculation.beam_ops import REFUSED_LOGIT
from adaserve.engine.speculation.grammar import JSON_OBJECT, GrammarCompiler, GrammarSpec, unpack
from adaserve.engine.speculation.sampling import SamplingParams, processed_probs
from adaserve.engine.speculation.speculate import DraftInput, beam_search
from tests.engine.helpers import engine, outputs, runner
from tests.engine.test_logits_processors import PROMPT
from tests.engine.test_sampling_lossless import SMALL, chi2_pvalue
from tests.models import make_checkpoint
from tests.servers import demo_pair

LENGTH = 32
SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12},
                                           "items": {"type": "array", "items": {"type": "integer"}}},
          "required": ["name", "items"], "additionalProperties": False}
# Python-like, as the demo pair writes: its draft then agrees with its target often enough to test speculation
REGEX = r"    result = \[\]\n    for [a-z_]+ in [a-z_]+:\n        [a-z_.]+\([a-z_]+\)\n"


@pytest.fixture(scope="module")
def pair() -> tuple[Path, Path]:
    return demo_pair()


@pytest.fixture(scope="module")
def compiler(pair: tuple[Path, Path]) -> GrammarCompiler:
    return GrammarCompiler.from_hf(load_tokenizer(pair[0]), vocab_size=4096, stop_ids=[1])


def constrained(eng: Engine, compiler: GrammarCompiler) -> Engine:
    eng.grammars = compiler
    return eng


def run(pair: tuple[Path, Path], policy: str, params: SamplingParams, compiler: GrammarCompiler, *,
        draft: str = "demo", prompt: list[int] = PROMPT) -> Request:
    eng = constrained(engine(pair[0], pair[1] if draft == "demo" else pair[0], policy, budget=24,
                             prefill_chunk=16), compiler)
    req = Request("r", prompt, params)
    eng.add_request(req)
    while eng.has_work:
        eng.step()
    return req


SPECS = {"schema": GrammarSpec("json", json.dumps(SCHEMA)), "regex": GrammarSpec("regex", REGEX),
         "json_object": JSON_OBJECT}


@pytest.fixture(scope="module")
def references(pair: tuple[Path, Path], compiler: GrammarCompiler) -> dict[str, Request]:
    """Constrained greedy decoding without speculation, per grammar."""
    return {name: run(pair, "incremental", SamplingParams(max_tokens=LENGTH, grammar=spec), compiler)
            for name, spec in SPECS.items()}


def test_the_references_follow_their_grammars(pair: tuple[Path, Path], compiler: GrammarCompiler,
                                               references: dict[str, Request]) -> None:
    """The grammar bites (the unconstrained output is Python), and what comes out matches it: the regex in full
    (the request ends with end-of-sequence, which the grammar allows only there), the schema's JSON as far as
    it got (a prefix no matcher refuses)."""
    tok = load_tokenizer(pair[0])
    plain = run(pair, "incremental", SamplingParams(max_tokens=LENGTH), compiler)
    regex = references["regex"]
    assert regex.finish_reason == "stop" and regex.output_ids[-1] == 1
    assert re.fullmatch(REGEX, tok.decode(regex.output_ids[:-1]))
    for name, spec in SPECS.items():
        out = references[name].output_ids
        assert out != plain.output_ids[: len(out)]
        fresh = GrammarCompiler.from_hf(tok, vocab_size=4096, stop_ids=[1])
        assert llguidance.LLMatcher(fresh.tokenizer, fresh.check(spec)).consume_tokens(out)
    assert tok.decode(references["schema"].output_ids).lstrip().startswith('{')


@pytest.mark.parametrize("policy", ["chain:4", "adaserve", "specinfer", "beam:2,2", "smartspec"])
@pytest.mark.parametrize("name", ["schema", "regex"])
def test_speculative_constrained_greedy_equals_plain(pair: tuple[Path, Path], compiler: GrammarCompiler,
                                                     references: dict[str, Request], name: str, policy: str) -> None:
    params = SamplingParams(max_tokens=LENGTH, grammar=SPECS[name])
    spec = run(pair, policy, params, compiler)
    assert spec.output_ids == references[name].output_ids
    assert spec.finish_reason == references[name].finish_reason
    assert sum(spec.metrics.accepted_per_step) > 0, "no draft token accepted: nothing speculative was checked"


@pytest.mark.parametrize("policy", ["chain:4", "adaserve"])
def test_self_drafting_under_a_grammar(pair: tuple[Path, Path], compiler: GrammarCompiler,
                                       references: dict[str, Request], policy: str) -> None:
    """The target drafts for itself: its masked draft proposes the constrained greedy path, and every proposal is
    accepted but where a beam had to take a token the grammar refuses."""
    spec = run(pair, policy, SamplingParams(max_tokens=LENGTH, grammar=JSON_OBJECT), compiler, draft="self")
    assert spec.output_ids == references["json_object"].output_ids
    assert sum(spec.metrics.accepted_per_step) >= len(spec.output_ids) // 2


def test_seeded_constrained_sampling_equals_plain(pair: tuple[Path, Path], compiler: GrammarCompiler) -> None:
    params = SamplingParams(max_tokens=LENGTH, temperature=0.9, seed=3, grammar=SPECS["schema"],
                            presence_penalty=0.3, logit_bias=((92, 2.0),))
    outs = [run(pair, policy, params, compiler).output_ids for policy in ("incremental", "chain:4", "adaserve")]
    assert outs[0] == outs[1] == outs[2]


def test_a_continuation_starts_past_its_earlier_tokens(pair: tuple[Path, Path], compiler: GrammarCompiler,
                                                       references: dict[str, Request]) -> None:
    """A request resumed after k tokens (a failover) has its grammar consume them first."""
    whole = references["schema"].output_ids
    k = 6
    eng = constrained(engine(*pair, "chain:4", budget=24, prefill_chunk=16), compiler)
    req = Request("c", PROMPT + whole[:k], SamplingParams(max_tokens=LENGTH - k, grammar=SPECS["schema"]))
    req.resumed = k
    eng.add_request(req)
    while eng.has_work:
        eng.step()
    assert whole[:k] + req.output_ids == whole


def test_the_draft_proposes_only_what_the_grammar_allows(pair: tuple[Path, Path], compiler: GrammarCompiler) -> None:
    """Every candidate node the masked draft reached with a probability above 0 carries a token the grammar allows
    after its parent's path; without the mask the same search proposes tokens it refuses."""
    draft = runner(pair[1])

    def search(spec: GrammarSpec | None) -> tuple[TokenTree, list[list[int]]]:
        state = compiler.start(spec or JSON_OBJECT)
        seq = SequenceKV()
        tree = beam_search(draft, [DraftInput(seq, list(PROMPT), state if spec else None)], depth=4, width=3)[0]
        draft.cache.release(seq)
        paths = [[]]
        for v in range(1, tree.size):
            paths.append([*paths[int(tree.parents[v])], int(tree.tokens[v])])
        return tree, paths

    def refused(tree: TokenTree, paths: list[list[int]], *, reached_only: bool) -> int:
        state = compiler.start(JSON_OBJECT)
        allowed = state.allowed([tuple(p[:-1]) for p in paths])
        bad = 0
        for v in range(1, tree.size):
            if reached_only and tree.log_probs[v] < REFUSED_LOGIT / 2:
                continue
            bad += not bool(allowed[v, int(tree.tokens[v])])
        return bad

    masked, paths = search(JSON_OBJECT)
    assert refused(masked, paths, reached_only=True) == 0
    assert (masked.log_probs[1:] > REFUSED_LOGIT / 2).sum() >= 4  # the search did find allowed tokens
    unmasked, paths = search(None)
    assert refused(unmasked, paths, reached_only=False) > 0


def test_requests_the_engine_cannot_constrain_are_refused(pair: tuple[Path, Path], compiler: GrammarCompiler) -> None:
    eng = engine(*pair, "chain:4", budget=24)
    with pytest.raises(ValueError, match="tokenizer"):
        eng.add_request(Request("a", PROMPT, SamplingParams(grammar=JSON_OBJECT)))
    eng.grammars = compiler
    for spec, message in [(GrammarSpec("json", '{"type": "foo"}'), "foo"),
                          (GrammarSpec("json", "[1, 2]"), "JSON object"),
                          (GrammarSpec("json", "{"), "not JSON"),
                          (GrammarSpec("regex", "a("), "unclosed group"),
                          (GrammarSpec("grammar", "start: nowhere"), "nowhere"),
                          (GrammarSpec("choice", "[]"), "list of 1 to")]:
        with pytest.raises(ValueError, match=message):
            eng.add_request(Request("b", PROMPT, SamplingParams(grammar=spec)))
    with pytest.raises(ValueError, match="min_tokens"):
        SamplingParams(grammar=JSON_OBJECT, min_tokens=2)
    assert not eng.has_work


def test_choice_and_lark(pair: tuple[Path, Path], compiler: GrammarCompiler) -> None:
    tok = load_tokenizer(pair[0])
    choices = ["yes", 'no "thanks"', "maybe"]
    out = run(pair, "chain:4", SamplingParams(max_tokens=LENGTH, grammar=GrammarSpec("choice", json.dumps(choices))),
              compiler)
    assert tok.decode(out.output_ids[:-1]) in choices and out.output_ids[-1] == 1
    lark = 'start: "def " NAME "(" NAME "):"\nNAME: /[a-z]{1,8}/'
    out = run(pair, "adaserve", SamplingParams(max_tokens=LENGTH, grammar=GrammarSpec("grammar", lark)), compiler)
    assert re.fullmatch(r"def [a-z]{1,8}\([a-z]{1,8}\):", tok.decode(out.output_ids[:-1]))


def test_unpack_reads_llguidance_bits() -> None:
    bits = np.zeros((2, 2), np.int32)
    bits[0, 0] = 1 | (1 << 5)
    bits[1, 1] = np.int32(-2**31)  # bit 31 of word 1: token 63
    rows = unpack(bits, 40)
    assert rows.shape == (2, 40)
    assert rows[0].nonzero()[0].tolist() == [0, 5] and not rows[1].any()
    assert unpack(bits, 64)[1].nonzero()[0].tolist() == [63]


# ---- the distribution of constrained sampling ----------------------------------------------------------------

V = 8
LETTERS = "abcdefgh"
# after a, b or c; after b, c or d; after c, d or a; after d, a or b; a pair at a time; e, f, g never; h (the
# end-of-sequence token) only after whole pairs. The second and third tokens' masks depend on the first.
PAIRS = r"(a[bc]|b[cd]|c[da]|d[ab])+"
FOLLOW = {0: [1, 2], 1: [2, 3], 2: [3, 0], 3: [0, 1]}
DIST_PROMPT = [3, 5, 2, 7]


class Letters:
    """A tokenizer of one letter per token, for llguidance."""

    def __init__(self) -> None:
        self.eos_token_id, self.bos_token_id = 7, None
        self.tokens = [c.encode() for c in LETTERS]
        self.special_token_ids = [7]

    def __call__(self, s: bytes) -> list[int]:
        return [LETTERS.index(chr(b)) for b in s]


def allowed_by_hand(ctx: list[int]) -> list[int]:
    """The tokens PAIRS allows after ``ctx``: the pair's second letter, or a new pair's first and, after whole
    pairs, the end."""
    return FOLLOW[ctx[-1]] if len(ctx) % 2 else [0, 1, 2, 3] + ([7] if ctx else [])


@pytest.fixture(scope="module")
def small(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    d = tmp_path_factory.mktemp("small-grammar")
    return (make_checkpoint(d / "t", "llama", seed=10, **SMALL),
            make_checkpoint(d / "d", "llama", seed=11, num_hidden_layers=1, **SMALL))


def exact_joint(path: Path, params: SamplingParams, *, masked: bool) -> np.ndarray:
    """P(y2, y3) of constrained sampling (the grammar's masks by hand), summing over y1: a [V, V] table."""
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()

    def dist(ctx: list[int]) -> np.ndarray:
        with torch.no_grad():
            logits = hf(torch.tensor([DIST_PROMPT + ctx])).logits[0, -1:]
        if masked:
            keep = torch.zeros(V, dtype=torch.bool)
            keep[allowed_by_hand(ctx)] = True
            logits = logits.masked_fill(~keep, float("-inf"))
        return processed_probs(logits, params)[0].numpy()

    joint = np.zeros((V, V))
    p1 = dist([])
    for y1 in range(V):
        p2 = dist([y1]) if p1[y1] > 0 else np.zeros(V)
        for y2 in range(V):
            if p2[y2] > 0:
                joint[y2] += p1[y1] * p2[y2] * dist([y1, y2])
    return joint


def test_constrained_sampling_matches_the_masked_target(small: tuple[Path, Path]) -> None:
    n = 3000
    target, draft = small
    grammars = GrammarCompiler(llguidance.LLTokenizer(llguidance.TokenizerWrapper(Letters())), vocab_size=V,
                               stop_ids=[7])
    eng = constrained(engine(target, draft, "beam:2,2", budget=4096, prefill_chunk=8192, max_batch=1024), grammars)
    params = SamplingParams(max_tokens=3, temperature=1.0, ignore_eos=True, grammar=GrammarSpec("regex", PAIRS))
    reqs = [Request(f"s{seed}", DIST_PROMPT, SamplingParams(**{**params.__dict__, "seed": seed})) for seed in range(n)]
    outputs(eng, reqs)
    counts = np.zeros((V, V), np.int64)
    for r in reqs:
        assert len(r.output_ids) == 3 and r.output_ids[1] in allowed_by_hand(r.output_ids[:1])
        counts[r.output_ids[1], r.output_ids[2]] += 1
    accepted = sum(sum(r.metrics.accepted_per_step) for r in reqs)
    assert 0 < accepted < 2 * n  # both acceptance and rejection happened
    assert chi2_pvalue(counts, exact_joint(target, params, masked=True)) > 1e-3
    # the test tells the masked distribution from the unmasked one (zero cells aside, which it never hits)
    unmasked = exact_joint(target, params, masked=False)
    assert chi2_pvalue(counts, unmasked) < 1e-6
