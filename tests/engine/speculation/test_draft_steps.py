"""The draft's beam-search steps over persistent buffers (speculation/draft_steps.py), checked on a CPU where the same
closures a GPU captures are called search after search:

- searches of one shape reuse one set of steps, and each gives the reference's trees bit for bit (the host-level
  search of test_beam_on_device.py), with and without a sliding window, batch buckets padded or not: a step that read
  anything but its buffers would read the first search's values in the later ones;
- a step makes no host-device crossing (what a CUDA graph may hold), and the whole search's function, which a GPU
  captures as one graph, gives the steps' outputs bit for bit without one either;
- a search launches few device ops outside its steps (one replay on a GPU), far fewer than the levels' loop;
- a level that is not finite refuses the trees once the pending tokens are committed.
The trees of every SHAPES entry through the steps are also held to the reference by
``test_device_levels_give_the_host_levels_trees_bit_for_bit`` (static, torch picks).
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from adaserve.bench.engine_only import OpCount, steps_as_replays
from adaserve.engine.model.host_sync import HostSync
from adaserve.engine.model.levels import BeamLevels
from adaserve.engine.model.runner import ModelRunner
from adaserve.engine.speculation import draft_steps, speculate
from adaserve.engine.speculation.draft_steps import DraftSteps
from adaserve.engine.speculation.speculate import beam_search
from tests.engine.helpers import captures_run_out_of_memory, runner, use_cpu_kernels
from tests.engine.speculation.test_beam_on_device import assert_same_trees, contexts, host_beam_search, twin_inputs


@pytest.fixture
def draft(draft_dir: Path, monkeypatch: pytest.MonkeyPatch) -> ModelRunner:
    use_cpu_kernels("torch", monkeypatch)  # the torch picks a GPU runs (the CPU kernels' picks take their own path)
    return runner(draft_dir, static_shapes=True)


def one_steps(r: ModelRunner) -> list[DraftSteps]:
    assert r.static is not None
    return list(draft_steps._STEPS.get(r.static, {}).values())


@pytest.mark.parametrize("window", [None, 3])
@pytest.mark.parametrize(("depth", "width", "expansion"), [(4, 2, None), (3, 1, None), (3, 3, None),
                                                           (0, 1, (2, 1, 2))])
def test_searches_of_one_shape_reuse_their_steps_and_give_the_reference_trees(
        draft: ModelRunner, monkeypatch: pytest.MonkeyPatch, window: int | None, depth: int, width: int,
        expansion: tuple[int, ...] | None) -> None:
    monkeypatch.setattr(draft.model, "cfg", replace(draft.model.cfg, sliding_window=window))
    rng = np.random.default_rng(3)
    made: list[Any] = []
    for search in range(4):
        # one batch bucket (4): padded, then not; contexts short enough for one key bucket
        ref_in, got_in, _ = twin_inputs(draft, rng, (3, 4, 3, 4)[search], 12)
        ref = host_beam_search(draft, ref_in, depth=depth, width=width, expansion=expansion)
        got = beam_search(draft, got_in, depth=depth, width=width, expansion=expansion)
        assert_same_trees(got, ref, search)
        steps = one_steps(draft)
        assert len(steps) == 1  # every search of this shape ran on the same steps
        made.append(list(steps[0].fns))
        for x in (*ref_in, *got_in):
            draft.cache.release(x.seq)
    assert all(fn is first for fns in made for fn, first in zip(fns, made[0], strict=True))


def test_a_step_crosses_nothing(draft: ModelRunner) -> None:
    """What a CUDA graph captures: the picks, the growth, the bucket's fills and the draft make no host-device
    crossing of any kind."""
    inputs = contexts(draft, [[5, 6, 7], [8], [3] * 9], [[9], [10, 11], [4]])
    beam_search(draft, inputs, depth=4, width=2)
    (steps,) = one_steps(draft)
    for fn in steps.fns:
        assert fn is not None
        with HostSync(forbid=True) as hs:
            fn()
        assert not hs.counts


def test_a_search_launches_few_ops_outside_its_steps(draft: ModelRunner, monkeypatch: pytest.MonkeyPatch) -> None:
    """Counted as a GPU launches them (``engine_only.steps_as_replays``: a search's steps are one replay), a search
    of depth 4 and width 2 at three requests launches a few ops outside the draft's forwards: the catch-up's integers
    and rows, the roots' copy, one copy of every fed level's integers and tree cells, the steps' one replay, and the
    trees' one copy to the host (9 in all). The levels' loop (eager picks and fills) launches 67."""

    def search() -> int:
        inputs = contexts(draft, [[5, 6, 7], [8], [3] * 9], [[9], [10, 11], [4]])
        with OpCount([draft.model]) as ops, steps_as_replays(ops):
            beam_search(draft, inputs, depth=4, width=2)
        for x in inputs:
            draft.cache.release(x.seq)
        return ops.outside

    search()  # the steps are made
    with_steps = search()
    monkeypatch.setattr(speculate, "steps_for", lambda *a, **k: None)
    loop = search()
    assert with_steps <= 10, with_steps
    assert loop >= 6 * with_steps, (loop, with_steps)


def test_the_search_function_is_the_steps_one_by_one(draft: ModelRunner) -> None:
    """What a GPU captures as one graph (``search_function``: every step made from the one before's outputs, called in
    turn) gives the steps' outputs bit for bit, and makes no host-device crossing of any kind."""
    inputs = contexts(draft, [[5, 6, 7], [8], [3] * 9], [[9], [10, 11], [4]])
    beam_search(draft, inputs, depth=4, width=2)  # the buffers hold this search's inputs
    (steps,) = one_steps(draft)
    with HostSync(forbid=True) as hs, torch.inference_mode():
        whole = steps.search_function()()
    assert not hs.counts
    assert len(whole) == len(steps.outs) == 4
    for got, want in zip(whole, steps.outs, strict=True):
        assert want is not None
        for g, w in zip(got.fields(), want.fields(), strict=True):
            assert (g is None) == (w is None)
            assert g is None or (w is not None and torch.equal(g, w))


def test_a_gpus_search_reports_every_level_after_its_one_replay(draft: ModelRunner,
                                                                monkeypatch: pytest.MonkeyPatch) -> None:
    """``run``'s GPU branch, its replay stood in by the search function called once (a CPU cannot capture): the trees
    of the steps one by one, and the catch-up and every fed level reported to the runner's listeners, in order."""
    prompts, pending = [[5, 6, 7], [8], [3] * 9], [[9], [10, 11], [4]]
    inputs = contexts(draft, prompts, pending)
    want = beam_search(draft, inputs, depth=4, width=2)
    for x in inputs:
        draft.cache.release(x.seq)
    (steps,) = one_steps(draft)
    replays: list[int] = []

    def replay() -> None:
        replays.append(1)
        with torch.inference_mode():
            steps.outs = list(steps.search_function()())

    steps.replayed = True
    monkeypatch.setattr(steps, "_replay", replay)
    inputs = contexts(draft, prompts, pending)  # prefilled: the search's forwards are the ones heard from here on
    records: list[Any] = []
    draft.forward_listeners.append(records.append)
    got = beam_search(draft, inputs, depth=4, width=2)
    assert replays == [1]
    assert_same_trees(got, want, 0)
    assert [r.n_new for r in records] == [4, 6, 6, 6]  # the catch-up's pending tokens, then 3 requests x 2 a level


def test_each_draft_forward_reports_its_context_and_attention_cells(draft: ModelRunner) -> None:
    """What the cost model is fitted on (timing.py): the catch-up's pending tokens read their sequence's committed keys
    (3, 1, 9) and, as a causal chunk, one another's (1 x 3 + 1, 2 x 1 + 3, 1 x 9 + 1 cells); a level's 2 nodes a
    request each read their root's keys and the tree nodes before the level (the roots' keys: 3, 2 and 9, so 14, plus
    1, 3, 5 nodes a request), and are counted as a chunk of 2 (3 cells a request: runner.chunk_cells)."""
    inputs = contexts(draft, [[5, 6, 7], [8], [3] * 9], [[9], [10, 11], [4]])
    records: list[Any] = []
    draft.forward_listeners.append(records.append)
    beam_search(draft, inputs, depth=4, width=2)
    assert [(r.n_new, r.n_context, r.n_cells) for r in records] == [(4, 13, 19), (6, 17, 34 + 9), (6, 23, 46 + 9),
                                                                      (6, 29, 58 + 9)]


def test_the_switch_keeps_the_levels_loop(draft: ModelRunner, monkeypatch: pytest.MonkeyPatch) -> None:
    """``ADASERVE_DRAFT_STEPS=off`` (a GPU session's fallback, read at each search): no steps are made, and the levels'
    loop gives the same trees as the steps."""
    prompts, pending = [[5, 6, 7], [8]], [[9], [10, 11]]
    monkeypatch.setenv(draft_steps.ENV, "off")
    inputs = contexts(draft, prompts, pending)
    loop = beam_search(draft, inputs, depth=3, width=2)
    for x in inputs:
        draft.cache.release(x.seq)
    assert not one_steps(draft)
    monkeypatch.setenv(draft_steps.ENV, "on")
    steps = beam_search(draft, contexts(draft, prompts, pending), depth=3, width=2)
    assert one_steps(draft)
    assert_same_trees(steps, loop, "switch")


def test_a_level_that_is_not_finite_refuses_the_trees(draft: ModelRunner, monkeypatch: pytest.MonkeyPatch) -> None:
    inputs = contexts(draft, [[5, 6, 7], [8]], [[9], [10, 11]])
    real = BeamLevels.catch_up
    monkeypatch.setattr(BeamLevels, "catch_up", lambda self: torch.full_like(real(self), float("nan")))
    with pytest.raises(FloatingPointError, match="non-finite"):
        beam_search(draft, inputs, depth=4, width=2)
    assert one_steps(draft)  # it ran on the steps
    assert [x.seq.length for x in inputs] == [4, 3]
    monkeypatch.setattr(BeamLevels, "catch_up", real)
    trees = beam_search(draft, contexts(draft, [[5, 6, 7], [8]], [[9], [10, 11]]), depth=4, width=2)
    assert all(t.size == 1 + 4 * 2 for t in trees)


# ---- on a GPU: the steps captured and replayed (run with --with-gpu) -------------------------------------------------
@pytest.mark.gpu
def test_replayed_steps_give_the_eager_levels_trees_on_cuda(draft_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The whole search captured as one graph at the first search of its shape and replayed at the later ones gives
    the trees of the levels' eager loop on the same card (the same kernels: tokens and parents equal, log path
    probabilities to float32 rounding)."""
    from tests.engine.model.test_static_shapes import cuda_runner

    draft = cuda_runner(draft_dir, static=True)
    assert draft.static is not None and draft.static.graphs
    rng = np.random.default_rng(5)
    for search in range(3):
        twins = twin_inputs(draft, rng, (3, 4, 3)[search], 12)[:2]
        trees = []
        for use_steps, inputs in zip((True, False), twins, strict=True):
            with monkeypatch.context() as m:
                if not use_steps:
                    m.setattr(speculate, "steps_for", lambda *a, **k: None)
                trees.append(beam_search(draft, inputs, depth=4, width=2))
                for x in inputs:
                    draft.cache.release(x.seq)
        (steps,) = one_steps(draft)
        assert steps.graph is not None
        for g, r in zip(*trees, strict=True):
            assert np.array_equal(g.tokens, r.tokens) and np.array_equal(g.parents, r.parents), search
            np.testing.assert_allclose(g.log_probs, r.log_probs, rtol=1e-5, atol=1e-5)


def test_a_search_whose_capture_runs_out_of_memory_runs_its_steps_one_by_one(
        draft: ModelRunner, monkeypatch: pytest.MonkeyPatch) -> None:
    """A GPU captures each search shape as one graph, lazily, while serving; one that runs out of memory there must not
    fail the search: the steps run one by one instead (what a CPU does), giving the reference's trees, and the shape
    is not captured again. ``capture`` stands in for CUDA's, the only part mocked (no GPU here): the search runs as a
    GPU's would, with ``graphs`` on."""
    assert draft.static is not None
    tries = captures_run_out_of_memory(draft.static, monkeypatch)
    monkeypatch.setattr(torch.cuda, "graph_pool_handle", lambda: (0, 7))  # the search's own pool, asked for
    # the buckets' own forwards (the catch-up, the reference search's levels) fail to capture alike, in the shared pool
    module_calls: list[int] = []
    forward = draft.model.forward

    def counted(*args: Any, **kwargs: Any) -> torch.Tensor:
        module_calls.append(1)
        return forward(*args, **kwargs)

    monkeypatch.setattr(draft.model, "forward", counted)
    rng = np.random.default_rng(5)
    for search in range(3):
        ref_in, got_in, _ = twin_inputs(draft, rng, 3, 12)
        ref = host_beam_search(draft, ref_in, depth=4, width=2)
        module_calls.clear()
        got = beam_search(draft, got_in, depth=4, width=2)
        assert_same_trees(got, ref, search)
        # the catch-up and the three fed levels, each through the module's forward (timed as any eager forward)
        assert len(module_calls) == 4, search
        for x in (*ref_in, *got_in):
            draft.cache.release(x.seq)
    (steps,) = one_steps(draft)
    assert not steps.replayed and steps.graph is None
    assert [p for p in tries if p is not None] == [(0, 7)]  # one try at the search, in a pool of its own
    assert any(f.startswith("draft search") for f in draft.static.capture_failures)
