"""The static-shape forward (model/static.py), checked on a CPU where it runs the function a GPU captures.

- poison: garbage in padded rows, padded segments, their masks and the scratch page leaves the real rows'
  logits bit-identical;
- it agrees with the eager forward on decode, beam and tree batches;
- its buffers keep their data_ptr across forwards of one bucket;
- the eager part outside the captured function is a few ops (the mask is made inside it);
- capture safety: the function a graph captures makes no host-device crossing at all, and a whole decode or
  verification forward (planning included) makes one non-blocking copy and nothing the host waits on.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import torch

from adaserve.bench.engine_only import OpCount
from adaserve.engine.model.attention.masks import MaskIndex, padded_mask
from adaserve.engine.model.batch import BatchLayout, Segment, build_layout
from adaserve.engine.model.host_sync import HostSync
from adaserve.engine.model.kv_cache import SequenceKV
from adaserve.engine.model.runner import ModelRunner
from adaserve.engine.model.static import Grid, StaticForward, round_up
from adaserve.engine.model.tree import TokenTree
from tests.engine.helpers import captures_run_out_of_memory, outputs, runner


def prefilled(r: ModelRunner, lengths: list[int], seed: int = 0) -> list[SequenceKV]:
    """Sequences with ``lengths`` committed tokens (prefilled eagerly)."""
    rng = np.random.default_rng(seed)
    seqs = [SequenceKV() for _ in lengths]
    segs = [Segment(s, 0, TokenTree.chain(rng.integers(2, 90, n).tolist())) for s, n in zip(seqs, lengths, strict=True)]
    for s in segs:
        r.cache.ensure(s.seq, s.kv_len)
    r.forward(segs, all_logits=[False] * len(segs))
    for s, n in zip(seqs, lengths, strict=True):
        r.cache.truncate(s, n)
    return seqs


def tree() -> TokenTree:
    return TokenTree(np.array([5, 6, 7, 8, 9]), np.array([-1, 0, 0, 1, 1]), np.zeros(5))


def batches(seqs: list[SequenceKV]) -> dict[str, list[Segment]]:
    a, b, c = seqs
    beam = TokenTree(np.array([5, 6, 7, 8, 9]), np.array([-1, 0, 0, 1, 2]), np.zeros(5))
    return {
        "decode": [Segment(s, s.length, TokenTree.root(11 + i)) for i, s in enumerate(seqs)],
        "verify": [Segment(a, a.length, tree()), Segment(b, b.length, TokenTree.root(3)),
                   Segment(c, c.length, TokenTree.chain([4, 5, 6]))],
        "beam": [Segment(s, s.length - 1, beam, num_cached=3) for s in seqs],
        # one request: its own path through the fill (a lone tree's cells without the batch's bookkeeping)
        "lone-verify": [Segment(a, a.length, tree())],
        "lone-beam": [Segment(b, b.length - 1, beam, num_cached=3)],
    }


@pytest.fixture
def static_runner(target_dir: Path) -> ModelRunner:
    return runner(target_dir, static_shapes=True)


def bucket_of(r: ModelRunner, segs: list[Segment]) -> Grid:
    """The grid a forward of ``segs`` runs on (after it ran)."""
    assert r.static is not None
    shape = r.static.bucket(build_layout(segs, page_size=r.cache.page_size, device=r.device))
    assert shape is not None
    return r.static.grid(shape)


def forward_static(r: ModelRunner, segs: list[Segment]) -> list[torch.Tensor]:
    for s in segs:
        r.cache.ensure(s.seq, s.kv_len)
    bucket_of(r, segs)  # it fits a static shape
    return r.forward(segs, all_logits=[True] * len(segs))


@pytest.mark.parametrize("kind", ["decode", "verify", "beam"])
def test_poison_in_padding_leaves_real_logits_bit_identical(static_runner: ModelRunner, kind: str) -> None:
    r = static_runner
    segs = batches(prefilled(r, [7, 12, 3]))[kind]  # 3 segments: the batch bucket 4 pads one
    clean = forward_static(r, segs)
    grid = bucket_of(r, segs)
    assert r.static is not None and grid.logits is not None and grid.g == 4
    padded_clean = grid.logits[3 * grid.q :].clone()  # the padded segment's rows
    r.static.poison = np.random.default_rng(1)
    poisoned = forward_static(r, segs)
    assert not torch.equal(grid.logits[3 * grid.q :], padded_clean)  # the garbage did reach the padding
    for x, y in zip(clean, poisoned, strict=True):
        assert torch.equal(x, y)


@pytest.mark.parametrize("window", [None, 2, 5])
@pytest.mark.parametrize("kind", ["decode", "verify", "beam", "lone-verify", "lone-beam"])
def test_static_mask_is_the_padded_rule(static_runner: ModelRunner, kind: str, window: int | None,
                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """The grid's mask (masks.grid_mask since issue 30) is the §2 rule on the padded grid (masks.padded_mask):
    real rows see their prefix and ancestors, padded rows key 0 only, with and without a sliding window."""
    r = static_runner
    assert r.static is not None
    monkeypatch.setattr(r.static.model, "cfg", replace(r.static.model.cfg, sliding_window=window))
    segs = batches(prefilled(r, [7, 12, 3]))[kind]
    for sg in segs:
        r.cache.ensure(sg.seq, sg.kv_len)

    def layout() -> BatchLayout:
        return build_layout(segs, page_size=r.cache.page_size, device=r.device)

    lay = layout()
    shape = r.static.bucket(lay)
    assert shape is not None
    grid = r.static.grid(shape)
    r.static._fill(grid, lay, list(range(int(lay.qo_indptr[-1]))))
    want = padded_mask(MaskIndex(layout()), torch.arange(len(segs)), grid.q, grid.k, window)
    mask = grid.mask(window is not None)  # as the captured function makes it from the grid's buffers
    assert torch.equal(mask[: len(segs)], want)
    assert not bool(mask[: len(segs)].all())  # the rule does hide keys
    assert torch.equal(mask[len(segs) :], torch.arange(grid.k).expand_as(mask[len(segs) :]) == 0)  # key 0 only


@pytest.mark.parametrize("kind", ["decode", "verify", "beam", "lone-verify", "lone-beam"])
def test_static_agrees_with_eager(target_dir: Path, kind: str) -> None:
    eager, static = runner(target_dir), runner(target_dir, static_shapes=True)
    got = [forward_static(static, batches(prefilled(static, [7, 12, 3]))[kind])]
    want = [eager.forward(s := batches(prefilled(eager, [7, 12, 3]))[kind], all_logits=[True] * len(s))]
    for x, y in zip(got[0], want[0], strict=True):
        torch.testing.assert_close(x, y, rtol=1e-4, atol=1e-4)
        assert torch.equal(x.argmax(-1), y.argmax(-1))


def test_buffers_keep_their_addresses_across_forwards(static_runner: ModelRunner) -> None:
    r = static_runner
    assert r.static is not None
    seqs = prefilled(r, [7, 12, 3])
    forward_static(r, batches(seqs)["decode"])
    grid = bucket_of(r, batches(seqs)["decode"])
    ptrs, n_grids = grid.data_ptrs(), len(r.static._grids)
    for s in seqs:
        r.cache.truncate(s, s.length + 1)
    forward_static(r, batches(seqs)["decode"])
    assert bucket_of(r, batches(seqs)["decode"]) is grid and len(r.static._grids) == n_grids
    assert grid.data_ptrs() == ptrs


def test_prefill_sized_forwards_stay_eager(static_runner: ModelRunner) -> None:
    r = static_runner
    assert r.static is not None
    seq = SequenceKV()
    seg = Segment(seq, 0, TokenTree.chain(list(range(2, 2 + r.static.max_rows + 1))))
    r.cache.ensure(seq, seg.kv_len)
    assert r.static.bucket(build_layout([seg], page_size=r.cache.page_size, device=r.device)) is None


def test_buckets_round_up() -> None:
    assert [round_up(x, (1, 2, 4, 8)) for x in (1, 3, 8, 9)] == [1, 4, 8, None]


@pytest.mark.parametrize("kind", ["decode", "verify"])
def test_captured_function_crosses_nothing(static_runner: ModelRunner, kind: str) -> None:
    """What a CUDA graph would hold (model, KV writes, grid attention) makes no host-device crossing."""
    r = static_runner
    segs = batches(prefilled(r, [7, 12, 3]))[kind]
    forward_static(r, segs)
    assert isinstance(r.static, StaticForward)
    grid = bucket_of(r, segs)
    with HostSync(forbid=True) as hs:
        r.static._function(grid)()
    assert not hs.counts


@pytest.mark.parametrize(("kind", "most"), [("decode", 2), ("verify", 4), ("beam", 4)])
def test_the_eager_part_of_a_static_forward_is_a_few_ops(static_runner: ModelRunner, kind: str, most: int) -> None:
    """Outside the function a graph captures, a static forward launches a few device ops (a kernel each on a GPU,
    each paid by the host before the replay): one copy of the bucket's integers, the tree cells where there are
    any (the last forward's cleared, this one's set), the logits rows; the mask is made inside the graph. On a
    GPU the layout's one host-to-device copy comes on top."""
    r = static_runner
    segs = batches(prefilled(r, [7, 12, 3]))[kind]
    forward_static(r, segs)  # the grid exists, and the forward below clears this one's cells first
    with OpCount([r.model]) as ops:
        forward_static(r, segs)
    assert ops.inside > 0
    assert ops.outside <= most, dict(ops.names)  # 10 (decode) and 11 before the mask moved inside


