"""Beam search with its levels on the device (issue 30): the same trees, bit for bit, as the implementation
that copied each level's picks to the host and laid the next level out from them, and one copy in all.

``host_beam_search`` below is that implementation, kept as the reference: each level's tokens, parents and
log path probabilities come to the host (``expand_level``), and the next forward is laid out from real
trees (host ids, host ancestor rows). The device version must give identical tokens, parents and float64
log-probs on the eager and the static path, with the torch attention's grouping and the static grid alike,
and with either implementation of a level's picks on a CPU: the torch ops a GPU runs, or the integer kernels'
``beam_picks`` (native/picks.c), whose trees ``test_native_picks_give_the_torch_ops_trees`` holds to the torch ops'.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from adaserve.engine.model.batch import BatchLayout, DeviceNodes, Segment, build_layout
from adaserve.engine.model.host_sync import HostSync
from adaserve.engine.model.kv_cache import SequenceKV
from adaserve.engine.model.runner import ModelRunner
from adaserve.engine.model.tree import TokenTree
from adaserve.engine.speculation.beam_ops import ancestor_rows, grow_ancestors, host_ancestor_rows
from adaserve.engine.speculation.speculate import DraftInput, beam_search, expand_level
from tests.engine.helpers import runner, use_cpu_kernels


def host_beam_search(draft: ModelRunner, inputs: list[DraftInput], *, depth: int, width: int,
                     expansion: tuple[int, ...] | None = None) -> list[TokenTree]:
    """The reference: every level's picks on the host, the next level laid out from the real trees."""
    if expansion is not None:
        depth = len(expansion)
    segs = [Segment(x.seq, x.seq.length, TokenTree.chain(x.pending)) for x in inputs]
    logits = draft.forward(segs, all_logits=[False] * len(segs))
    for x in inputs:
        draft.cache.truncate(x.seq, x.seq.length + len(x.pending))
    n = len(inputs)
    toks = np.asarray([[x.pending[-1]] for x in inputs], np.int64)
    pars = np.full((n, 1), -1, np.int64)
    lps = np.zeros((n, 1))
    base = np.zeros((n, 1))
    for step in range(depth):
        m = toks.shape[1]
        frontier = m - len(logits[0])
        k = None if expansion is None else expansion[step]
        tok, parent, value = expand_level(logits, base, width=width, per_node=k)
        base = value
        toks = np.concatenate([toks, tok], axis=1)
        pars = np.concatenate([pars, frontier + parent], axis=1)
        lps = np.concatenate([lps, value], axis=1)
        if step == depth - 1:
            break
        segs = [Segment(x.seq, x.seq.length - 1, TokenTree(toks[r], pars[r], lps[r]), num_cached=m)
                for r, x in enumerate(inputs)]
        logits = draft.forward(segs, all_logits=[True] * n)
    for x in inputs:
        draft.cache.truncate(x.seq, x.seq.length)
    return [TokenTree(toks[r], pars[r], lps[r]).with_strict_decrease() for r in range(n)]


def contexts(draft: ModelRunner, prompts: list[list[int]], pending: list[list[int]]) -> list[DraftInput]:
    """Fresh draft sequences holding ``prompts``, with ``pending`` tokens not yet seen."""
    out = []
    for p, q in zip(prompts, pending, strict=True):
        s = SequenceKV()
        draft.forward([Segment(s, 0, TokenTree.chain(p))], all_logits=[False])
        draft.cache.truncate(s, len(p))
        out.append(DraftInput(s, list(q)))
    return out


def twin_inputs(draft: ModelRunner, rng: np.random.Generator, n: int,
                longest: int) -> tuple[list[DraftInput], list[DraftInput], list[list[int]]]:
    """Two identical sets of ``n`` random contexts (prompts of 1 .. ``longest`` - 1 tokens, 1 .. 3 pending): one for
    the reference search, one for the search under test; and the prompts."""
    prompts = [rng.integers(2, 97, int(rng.integers(1, longest))).tolist() for _ in range(n)]
    pending = [rng.integers(2, 97, int(rng.integers(1, 4))).tolist() for _ in range(n)]
    return contexts(draft, prompts, pending), contexts(draft, prompts, pending), prompts


def assert_same_trees(got: list[TokenTree], ref: list[TokenTree], tag: object) -> None:
    """Tokens, parents and float64 log path probabilities, bit for bit."""
    for g, r in zip(got, ref, strict=True):
        assert np.array_equal(g.tokens, r.tokens), tag
        assert np.array_equal(g.parents, r.parents), tag
        assert np.array_equal(g.log_probs, r.log_probs), tag


