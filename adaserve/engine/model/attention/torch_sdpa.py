"""Reference backend: PyTorch scaled_dot_product_attention with a boolean mask (CPU and CUDA).

Segments are grouped by their number of new tokens (``group_segments``): a 256-token prefill chunk does
not pad every decoding request's rows to 256. Per group, ragged queries are scattered into a padded
``[g, Qmax]`` grid, keys gathered into ``[g, Kmax]`` from each request's slots, and the mask (prefix,
tree and padding structure, ``masks.padded_mask``) is built on the device once per forward.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

from adaserve.engine.model.attention.base import write_kv
from adaserve.engine.model.attention.masks import MaskIndex, padded_mask
from adaserve.engine.model.batch import BatchLayout
from adaserve.engine.model.kv_cache import PagedKVCache

# A group with more query rows than this splits off segments with at most 1/SPLIT_RATIO of its rows:
# decoding trees (up to a few dozen nodes) share one SDPA call, a prefill chunk gets its own.
SPLIT_ROWS, SPLIT_RATIO = 32, 4


def group_segments(n_new: list[int]) -> list[list[int]]:
    """Segment indices in groups sharing one padded grid; each group in batch order, groups by size."""
    order = sorted(range(len(n_new)), key=lambda b: -n_new[b])
    groups: list[list[int]] = []
    for b in order:
        if groups and not (n_new[groups[-1][0]] > SPLIT_ROWS and n_new[b] * SPLIT_RATIO <= n_new[groups[-1][0]]):
            groups[-1].append(b)
        else:
            groups.append([b])
    return [sorted(g) for g in groups]


@dataclass(frozen=True)
class _Group:
    """One padded SDPA call: its segments' queries, keys and mask."""

    tokens: torch.Tensor | None  # [t] flat token indices of the group (None: all tokens, in order)
    rows: tuple[torch.Tensor, torch.Tensor] | None  # (segment, row) of each token in the grid; None: one segment
    q_max: int
    key_slots: torch.Tensor  # [g, Kmax] int64
    mask: torch.Tensor  # [g, 1, Qmax, Kmax] bool


class TorchAttention:
    name = "torch"

    def __init__(self, *, head_dim: int, sliding_window: int | None = None) -> None:
        self.scale = head_dim**-0.5
        self.sliding_window = sliding_window
        self._layout: BatchLayout | None = None
        self._groups: list[_Group] = []

    def plan(self, layout: BatchLayout, cache: PagedKVCache) -> None:
        """Every group's index arrays are staged on the host with the layout's, then sent in one copy."""
        stage = layout.stage
        MaskIndex.stage(layout)
        indptr = np.asarray(layout.qo_indptr)
        n_new = np.diff(indptr)
        kv_lens = np.asarray(layout.kv_lens, np.int64)
        groups = group_segments(n_new.tolist())
        shapes = []
        ps = layout.page_size
        for j, members in enumerate(groups):
            g = np.asarray(members)
            q_max, k_max = int(n_new[g].max()), int(kv_lens[g].max())
            every = len(groups) == 1 and len(members) == len(n_new)  # one group: tokens already in order
            # the group's flat token indices, segment by segment (issue 30: no arange per segment)
            seg_local = np.repeat(np.arange(len(members)), n_new[g])
            row = np.arange(len(seg_local)) - (np.cumsum(n_new[g]) - n_new[g])[seg_local]
            tok = indptr[g][seg_local] + row
            if len(members) > 1:
                stage.put(f"sdpa.{j}.seg", seg_local)
                stage.put(f"sdpa.{j}.row", row)
            # key index k of a segment lives in slot pages[k // page_size] * page_size + k % page_size;
            # padding keys repeat the last real one
            k_idx = np.minimum(np.arange(k_max)[None, :], kv_lens[g][:, None] - 1)
            pages = layout.page_table[g[:, None], k_idx // ps]
            stage.put(f"sdpa.{j}.key_slots", pages * ps + k_idx % ps)
            stage.put(f"sdpa.{j}.group", g)
            if not every:
                stage.put(f"sdpa.{j}.tok", tok)
            shapes.append((len(members), every, q_max, k_max))
        index = MaskIndex(layout)  # the first read: one copy of everything staged above
        self._groups = []
        for j, (size, every, q_max, k_max) in enumerate(shapes):
            rows = (stage.get(f"sdpa.{j}.seg"), stage.get(f"sdpa.{j}.row")) if size > 1 else None
            mask = padded_mask(index, stage.get(f"sdpa.{j}.group"), q_max, k_max, self.sliding_window)
            self._groups.append(_Group(None if every else stage.get(f"sdpa.{j}.tok"), rows, q_max,
                                       stage.get(f"sdpa.{j}.key_slots"), mask[:, None]))
        self._layout = layout

    def forward(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                cache: PagedKVCache) -> torch.Tensor:
        lay = self._layout
        assert lay is not None and self._groups, "plan() must run before forward()"
        write_kv(layer, k, v, cache, lay.write_slots)
        if len(self._groups) == 1 and self._groups[0].tokens is None:
            return self._attend(self._groups[0], q, layer, cache)
        out = q.new_empty(q.shape)
        for g in self._groups:
            assert g.tokens is not None
            out[g.tokens] = self._attend(g, q[g.tokens], layer, cache)
        return out

    def _attend(self, g: _Group, q: torch.Tensor, layer: int, cache: PagedKVCache) -> torch.Tensor:
        """q [t, H, D] of the group's tokens -> attention output [t, H, D]."""
        if g.rows is None:
            qp = q[None]  # one segment: its rows are the grid
        else:
            qp = q.new_zeros((g.key_slots.shape[0], g.q_max, *q.shape[1:]))
            qp[g.rows] = q
        kp = cache.k[layer][g.key_slots].to(q.dtype)  # [g, Kmax, Hkv, D]
        vp = cache.v[layer][g.key_slots].to(q.dtype)
        out = F.scaled_dot_product_attention(
            qp.transpose(1, 2), kp.transpose(1, 2), vp.transpose(1, 2),
            attn_mask=g.mask, scale=self.scale, enable_gqa=True,
        ).transpose(1, 2)  # [g, Qmax, H, D]
        return out[0] if g.rows is None else out[g.rows]
