"""The flashinfer backend computes what the torch backend computes.

CPU tests check the pure plan metadata (page table, flattened mask, sliding window, causal fast path)
against hand-computed values and against the torch backend's mask, and the backend's wiring (one plan
per forward, cache views, dtypes) through a torch stand-in for flashinfer's documented plan/run
semantics. GPU tests (``--with-gpu``, CUDA and flashinfer installed) compare the logits of both backends
on ragged batches of random trees, and the engine's greedy output end to end.
"""

from __future__ import annotations

import random
import sys
import types
from pathlib import Path

import numpy as np
import pytest
import torch

from adaserve.engine.config import EngineConfig
from adaserve.engine.engine import Engine
from adaserve.engine.loading.loader import load_model
from adaserve.engine.model.attention.flashinfer_paged import FlashInferAttention, plan_arrays
from adaserve.engine.model.attention.torch_sdpa import TorchAttention, group_segments
from adaserve.engine.model.batch import Segment, build_layout
from adaserve.engine.model.kv_cache import KVCacheConfig, SequenceKV
from adaserve.engine.model.runner import ModelRunner
from adaserve.engine.model.tree import TokenTree
from adaserve.engine.request import Request
from adaserve.engine.speculation.policies import make_policy
from adaserve.engine.speculation.sampling import SamplingParams
from tests.engine.model.test_tree_attention import random_tree
from tests.engine.test_greedy_generation import run_staggered
from tests.models import make_checkpoint

CPU = torch.device("cpu")
VOCAB = 97


# ---- CPU: plan metadata ------------------------------------------------------------------------
def tiny_batch() -> list[Segment]:
    # request 0: prefix 6, tree root -> {1, 2} (not a chain), nothing cached: kv_len 9 over 3 pages
    # request 1: prefix 1, chain of 3 with its root cached: kv_len 4, one page read of the two it owns
    a = Segment(SequenceKV(pages=[7, 2, 11]), 6, TokenTree.from_lists([5, 6, 7], [-1, 0, 0]))
    b = Segment(SequenceKV(pages=[5, 9]), 1, TokenTree.chain([8, 9, 10]), num_cached=1)
    return [a, b]


def test_plan_arrays_tiny_batch() -> None:
    layout = build_layout(tiny_batch(), page_size=4, device=CPU)
    arr = plan_arrays(layout, page_size=4)
    assert arr.qo_indptr.tolist() == [0, 3, 5]
    assert arr.kv_indptr.tolist() == [0, 3, 4]
    assert arr.kv_indices.tolist() == [7, 2, 11, 5]
    assert arr.kv_last_page_len.tolist() == [1, 4]
    for a in (arr.qo_indptr, arr.kv_indptr, arr.kv_indices, arr.kv_last_page_len):
        assert a.dtype == np.int32
    assert not arr.causal and arr.window_left == -1
    req0 = [[1, 1, 1, 1, 1, 1, 1, 0, 0],
            [1, 1, 1, 1, 1, 1, 1, 1, 0],
            [1, 1, 1, 1, 1, 1, 1, 0, 1]]
    req1 = [[1, 1, 1, 0],
            [1, 1, 1, 1]]
    expected = np.concatenate([np.ravel(req0), np.ravel(req1)]).astype(bool)
    assert arr.mask is not None and arr.mask.dtype == torch.bool
    assert arr.mask.tolist() == expected.tolist()

    # window 3 by position (depth): request 0 queries sit at 6, 7, 7; keys at 0..5, 6, 7, 7
    windowed = plan_arrays(layout, page_size=4, sliding_window=3)
    req0 = [[0, 0, 0, 0, 1, 1, 1, 0, 0],
            [0, 0, 0, 0, 0, 1, 1, 1, 0],
            [0, 0, 0, 0, 0, 1, 1, 0, 1]]
    req1 = [[1, 1, 1, 0],  # query at 2 sees keys at 0, 1, 2
            [0, 1, 1, 1]]  # query at 3 loses key 0
    expected = np.concatenate([np.ravel(req0), np.ravel(req1)]).astype(bool)
    assert windowed.mask is not None and windowed.mask.tolist() == expected.tolist()