@pytest.mark.parametrize("static", [False, True])
@pytest.mark.parametrize("kind", ["decode", "verify", "beam"])
def test_a_forward_waits_on_nothing(target_dir: Path, static: bool, kind: str) -> None:
    """Eager or static, a decode-sized forward (planning included) makes one non-blocking copy and nothing
    the host waits on: no synchronize, no copy back, no data-dependent shape."""
    r = runner(target_dir, static_shapes=static)
    segs = batches(prefilled(r, [7, 12, 3]))[kind]
    for s in segs:
        r.cache.ensure(s.seq, s.kv_len)
    with HostSync(forbid=True) as hs:
        r.forward(segs, all_logits=[True] * len(segs))
    assert dict(hs.counts) == {"async_copy": 1}


# ---- on a GPU: the captured graphs (run with --with-gpu) ------------------------------------------------
def cuda_runner(path: Path, *, static: bool) -> ModelRunner:
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    from adaserve.engine.config import EngineConfig
    from adaserve.engine.loading.loader import load_model
    from adaserve.engine.model.kv_cache import KVCacheConfig

    cfg = EngineConfig(attention="torch", kv=KVCacheConfig(page_size=4, num_pages=2000), static_shapes=static)
    return ModelRunner(load_model(path, device=torch.device("cuda"), dtype=torch.float32), cfg)


