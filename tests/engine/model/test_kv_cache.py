from __future__ import annotations

import pytest
import torch

from adaserve.engine.model.config import ModelConfig
from adaserve.engine.model.kv_cache import (
    KVCacheConfig,
    OutOfPagesError,
    PagedKVCache,
    SequenceKV,
    SharedPageWriteError,
)
from adaserve.engine.speculation.verify import commit_moves

CFG = ModelConfig(model_type="llama", vocab_size=10, hidden_size=8, intermediate_size=16, num_layers=2,
                  num_heads=2, num_kv_heads=1, head_dim=4, rms_norm_eps=1e-6, rope_theta=1e4,
                  max_position_embeddings=64, tie_word_embeddings=False)


def cache(pages: int = 8) -> PagedKVCache:
    return PagedKVCache(CFG, KVCacheConfig(page_size=4, num_pages=pages), dtype=torch.float32,
                        device=torch.device("cpu"))


def test_memory_budget_sizes_the_cache() -> None:
    c = PagedKVCache(CFG, KVCacheConfig(page_size=4, memory_bytes=2 * 2 * 1 * 4 * 4 * 4 * 10),
                     dtype=torch.float32, device=torch.device("cpu"))
    assert c.num_pages == 10


def test_ensure_truncate_release() -> None:
    c = cache()
    s = SequenceKV()
    c.ensure(s, 9)
    assert len(s.pages) == 3 and c.free_pages == 5
    c.truncate(s, 5)  # a rejected tree: pages past the committed length return
    assert len(s.pages) == 2 and s.length == 5 and c.free_pages == 6
    c.release(s)
    assert c.free_pages == 8 and s.pages == []
    with pytest.raises(OutOfPagesError):
        c.ensure(s, 33)
    with pytest.raises(ValueError):
        c.truncate(SequenceKV(), 1)


def test_commit_moves_compact_the_accepted_path() -> None:
    c = cache()
    s = SequenceKV()
    c.ensure(s, 12)
    for i in range(12):
        c.k[:, s.slot(i, 4)] = float(i)
    src, dst = commit_moves([0, 2, 5, 9], prefix_len=3)
    assert src == [3, 5, 8, 12] and dst == [3, 4, 5, 6]
    c.move_slots(s, [3, 5, 8, 11], [3, 4, 5, 6])
    got = [float(c.k[0, s.slot(i, 4)][0, 0]) for i in range(7)]
    assert got == [0, 1, 2, 3, 5, 8, 11]


