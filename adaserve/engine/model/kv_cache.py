"""The paged KV cache the engine owns, and the page accounting that keeps it from leaking.

Storage is one tensor per K and V, ``[num_layers, (num_pages + 1) * page_size, kv_heads, head_dim]``: a
token's *slot* is ``page * page_size + offset``. Viewed per layer as ``[num_pages + 1, page_size, ...]``
it is the paged layout flashinfer reads. The last page is scratch, outside the accounting: padded rows of
a static-shape forward write their K/V there.

Accounting per sequence: ``length`` tokens hold committed KV; pages cover ``allocated`` >= length
slots. A verification step may write a whole tree past ``length``; afterwards the engine calls
``truncate`` to the committed length, which returns every page beyond it. Rejected tree nodes
therefore cannot keep pages alive.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import torch

from adaserve.engine.checks import at_least
from adaserve.engine.model.config import ModelConfig
from adaserve.engine.model.staging import HostStage


@dataclass(frozen=True)
class KVCacheConfig:
    """The paged KV cache of one model (kv_cache.py)."""

    page_size: int = 16  # tokens per page
    num_pages: int | None = None  # explicit size; else derived from memory_bytes
    memory_bytes: int = 256 * 2**20

    def __post_init__(self) -> None:
        at_least("KVCacheConfig", "page_size", self.page_size, 1)
        if self.num_pages is not None:
            at_least("KVCacheConfig", "num_pages", self.num_pages, 1)
        else:
            at_least("KVCacheConfig", "memory_bytes", self.memory_bytes, 1)


class OutOfPagesError(RuntimeError):
    """The cache has no free page for a write the scheduler allowed: an accounting bug upstream."""


@dataclass
class SequenceKV:
    """One request's view of the cache: its pages and how many leading slots hold committed KV."""

    pages: list[int] = field(default_factory=list)
    length: int = 0

    def slot(self, index: int, page_size: int) -> int:
        return self.pages[index // page_size] * page_size + index % page_size

    def slots(self, start: int, stop: int, page_size: int) -> np.ndarray:
        return self.slots_at(np.arange(start, stop), page_size)

    def slots_at(self, index: np.ndarray, page_size: int) -> np.ndarray:
        """Cache slots of token indices ``index`` (int64 array)."""
        return np.asarray(self.pages, np.int64)[index // page_size] * page_size + index % page_size


def bytes_per_token(model: ModelConfig, dtype: torch.dtype) -> int:
    """K and V of one token in every layer."""
    return 2 * model.num_layers * model.num_kv_heads * model.head_dim * dtype.itemsize


class PagedKVCache:
    def __init__(self, model: ModelConfig, cfg: KVCacheConfig, *, dtype: torch.dtype,
                 device: torch.device) -> None:
        self.page_size = cfg.page_size
        per_token = bytes_per_token(model, dtype)
        self.num_pages = cfg.num_pages or max(1, cfg.memory_bytes // (per_token * cfg.page_size))
        # one page past the accounted ones is scratch: padded rows of a static-shape forward write there
        # (static.py), and no sequence ever owns it
        self.scratch_page = self.num_pages
        shape = (model.num_layers, (self.num_pages + 1) * self.page_size, model.num_kv_heads, model.head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)
        self._free: list[int] = list(range(self.num_pages - 1, -1, -1))
        self.move_listeners: list[Callable[[np.ndarray, np.ndarray], None]] = []

    @property
    def scratch_slot(self) -> int:
        """A slot no sequence owns: where padding writes its K/V."""
        return self.scratch_page * self.page_size

    # ---- accounting -----------------------------------------------------------------------------
    @property
    def free_pages(self) -> int:
        return len(self._free)

    @property
    def capacity_tokens(self) -> int:
        return self.num_pages * self.page_size

    def pages_for(self, n_tokens: int) -> int:
        return -(-n_tokens // self.page_size)

    def ensure(self, seq: SequenceKV, n_tokens: int) -> None:
        """Allocate pages so that slots [0, n_tokens) exist for ``seq``."""
        need = self.pages_for(n_tokens) - len(seq.pages)
        if need > len(self._free):
            raise OutOfPagesError(f"need {need} pages, {len(self._free)} free")
        for _ in range(max(0, need)):
            seq.pages.append(self._free.pop())

    def truncate(self, seq: SequenceKV, n_tokens: int) -> None:
        """Keep slots [0, n_tokens) as committed; free every page past them."""
        if n_tokens > len(seq.pages) * self.page_size:
            raise ValueError("cannot commit more tokens than were allocated")
        seq.length = n_tokens
        keep = self.pages_for(n_tokens)
        while len(seq.pages) > keep:
            self._free.append(seq.pages.pop())

    def release(self, seq: SequenceKV) -> None:
        self.truncate(seq, 0)

    # ---- data movement --------------------------------------------------------------------------
    def move_slots(self, seq: SequenceKV, src: list[int], dst: list[int]) -> None:
        """Copy KV of token indices ``src`` to ``dst`` in every layer (used to compact accepted paths)."""
        self.move_many([(seq, src, dst)])

    def move_many(self, moves: list[tuple[SequenceKV, list[int], list[int]]]) -> None:
        """Every sequence's (src, dst) token moves in one gather/scatter over all layers.

        The gather reads every source before the scatter writes, so any order is safe; sequences own
        disjoint slots, so their moves never collide.
        """
        s_all, d_all = [], []
        for seq, src, dst in moves:
            if len(src) != len(dst):
                raise ValueError("src and dst must have the same length")
            if src == dst:  # nothing moves (a lone root, or a path along the first nodes)
                continue
            s, d = np.asarray(src, np.int64), np.asarray(dst, np.int64)
            keep = s != d
            if keep.any():
                s_all.append(seq.slots_at(s[keep], self.page_size))
                d_all.append(seq.slots_at(d[keep], self.page_size))
        if not s_all:
            return
        self.move_slot_arrays(np.concatenate(s_all), np.concatenate(d_all))

    def move_slot_arrays(self, src: np.ndarray, dst: np.ndarray) -> None:
        """Copy KV of cache slots ``src`` to ``dst`` (int64) in every layer; every listener hears of it first
        (a tensor-parallel rank 0 sends the move to the other ranks' shards, parallel.py)."""
        for listener in self.move_listeners:
            listener(src, dst)
        stage = HostStage(self.k.device)  # sources and destinations in one non-blocking copy
        stage.put("src", src)
        stage.put("dst", dst)
        s_idx, d_idx = stage.get("src"), stage.get("dst")
        self.k[:, d_idx] = self.k[:, s_idx]
        self.v[:, d_idx] = self.v[:, s_idx]
