"""Reference backend: PyTorch scaled_dot_product_attention with a boolean mask (CPU and CUDA).

Segments are grouped by their number of new tokens (``group_segments``): a 256-token prefill chunk does
not pad every decoding request's rows to 256. Per group, ragged queries are scattered into a padded
``[g, Qmax]`` grid, keys gathered into ``[g, Kmax]`` from each request's slots, and the mask (prefix,
tree and padding structure, ``masks.grid_mask``) is built on the device once per forward, from bounds
and cells staged with the layout: a few ops, whatever the batch.

Per layer the work is kept to what the layer needs (issue 35: a lone decode step of a small model is bound by
its op count on a CPU): the mask goes to SDPA in the additive form SDPA would otherwise rebuild from the
boolean one in every layer, made once a forward; a group whose every row sees every key (a lone decode step)
runs without one on a CPU; keys and values are gathered by ``index_select``. None of it changes a bit
(tests/engine/model/test_sdpa_masks.py).

A lone segment on a CPU whose kernels serve (``native_kernels.chosen``, read at each plan as everywhere) gets its
mask made in host memory instead, by numpy, from the tree's ancestor matrix: its prefix columns, then the rows of
its new nodes (issue 30: two slice copies where the device takes the cells' arithmetic, two more staged arrays and
two ops); the same bits (tests/engine/model/test_sdpa_masks.py).

A model served on the integer kernels (``native``, native_kernels.py) attends with their ``attend`` instead: the
same grid, keys read straight from the cache by slot, each row a function of the keys it sees alone (no float64
sums needed for that), one call a layer where SDPA takes casts, a gather and its own set-up.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np
import torch

from adaserve.engine.model import native_kernels
from adaserve.engine.model.attention.base import additive_mask, grid_sdpa, sum_dtype, write_kv_into
from adaserve.engine.model.attention.masks import fill_grid_mask, grid_mask, lone_tree_cells
from adaserve.engine.model.batch import BatchLayout, grid_key_slots
from adaserve.engine.model.kv_cache import PagedKVCache, page_slots
from adaserve.engine.model.native_kernels import NativeKernels

# A group with more query rows than this splits off segments with at most 1/SPLIT_RATIO of its rows:
# decoding trees (up to a few dozen nodes) share one SDPA call, a prefill chunk gets its own.
SPLIT_ROWS, SPLIT_RATIO = 32, 4


def group_segments(n_new: list[int]) -> list[list[int]]:
    """Segment indices in groups sharing one padded grid; each group in batch order, groups by size."""
    if n_new and min(n_new) == max(n_new):  # every segment alike (decode steps, equal chains): one group, no sort
        return [list(range(len(n_new)))]
    order = sorted(range(len(n_new)), key=lambda b: -n_new[b])
    groups: list[list[int]] = []
    for b in order:
        if groups and not (n_new[groups[-1][0]] > SPLIT_ROWS and n_new[b] * SPLIT_RATIO <= n_new[groups[-1][0]]):
            groups[-1].append(b)
        else:
            groups.append([b])
    return [sorted(g) for g in groups]


class _Group(NamedTuple):
    """One padded SDPA call: its segments' queries, keys and mask (a named tuple: planned every forward)."""

    tokens: torch.Tensor | None  # [t] flat token indices of the group (None: all tokens, in order)
    rows: torch.Tensor | None  # [t] flat grid row (segment * Qmax + row) of each token; None: the tokens fill
    # the grid in order (one segment, or every segment with Qmax new tokens: beam levels)
    q_max: int
    key_slots: torch.Tensor  # [g, Kmax] int64
    mask: torch.Tensor  # [g, 1, Qmax, Kmax] bool
    full: bool = False  # every cell of the mask is true (known on the host): SDPA runs without one


