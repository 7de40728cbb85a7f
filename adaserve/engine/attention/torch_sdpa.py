"""Reference backend: PyTorch scaled_dot_product_attention with a boolean mask (CPU and CUDA).

Ragged queries are scattered into a padded ``[B, Qmax]`` grid and keys gathered into ``[B, Kmax]``
from each request's slots; the layout's mask carries prefix, tree and padding structure.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from adaserve.engine.attention.base import write_kv
from adaserve.engine.batch import BatchLayout
from adaserve.engine.kv_cache import PagedKVCache


class TorchAttention:
    name = "torch"

    def __init__(self, *, head_dim: int, sliding_window: int | None = None) -> None:
        self.scale = head_dim**-0.5
        self.sliding_window = sliding_window
        self._layout: BatchLayout | None = None
        self._mask: torch.Tensor | None = None

    def plan(self, layout: BatchLayout, cache: PagedKVCache) -> None:
        self._layout = layout
        mask = layout.mask
        if self.sliding_window is not None:
            q_pos = torch.zeros(mask.shape[:2], dtype=torch.int64, device=mask.device)
            q_pos[layout.token_batch, layout.token_row] = layout.positions
            # a query at position p sees keys at positions > p - window (Mistral's convention)
            in_window = (q_pos[:, :, None] - layout.key_positions[:, None, :]) < self.sliding_window
            mask = mask & in_window
            mask[:, :, 0] |= ~mask.any(dim=-1)  # keep padded rows non-empty
        self._mask = mask[:, None]  # [B, 1, Qmax, Kmax]

    def forward(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                cache: PagedKVCache) -> torch.Tensor:
        lay = self._layout
        assert lay is not None and self._mask is not None, "plan() must run before forward()"
        write_kv(layer, k, v, cache, lay.write_slots)
        b, q_max = self._mask.shape[0], self._mask.shape[2]
        qp = q.new_zeros((b, q_max, *q.shape[1:]))
        qp[lay.token_batch, lay.token_row] = q
        kp = cache.k[layer][lay.key_slots].to(q.dtype)  # [B, Kmax, Hkv, D]
        vp = cache.v[layer][lay.key_slots].to(q.dtype)
        out = F.scaled_dot_product_attention(
            qp.transpose(1, 2), kp.transpose(1, 2), vp.transpose(1, 2),
            attn_mask=self._mask, scale=self.scale, enable_gqa=True,
        )  # [B, H, Qmax, D]
        return out.transpose(1, 2)[lay.token_batch, lay.token_row]