@pytest.mark.gpu
@pytest.mark.parametrize("kind", ["decode", "verify", "beam"])
def test_graph_replay_agrees_with_eager_on_cuda(target_dir: Path, kind: str) -> None:
    static, eager = cuda_runner(target_dir, static=True), cuda_runner(target_dir, static=False)
    assert static.static is not None and static.static.graphs
    for _ in range(2):  # the first call captures, the second replays the captured graph
        segs = batches(prefilled(static, [7, 12, 3]))[kind]
        got = forward_static(static, segs)
        assert bucket_of(static, segs).graph is not None
        want_segs = batches(prefilled(eager, [7, 12, 3]))[kind]
        want = eager.forward(want_segs, all_logits=[True] * len(want_segs))
        for x, y in zip(got, want, strict=True):
            torch.testing.assert_close(x, y, rtol=1e-3, atol=1e-3)
            assert torch.equal(x.argmax(-1), y.argmax(-1))


@pytest.mark.gpu
@pytest.mark.parametrize("policy", ["incremental", "adaserve", "chain:3", "specinfer"])
def test_graphs_keep_greedy_output_on_cuda(target_dir: Path, draft_dir: Path, policy: str) -> None:
    from adaserve.engine.config import EngineConfig
    from adaserve.engine.engine import Engine
    from adaserve.engine.speculation.policies import make_policy
    from tests.engine.speculation.test_policies import mixed_workload

    outs = []
    for static in (False, True):
        config = EngineConfig(policy=policy, budget=20, prefill_chunk=24, static_shapes=static)
        drf = cuda_runner(draft_dir, static=static) if make_policy(policy, config).max_shape else None
        eng = Engine(cuda_runner(target_dir, static=static), drf, config)
        outs.append(outputs(eng, mixed_workload(12, 3)))
    assert outs[0] == outs[1]


