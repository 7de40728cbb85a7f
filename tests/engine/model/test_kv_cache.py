from __future__ import annotations

import pytest
import torch

from adaserve.engine.model.config import ModelConfig
from adaserve.engine.model.kv_cache import KVCacheConfig, OutOfPagesError, PagedKVCache, SequenceKV
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


@pytest.mark.parametrize("bad", [dict(page_size=0), dict(num_pages=0), dict(memory_bytes=0)])
def test_config_validation(bad: dict) -> None:
    with pytest.raises(ValueError):
        KVCacheConfig(**bad)