def test_many_sequences_moves_are_each_tokens_own_copy() -> None:
    """``move_many`` over several sequences (scattered pages, moves across page boundaries, some not moving at all)
    leaves every layer's K and V as token-by-token copies from a snapshot would."""
    import random

    rng = random.Random(30)
    for _ in range(40):
        c = cache(pages=64)
        seqs, moves = [], []
        for _ in range(rng.randint(1, 4)):
            s = SequenceKV()
            c.ensure(s, rng.randint(4, 30))
            seqs.append(s)
        c.k.copy_(torch.randn_like(c.k))
        c.v.copy_(torch.randn_like(c.v))
        k0, v0 = c.k.clone(), c.v.clone()
        for s in seqs:
            n = len(s.pages) * 4
            start = rng.randint(0, n - 1)
            dst = list(range(start, start + rng.randint(0, (n - start) // 2)))
            src = sorted(rng.sample(range(start, n), len(dst))) if rng.random() < 0.8 else list(dst)
            moves.append((s, src, dst))
        c.move_many(moves)
        want_k, want_v = k0.clone(), v0.clone()
        for s, src, dst in moves:
            for a, b in zip(src, dst, strict=True):
                want_k[:, s.slot(b, 4)] = k0[:, s.slot(a, 4)]
                want_v[:, s.slot(b, 4)] = v0[:, s.slot(a, 4)]
        assert torch.equal(c.k, want_k) and torch.equal(c.v, want_v)
    with pytest.raises(ValueError, match="same length"):
        c.move_many([(seqs[0], [1, 2], [1])])


@pytest.mark.parametrize("bad", [dict(page_size=0), dict(num_pages=0), dict(memory_bytes=0)])
def test_config_validation(bad: dict) -> None:
    with pytest.raises(ValueError):
        KVCacheConfig(**bad)


# ---- prefix caching (issue 34) -------------------------------------------------------------------------
def caching(pages: int = 8) -> PagedKVCache:
    c = cache(pages)
    c.enable_prefix_caching(True)
    return c


def written(c: PagedKVCache, seq: SequenceKV, tokens: list[int]) -> None:
    """Commit ``tokens`` to ``seq`` as a prefill would: pages, a K/V value per token, then the truncate."""
    seq.tokens = lambda start: tokens[start:]
    c.ensure(seq, len(tokens))
    for i, t in enumerate(tokens):
        c.k[:, seq.slot(i, 4)] = float(t)
    c.truncate(seq, len(tokens))


def test_full_committed_pages_are_reused_and_the_partial_page_is_not() -> None:
    c = caching()
    a = SequenceKV()
    written(c, a, list(range(10)))  # pages [0..3] [4..7] full, [8, 9] partial
    assert c.cached_pages == 2 and len(a.keys) == 2
    b = SequenceKV()
    assert c.reuse_prefix(b, list(range(12)), limit=11) == 8
    assert b.pages == a.pages[:2] and b.length == 8
    assert [float(c.k[0, b.slot(i, 4)][0, 0]) for i in range(8)] == [float(i) for i in range(8)]
    assert c.free_pages == 8 - 3  # shared pages are held once
    # the limit is in tokens and only whole pages under it count: 7 tokens may reuse one page
    d = SequenceKV()
    assert c.reuse_prefix(d, list(range(8)), limit=7) == 4
    assert c.prefix_stats.queried_tokens == 20 and c.prefix_stats.hit_tokens == 12
    assert c.prefix_stats.hit_rate == pytest.approx(0.6)
    with pytest.raises(ValueError, match="empty"):
        c.reuse_prefix(d, [0], limit=1)


def test_released_pages_stay_cached_until_an_allocation_needs_them() -> None:
    c = caching(pages=4)
    a = SequenceKV()
    written(c, a, list(range(8)))
    c.release(a)
    assert c.free_pages == 4 and c.cached_pages == 2  # idle cached pages count as free
    b = SequenceKV()
    assert c.reuse_prefix(b, list(range(9)), limit=8) == 8
    c.release(b)
    other = SequenceKV()
    c.ensure(other, 12)  # two free pages, then the least recently used cached page: the prefix's end first
    assert c.prefix_stats.evictions == 1 and c.cached_pages == 1
    assert c.reuse_prefix(SequenceKV(), list(range(9)), limit=8) == 4
    with pytest.raises(OutOfPagesError):
        c.ensure(other, 20)


def test_release_keys_the_tokens_emitted_since_the_last_truncate() -> None:
    c = caching()
    toks = [5, 6, 7]
    a = SequenceKV(tokens=lambda start: toks[start:])
    c.ensure(a, 8)
    c.truncate(a, 8)  # KV for 8 tokens committed, only 3 known yet (the rest is being emitted)
    assert c.cached_pages == 0
    toks += [8, 9, 10, 11, 12]
    c.release(a)
    assert c.cached_pages == 2 and c.free_pages == 8


def test_a_move_into_a_shared_or_cached_page_is_refused() -> None:
    c = caching()
    a = SequenceKV()
    written(c, a, list(range(6)))  # page 0 keyed, page 1 partial
    c.ensure(a, 10)
    c.move_slots(a, [8, 9], [6, 7])  # past the committed length, in its own page: fine
    with pytest.raises(SharedPageWriteError):
        c.move_slots(a, [8], [2])
    c._refs[a.pages[1]] += 1  # page 1 as if another sequence held it too (unkeyed: only its count refuses)
    with pytest.raises(SharedPageWriteError, match=r"\[1\]"):
        c.move_slots(a, [8, 9], [6, 7])
    c._refs[a.pages[1]] -= 1
    c.move_slots(a, [8, 9], [6, 7])


def test_disabling_frees_the_idle_pages_and_forgets_every_key() -> None:
    c = caching()
    a = SequenceKV()
    written(c, a, list(range(8)))
    c.release(a)
    c.enable_prefix_caching(False)
    assert c.free_pages == 8 and c.cached_pages == 0 and c.prefix is None
    assert c.reuse_prefix(SequenceKV(), list(range(8)), limit=7) == 0


def test_slots_of_a_range_are_the_array_lookups() -> None:
    """``SequenceKV.slots`` computes a short range one token at a time and a long one from its pages' slots
    (``page_slots``, no division): both the same slots, in the same dtype, as the division's array lookup, and the
    same error past the sequence's pages."""
    import numpy as np

    from adaserve.engine.model.kv_cache import SHORT_SLOTS

    rng = np.random.default_rng(4)
    for _ in range(400):
        ps = int(rng.integers(1, 9))
        seq = SequenceKV(pages=rng.permutation(200)[: int(rng.integers(1, 60))].tolist())
        start = int(rng.integers(0, len(seq.pages) * ps))
        stop = int(rng.integers(start, min(len(seq.pages) * ps, start + rng.choice([2 * SHORT_SLOTS, 400])) + 1))
        got = seq.slots(start, stop, ps)
        index = np.arange(start, stop)  # the definition: page index // P, offset index % P
        want = np.asarray(seq.pages, np.int64)[index // ps] * ps + index % ps
        assert got.dtype == want.dtype == np.int64 and np.array_equal(got, want), (ps, start, stop)
    seq = SequenceKV(pages=[3, 1])
    for start, stop in ((0, 5), (0, 5 + 2 * SHORT_SLOTS), (3, 5 + 2 * SHORT_SLOTS)):  # past 2 pages of 2 slots
        with pytest.raises(IndexError):
            seq.slots(start, stop, 2)


def test_page_slots_and_grid_key_slots_are_the_divisions() -> None:
    """``page_slots`` lays out key index i's slot ``pages[i // P] * P + i % P`` for every key its pages cover, and
    ``grid_key_slots`` gives each row its keys' slots up to its length and its last key's slot after it, wider
    than its pages or not (a static bucket's K), as the division's formula does."""
    import numpy as np

    from adaserve.engine.model.batch import grid_key_slots, page_table
    from adaserve.engine.model.kv_cache import page_slots

    rng = np.random.default_rng(7)
    for _ in range(200):
        ps = int(rng.integers(1, 17))
        b = int(rng.integers(1, 6))
        kv_lens = rng.integers(1, 90, b)
        pages = [rng.permutation(500)[: -(-int(n) // ps) + int(rng.integers(0, 3))].tolist() for n in kv_lens]
        table = page_table(pages, kv_lens, ps)
        flat = page_slots(table, ps)
        assert flat.shape == (b, table.shape[1] * ps) and flat.dtype == np.int64
        i = np.arange(flat.shape[1])
        assert np.array_equal(flat, table[:, i // ps] * ps + i % ps)
        k = int(kv_lens.max()) + int(rng.integers(0, 40))  # past every row's pages, sometimes
        k_idx = np.minimum(np.arange(k)[None, :], kv_lens[:, None] - 1)
        want = np.take_along_axis(table, k_idx // ps, 1) * ps + k_idx % ps
        got = grid_key_slots(table, kv_lens, k, ps)
        assert got.dtype == np.int64 and np.array_equal(got, want), (ps, kv_lens, k)
        assert np.array_equal(page_slots(table[0], ps), flat[0])  # one sequence's pages: a 1-D layout