def test_all_chains_use_causal_with_window_left() -> None:
    segs = [Segment(SequenceKV(pages=[3, 1]), 2, TokenTree.chain([4, 5, 6])),
            Segment(SequenceKV(pages=[0]), 3, TokenTree.root(7))]
    layout = build_layout(segs, page_size=4, device=CPU)
    arr = plan_arrays(layout, page_size=4, sliding_window=5)
    assert arr.causal and arr.mask is None and arr.window_left == 4
    assert arr.kv_indices.tolist() == [3, 1, 0] and arr.kv_last_page_len.tolist() == [1, 4]
    assert plan_arrays(layout, page_size=4).window_left == -1
    forced = plan_arrays(layout, page_size=4, sliding_window=5, allow_causal=False)
    assert not forced.causal and forced.mask is not None and forced.window_left == -1


@pytest.mark.parametrize("window", [None, 4])
def test_flat_mask_equals_torch_backend_mask(window: int | None) -> None:
    """For random ragged batches the flat mask is the torch backend's mask, request by request."""
    rng = np.random.default_rng(0)
    page_size = 4
    for _ in range(20):
        segs = []
        for _ in range(int(rng.integers(1, 5))):
            tree = random_tree(rng, int(rng.integers(1, 10)), VOCAB)
            prefix = int(rng.integers(0, 20))
            cached = int(rng.integers(0, tree.size))
            pages = rng.permutation(100)[: -(-(prefix + tree.size) // page_size)].tolist()
            segs.append(Segment(SequenceKV(pages=pages), prefix, tree, num_cached=cached))
        layout = build_layout(segs, page_size=page_size, device=CPU)
        arr = plan_arrays(layout, page_size, sliding_window=window, allow_causal=False)
        ref = TorchAttention(head_dim=8, sliding_window=window)
        ref.plan(layout, None)  # type: ignore[arg-type]  # the torch plan only reads the layout
        blocks: dict[int, torch.Tensor] = {}
        for g, members in zip(ref._groups, group_segments([s.num_new for s in segs]), strict=True):
            for j, b in enumerate(members):
                blocks[b] = g.mask[j, 0, : segs[b].num_new, : segs[b].kv_len].reshape(-1)
        assert sorted(blocks) == list(range(len(segs)))
        assert arr.mask is not None and torch.equal(arr.mask, torch.cat([blocks[b] for b in range(len(segs))]))
        for b, s in enumerate(segs):
            lo, hi = arr.kv_indptr[b], arr.kv_indptr[b + 1]
            assert arr.kv_indices[lo:hi].tolist() == s.seq.pages[: hi - lo]
            assert (hi - lo - 1) * page_size + arr.kv_last_page_len[b] == s.kv_len


# ---- CPU: the backend's wiring, against a stand-in with flashinfer's documented semantics --------
class StandInWrapper:
    """BatchPrefillWithPagedKVCacheWrapper's plan/run contract in plain torch (CPU, slow, exact).

    Semantics as documented and as in flashinfer's kernels (variants.cuh): query row i of request b
    has kv index kv_len - qo_len + i; causal keeps kv_idx <= that; window_left keeps
    kv_idx >= that - window_left; a custom mask is row-major [qo_len, kv_len] per request.
    """

    plans = 0

    def __init__(self, workspace: torch.Tensor, kv_layout: str = "NHD", backend: str = "auto") -> None:
        assert kv_layout == "NHD" and workspace.dtype == torch.uint8
        self.backend = backend

    def plan(self, qo_indptr: torch.Tensor, kv_indptr: torch.Tensor, kv_indices: torch.Tensor,
             last_page_len: torch.Tensor, num_qo_heads: int, num_kv_heads: int, head_dim: int, page_size: int,
             *, custom_mask: torch.Tensor | None = None, causal: bool = False, sm_scale: float | None = None,
             window_left: int = -1, q_data_type: torch.dtype = torch.float16,
             kv_data_type: torch.dtype | None = None) -> None:
        for t in (qo_indptr, kv_indptr, kv_indices, last_page_len):
            assert t.dtype == torch.int32
        assert custom_mask is None or (custom_mask.dtype == torch.bool and not causal and self.backend == "fa2")
        self.qo, self.kv_indptr, self.indices = qo_indptr.tolist(), kv_indptr.tolist(), kv_indices.tolist()
        self.kv_lens = [(self.kv_indptr[b + 1] - self.kv_indptr[b] - 1) * page_size + int(last)
                        for b, last in enumerate(last_page_len.tolist())]
        assert all(1 <= int(x) <= page_size for x in last_page_len)
        sizes = [(self.qo[b + 1] - self.qo[b]) * kv for b, kv in enumerate(self.kv_lens)]
        assert custom_mask is None or custom_mask.numel() == sum(sizes)
        self.mask, self.sizes, self.causal, self.window_left = custom_mask, sizes, causal, window_left
        self.scale, self.dtype, self.heads = sm_scale, q_data_type, (num_qo_heads, num_kv_heads, head_dim)
        StandInWrapper.plans += 1

    def run(self, q: torch.Tensor, paged_kv_cache: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        k_cache, v_cache = paged_kv_cache
        h, hkv, d = self.heads
        assert q.dtype == self.dtype and q.shape == (self.qo[-1], h, d) and q.is_contiguous()
        assert k_cache.dim() == 4 and k_cache.shape[2:] == (hkv, d)
        out = torch.empty_like(q)
        offset = 0
        for b, kv_len in enumerate(self.kv_lens):
            lo, hi = self.qo[b], self.qo[b + 1]
            pages = self.indices[self.kv_indptr[b] : self.kv_indptr[b + 1]]
            k = k_cache[pages].reshape(-1, hkv, d)[:kv_len]
            v = v_cache[pages].reshape(-1, hkv, d)[:kv_len]
            qo_len = hi - lo
            q_idx = torch.arange(qo_len)[:, None] + kv_len - qo_len
            kv_idx = torch.arange(kv_len)[None, :]
            if self.mask is not None:
                allowed = self.mask[offset : offset + self.sizes[b]].view(qo_len, kv_len)
            else:
                allowed = kv_idx <= q_idx if self.causal else torch.ones(qo_len, kv_len, dtype=torch.bool)
            if self.window_left >= 0:
                allowed = allowed & (kv_idx >= q_idx - self.window_left)
            offset += self.sizes[b]
            o = torch.nn.functional.scaled_dot_product_attention(
                q[lo:hi].transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), attn_mask=allowed,
                scale=self.scale, enable_gqa=True)
            out[lo:hi] = o.transpose(0, 1)
        return out


@pytest.fixture
def stand_in(monkeypatch: pytest.MonkeyPatch) -> type[StandInWrapper]:
    fake = types.ModuleType("flashinfer")
    fake.__version__ = "0.6.18"  # type: ignore[attr-defined]
    fake.BatchPrefillWithPagedKVCacheWrapper = StandInWrapper  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "flashinfer", fake)
    return StandInWrapper


@pytest.mark.parametrize("fast", [True, False])
@pytest.mark.parametrize("window", [None, 8])
def test_backend_wiring_with_stand_in(stand_in: type[StandInWrapper], tmp_path: Path, window: int | None,
                                      fast: bool) -> None:
    path = make_checkpoint(tmp_path / "m", "mistral", seed=2, sliding_window=window)
    ref = scenario(cpu_runner(path), seed=1)
    r = cpu_runner(path)
    r.backend = FlashInferAttention(r.model.cfg, device=CPU, workspace_bytes=16, causal_fast_path=fast)
    before = stand_in.plans
    got = scenario(r, seed=1)
    assert stand_in.plans - before == 5  # one plan per forward, reused by every layer
    assert len(got) == len(ref)
    for a, b in zip(got, ref, strict=True):
        assert (a - b).abs().max().item() <= 1e-4


def test_backend_without_flashinfer_says_so(monkeypatch: pytest.MonkeyPatch, target_dir: Path) -> None:
    monkeypatch.setitem(sys.modules, "flashinfer", None)  # import flashinfer -> ImportError
    with pytest.raises(ImportError, match="flashinfer"):
        FlashInferAttention(cpu_runner(target_dir).model.cfg, device=CPU)


# ---- GPU: logits parity with the torch backend ------------------------------------------------
# head_dim 64 (hidden 256 / 4 heads) and 128 (hidden 256 / 2 heads): head dims flashinfer ships kernels for
DIMS = {"d64-gqa2": dict(hidden_size=256, intermediate_size=256, num_attention_heads=4, num_key_value_heads=2),
        "d128-gqa2": dict(hidden_size=256, intermediate_size=256, num_attention_heads=2, num_key_value_heads=1)}
TOL = {torch.float16: 1e-2, torch.bfloat16: 3e-2}  # of the largest |logit|


def cpu_runner(path: Path, page_size: int = 4) -> ModelRunner:
    return ModelRunner(load_model(path, device=CPU),
                       EngineConfig(attention="torch", kv=KVCacheConfig(page_size=page_size, num_pages=2000)))


def cuda_device() -> torch.device:
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    pytest.importorskip("flashinfer")
    return torch.device("cuda")


@pytest.fixture(scope="module")
def gpu_ckpts(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("fi_ckpt")
    out = {name: make_checkpoint(root / name, "llama", seed=5, **dims) for name, dims in DIMS.items()}
    out["mistral-window"] = make_checkpoint(root / "mistral", "mistral", seed=6, sliding_window=8, **DIMS["d64-gqa2"])
    out["draft"] = make_checkpoint(root / "draft", "llama", seed=7, num_hidden_layers=1, **DIMS["d64-gqa2"])
    return out


def gpu_runner(path: Path, attention: str, dtype: torch.dtype, *, page_size: int = 4,
               causal_fast_path: bool = True) -> ModelRunner:
    device = cuda_device()
    r = ModelRunner(load_model(path, device=device, dtype=dtype),
                    EngineConfig(attention=attention, kv=KVCacheConfig(page_size=page_size, num_pages=2000)))
    if attention == "flashinfer":
        assert isinstance(r.backend, FlashInferAttention)
        if not causal_fast_path:
            r.backend = FlashInferAttention(r.model.cfg, device=device, causal_fast_path=False)
    return r


def scenario(r: ModelRunner, seed: int) -> list[torch.Tensor]:
    """Every kind of step the engine issues, on one runner; returns all logits in order.

    1. ragged prefill of prefixes 1, 6, 17, 33 (chains: the causal path), every position's logits;
    2. the first k nodes of a random tree per request (trees: the custom-mask path);
    3. the whole trees with those k nodes cached, batched with a fresh prompt's prefill chunk;
    4. after dropping the trees: a chain of 3, then the same chain grown to 7 with 3 cached (causal
       path with cached nodes, so the query rows are not the last keys of a plain prefill).
    """
    rng = np.random.default_rng(seed)
    out: list[torch.Tensor] = []
    prefixes = [rng.integers(2, VOCAB, n).tolist() for n in (1, 6, 17, 33)]
    seqs = [SequenceKV() for _ in prefixes]
    out += r.forward([Segment(s, 0, TokenTree.chain(p)) for s, p in zip(seqs, prefixes, strict=True)],
                     all_logits=[True] * len(seqs))
    for s, p in zip(seqs, prefixes, strict=True):
        r.cache.truncate(s, len(p))

    fulls = [random_tree(rng, 12, VOCAB) for _ in prefixes]
    ks = [int(rng.integers(1, 8)) for _ in prefixes]
    out += r.forward([Segment(s, len(p), t.subtree(range(k)))
                      for s, p, t, k in zip(seqs, prefixes, fulls, ks, strict=True)],
                     all_logits=[True] * len(seqs))
    fresh = SequenceKV()
    segs = [Segment(fresh, 0, TokenTree.chain(rng.integers(2, VOCAB, 20).tolist()))]
    segs += [Segment(s, len(p), t, num_cached=k) for s, p, t, k in zip(seqs, prefixes, fulls, ks, strict=True)]
    out += r.forward(segs, all_logits=[True] * len(segs))

    for s, p in zip(seqs, prefixes, strict=True):
        r.cache.truncate(s, len(p))
    chains = [TokenTree.chain(rng.integers(2, VOCAB, 7).tolist()) for _ in prefixes]
    out += r.forward([Segment(s, len(p), c.subtree(range(3))) for s, p, c in zip(seqs, prefixes, chains, strict=True)],
                     all_logits=[True] * len(seqs))
    out += r.forward([Segment(s, len(p), c, num_cached=3) for s, p, c in zip(seqs, prefixes, chains, strict=True)],
                     all_logits=[True] * len(seqs))
    return out


def assert_logits_close(got: list[torch.Tensor], ref: list[torch.Tensor], dtype: torch.dtype) -> None:
    assert len(got) == len(ref)
    for i, (a, b) in enumerate(zip(got, ref, strict=True)):
        assert a.shape == b.shape, i
        a32, b32 = a.float(), b.float()
        assert torch.isfinite(a32).all(), i
        scale = max(1.0, b32.abs().max().item())
        err = (a32 - b32).abs().max().item()
        assert err <= TOL[dtype] * scale, f"logits block {i}: max error {err:.4g} (scale {scale:.3g})"


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
@pytest.mark.parametrize("page_size", [4, 16])
@pytest.mark.parametrize("model", ["d64-gqa2", "d128-gqa2", "mistral-window"])
def test_flashinfer_logits_equal_torch(gpu_ckpts: dict[str, Path], model: str, page_size: int,
                                       dtype: torch.dtype) -> None:
    path = gpu_ckpts[model]
    ref = scenario(gpu_runner(path, "torch", dtype, page_size=page_size), seed=page_size)
    for fast in (True, False):  # chains through flashinfer's causal kernel, and through the custom mask
        fi = gpu_runner(path, "flashinfer", dtype, page_size=page_size, causal_fast_path=fast)
        assert_logits_close(scenario(fi, seed=page_size), ref, dtype)


@pytest.mark.gpu
def test_flashinfer_plans_the_expected_path(gpu_ckpts: dict[str, Path]) -> None:
    r = gpu_runner(gpu_ckpts["mistral-window"], "flashinfer", torch.float16)
    seq = SequenceKV()
    r.forward([Segment(seq, 0, TokenTree.chain(list(range(2, 30))))], all_logits=[False])
    plan = r.backend.last_plan
    assert plan.causal and plan.mask is None and plan.window_left == 7
    r.cache.truncate(seq, 28)
    r.forward([Segment(seq, 28, TokenTree.from_lists([3, 4, 5], [-1, 0, 0]))], all_logits=[True])
    plan = r.backend.last_plan
    assert not plan.causal and plan.window_left == -1 and plan.mask.numel() == 3 * 31


@pytest.mark.gpu
def test_flashinfer_growing_tree_with_cached_nodes(gpu_ckpts: dict[str, Path]) -> None:
    """Beam search's level-by-level writes: new nodes see cached earlier nodes only through the mask."""
    dtype = torch.float16
    logits = []
    for backend in ("torch", "flashinfer"):
        r = gpu_runner(gpu_ckpts["d64-gqa2"], backend, dtype)
        rng = np.random.default_rng(7)
        prefix = rng.integers(2, VOCAB, 9).tolist()
        seq = SequenceKV()
        r.forward([Segment(seq, 0, TokenTree.chain(prefix))], all_logits=[False])
        r.cache.truncate(seq, len(prefix))
        full = random_tree(rng, 10, VOCAB)
        got = [r.forward([Segment(seq, len(prefix), full.subtree(range(5)))], all_logits=[True])[0]]
        got += r.forward([Segment(seq, len(prefix), full, num_cached=5)], all_logits=[True])
        assert got[1].shape == (5, VOCAB)
        logits.append(got)
    assert_logits_close(logits[1], logits[0], dtype)


# ---- GPU: greedy end to end ---------------------------------------------------------------------
def workload(n: int, seed: int = 0) -> list[Request]:
    rng = random.Random(seed)
    return [Request(f"r{i}", [rng.randrange(2, VOCAB) for _ in range(rng.randrange(1, 40))],
                    SamplingParams(max_tokens=rng.randrange(1, 30), ignore_eos=True)) for i in range(n)]


def run_engine(ckpts: dict[str, Path], attention: str, policy: str, dtype: torch.dtype) -> dict[str, list[int]]:
    cfg = EngineConfig(policy=policy, budget=24, prefill_chunk=16)
    draft = gpu_runner(ckpts["draft"], attention, dtype) if make_policy(policy, cfg).max_shape is not None else None
    eng = Engine(gpu_runner(ckpts["d64-gqa2"], attention, dtype), draft, cfg)
    reqs = workload(10)
    run_staggered(eng, reqs)
    assert all(r.finish_reason == "length" for r in reqs)
    return {r.request_id: r.output_ids for r in reqs}


@pytest.mark.gpu
@pytest.mark.parametrize("policy", ["beam:4,2", "incremental"])
def test_engine_greedy_flashinfer_equals_torch(gpu_ckpts: dict[str, Path], policy: str) -> None:
    """Same tokens as the torch backend; half precision may flip a genuine near-tie, nothing more.

    At a first disagreement both engines have the same context, so the fp32 model must rate the two
    tokens (almost) equally there; a wrong mask or page table would disagree early and by far.
    """
    dtype = torch.float16
    ref = run_engine(gpu_ckpts, "torch", policy, dtype)
    got = run_engine(gpu_ckpts, "flashinfer", policy, dtype)
    oracle = None
    for rid, prompt in ((r.request_id, r.prompt_ids) for r in workload(10)):
        a, b = got[rid], ref[rid]
        assert len(a) == len(b)
        diff = next((i for i, (x, y) in enumerate(zip(a, b, strict=True)) if x != y), None)
        if diff is None:
            continue
        oracle = oracle or gpu_runner(gpu_ckpts["d64-gqa2"], "torch", torch.float32)
        seq = SequenceKV()
        lg = oracle.forward([Segment(seq, 0, TokenTree.chain(prompt + a[:diff]))], all_logits=[False])[0][0]
        oracle.cache.release(seq)
        gap = (lg[a[diff]] - lg[b[diff]]).abs().item()
        assert gap <= 0.02 * lg.abs().max().item(), f"{rid}: diverged at token {diff} with logit gap {gap:.3g}"
