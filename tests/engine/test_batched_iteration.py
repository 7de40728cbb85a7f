"""The batched iteration computes what the per-request one did (docs/architecture.md §4, §7, §3).

Each batched step is checked against a plain per-request reference written here: beam search level by
level with one forward per request, the verification walk drawing token by token (argmax, or one
uniform per emitted token through the inverse CDF), and KV compaction sequence by sequence.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from adaserve.engine.model.batch import Segment
from adaserve.engine.model.config import ModelConfig
from adaserve.engine.model.kv_cache import KVCacheConfig, PagedKVCache, SequenceKV
from adaserve.engine.model.runner import ModelRunner
from adaserve.engine.model.tree import TokenTree
from adaserve.engine.request import Request
from adaserve.engine.speculation.sampling import SamplingParams, draw_rows, make_generator, processed_probs
from adaserve.engine.speculation.speculate import DraftInput, beam_search, expand_level
from adaserve.engine.speculation.verify import WalkInput, WalkResult, commit_moves, draw_at_nodes, walk, walk_trees
from tests.engine.helpers import runner, use_cpu_kernels
from tests.engine.model.test_tree_attention import random_tree


# ---- beam search -----------------------------------------------------------------------------------
def reference_beam(draft: ModelRunner, x: DraftInput, depth: int, width: int) -> TokenTree:
    """One request alone, node lists grown level by level, top-w of the flattened [F, V] scores."""
    seq = SequenceKV(pages=list(x.seq.pages), length=x.seq.length)
    lg = draft.forward([Segment(seq, seq.length, TokenTree.chain(x.pending))], all_logits=[False])[0]
    draft.cache.truncate(seq, seq.length + len(x.pending))
    toks, pars, lps, frontier = [x.pending[-1]], [-1], [0.0], [0]
    for step in range(depth):
        logp = torch.log_softmax(lg.float(), -1).double()
        score = torch.tensor([lps[f] for f in frontier], dtype=torch.float64)[:, None] + logp
        top = torch.topk(score.flatten(), width)
        new = []
        for val, i in zip(top.values.tolist(), top.indices.tolist(), strict=True):
            toks.append(i % score.shape[1])
            pars.append(frontier[i // score.shape[1]])
            lps.append(val)
            new.append(len(toks) - 1)
        frontier = new
        if step < depth - 1:
            tree = TokenTree.from_lists(toks, pars, lps)
            lg = draft.forward([Segment(seq, seq.length - 1, tree, num_cached=tree.size - len(frontier))],
                               all_logits=[True])[0]
    draft.cache.truncate(seq, seq.length)
    return TokenTree.from_lists(toks, pars, lps).with_strict_decrease()


def test_batched_beam_search_equals_per_request_search(draft_dir: Path) -> None:
    rng = np.random.default_rng(4)
    draft = runner(draft_dir)
    for depth, width in ((1, 1), (3, 2), (4, 3)):
        prompts = [rng.integers(2, 97, int(rng.integers(1, 12))).tolist() for _ in range(5)]
        seqs = []
        for p in prompts:  # a committed context, then pending tokens the draft has not seen
            s = SequenceKV()
            draft.forward([Segment(s, 0, TokenTree.chain(p[:-1] or p))], all_logits=[False])
            draft.cache.truncate(s, len(p[:-1] or p))
            seqs.append(s)
        inputs = [DraftInput(s, p[-1:] if len(p) > 1 else [int(rng.integers(2, 97))]) for s, p in zip(seqs, prompts,
                                                                                                      strict=True)]
        refs = [reference_beam(draft, x, depth, width) for x in inputs]
        got = beam_search(draft, inputs, depth=depth, width=width)
        for g, r in zip(got, refs, strict=True):
            assert g.tokens.tolist() == r.tokens.tolist()
            assert g.parents.tolist() == r.parents.tolist()
            assert np.allclose(g.log_probs, r.log_probs, atol=1e-5)
        for s in seqs:
            draft.cache.release(s)


def test_expand_level_static_and_beam_by_hand() -> None:
    logits = torch.log(torch.tensor([[0.1, 0.6, 0.3], [0.5, 0.25, 0.25], [0.2, 0.2, 0.6], [0.7, 0.2, 0.1]]))
    base = np.log([[0.5, 0.25], [1.0, 0.1]])  # two requests, two frontier nodes each
    tok, parent, value = expand_level([logits[:2], logits[2:]], base, width=2)
    # request 0: 0.5*0.6=0.3 (node 0, token 1), 0.5*0.3=0.15 (node 0, token 2) beat 0.25*0.5=0.125
    assert tok.tolist()[0] == [1, 2] and parent.tolist()[0] == [0, 0]
    assert tok.tolist()[1] == [2, 0] and parent.tolist()[1] == [0, 0]
    assert np.allclose(np.exp(value[0]), [0.3, 0.15])
    # static: each node's best child
    tok, parent, value = expand_level([logits[:2], logits[2:]], base, width=2, per_node=1)
    assert tok.tolist() == [[1, 0], [2, 0]] and parent.tolist() == [[0, 1], [0, 1]]
    assert np.allclose(np.exp(value[1]), [0.6, 0.07])


@pytest.mark.parametrize("picks", ["torch", "native"])
@pytest.mark.parametrize("rows", [2, 16])  # below and above CHAIN_ARGMAX_BLOCKED_MIN's 8 rows of 4096
def test_one_wide_levels_pick_the_first_maximum(rows: int, picks: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """A 1-wide level (chains, 1-wide static levels) picks each row's first maximum, as greedy decoding does,
    whichever path first_argmax takes: ties at the top go to the lowest token id; the value is that logit's
    log-probability."""
    use_cpu_kernels(picks, monkeypatch)
    gen = torch.Generator().manual_seed(3)
    logits = torch.randint(0, 4, (rows, 4096), generator=gen).float()  # every row's top value repeated
    logits[0, 4000] = 9.0  # a unique maximum in a late block
    base = np.log(np.linspace(0.2, 1.0, rows))[:, None]
    want = [int(np.flatnonzero(r == r.max())[0]) for r in logits.numpy()]
    for expansion in (None, 1):  # a chain's level, and a static level of one child per node
        tok, parent, value = expand_level(list(logits[:, None]), base, width=1, per_node=expansion)
        assert tok[:, 0].tolist() == want and parent[:, 0].tolist() == [0] * rows
        expect = base[:, 0] + torch.log_softmax(logits, -1)[torch.arange(rows), want].double().numpy()
        if picks == "torch":
            assert value[:, 0].tolist() == expect.tolist()
        else:  # native/picks.c: another exponential and summation order, float32 rounding apart
            assert np.allclose(value[:, 0], expect, rtol=0, atol=1e-5)


@pytest.mark.parametrize("picks", ["torch", "native"])
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
def test_non_finite_draft_log_probs_fail_loudly(bad: float, picks: str, monkeypatch: pytest.MonkeyPatch) -> None:
    use_cpu_kernels(picks, monkeypatch)
    logits = torch.zeros(2, 5)
    logits[1, 3] = bad
    with pytest.raises(FloatingPointError, match="non-finite"):
        expand_level([logits[:1], logits[1:]], np.zeros((2, 1)), width=2)


# ---- verification ----------------------------------------------------------------------------------
def reference_walk(tree: TokenTree, logits: torch.Tensor, params: SamplingParams, gen: torch.Generator,
                   stop_ids: frozenset[int], budget: int) -> tuple[list[int], list[int]]:
    """Token by token: argmax, or one uniform and the inverse CDF of the processed row."""
    children = tree.children()
    tokens, path, node = [], [0], 0
    while len(tokens) < budget:
        if params.greedy:
            y = int(logits[node].argmax())
        else:
            u = torch.rand((), generator=gen, dtype=torch.float64)
            probs = processed_probs(logits[node : node + 1], params)[0]
            cdf = probs.cumsum(0)
            y = min(int(torch.searchsorted(cdf, u * cdf[-1], right=True)), probs.shape[0] - 1)
            while probs[y] <= 0:
                y -= 1
        tokens.append(y)
        if y in stop_ids:
            break
        nxt = next((c for c in children[node] if tree.tokens[c] == y), None)
        if nxt is None:
            break
        path.append(nxt)
        node = nxt
    return tokens, path


SETTINGS = [SamplingParams(), SamplingParams(temperature=1.0), SamplingParams(temperature=0.7, top_k=3, top_p=0.8),
            SamplingParams(temperature=1.3, top_p=0.5)]


@pytest.mark.parametrize("seed", range(4))
def test_batched_walks_equal_token_by_token_walks(seed: int) -> None:
    rng = np.random.default_rng(seed)
    v = 6
    for _ in range(40):
        inputs, refs = [], []
        for i in range(int(rng.integers(1, 7))):
            tree = random_tree(rng, int(rng.integers(1, 9)), v)
            # logits that often agree with the tree, so walks go deep
            logits = torch.randn(tree.size, v, dtype=torch.float32)
            for node, kids in enumerate(tree.children()):
                if kids and rng.random() < 0.7:
                    logits[node, int(tree.tokens[kids[int(rng.integers(0, len(kids)))]])] += 4.0
            params = SETTINGS[int(rng.integers(0, len(SETTINGS)))]
            stop = frozenset({int(rng.integers(0, v))}) if rng.random() < 0.3 else frozenset()
            budget = int(rng.integers(1, 6))
            inputs.append(WalkInput(tree, logits, params, make_generator(1000 * seed + i), stop, budget))
            ref_gen = make_generator(1000 * seed + i)
            refs.append((reference_walk(tree, logits, params, ref_gen, stop, budget), ref_gen))
        for res, ((tokens, path), ref_gen), x in zip(walk_trees(inputs), refs, inputs, strict=True):
            assert res.tokens == tokens and res.accepted_nodes == path
            # exactly one uniform per emitted token was consumed (none when greedy)
            assert torch.equal(x.generator.get_state(), ref_gen.get_state())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_greedy_draws_are_argmax_with_ties_infinities_and_nan(dtype: torch.dtype) -> None:
    """draw_at_nodes reads greedy rows with max(-1).indices on CPU (issue 30): argmax's first maximum, always."""
    gen = torch.Generator().manual_seed(0)
    for trial in range(60):
        sizes = torch.randint(1, 6, (int(torch.randint(1, 5, (), generator=gen)),), generator=gen).tolist()
        v = int(torch.randint(2, 300, (), generator=gen))
        big = torch.randint(-2, 2, (sum(sizes) + 2, v), generator=gen).to(dtype)  # small ints: many ties
        if trial % 3 == 0:
            big[torch.rand(big.shape, generator=gen) < 0.4] = float("-inf")
        if trial % 4 == 0:
            big[1] = float("-inf")  # a row with no finite logit
        if trial % 5 == 0:
            big[torch.rand(big.shape, generator=gen) < 0.02] = float("nan")
        rows = big[1:-1]  # consecutive blocks of one tensor at an offset: joined_rows' view
        blocks = list(rows.split(sizes))
        inputs = [WalkInput(TokenTree.chain(list(range(m))), b, SamplingParams(), make_generator(i), frozenset(), 9)
                  for i, (m, b) in enumerate(zip(sizes, blocks, strict=True))]
        drawn, _ = draw_at_nodes(inputs)
        assert drawn == [b.argmax(-1).tolist() for b in blocks]


