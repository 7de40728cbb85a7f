"""GPU backend: flashinfer batch prefill over the paged KV cache, with a custom mask for trees.

One ``plan`` per forward turns the :class:`BatchLayout` into flashinfer's page table (per request: the
pages covering its ``kv_len`` keys, and how full the last one is) and a flattened boolean mask, one
row-major ``[num_new, kv_len]`` block per request: ``[prefix all true | ancestor rows]``, with the
sliding window (if any) folded in by *position* (depth), exactly as the torch backend does. Every
layer's ``forward`` writes its new K/V, then runs the planned kernel on that layer's cache viewed as
``[num_pages, page_size, kv_heads, head_dim]`` (flashinfer's NHD paged layout).

When every segment of a step is a chain (prefill chunks, plain decoding) the mask is exactly
flashinfer's causal mask, positions equal key indices, and the window is flashinfer's own
``window_left`` = ``window - 1``: that step runs the mask-free causal kernel instead (FA3 on Hopper).

Mask handling: the flat boolean mask is handed to ``plan(custom_mask=...)``, which packs it per
request with flashinfer's ``segment_packbits`` (little bit order) and derives the per-request byte
offsets itself. We deliberately do not pass ``packed_custom_mask``: up to at least 0.6.x, ``plan``
then keeps the *unpacked* (bit) offsets as the per-request byte offsets (flashinfer PR #2201), which
is wrong for every request after the first.

Targets flashinfer >= 0.2.0 (``plan``/``run`` API). The arguments used exist, with these names, from
0.2.0 through 0.6.x: the first eight ``plan`` arguments positionally (the head-dim argument was
renamed ``head_dim`` -> ``head_dim_qk`` in 0.2.3), then ``custom_mask``, ``causal``, ``sm_scale``,
``window_left``, ``q_data_type`` and ``kv_data_type`` by keyword; ``run(q, (k_cache, v_cache))``.
flashinfer is imported only when the backend is built, so this module imports without it.
"""

from __future__ import annotations

import re
import warnings
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from adaserve.engine.model.attention.base import write_kv
from adaserve.engine.model.attention.masks import MaskIndex, flat_mask
from adaserve.engine.model.batch import BatchLayout
from adaserve.engine.model.config import ModelConfig
from adaserve.engine.model.kv_cache import PagedKVCache

WORKSPACE_BYTES = 128 * 2**20  # flashinfer's recommended float workspace (split-kv partial results)
MIN_VERSION = (0, 2, 0)  # plan()/run() API
# Before 0.2.6 the custom-mask kernel read mask bits for tile rows/columns past qo_len/kv_len
# (flashinfer issue #1005, fixed by #1008): an out-of-bounds read at the end of the packed mask.
MASK_BOUNDS_FIX_VERSION = (0, 2, 6)


# ---- pure metadata (no flashinfer; runs on CPU) -------------------------------------------------
@dataclass(frozen=True)
class PlanArrays:
    """What ``plan`` hands flashinfer for one step."""

    qo_indptr: np.ndarray  # [B+1] int32: request b owns query rows qo_indptr[b]:qo_indptr[b+1]
    kv_indptr: np.ndarray  # [B+1] int32: request b owns kv_indices[kv_indptr[b]:kv_indptr[b+1]]
    kv_indices: np.ndarray  # [kv_indptr[-1]] int32: page ids covering each request's kv_len keys
    kv_last_page_len: np.ndarray  # [B] int32, in [1, page_size]
    causal: bool  # True: every segment is a chain and flashinfer's causal mask is exact
    window_left: int  # -1, or window - 1 (only with ``causal``; the custom mask carries it otherwise)
    mask: torch.Tensor | None  # flat bool [sum_b num_new_b * kv_len_b] on the layout's device, or None


def page_table(layout: BatchLayout) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(kv_indptr, kv_indices, kv_last_page_len): the first ceil(kv_len / page_size) pages of each sequence.

    A sequence may own more pages than this step reads (allocation runs ahead); those are not listed.
    """
    kv_lens = np.asarray(layout.kv_lens, np.int64)
    n_pages = -(-kv_lens // layout.page_size)
    indptr = np.concatenate([[0], np.cumsum(n_pages)])
    listed = np.arange(layout.page_table.shape[1])[None, :] < n_pages[:, None]
    indices = layout.page_table[listed]  # row-major: each request's pages in order
    last = kv_lens - (n_pages - 1) * layout.page_size
    return indptr.astype(np.int32), indices.astype(np.int32), last.astype(np.int32)


def plan_arrays(layout: BatchLayout, page_size: int, *, sliding_window: int | None = None,
                allow_causal: bool = True) -> PlanArrays:
    """Everything flashinfer's ``plan`` needs for ``layout``; pure numpy/torch, no flashinfer."""
    if page_size != layout.page_size:
        raise ValueError(f"layout built for page size {layout.page_size}, cache pages hold {page_size}")
    kv_indptr, kv_indices, last = page_table(layout)
    causal = allow_causal and layout.all_chains
    if causal:
        # chain: query j sits at key index kv_len - num_new + j == its position, so flashinfer's
        # "kv_idx >= q_idx - window_left" equals the torch rule "q_pos - k_pos < window"
        window_left = sliding_window - 1 if sliding_window is not None else -1
        mask = None
    else:
        window_left, mask = -1, flat_mask(MaskIndex(layout, layout.input_ids.device), sliding_window)
    return PlanArrays(
        qo_indptr=np.asarray(layout.qo_indptr, np.int32),
        kv_indptr=kv_indptr,
        kv_indices=kv_indices,
        kv_last_page_len=last,
        causal=causal,
        window_left=window_left,
        mask=mask,
    )


