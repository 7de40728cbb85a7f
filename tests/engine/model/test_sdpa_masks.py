"""The torch backend's cheaper masks change no bit (issue 35): on a CPU, SDPA without a mask equals SDPA with an
all-true one, and the additive 0 / -inf mask made once a forward equals the boolean mask SDPA converts in every
layer; a lone decode step, which runs without a mask, gives bitwise the logits of the masked forms."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from adaserve.engine.model.attention.torch_sdpa import TorchAttention
from adaserve.engine.model.batch import BatchLayout, Segment
from adaserve.engine.model.kv_cache import PagedKVCache, SequenceKV
from adaserve.engine.model.tree import TokenTree
from tests.engine.helpers import runner, use_cpu_kernels


@pytest.mark.parametrize("seed", range(4))
def test_cpu_sdpa_without_mask_equals_all_true_and_additive_masks(seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    for _ in range(20):
        g, q, k = (int(torch.randint(1, n, (), generator=gen)) for n in (4, 9, 700))
        query = torch.randn(g, 6, q, 32, generator=gen)
        key, value = (3 * torch.randn(g, 2, k, 32, generator=gen) for _ in range(2))
        every = torch.ones(g, 1, q, k, dtype=torch.bool)
        out = F.scaled_dot_product_attention(query, key, value, attn_mask=every, scale=0.2, enable_gqa=True)
        bare = F.scaled_dot_product_attention(query, key, value, scale=0.2, enable_gqa=True)
        zeros = F.scaled_dot_product_attention(query, key, value, attn_mask=torch.zeros(every.shape), scale=0.2,
                                               enable_gqa=True)
        assert torch.equal(out, bare) and torch.equal(out, zeros)
        some = torch.rand(g, 1, q, k, generator=gen) < 0.7
        some[..., 0] = True  # every row sees a key
        additive = torch.zeros(some.shape).masked_fill_(~some, float("-inf"))
        masked = [F.scaled_dot_product_attention(query, key, value, attn_mask=m, scale=0.2, enable_gqa=True)
                  for m in (some, additive)]
        assert torch.equal(*masked)


def _decode_logits(target_dir: Path, mask: str, monkeypatch: pytest.MonkeyPatch) -> tuple[torch.Tensor, list[bool]]:
    """Logits of a prefill chunk beside nothing, then of one lone decode step; ``mask``: ``fast`` (as served),
    ``additive`` (never the no-mask shortcut) or ``bool`` (the boolean mask straight to SDPA, as before). SDPA
    serves a float model where the CPU kernels are off (else their attention: CausalLM.attention_kernels)."""
    use_cpu_kernels("torch", monkeypatch)
    full: list[bool] = []
    fast = TorchAttention._mask

    def chosen(self: TorchAttention, j: int, q: torch.Tensor) -> torch.Tensor | None:
        g = self._groups[j]
        full.append(g.full)
        if mask == "bool":
            return g.mask
        if mask == "additive" and g.full:
            self._groups[j] = type(g)(g.tokens, g.rows, g.q_max, g.key_slots, g.mask, False)
        return fast(self, j, q)

    monkeypatch.setattr(TorchAttention, "_mask", chosen)
    r = runner(target_dir, page_size=4)
    seq, prompt = SequenceKV(), list(range(2, 21))
    prefill = r.forward([Segment(seq, 0, TokenTree.chain(prompt))], all_logits=[True])[0]
    step = r.forward([Segment(seq, len(prompt), TokenTree.chain([7]))], all_logits=[True])[0]
    monkeypatch.setattr(TorchAttention, "_mask", fast)
    return torch.cat([prefill, step]), full


def test_lone_decode_runs_without_a_mask_and_changes_no_bit(target_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    served, full = _decode_logits(target_dir, "fast", monkeypatch)
    assert True in full and False in full  # the decode step had no mask, the causal prefill had one
    for other in ("additive", "bool"):
        assert torch.equal(served, _decode_logits(target_dir, other, monkeypatch)[0])


def test_equal_segments_fill_the_grid_without_a_row_scatter(target_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Segments with as many new tokens as the grid has rows (equal chains, decode steps) plan no row index, and
    give bitwise the logits of the scattered grid (rows = every token in order), as planned before."""
    r = runner(target_dir, page_size=4)
    seqs = [SequenceKV() for _ in range(3)]
    for s, n in zip(seqs, (5, 9, 7), strict=True):  # contexts of different lengths
        r.forward([Segment(s, 0, TokenTree.chain(list(range(2, 2 + n))))], all_logits=[False])
        r.cache.truncate(s, n)
    segs = [Segment(s, s.length, TokenTree.chain([3, 4, 5])) for s in seqs]
    planned = TorchAttention.plan

    def scattered(self: TorchAttention, layout: BatchLayout, cache: PagedKVCache) -> None:
        planned(self, layout, cache)
        assert all(g.rows is None for g in self._groups)
        self._groups = [type(g)(g.tokens, torch.arange(g.key_slots.shape[0] * g.q_max), g.q_max, g.key_slots, g.mask,
                                g.full) for g in self._groups]

    served = r.forward_joined(segs, all_logits=[True] * 3)
    monkeypatch.setattr(TorchAttention, "plan", scattered)
    assert torch.equal(served, r.forward_joined(segs, all_logits=[True] * 3))


