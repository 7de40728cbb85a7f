"""The contract every attention backend meets."""

from __future__ import annotations

import math
from typing import Protocol

import torch
import torch.nn.functional as F

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


def sum_dtype(device: torch.device) -> torch.dtype | None:
    """The dtype SDPA sums in on ``device``: float64 on a CPU, the inputs' own elsewhere (None).

    Lossless verification needs a token's logits to be one function of its visible keys, whether the token is
    decoded alone or verified among other rows. Torch's CPU SDPA is not bitwise so: a row's sums follow the
    number of query rows, the padded keys and the thread split (~1e-7 of the output). Quantized layers round
    their input (to bfloat16 for torch's kernels, to int8 for the integer ones), which turns such a difference
    into a step of their rounding, and greedy outputs part: the default int4 model's plain and speculative
    answers differed on 4-6 of 16 batched chat prompts within 48 tokens (docs/benchmarks.md, "Row invariance").
    Summed in float64 and rounded back, a row's float32 output differs only where the float64 sum lies within
    ~1e-16 of a float32 rounding boundary: 0 of 16 there, on both kernel families."""
    return torch.float64 if device.type == "cpu" else None


def additive_mask(mask: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """A boolean mask as SDPA adds it, 0 / -inf, in the dtype ``grid_sdpa`` sums q's rows in (made once a forward
    and reused by every layer: SDPA would rebuild this very tensor from the boolean one in each)."""
    dtype = sum_dtype(q.device) or q.dtype
    return torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill_(~mask, -math.inf)


def grid_sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, bias: torch.Tensor | None,
              scale: float) -> torch.Tensor:
    """SDPA over ``[G, H, Q, D]`` grids (GQA), ``bias`` from ``additive_mask`` or None; q, k and v are cast to
    ``sum_dtype`` (q's own dtype on a GPU) here, once, and the output comes back in q's dtype."""
    dtype = sum_dtype(q.device) or q.dtype
    out = F.scaled_dot_product_attention(q.to(dtype), k.to(dtype), v.to(dtype), attn_mask=bias, scale=scale,
                                         enable_gqa=True)
    return out.to(q.dtype)
