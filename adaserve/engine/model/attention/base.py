"""The contract every attention backend meets."""

from __future__ import annotations

from typing import Protocol

import torch

from adaserve.engine.model.batch import BatchLayout
from adaserve.engine.model.kv_cache import PagedKVCache


class AttentionBackend(Protocol):
    name: str

    def plan(self, layout: BatchLayout, cache: PagedKVCache) -> None:
        """Prepare per-step metadata once; every layer's ``forward`` reuses it."""

    def forward(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                cache: PagedKVCache) -> torch.Tensor:
        """Write the new tokens' k, v [T, Hkv, D] into the cache, attend, return [T, H, D]."""


def write_kv(layer: int, k: torch.Tensor, v: torch.Tensor, cache: PagedKVCache, slots: torch.Tensor) -> None:
    """KV of the new tokens goes in before attention, so a node attends to itself and its ancestors."""
    write_kv_into(cache.k[layer], cache.v[layer], k, v, slots)


def write_kv_into(k_cache: torch.Tensor, v_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                  slots: torch.Tensor) -> None:
    """``write_kv`` into one layer's cache tensors ``[slots, Hkv, D]``, for a backend that reads them again (one
    ``select`` a tensor fewer); a cast only where the dtypes differ (no call that would return k itself)."""
    k_cache.index_copy_(0, slots, k if k.dtype == k_cache.dtype else k.to(k_cache.dtype))
    v_cache.index_copy_(0, slots, v if v.dtype == v_cache.dtype else v.to(v_cache.dtype))