@pytest.mark.parametrize("kernels", ["torch", "native"])
def test_a_lone_segment_is_planned_as_any_group_of_one(kernels: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """``_plan_lone`` (verification, decode or a prompt chunk of one request) stages the arrays and builds the mask
    that ``_plan_groups`` makes for the same layout: chains and trees, cached nodes, pages out of order, the
    reference mask of docs/architecture.md §2 as the check on both; with the device's ops, and in host memory where
    the CPU kernels serve (``native``)."""
    import numpy as np

    use_cpu_kernels(kernels, monkeypatch)

    from adaserve.engine.model.batch import build_layout
    from tests.engine.model.test_batch_layout import PAGE, random_batch, reference_block

    rng = np.random.default_rng(29)
    plans = {"lone": TorchAttention._plan_lone, "groups": TorchAttention._plan_groups}
    seen = set()
    for _ in range(300):
        seg = random_batch(rng, max_tree=12)[0]
        got = {}
        for name, plan in plans.items():
            backend = TorchAttention(head_dim=32)
            layout = build_layout([seg], page_size=PAGE, device=torch.device("cpu"))
            plan(backend, layout)
            (g,) = backend._groups
            got[name] = (g.tokens, g.rows, g.q_max, g.key_slots, g.mask, g.full, backend._write_slots)
        (tok, rows, q, keys, mask, full, slots), other = got["lone"], got["groups"]
        assert tok is None and rows is None and other[0] is None and other[1] is None
        assert q == other[2] and full == other[5]
        for a, b in ((keys, other[3]), (mask, other[4]), (slots, other[6])):
            assert a.dtype == b.dtype and torch.equal(a, b)
        assert torch.equal(mask[0, 0], reference_block(seg, None))
        seen.add((seg.tree.is_chain, seg.num_cached > 0, full))
    assert len(seen) >= 5  # chains and trees, with and without cached nodes, a one-row chain that sees every key


def test_plan_takes_the_lone_path_for_one_segment_only(monkeypatch: pytest.MonkeyPatch) -> None:
    import numpy as np

    from adaserve.engine.model.batch import build_layout
    from tests.engine.model.test_batch_layout import PAGE, random_batch

    taken: list[str] = []
    monkeypatch.setattr(TorchAttention, "_plan_lone", lambda self, layout: taken.append("lone"))
    monkeypatch.setattr(TorchAttention, "_plan_groups", lambda self, layout: taken.append("groups"))
    rng = np.random.default_rng(3)
    one, many = random_batch(rng)[:1], random_batch(rng) * 2
    for backend, segs, want in ((TorchAttention(head_dim=32), one, "lone"),
                                (TorchAttention(head_dim=32, sliding_window=4), one, "groups"),
                                (TorchAttention(head_dim=32), many, "groups")):
        backend.plan(build_layout(segs, page_size=PAGE, device=torch.device("cpu")), None)
        assert taken.pop() == want