@pytest.mark.parametrize("picks", ["torch", "native"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_blocked_argmax_is_argmax_with_ties_infinities_and_nan(dtype: torch.dtype, picks: str,
                                                                monkeypatch: pytest.MonkeyPatch) -> None:
    """first_argmax's two steps over blocks (many rows on a CPU, issue 30), and the integer kernels' scan (float32
    rows, native/picks.c), give argmax's first maximum, NaN first: the target's greedy draws take it."""
    from adaserve.engine.speculation import verify

    use_cpu_kernels(picks, monkeypatch)

    assert verify.first_argmax(torch.zeros(2, verify.ARGMAX_BLOCKED_MIN // 2)).tolist() == [0, 0]  # blocked
    monkeypatch.setattr(verify, "ARGMAX_BLOCKED_MIN", 1)  # every shape below takes the blocks where it can
    gen = torch.Generator().manual_seed(1)
    for trial in range(80):
        n = int(torch.randint(1, 48, (), generator=gen))
        v = verify.ARGMAX_BLOCK * int(torch.randint(1, 80, (), generator=gen)) + (3 if trial % 9 == 0 else 0)
        big = torch.randint(-2, 2, (n + 2, v), generator=gen).to(dtype)  # small ints: ties within and across blocks
        if trial % 3 == 0:
            big[torch.rand(big.shape, generator=gen) < 0.4] = float("-inf")
        if trial % 4 == 0:
            big[1] = float("-inf")
        if trial % 5 == 0:
            big[torch.rand(big.shape, generator=gen) < 0.002] = float("nan")
        if trial % 7 == 0:
            big[torch.rand(big.shape, generator=gen) < 0.01] = float("inf")
        rows = big[1:-1]
        want = rows.argmax(-1)
        assert torch.equal(verify.first_argmax(rows), want), trial
        assert torch.equal(verify.first_argmax(rows.T.contiguous().T), want), trial  # not contiguous: max(-1)
    x = torch.zeros(2, 4096)
    x[0, -1], x[1, 5] = 1.0, -0.0  # -0.0 equals 0.0: the first maximum is still index 0
    assert verify.first_argmax(x).tolist() == [x.shape[1] - 1, 0]



def test_top_k_indices_blocked_matches_topk() -> None:
    """top_k_indices' blocked pass (many rows on a CPU, issue 30) picks the k greatest logits of every row,
    greatest first, as torch.topk does: the same values (which of equal logits fills the k-th place may differ),
    distinct indices, over leading dims, with ties within and across blocks, -inf and NaN rows."""
    from adaserve.engine.speculation import verify

    gen = torch.Generator().manual_seed(2)
    for trial in range(60):
        n, f = int(torch.randint(1, 40, (), generator=gen)), int(torch.randint(1, 4, (), generator=gen))
        v = verify.ARGMAX_BLOCK * int(torch.randint(1, 70, (), generator=gen)) + (5 if trial % 11 == 0 else 0)
        k = int(torch.randint(1, 6, (), generator=gen))
        # odd trials: small integers, ties everywhere
        x = torch.randint(-3, 3, (n, f, v), generator=gen).float() if trial % 2 else torch.randn(n, f, v, generator=gen)
        if trial % 3 == 0:
            x[torch.rand(x.shape, generator=gen) < 0.5] = float("-inf")
        if trial % 7 == 0:
            x[0, 0, int(torch.randint(0, v, (), generator=gen))] = float("nan")
        k = min(k, v)
        got = verify.top_k_indices(x, k, blocked_min=1)
        want = torch.topk(x, k, dim=-1)
        assert got.shape == (n, f, k), trial
        assert torch.allclose(x.gather(-1, got), want.values, rtol=0, atol=0, equal_nan=True), trial  # exactly
        assert (got.sort(-1).values.diff(dim=-1) > 0).all(), trial  # k distinct logits of the row
    x = torch.randn(8, 4096)
    assert torch.equal(verify.top_k_indices(x, 3), torch.topk(x, 3).indices)  # distinct values: the same indices

def test_root_walk_respects_budget_and_stop() -> None:
    root = TokenTree.root(3)
    assert walk(root, [5], stop_ids=frozenset(), budget=0) == WalkResult([], [0])
    assert walk(root, [5], stop_ids=frozenset({5}), budget=1) == WalkResult([5], [0])
    assert walk(root, [5], stop_ids=frozenset(), budget=2) == WalkResult([5], [0])


def test_chain_walk_equals_the_child_table_walk() -> None:
    """A chain's walk (node i's child is i + 1) is the general walk's, stops and budgets included."""
    rng = np.random.default_rng(5)
    for _ in range(400):
        m = int(rng.integers(2, 7))
        toks = rng.integers(0, 4, m)
        drawn = rng.integers(0, 4, m).tolist()
        chain = TokenTree.chain(toks.tolist())
        general = TokenTree.trusted(chain.tokens, chain.parents, chain.log_probs, is_chain=False)
        stops = frozenset(rng.choice(4, int(rng.integers(0, 2)), replace=False).tolist())
        budget = int(rng.integers(0, m + 2))
        assert walk(chain, drawn, stop_ids=stops, budget=budget) == walk(general, drawn, stop_ids=stops,
                                                                          budget=budget)


def test_draw_rows_falls_back_to_the_last_token_with_mass() -> None:
    probs = torch.tensor([[0.5, 0.5, 0.0, 0.0], [0.0, 0.25, 0.75, 0.0]], dtype=torch.float64)
    assert draw_rows(probs, torch.tensor([0.0, 0.0])).tolist() == [0, 1]
    assert draw_rows(probs, torch.tensor([0.6, 0.2])).tolist() == [1, 1]
    assert draw_rows(probs, torch.tensor([1.0, 1.0])).tolist() == [1, 2]  # u * total == total: past the end


def test_uniforms_in_one_call_equal_one_at_a_time() -> None:
    """walk_trees draws a request's uniforms in one call and rewinds: this must be the same stream."""
    a, b = make_generator(5), make_generator(5)
    many = torch.rand(7, generator=a, dtype=torch.float64)
    one_by_one = torch.stack([torch.rand((), generator=b, dtype=torch.float64) for _ in range(7)])
    assert torch.equal(many, one_by_one)


# ---- KV compaction -----------------------------------------------------------------------------------
def test_one_compaction_for_many_sequences_equals_one_at_a_time() -> None:
    cfg = ModelConfig(model_type="llama", vocab_size=10, hidden_size=8, intermediate_size=8, num_layers=2,
                      num_heads=2, num_kv_heads=1, head_dim=4, rms_norm_eps=1e-6, rope_theta=1e4,
                      max_position_embeddings=64, tie_word_embeddings=True)
    caches = [PagedKVCache(cfg, KVCacheConfig(page_size=4, num_pages=12), dtype=torch.float32,
                           device=torch.device("cpu")) for _ in range(2)]
    for c in caches:
        c.k.copy_(torch.arange(c.k.numel(), dtype=torch.float32).view_as(c.k))
        c.v.copy_(-c.k)
    paths = [[0, 2, 5, 9], [0, 1, 3], [0]]
    lengths = [3, 6, 1]
    seqs = [[SequenceKV(pages=[p for p in range(12) if p % 3 == i], length=n) for i, n in enumerate(lengths)]
            for _ in caches]
    moves = [[(s, *commit_moves(path, s.length)) for s, path in zip(ss, paths, strict=True)] for ss in seqs]
    for s, src, dst in moves[0]:
        caches[0].move_slots(s, src, dst)
    caches[1].move_many(moves[1])
    assert torch.equal(caches[0].k, caches[1].k) and torch.equal(caches[0].v, caches[1].v)


# ---- request reads -------------------------------------------------------------------------------------
def test_last_token_and_ids_from_without_concatenation() -> None:
    r = Request("x", [1, 2, 3], SamplingParams())
    assert r.last_token == 3 and r.ids_from(1) == [2, 3] and r.ids_from(3) == []
    r.output_ids.extend([7, 8])
    assert r.last_token == 8
    for start in range(6):
        assert r.ids_from(start) == r.all_ids[start:]


# ---- a plain streak's probe --------------------------------------------------------------------------
def test_a_probe_drafts_for_one_request_and_stays_lossless(target_dir: Path, draft_dir: Path,
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """``TreeShape.probe``: one request drafts, the one whose draft has the fewest tokens to catch up, and the others
    verify their roots alone; greedy output is the target's own either way."""
    from adaserve.engine.speculation.policies import TreeShape
    from tests.engine.helpers import engine, outputs

    rng = np.random.default_rng(9)
    prompts = [rng.integers(2, 97, int(n)).tolist() for n in (5, 9, 3)]

    def reqs() -> list[Request]:
        return [Request(f"r{i}", p, SamplingParams(max_tokens=12, ignore_eos=True)) for i, p in enumerate(prompts)]

    reference = outputs(engine(target_dir, None, "incremental"), reqs())
    eng = engine(target_dir, draft_dir, "adaserve")
    shapes = iter([None, None, TreeShape(3, 2, probe=True)] * 20)  # two plain iterations, then a probe
    object.__setattr__(eng.policy, "tree_shape", lambda view: next(shapes))
    drafted: list[dict[str, int]] = []
    eng.step_listeners.append(lambda m: drafted.append(m.per_request_verified) if m.depth else None)
    assert outputs(eng, reqs()) == reference
    assert drafted and all(sorted(v.values())[:-1] == [1] * (len(v) - 1) for v in drafted)  # roots, but one
    assert any(max(v.values()) > 1 for v in drafted)
    # the first probe (after two plain iterations of all three, their prompts fed to no draft yet): the shortest
    # prompt has the fewest tokens to catch up
    first = drafted[0]
    assert max(first, key=first.__getitem__) == "r2"