SHAPES = [(1, 1, None), (2, 1, None), (3, 2, None), (4, 3, None), (5, 4, None), (0, 1, (1, 1, 3, 1)),
          (0, 1, (2, 2, 1)), (0, 1, (1, 1, 1))]


@pytest.mark.parametrize("picks", ["torch", "native"])
@pytest.mark.parametrize("static", [False, True])
def test_device_levels_give_the_host_levels_trees_bit_for_bit(draft_dir: Path, static: bool, picks: str,
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    use_cpu_kernels(picks, monkeypatch)
    draft = runner(draft_dir, static_shapes=static)
    rng = np.random.default_rng(7)
    for depth, width, expansion in SHAPES:
        ref_in, got_in, prompts = twin_inputs(draft, rng, int(rng.integers(1, 7)), 20)
        ref = host_beam_search(draft, ref_in, depth=depth, width=width, expansion=expansion)
        got = beam_search(draft, got_in, depth=depth, width=width, expansion=expansion)
        assert_same_trees(got, ref, (depth, width, expansion))
        for g, r in zip(got, ref, strict=True):
            # the ancestor matrices the CPU kernels' search grew and handed over are the trees' own
            assert np.array_equal(g.ancestor_matrix(), r.ancestor_matrix()), (depth, width, expansion)
            assert not g.ancestor_matrix().flags.writeable
        for x in got_in:
            assert x.seq.length == len(prompts[got_in.index(x)]) + len(x.pending)
        for x in (*ref_in, *got_in):
            draft.cache.release(x.seq)


@pytest.mark.parametrize("static", [False, True])
def test_beam_search_frees_no_page_before_its_last_forward(draft_dir: Path, static: bool,
                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    """The levels' pages are taken when the search is planned (model/levels.py); a truncate before the last level
    would hand them back to the pool while later levels still write and read them. The pending tokens are
    committed once, at the end, on the planned and the laid-out catch-up alike."""
    draft = runner(draft_dir, static_shapes=static)
    inputs = contexts(draft, [[5, 6, 7], [8], [3] * 9], [[9], [10, 11], [4]])
    events: list[str] = []
    truncate, record = draft.cache.truncate, draft.record
    monkeypatch.setattr(draft.cache, "truncate", lambda *a, **k: (events.append("truncate"), truncate(*a, **k))[1])
    monkeypatch.setattr(draft, "record", lambda *a, **k: (events.append("forward"), record(*a, **k))[1])
    beam_search(draft, inputs, depth=4, width=2)
    assert events.count("forward") == 4 and events[:4] == ["forward"] * 4, events
    assert events[4:] == ["truncate"] * len(inputs)
    assert [x.seq.length for x in inputs] == [4, 3, 10]


@pytest.mark.parametrize("picks", ["torch", "native"])
@pytest.mark.parametrize("static", [False, True])
def test_beam_search_waits_on_the_device_once(draft_dir: Path, static: bool, picks: str,
                                              monkeypatch: pytest.MonkeyPatch) -> None:
    use_cpu_kernels(picks, monkeypatch)
    draft = runner(draft_dir, static_shapes=static)
    inputs = contexts(draft, [[5, 6, 7], [8]], [[9], [10, 11]])
    with HostSync() as sync:
        trees = beam_search(draft, inputs, depth=4, width=3)
    # the whole candidate tree in one copy; the CPU kernels write it into host arrays, with nothing to copy
    assert sync.counts["d2h"] == (0 if picks == "native" else 1), sync.counts
    assert sync.counts["sync"] == sync.counts["h2d"] == sync.counts["data_shape"] == 0
    # one non-blocking copy for the catch-up's and every beam level's arrays (model/levels.py), on the torch grid
    # and on the static buckets alike (the static path laid its catch-up out, with a copy of its own, until issue
    # 30's last round)
    assert sync.counts["async_copy"] == 1
    assert all(t.size == 1 + 4 * 3 for t in trees)


def test_native_picks_give_the_torch_ops_trees(draft_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Every shape of SHAPES, on the draft's real logits: the same tokens and parents whichever implementation
    picks a level on a CPU; the log path probabilities agree to float32 rounding (another exponential, another
    summation order)."""
    draft = runner(draft_dir)
    rng = np.random.default_rng(11)
    for depth, width, expansion in SHAPES:
        n = int(rng.integers(1, 7))
        prompts = [rng.integers(2, 97, int(rng.integers(1, 20))).tolist() for _ in range(n)]
        pending = [rng.integers(2, 97, int(rng.integers(1, 4))).tolist() for _ in range(n)]
        trees = {}
        for picks in ("torch", "native"):
            use_cpu_kernels(picks, monkeypatch)
            inputs = contexts(draft, prompts, pending)
            trees[picks] = beam_search(draft, inputs, depth=depth, width=width, expansion=expansion)
            for x in inputs:
                draft.cache.release(x.seq)
        for t, nat in zip(trees["torch"], trees["native"], strict=True):
            assert np.array_equal(t.tokens, nat.tokens), (depth, width, expansion)
            assert np.array_equal(t.parents, nat.parents), (depth, width, expansion)
            assert np.allclose(t.log_probs, nat.log_probs, rtol=0, atol=1e-5), (depth, width, expansion)


def test_grown_ancestor_rows_are_the_trees_matrices() -> None:
    """The rows are made once for the whole tree and filled level by level in place: after each level, the rows
    of every node so far are its tree's ancestor matrix, and the rows still to come hold only their own bit."""
    rng = np.random.default_rng(3)
    n, levels = 3, (2, 3, 1, 4)
    side = 1 + sum(levels)
    parents = np.full((n, 1), -1)
    anc = ancestor_rows(n, side, torch.device("cpu"))
    for k in levels:
        m = parents.shape[1]
        new = rng.integers(0, m, (n, k))
        parents = np.concatenate([parents, new], axis=1)
        grow_ancestors(anc, m, torch.from_numpy(new))
        for r in range(n):
            tree = TokenTree(np.zeros(m + k, np.int64), parents[r], np.zeros(m + k))
            assert np.array_equal(anc[r, : m + k, : m + k].numpy(), tree.ancestor_matrix())
            assert not anc[r, : m + k, m + k :].any()
            assert np.array_equal(anc[r, m + k :].numpy(), np.eye(side, dtype=bool)[m + k :])


def test_rows_made_with_the_first_level_are_the_grown_ones() -> None:
    """Level 1 hangs off the root, so its rows are made with the others: the same bits as growing them."""
    n, side, first = 3, 9, 2
    grown = ancestor_rows(n, side, torch.device("cpu"))
    grow_ancestors(grown, 1, torch.zeros((n, first), dtype=torch.int64))
    assert torch.equal(ancestor_rows(n, side, torch.device("cpu"), first_level=first), grown)


@pytest.mark.parametrize(("n", "side", "first"), [(1, 1, 0), (1, 9, 2), (3, 7, 3), (2, 13, 0)])
def test_host_rows_are_the_device_rows(n: int, side: int, first: int) -> None:
    """The CPU's own path makes the rows by numpy: the same bits, each call a fresh array it may grow in place."""
    want = np.zeros((n, side, side), bool)  # each node its own ancestor; level 1 hangs off the root
    want[:, np.arange(side), np.arange(side)] = True
    want[:, 1 : 1 + first, 0] = True
    rows = host_ancestor_rows(n, side, first_level=first)
    assert rows.dtype == bool and rows.flags.writeable and rows.flags.c_contiguous
    assert np.array_equal(rows, want)
    assert np.array_equal(ancestor_rows(n, side, torch.device("cpu"), first_level=first).numpy(), want)
    rows[:] = False  # a copy: the next search's rows are not this one's
    assert np.array_equal(host_ancestor_rows(n, side, first_level=first), want)


def test_device_nodes_are_checked_against_the_layout(draft_dir: Path) -> None:
    draft = runner(draft_dir)
    s = SequenceKV()
    draft.cache.ensure(s, 8)
    tree = TokenTree.from_lists([0, 0, 0], [-1, 0, 0])
    seg = Segment(s, 4, tree, num_cached=1)
    page = draft.cache.page_size

    def layout(nodes: DeviceNodes) -> BatchLayout:
        return build_layout([seg], page_size=page, device=draft.device, on_device=nodes)

    with pytest.raises(ValueError, match="device ids of shape"):
        layout(DeviceNodes(torch.zeros(3, dtype=torch.long)))
    with pytest.raises(ValueError, match="need their ancestor rows"):
        layout(DeviceNodes(torch.zeros(2, dtype=torch.long)))
    with pytest.raises(ValueError, match="expected"):
        layout(DeviceNodes(torch.zeros(2, dtype=torch.long), torch.ones((1, 2, 2), dtype=torch.bool)))
    lay = layout(DeviceNodes(torch.tensor([5, 6]), torch.tensor(tree.ancestor_matrix()[None])))
    assert lay.ids is None and lay.input_ids.tolist() == [5, 6] and lay.num_tokens == 2
    assert lay.position_ids.tolist() == [5, 5]


@pytest.mark.parametrize("grid", ["torch", "torch, host masks", "static"])
@pytest.mark.parametrize("window", [None, 2])
@pytest.mark.parametrize("sizes", [[1, 1, 1], [1, 3, 3, 3], [1, 1, 1, 3, 3], [1, 2, 4]])
def test_planned_levels_give_each_level_laid_out_logits_bit_for_bit(
        draft_dir: Path, monkeypatch: pytest.MonkeyPatch, grid: str, window: int | None, sizes: list[int]) -> None:
    """A level planned ahead (model/levels.py: one host pass for all levels, on the torch grid, with its masks
    made on the device or in host memory, or on the static bucket) computes exactly the logits of the same level
    laid out from its real trees and planned alone (build_layout + the backend's or the static path's plan), with
    and without a sliding window."""
    from dataclasses import replace

    from adaserve.engine.model.levels import BeamLevels

    static = grid == "static"
    draft = runner(draft_dir, static_shapes=static)
    monkeypatch.setattr(draft.model, "cfg", replace(draft.model.cfg, sliding_window=window))
    monkeypatch.setattr(draft.backend, "sliding_window", window)
    many = grid != "torch, host masks"  # host masks are a lone request's (a batch keeps the device's)
    count = 3 if many else 1
    inputs = contexts(draft, [[5, 6, 7, 8, 9], [8], [3] * 9][:count], [[9], [10, 11], [4]][:count])
    for x in inputs:  # the catch-up forward: the pending tokens join the draft KV, the root last
        draft.forward([Segment(x.seq, x.seq.length, TokenTree.chain(x.pending))], all_logits=[False])
        draft.cache.truncate(x.seq, x.seq.length + len(x.pending))
    seqs = [x.seq for x in inputs]
    n, rng = len(seqs), np.random.default_rng(5)
    levels = BeamLevels(draft, seqs, sizes, host_masks=grid != "torch")  # the static bucket's are the device's
    assert [how for how, *_ in levels._grids[1:]] == ["static" if static else "torch"] * (len(sizes) - 1)
    lone_host = grid == "torch, host masks" and window is None  # the lone plan takes no window
    assert sorted(levels.masks) == (list(range(1, len(sizes))) if lone_host else [])
    ends = np.cumsum(sizes)
    parents = np.full((n, ends[-1]), -1, np.int64)
    for lv in range(1, len(sizes)):  # each node of level lv hangs off a random node of level lv - 1
        low = ends[lv - 2] if lv > 1 else 0
        parents[:, ends[lv - 1] : ends[lv]] = rng.integers(low, ends[lv - 1], (n, sizes[lv]))
    for lv in range(1, len(sizes)):
        size, c = int(ends[lv]), int(ends[lv - 1])
        trees = [TokenTree(np.zeros(size, np.int64), parents[b, :size], np.zeros(size)) for b in range(n)]
        chain = trees[0].is_chain
        anc = None if chain else torch.from_numpy(np.stack([t.ancestor_matrix() for t in trees]))
        # the level reads [n, S, S] rows of the whole search (S: the last level's tree), those past it unfilled
        rows = None if anc is None else torch.zeros((n, ends[-1], ends[-1]), dtype=torch.bool)
        if rows is not None:
            rows[:, :size, :size] = anc
            rows[:, size:].diagonal(offset=size, dim1=1, dim2=2).fill_(True)
        ids = torch.from_numpy(rng.integers(2, 97, n * sizes[lv]))
        if anc is not None and size < ends[-1]:  # the level's own [n, s, s] rows are not the search's
            with pytest.raises(ValueError, match="ancestor rows of shape"):
                levels.forward(lv, ids, anc)
        got = levels.forward(lv, ids, rows).clone()
        rec = draft.last_forward
        segs = [Segment(s, s.length - 1, t, num_cached=c) for s, t in zip(seqs, trees, strict=True)]
        want = torch.cat(draft.forward(segs, all_logits=[True] * n, on_device=DeviceNodes(ids, anc)))
        assert got.shape == want.shape == (n * sizes[lv], draft.vocab_size)
        assert torch.equal(got, want), (lv, sizes, window, static)
        assert rec is not None and draft.last_forward is not None and rec is not draft.last_forward
        assert (rec.n_new, rec.n_context) == (draft.last_forward.n_new, draft.last_forward.n_context)
    for s in seqs:
        draft.cache.release(s)


@pytest.mark.parametrize(("host_masks", "static"), [(False, False), (True, False), (False, True)])
@pytest.mark.parametrize("window", [None, 2])
@pytest.mark.parametrize("pending", [[[9], [10, 11], [4]], [[9], [10], [4]], [[7, 8, 9]], [[3]], [[1] * 40, [2]]])
def test_planned_catch_up_gives_the_laid_out_logits_bit_for_bit(draft_dir: Path, monkeypatch: pytest.MonkeyPatch,
                                                                window: int | None, pending: list[list[int]],
                                                                host_masks: bool, static: bool) -> None:
    """The draft's catch-up planned with the levels (``BeamLevels(..., pending=...)``, on the torch grid or on a
    static bucket) computes the logits, the KV and the forward record of the catch-up laid out alone
    (``ModelRunner.forward`` of the chains, last rows only), bit for bit; chains that ``TorchAttention.plan`` would
    split into groups, or too long for a static bucket, are not planned."""
    from dataclasses import replace

    from adaserve.engine.model.levels import BeamLevels

    draft = runner(draft_dir, static_shapes=static)
    monkeypatch.setattr(draft.model, "cfg", replace(draft.model.cfg, sliding_window=window))
    monkeypatch.setattr(draft.backend, "sliding_window", window)
    prompts = [[5, 6, 7, 8, 9], [8], [3] * 9][: len(pending)]
    ref_in, got_in = contexts(draft, prompts, pending), contexts(draft, prompts, pending)
    levels = BeamLevels(draft, [x.seq for x in got_in], [1, 2, 2], pending=[x.pending for x in got_in],
                        host_masks=host_masks)
    if max(map(len, pending)) > 32:  # one long chain beside short ones: plan would group them apart (past a bucket)
        assert not levels.folds_catch_up
        with pytest.raises(ValueError, match="not planned"):
            levels.catch_up()
        return
    # host masks are a lone request's, without a window (the lone plan's)
    assert levels.folds_catch_up and (0 in levels.masks) == (host_masks and len(pending) == 1 and window is None)
    assert levels._grids[0][0] == ("static" if static else "torch")
    got = levels.catch_up().clone()
    rec = draft.last_forward
    segs = [Segment(x.seq, x.seq.length, TokenTree.chain(x.pending)) for x in ref_in]
    want = draft.forward_joined(segs, all_logits=[False] * len(segs))
    assert got.shape == want.shape == (len(pending), draft.vocab_size)
    assert torch.equal(got, want)
    assert rec is not None and draft.last_forward is not None and rec is not draft.last_forward
    assert (rec.n_new, rec.n_context) == (draft.last_forward.n_new, draft.last_forward.n_context)
    for r, g in zip(ref_in, got_in, strict=True):  # the same keys and values written for the pending tokens
        slots = [torch.from_numpy(x.seq.slots(x.seq.length, x.seq.length + len(x.pending), draft.cache.page_size))
                 for x in (r, g)]
        for layer in range(len(draft.cache.k)):
            for cache in (draft.cache.k, draft.cache.v):
                assert torch.equal(cache[layer][slots[0]], cache[layer][slots[1]])
    for x in (*ref_in, *got_in):
        draft.cache.release(x.seq)


@pytest.mark.parametrize("picks", ["torch", "native"])
def test_a_level_that_is_not_finite_refuses_the_trees_after_committing(
        draft_dir: Path, picks: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """A level whose logits are not finite: the search raises, whichever picks ran, once its forwards are done and
    its pending tokens committed (the scratch beams dropped), so the sequences are as after any search."""
    from adaserve.engine.model.levels import BeamLevels

    use_cpu_kernels(picks, monkeypatch)
    draft = runner(draft_dir)
    inputs = contexts(draft, [[5, 6, 7], [8]], [[9], [10, 11]])
    real = BeamLevels.forward

    def poisoned(self: BeamLevels, level: int, ids: torch.Tensor, anc: torch.Tensor | None) -> torch.Tensor:
        out = real(self, level, ids, anc)
        return torch.full_like(out, float("nan")) if level == 2 else out

    monkeypatch.setattr(BeamLevels, "forward", poisoned)
    with pytest.raises(FloatingPointError, match="non-finite"):
        beam_search(draft, inputs, depth=4, width=2)
    assert [x.seq.length for x in inputs] == [4, 3]
    monkeypatch.setattr(BeamLevels, "forward", real)
    trees = beam_search(draft, contexts(draft, [[5, 6, 7], [8]], [[9], [10, 11]]), depth=4, width=2)
    assert all(t.size == 1 + 4 * 2 for t in trees)  # the runner is left as it was