# ---- a capture that runs out of memory: the bucket runs eagerly (the CUDA part mocked: no GPU here) ------------------
def test_a_bucket_whose_capture_runs_out_of_memory_runs_eagerly(target_dir: Path,
                                                                  monkeypatch: pytest.MonkeyPatch,
                                                                  caplog: pytest.LogCaptureFixture) -> None:
    """Graphs are captured lazily, after the KV cache took its share of the device. A capture that runs out of memory
    must not fail the forward: the bucket runs its function eagerly (the same logits), is not captured again, and the
    failure is recorded and logged once. ``capture`` stands in for CUDA's (it raises what the allocator raises), the
    only part mocked; the rest is the static path as a GPU takes it (``graphs`` on)."""
    static, eager = runner(target_dir, static_shapes=True), runner(target_dir)
    assert static.static is not None
    tries = captures_run_out_of_memory(static.static, monkeypatch)
    tried = []
    for _ in range(2):
        segs = batches(prefilled(static, [7, 12, 3]))["verify"]
        got = forward_static(static, segs)
        want_segs = batches(prefilled(eager, [7, 12, 3]))["verify"]
        want = eager.forward(want_segs, all_logits=[True] * len(want_segs))
        for x, y in zip(got, want, strict=True):
            torch.testing.assert_close(x, y)
        grid = bucket_of(static, segs)
        assert grid.eager and grid.graph is None
        tried.append(len(tries))
    # the prefill's bucket and the verification's: each tried once, neither again
    assert tried == [2, 2]
    assert len(static.static.capture_failures) == 2
    assert any(f"bucket {(grid.g, grid.q, grid.k)}: CUDA out of memory" in f for f in static.static.capture_failures)
    assert sum("ran out of memory" in r.getMessage() for r in caplog.records) == 2


def test_graphs_switched_off_run_every_bucket_eagerly(target_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """``graphs`` off after a bucket was captured (scripts/gpu-trace.py times eager against replay so) runs it eagerly:
    the captured graph is not replayed. ``capture`` stands in for CUDA's (no GPU here)."""
    static = runner(target_dir, static_shapes=True)
    assert static.static is not None
    replays: list[int] = []

    class Graph:
        def replay(self) -> None:
            replays.append(1)

    monkeypatch.setattr(static.static, "graphs", True)
    monkeypatch.setattr(static.static, "capture", lambda fn, pool=None: (Graph(), fn()))
    segs = batches(prefilled(static, [7, 12, 3]))["decode"]
    forward_static(static, segs)  # captured
    replays.clear()
    forward_static(static, segs)
    assert replays == [1]
    static.static.graphs = False
    got = forward_static(static, segs)
    assert replays == [1]  # not replayed: run eagerly
    eager = runner(target_dir)
    want_segs = batches(prefilled(eager, [7, 12, 3]))["decode"]
    for x, y in zip(got, eager.forward(want_segs, all_logits=[True] * 3), strict=True):
        torch.testing.assert_close(x, y)


def test_a_capture_failing_for_another_reason_still_raises(target_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Only running out of memory falls back: any other capture error is a bug to see, not to hide."""
    static = runner(target_dir, static_shapes=True)
    assert static.static is not None

    def capture(fn: object, pool: object = None) -> None:
        raise RuntimeError("operation not permitted when stream is capturing")

    segs = batches(prefilled(static, [7, 12, 3]))["decode"]  # prefilled before the captures are on
    monkeypatch.setattr(static.static, "graphs", True)
    monkeypatch.setattr(static.static, "capture", capture)
    with pytest.raises(RuntimeError, match="not permitted"):
        forward_static(static, segs)
    assert not static.static.capture_failures


def test_only_an_out_of_memory_raised_inside_the_capture_falls_back() -> None:
    """What the capture ran raising the OOM (torch's capture context then ends the capture cleanly) falls back; an error
    the capture's end raised itself, an OOM behind it or not, does not: the allocator's state after it is unknown."""
    from adaserve.engine.model.static import out_of_memory

    assert out_of_memory(torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB"))
    assert out_of_memory(RuntimeError("CUDA error: out of memory"))
    try:
        try:
            raise torch.OutOfMemoryError("CUDA out of memory")
        except torch.OutOfMemoryError:
            raise RuntimeError("CUDA error: operation failed due to a previous error during capture")  # noqa: B904
    except RuntimeError as e:
        assert not out_of_memory(e)
    assert not out_of_memory(RuntimeError("CUDA error: an illegal memory access was encountered"))