# ---- the backend --------------------------------------------------------------------------------
def _version_tuple(version: str) -> tuple[int, ...]:
    return tuple(int(x) for x in re.findall(r"\d+", version.split("+")[0])[:3])


def _import_flashinfer() -> Any:
    try:
        import flashinfer
    except ImportError as e:
        raise ImportError("the flashinfer attention backend needs the flashinfer package "
                          "(install the 'gpu' extra: flashinfer-python)") from e
    version = str(getattr(flashinfer, "__version__", "0"))
    wrapper = getattr(flashinfer, "BatchPrefillWithPagedKVCacheWrapper", None)
    if wrapper is None or not hasattr(wrapper, "plan") or _version_tuple(version) < MIN_VERSION:
        raise RuntimeError(f"flashinfer {version} is too old: the backend needs >= 0.2.0 (plan()/run() API)")
    if _version_tuple(version) < MASK_BOUNDS_FIX_VERSION:
        warnings.warn(f"flashinfer {version} < 0.2.6 may read past the custom mask (flashinfer issue #1005); "
                      "upgrade if tree verification faults", RuntimeWarning, stacklevel=3)
    return flashinfer


class FlashInferAttention:
    name = "flashinfer"

    def __init__(self, cfg: ModelConfig, *, device: torch.device, workspace_bytes: int = WORKSPACE_BYTES,
                 causal_fast_path: bool = True) -> None:
        fi = _import_flashinfer()  # make_backend has already refused non-CUDA devices
        self.device = torch.device(device)
        self.num_qo_heads = cfg.num_heads
        self.num_kv_heads = cfg.num_kv_heads
        self.head_dim = cfg.head_dim
        self.sliding_window = cfg.sliding_window
        self.scale = cfg.head_dim**-0.5
        self.causal_fast_path = causal_fast_path
        # One float workspace, allocated once and shared by both wrappers: a step plans and runs only
        # one of them, and every run follows its own plan, so they never hold live data at once.
        self._workspace = torch.zeros(workspace_bytes, dtype=torch.uint8, device=device)
        # Two wrappers because a wrapper built with backend="auto" fixes its kernel family at its first
        # plan (FA3 on Hopper for causal, which has no custom mask), and because flashinfer < 0.2.6
        # kept a previous plan's mask buffer alive on a later mask-free plan (and ran it as custom).
        self._causal = fi.BatchPrefillWithPagedKVCacheWrapper(self._workspace, "NHD")
        self._masked = fi.BatchPrefillWithPagedKVCacheWrapper(self._workspace, "NHD", backend="fa2")
        self._wrapper: Any = None
        self._write_slots: torch.Tensor | None = None
        self._dtype: torch.dtype | None = None
        self.last_plan: PlanArrays | None = None  # for inspection and tests

    def plan(self, layout: BatchLayout, cache: PagedKVCache) -> None:
        arr = plan_arrays(layout, cache.page_size, sliding_window=self.sliding_window,
                          allow_causal=self.causal_fast_path)

        def dev_i32(x: np.ndarray) -> torch.Tensor:
            # on the device: old flashinfer packs the mask with indptrs taken from qo_indptr's device
            return torch.as_tensor(x, dtype=torch.int32, device=self.device)

        kwargs: dict[str, Any] = dict(causal=arr.causal, sm_scale=self.scale, window_left=arr.window_left,
                                      q_data_type=cache.k.dtype, kv_data_type=cache.k.dtype)
        if arr.mask is None:
            wrapper = self._causal
        else:
            wrapper = self._masked
            kwargs["custom_mask"] = arr.mask.to(self.device)
        wrapper.plan(dev_i32(arr.qo_indptr), dev_i32(arr.kv_indptr), dev_i32(arr.kv_indices),
                     dev_i32(arr.kv_last_page_len), self.num_qo_heads, self.num_kv_heads, self.head_dim,
                     cache.page_size, **kwargs)
        self._wrapper = wrapper
        self._write_slots = layout.write_slots
        self._dtype = cache.k.dtype
        self.last_plan = arr

    def forward(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                cache: PagedKVCache) -> torch.Tensor:
        assert self._wrapper is not None and self._write_slots is not None, "plan() must run before forward()"
        write_kv(layer, k, v, cache, self._write_slots)
        paged = (cache.k.shape[1] // cache.page_size, cache.page_size, self.num_kv_heads, self.head_dim)  # + scratch
        kv = (cache.k[layer].view(paged), cache.v[layer].view(paged))
        out = self._wrapper.run(q.to(self._dtype).contiguous(), kv)  # [T, H, D]
        return out.to(q.dtype)
