"""A beam search's planned levels (model/levels.py): the one-request plan stages the batch plan's arrays.

The logits of planned levels against laid-out ones are held bit for bit in
tests/engine/speculation/test_beam_on_device.py; here ``BeamLevels._plan_lone`` is held to ``_plan_batch``, array by
array, on random requests (prefix lengths across page boundaries, pending tokens, level sizes), and the plan is shown
to choose it only where it applies.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import torch

from adaserve.engine.model.attention.masks import fill_grid_mask
from adaserve.engine.model.kv_cache import SequenceKV
from adaserve.engine.model.levels import BeamLevels
from adaserve.engine.model.runner import ModelRunner
from adaserve.engine.model.staging import HostStage
from tests.engine.helpers import runner


def staged(levels: BeamLevels) -> dict[str, np.ndarray]:
    """The arrays the plan put in its stage, by name, before anything is sent (a CPU's stage takes them as they are put:
    its tensors, as numpy reads them)."""
    stage = levels.stage
    return {**{name: np.asarray(a) for name, (a, _) in stage._pending.items()},
            **{name: t.numpy() for name, t in stage._sent.items()}}


def random_sizes(rng: np.random.Generator) -> list[int]:
    """Level sizes a beam search makes: the root, then chains, beams or static products."""
    depth = int(rng.integers(1, 6))
    kind = rng.integers(3)
    if kind == 0:  # a beam w wide: 1, min(w, 1 * w) = w, w, ...
        w = int(rng.integers(1, 5))
        return [1] + [w] * depth
    if kind == 1:  # a chain
        return [1] * (depth + 1)
    sizes = [1]  # a static tree: each level's nodes times its factor
    for _ in range(depth):
        sizes.append(sizes[-1] * int(rng.integers(1, 3)))
    return sizes


def host_masks(levels: BeamLevels, anc: torch.Tensor) -> dict[int, np.ndarray]:
    """The masks the plan made in host memory, by level, their tree cells filled from the ancestor rows ``anc``."""
    return {level: levels._host_mask(level, anc).numpy().copy() for level in levels.masks}


def random_rows(rng: np.random.Generator, side: int) -> torch.Tensor:
    """[1, S, S] ancestor rows of a random tree of S nodes (each node's parent before it)."""
    anc = np.eye(side, dtype=bool)
    for i in range(1, side):
        anc[i] |= anc[int(rng.integers(0, i))]
    return torch.from_numpy(anc[None])


def random_request(draft: ModelRunner, rng: np.random.Generator, case: int, *,
                   longest: int) -> tuple[SequenceKV, list[list[int]] | None, list[int]]:
    """One request of up to ``longest`` committed tokens (pages ensured), its pending tokens (none in every fifth
    case) and the level sizes of a search over it."""
    seq = SequenceKV()
    length = int(rng.integers(1, longest))
    draft.cache.ensure(seq, length)
    seq.length = length
    pending = None if case % 5 == 0 else [rng.integers(2, 90, int(rng.integers(1, 7))).tolist()]
    # a depth-d search feeds its first d levels (speculate.beam_search): every third case with pending tokens is a
    # one-level search, the catch-up alone (depth 1, the policies' usual pick at one request)
    sizes = [1] if pending is not None and case % 3 == 0 else random_sizes(rng)
    if pending is None and len(sizes) < 2:
        sizes = [1, 2]
    return seq, pending, sizes


def assert_same_staged(lone: dict[str, np.ndarray], batch: dict[str, np.ndarray], tag: object) -> None:
    """The same names, and under each the same int64 array."""
    assert lone.keys() == batch.keys(), tag
    for name in lone:
        assert lone[name].shape == batch[name].shape and lone[name].dtype == batch[name].dtype == np.int64, name
        assert np.array_equal(lone[name], batch[name]), (name, tag)


MASK_PARTS = ("hi", "lo", "cells", "src")  # the staged arrays a device mask is made of (masks.fill_grid_mask)


def device_mask(batch: dict[str, np.ndarray], level: int, keys: int, anc: torch.Tensor) -> np.ndarray:
    """Level ``level``'s mask as the device makes it from the batch plan's staged arrays and the ancestor rows."""
    cells = batch.get(f"{level}.cells")
    values = None if cells is None else torch.take(anc, torch.from_numpy(batch[f"{level}.src"]))
    mask = fill_grid_mask(torch.arange(keys), torch.from_numpy(batch[f"{level}.hi"]), None,
                          None if cells is None else torch.from_numpy(cells), values)
    return mask.numpy()


@pytest.mark.parametrize("on_host", [False, True])
def test_the_lone_plan_stages_the_batch_plans_arrays(draft_dir: Path, on_host: bool) -> None:
    """The same staged arrays; with host masks the mask's own arrays are not staged, and each level's host mask, its
    cells filled from random ancestor rows, is the mask the device makes from the batch plan's arrays."""
    draft = runner(draft_dir)
    rng = np.random.default_rng(30)
    lone_planned = one_level = 0
    for case in range(300):
        seq, pending, sizes = random_request(draft, rng, case, longest=60)
        levels = BeamLevels(draft, [seq], sizes, pending=pending, host_masks=on_host)
        anc = random_rows(rng, levels.tree_size)
        lone, lone_masks = staged(levels), host_masks(levels, anc)
        levels.stage, levels.masks = HostStage(draft.device), {}
        levels._host_masks = False
        levels._plan_batch()
        batch = staged(levels)
        assert len(lone_masks) == (len(sizes) - 1 + (pending is not None) if on_host else 0)
        for level, mask in lone_masks.items():
            want = device_mask(batch, level, levels._grids[level][3], anc)
            assert mask.dtype == bool and np.array_equal(mask[:, 0], want), (level, sizes, pending)
        if on_host:  # the batch's mask arrays of the levels whose masks the lone plan made
            batch = {k: v for k, v in batch.items()
                     if not (int(k.split(".")[0]) in lone_masks and k.split(".")[1] in MASK_PARTS)}
        assert_same_staged(lone, batch, (sizes, pending, seq.length))
        lone_planned += levels.folds_catch_up or pending is None
        one_level += len(sizes) == 1
        draft.cache.release(seq)
    assert lone_planned == 300 and one_level > 50


def test_the_lone_static_plan_stages_the_batch_plans_arrays(draft_dir: Path) -> None:
    """On static buckets (a GPU's path) the lone plan stages the batch plan's arrays too, and puts each level's
    integers, cells and sources at the same places of the static levels' one array."""
    draft = runner(draft_dir, static_shapes=True)
    rng = np.random.default_rng(31)
    planned = 0
    for case in range(300):
        seq, pending, sizes = random_request(draft, rng, case, longest=200)
        levels = BeamLevels(draft, [seq], sizes, pending=pending)
        lone, lone_at = staged(levels), dict(levels._static_at)
        planned += levels.static_shape() is not None or len(sizes) == 1
        levels.stage, levels._static_at = HostStage(draft.device), {}
        levels._plan_batch()
        batch = staged(levels)
        assert_same_staged(lone, batch, (sizes, pending, seq.length))
        assert lone_at == levels._static_at
        draft.cache.release(seq)
    assert planned > 250  # most cases fit the buckets (the rest: a level wider than max_rows)


def test_the_lone_plan_is_chosen_only_for_one_request_without_a_window(
        draft_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    draft = runner(draft_dir)
    calls: list[str] = []
    monkeypatch.setattr(BeamLevels, "_plan_lone", lambda self: calls.append("lone"))
    monkeypatch.setattr(BeamLevels, "_plan_batch", lambda self: calls.append("batch"))

    sizes = [1, 2, 2]

    def plan(r: ModelRunner, n: int, pending: bool = True) -> str:
        seqs = []
        for _ in range(n):
            s = SequenceKV()
            r.cache.ensure(s, 9)
            s.length = 9
            seqs.append(s)
        BeamLevels(r, seqs, sizes, pending=[[4, 5]] * n if pending else None)
        for s in seqs:
            r.cache.release(s)
        return calls.pop()

    assert plan(draft, 1) == "lone" and plan(draft, 2) == "batch"
    sizes = [1]  # a one-level search: the catch-up alone
    assert plan(draft, 1) == "lone" and plan(draft, 2) == "batch"
    sizes = [1, 2, 2]
    monkeypatch.setattr(draft.model, "cfg", replace(draft.model.cfg, sliding_window=2))
    assert plan(draft, 1) == "batch"
    monkeypatch.setattr(BeamLevels, "_plan_lone_static", lambda self: calls.append("lone static"))
    static = runner(draft_dir, static_shapes=True)  # static buckets pad the grid: their own lone plan
    assert plan(static, 1, pending=False) == plan(static, 1) == "lone static"
    assert plan(static, 2) == "batch"
    sizes = [1]
    assert plan(static, 1) == "lone static" and plan(static, 2) == "batch"
    sizes = [1, 2, 2]
    monkeypatch.setattr(static.model, "cfg", replace(static.model.cfg, sliding_window=2))
    assert plan(static, 1) == "batch"


@pytest.mark.parametrize("path", ["torch", "static", "static-steps"])
def test_a_lone_request_drafts_the_trees_of_the_batch_plan(draft_dir: Path, path: str,
                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    """End to end: a lone request's beam search on the lone plan gives the trees the batch plan gives: on the torch
    grid, on static buckets, and there through the draft's steps (the torch picks a GPU runs)."""
    from adaserve.engine.speculation.speculate import DraftInput, beam_search
    from tests.engine.helpers import use_cpu_kernels
    from tests.engine.speculation.test_beam_on_device import contexts

    if path == "static-steps":
        use_cpu_kernels("torch", monkeypatch)
    draft = runner(draft_dir, static_shapes=path != "torch")
    lone_plan = "_plan_lone" if path == "torch" else "_plan_lone_static"
    trees = {}
    for how in ("lone", "batch"):
        if how == "batch":
            monkeypatch.setattr(BeamLevels, lone_plan, BeamLevels._plan_batch)
        inputs = contexts(draft, [[5, 6, 7, 8, 9, 10, 11]], [[12, 13, 14]])
        got = []
        for depth, width in [(1, 1), (3, 1), (3, 2), (4, 3)]:
            (tree,) = beam_search(draft, [DraftInput(inputs[0].seq, inputs[0].pending)], depth=depth, width=width)
            got.append((tree.tokens.tolist(), tree.parents.tolist(), torch.tensor(tree.log_probs).tolist()))
            draft.cache.truncate(inputs[0].seq, inputs[0].seq.length - len(inputs[0].pending))
        trees[how] = got
        draft.cache.release(inputs[0].seq)
    assert trees["lone"] == trees["batch"]
