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
    cache.k[layer].index_copy_(0, slots, k.to(cache.k.dtype))
    cache.v[layer].index_copy_(0, slots, v.to(cache.v.dtype))