class TorchAttention:
    name = "torch"

    def __init__(self, *, head_dim: int, sliding_window: int | None = None,
                 native: NativeKernels | None = None) -> None:
        self.scale = head_dim**-0.5
        self.sliding_window = sliding_window
        self.native = native  # the integer kernels' attention (module docstring), or None for SDPA
        self._write_slots: torch.Tensor | None = None  # [T] the planned forward's cache slots for its K/V
        self._groups: list[_Group] = []
        self._cols: torch.Tensor | None = None  # arange(Kmax) on the device, grown as needed
        self._cols_at, self._cols_len = torch.device("cpu"), 0  # its device and length (no tensor read per forward)
        self._additive: list[torch.Tensor | None] = []  # per group: its mask as SDPA's 0 / -inf, once a forward

    def plan(self, layout: BatchLayout, cache: PagedKVCache) -> None:
        """Every group's index arrays and mask bounds (``masks.grid_mask``) are staged on the host with the
        layout's, then sent in one copy; the masks take a few device ops each (issue 30). A lone segment (one
        request's verification, decode step or prompt chunk) without a sliding window: ``_plan_lone``."""
        if (len(layout.segments) == 1 and self.sliding_window is None
                and not (layout.ids is None and "mask.anc" in layout.stage)):
            self._plan_lone(layout)
        else:
            self._plan_groups(layout)

    def _plan_lone(self, layout: BatchLayout) -> None:
        """``_plan_groups``' one group for a lone segment, without the batch's bookkeeping (issue 30: at one
        request it was a fifth of the verification's host time). L prefix, c cached nodes, M tree nodes:

            Q = M - c rows, the tokens in order     K = L + M keys: key k is key index k (no padding key)
            hi[r] = L + c + r + 1 (a chain sees its own nodes through the bound), L (a tree)
            cells (r, L + j) for every true anc[c + r, j] of a tree (``masks.grid_mask``'s, for one member)

        The same arrays as ``_plan_groups`` (tests/engine/model/test_sdpa_masks.py)."""
        seg, stage, ps = layout.segments[0], layout.stage, layout.page_size
        tree, c, prefix = seg.tree, seg.num_cached, seg.prefix_len
        q_max, k_max = tree.size - c, prefix + tree.size
        stage.put("sdpa.0.key_slots", page_slots(layout.page_table[0], ps)[:k_max].reshape(1, k_max))
        if layout.device.type == "cpu" and native_kernels.chosen() is not None:  # the mask in host memory
            grid = np.zeros((1, q_max, k_max), bool)
            grid[0, :, :prefix] = True  # every row sees the prefix,
            grid[0, :, prefix:] = tree.ancestor_matrix()[c:]  # and its node's ancestors and itself (a chain's: <=)
            self._groups = [_Group(None, None, q_max, stage.get("sdpa.0.key_slots"),
                                   torch.from_numpy(grid[:, None]), tree.is_chain and q_max == 1)]
            self._additive = [None]
            self._write_slots = layout.write_slots
            return
        if tree.is_chain:
            hi, cells = np.arange(prefix + c + 1, k_max + 1), None
        else:
            hi = np.full(q_max, prefix, np.int64)
            cells = lone_tree_cells(seg, k_max)
            stage.put("sdpa.0.cells", cells)
        stage.put("sdpa.0.hi", hi.reshape(1, q_max, 1))
        full = cells is None and q_max == 1  # a chain's rows see every key only if it has one
        mask = fill_grid_mask(self.columns(k_max, layout.device), stage.get("sdpa.0.hi"), None,
                              None if cells is None else stage.get("sdpa.0.cells"), None)
        self._groups = [_Group(None, None, q_max, stage.get("sdpa.0.key_slots"), mask.unsqueeze(1), full)]
        self._additive = [None]
        self._write_slots = layout.write_slots

    def _plan_groups(self, layout: BatchLayout) -> None:
        """``plan`` for any layout: its segments in groups (``group_segments``), one padded grid each."""
        stage = layout.stage
        indptr = np.asarray(layout.qo_indptr)
        n_new = np.diff(indptr)
        kv_lens = np.asarray(layout.kv_lens, np.int64)
        groups = group_segments(n_new.tolist())
        # beam levels: the trees' ancestor rows are on the device already (batch.DeviceNodes)
        device_rows = layout.ids is None and "mask.anc" in stage
        shapes = []
        ps = layout.page_size
        for j, members in enumerate(groups):
            g = np.asarray(members)
            # the reductions' C forms (ufuncs), not the methods' Python layer (issue 30)
            q_max, k_max = int(np.maximum.reduce(n_new[g])), int(np.maximum.reduce(kv_lens[g]))
            every = len(groups) == 1 and len(members) == len(n_new)  # one group: tokens already in order
            # every member has Qmax new tokens (equal chains, decode steps): its tokens fill the grid in order, so
            # no row index, and the forward views q as the grid instead of scattering it in every layer
            uniform = bool(np.logical_and.reduce(n_new[g] == q_max))
            if not every or (len(members) > 1 and not uniform):
                # the group's flat token indices, segment by segment (issue 30: no arange per segment)
                seg_local = np.repeat(np.arange(len(members)), n_new[g])
                row = np.arange(len(seg_local)) - (np.cumsum(n_new[g]) - n_new[g])[seg_local]
                if len(members) > 1 and not uniform:
                    stage.put(f"sdpa.{j}.rows", seg_local * q_max + row)
                if not every:
                    stage.put(f"sdpa.{j}.tok", indptr[g][seg_local] + row)
            # each member's key slots; padding keys repeat its last real one
            table = layout.page_table if every else layout.page_table[g]
            stage.put(f"sdpa.{j}.key_slots", grid_key_slots(table, kv_lens[g], k_max, ps))
            gm = grid_mask(layout.segments, members, q_max, k_max, self.sliding_window, device_rows=device_rows)
            for name in ("hi", "lo", "cells", "src"):
                if (arr := getattr(gm, name)) is not None:
                    stage.put(f"sdpa.{j}.{name}", arr)
            # every row sees every key (a lone decode step, equal-length decodes): no mask at all
            full = (gm.cells is None and bool(np.logical_and.reduce(gm.hi == k_max, axis=None))
                    and (gm.lo is None or not bool(np.logical_or.reduce(gm.lo, axis=None))))
            shapes.append((len(members) > 1 and not uniform, every, q_max, k_max, gm, full))
        anc = stage.get("mask.anc").reshape(-1) if device_rows else None  # the first read: one copy
        self._groups = []
        for j, (scattered, every, q_max, k_max, gm, full) in enumerate(shapes):
            got = {name: stage.get(f"sdpa.{j}.{name}") if getattr(gm, name) is not None else None
                   for name in ("hi", "lo", "cells", "src")}
            values = None if got["src"] is None or anc is None else anc[got["src"]]
            mask = fill_grid_mask(self.columns(k_max, layout.device), got["hi"], got["lo"], got["cells"], values)
            self._groups.append(_Group(None if every else stage.get(f"sdpa.{j}.tok"),
                                       stage.get(f"sdpa.{j}.rows") if scattered else None, q_max,
                                       stage.get(f"sdpa.{j}.key_slots"), mask.unsqueeze(1), full))
        self._additive = [None] * len(self._groups)
        self._write_slots = layout.write_slots

    def use_grid(self, write_slots: torch.Tensor, key_slots: torch.Tensor, mask: torch.Tensor,
                 rows: torch.Tensor | None = None) -> None:
        """Plan a forward of g segments with Q new tokens each, in order (a beam level, model/levels.py), from
        arrays already on the device: ``write_slots`` [g * Q], ``key_slots`` [g, K], ``mask`` [g, Q, K] bool (or
        [g, 1, Q, K], the form the groups keep, taken as it is). With ``rows`` [T] the segments are ragged (the
        draft's catch-up): token t sits at grid row ``rows[t]`` and ``write_slots`` is [T]. ``plan`` would make the
        same single group from the forward's layout."""
        if mask.dim() == 3:
            mask = mask.unsqueeze(1)
        self._groups = [_Group(None, rows, int(mask.shape[2]), key_slots, mask)]
        self._additive = [None]
        self._write_slots = write_slots

    def columns(self, k_max: int, device: torch.device) -> torch.Tensor:
        """arange(k_max) on ``device``, a view of one kept tensor (no op per forward but the slice)."""
        if self._cols is None or self._cols_at != device or self._cols_len < k_max:
            self._cols_len = max(k_max, 2 * self._cols_len, 1024)
            self._cols, self._cols_at = torch.arange(self._cols_len, device=device), device
        return self._cols[:k_max]

    def forward(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                cache: PagedKVCache) -> torch.Tensor:
        assert self._write_slots is not None and self._groups, "plan() must run before forward()"
        kv = cache.k[layer], cache.v[layer]  # this layer's [slots, Hkv, D], written then read
        write_kv_into(*kv, k, v, self._write_slots)
        if len(self._groups) == 1 and self._groups[0].tokens is None:
            return self._attend(0, q, kv)
        out = q.new_empty(q.shape)
        for j, g in enumerate(self._groups):
            assert g.tokens is not None
            out[g.tokens] = self._attend(j, q[g.tokens], kv)
        return out

    def _mask(self, j: int, q: torch.Tensor) -> torch.Tensor | None:
        """Group j's mask as SDPA takes it: the additive 0 / -inf mask (``base.additive_mask``), made by the first
        layer and reused by the others (SDPA turns a boolean mask into exactly this one, ``where(mask, 0, -inf)``,
        on every call: the same values, a few ops a layer fewer, as static.GridAttention does). On a CPU, none at all
        where every cell is true (a lone decode step): the CPU flash kernel adds the mask to the scores, and
        adding 0 leaves them as they are, so a row's output is bitwise the same with or without it
        (tests/engine/model/test_sdpa_masks.py); a GPU could pick another kernel without one, so it keeps it."""
        g = self._groups[j]
        if g.full and q.device.type == "cpu":
            return None
        add = self._additive[j]
        if add is None or add.dtype != (sum_dtype(q.device) or q.dtype):
            add = self._additive[j] = additive_mask(g.mask, q)
        return add

    def _attend(self, j: int, q: torch.Tensor, kv: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        """q [t, H, D] of group j's tokens, the layer's cache tensors ``kv`` -> attention output [t, H, D]."""
        g = self._groups[j]
        if g.rows is None:  # the tokens fill the grid in order
            qp = q.view(g.key_slots.shape[0], g.q_max, *q.shape[1:])
        else:
            qp = q.new_zeros((g.key_slots.shape[0] * g.q_max, *q.shape[1:]))
            qp[g.rows] = q
            qp = qp.view(g.key_slots.shape[0], g.q_max, *q.shape[1:])
        k_cache, v_cache = kv
        if self.native is not None:  # only where it takes the model's rows (CausalLM.attention_kernels)
            out = self.native.attend(qp, k_cache, v_cache, g.key_slots, None if g.full else g.mask[:, 0], self.scale)
            return out if g.rows is None else out[g.rows]
        # the keys' slots gathered by index_select on the flat slot list: the same copy as advanced indexing,
        # in fewer dispatcher steps
        grid = (*g.key_slots.shape, *k_cache.shape[1:])
        slots = g.key_slots.reshape(-1)
        kp = k_cache.index_select(0, slots).view(grid)  # [g, Kmax, Hkv, D]
        vp = v_cache.index_select(0, slots).view(grid)
        # k and v cast once, in grid_sdpa, to what the sums run in: float64 on a CPU, so that a row's output
        # does not follow the grid around it (base.sum_dtype)
        out = grid_sdpa(qp.transpose(1, 2), kp.transpose(1, 2), vp.transpose(1, 2), self._mask(j, q),
                        self.scale).transpose(1, 2)  # [g, Qmax, H, D]
        out = out.reshape(-1, *out.shape[2:])
        return out if g.rows is None else out[g.rows]
