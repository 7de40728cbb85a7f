"""The §2 attention mask, evaluated on the device from per-segment vectors (docs/architecture.md §2).

Query row i of segment b is tree node c_b + i (c_b: its cached nodes); it may attend to key index k when

    k < L_b                                               the committed prefix, or
    0 <= k - L_b < M_b  and  anc_b[c_b + i, k - L_b]      an ancestor in its tree (itself included).

For a chain anc is the lower triangle, so the rule is k - L_b <= c_b + i and no block is stored: only
trees that are not chains carry their ancestor rows, stacked as [n_trees, Mt, Mt] (Mt: the largest of
them; verification and beam trees are small). With a sliding window a query at position p keeps keys at
positions > p - window, positions by depth (``prefix + depth``; for a chain, the key index).

Each backend evaluates the rule on the grid it needs: the torch backend on a padded [b, Qmax, Kmax]
grid per group of similar segments, flashinfer on the flat per-request [num_new, kv_len] blocks. No
dense mask is filled on the host, and no request's rows are padded to another group's longest chunk.

The torch backend's grid (``grid_mask``, issue 30) costs a handful of device ops, whatever the batch: the
rule splits into a bound per query row and a few tree cells. A row sees the keys in ``[lo, hi)``: the
prefix (and for a chain its own nodes: ``hi = L + c + i + 1``; a padded row: key 0 only), ``lo`` the
sliding window's lower bound. A tree row's tree block (at most M x M cells per tree, none for a chain)
is then set cell by cell: the host lists the cells (flat grid indices) from the trees' ancestor rows, or,
when the rows are on the device (beam levels), every cell of the block with the index of its ancestor
bit, which one gather reads there. The per-segment vectors and the rule (``MaskIndex``, ``padded_mask``)
stay the definition those arrays are tested against, and what flashinfer and the static path read.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from adaserve.engine.model.batch import BatchLayout, Segment


class MaskIndex:
    """Per-segment vectors of one layout on its device; ``visible`` evaluates the mask on any index grid.

    The vectors travel in the layout's ``HostStage`` (``stage`` puts them there, the constructor reads
    them): a backend that stages its own arrays first gets everything in one copy.
    """

    _VECTORS = ("prefix", "cached", "size", "n_new", "kv_len")

    @staticmethod
    def stage(layout: BatchLayout) -> None:
        """Queue this layout's mask vectors for the device (once; later calls do nothing)."""
        stage = layout.stage
        if "mask.prefix" in stage:
            return
        segs = layout.segments
        stage.put("mask.prefix", np.fromiter((s.prefix_len for s in segs), np.int64, len(segs)))
        stage.put("mask.cached", np.fromiter((s.num_cached for s in segs), np.int64, len(segs)))
        stage.put("mask.size", np.fromiter((s.tree.size for s in segs), np.int64, len(segs)))
        stage.put("mask.n_new", np.diff(layout.qo_indptr))
        stage.put("mask.kv_len", np.asarray(layout.kv_lens, np.int64))
        trees = [b for b, s in enumerate(segs) if not s.tree.is_chain]
        if trees:
            mt = max(segs[b].tree.size for b in trees)
            # bound by the layout: the rows are on the device already (batch.DeviceNodes: beam levels)
            on_device = "mask.anc" in stage
            anc = np.zeros((0 if on_device else len(trees), mt, mt), bool)
            depth = np.zeros((len(trees), mt), np.int64)
            slot = np.full(len(segs), -1, np.int64)
            for j, b in enumerate(trees):
                tree = segs[b].tree
                if not on_device:
                    anc[j, : tree.size, : tree.size] = tree.ancestor_matrix()
                depth[j, : tree.size] = tree.depths()
                slot[b] = j
            if not on_device:
                stage.put("mask.anc", anc, torch.bool)
            stage.put("mask.depth", depth)
            stage.put("mask.tree_slot", slot)

    def __init__(self, layout: BatchLayout, device: torch.device | None = None) -> None:
        if device is not None and torch.device(device) != layout.device:
            raise ValueError(f"layout staged for {layout.device}, mask asked on {device}")
        MaskIndex.stage(layout)
        stage = layout.stage
        self.device = layout.device
        self.flat_size = int(np.dot(np.diff(layout.qo_indptr), layout.kv_lens))  # sum_b num_new_b * kv_len_b
        self.prefix, self.cached, self.size, self.n_new, self.kv_len = (
            stage.get(f"mask.{v}") for v in self._VECTORS)
        self.anc: torch.Tensor | None = None
        self.depth: torch.Tensor | None = None
        if "mask.anc" in stage:
            self.anc = stage.get("mask.anc")
            self.depth = stage.get("mask.depth")
            self.tree_slot = stage.get("mask.tree_slot")

    def _node_depth(self, b: torch.Tensor, node: torch.Tensor) -> torch.Tensor:
        """depth of tree node ``node`` of segment ``b`` (a chain's node index is its depth)."""
        if self.depth is None:
            return node
        slot = self.tree_slot[b]
        mt = self.depth.shape[-1]
        return torch.where(slot >= 0, self.depth[slot.clamp(min=0), node.clamp(0, mt - 1)], node)

    def visible(self, b: torch.Tensor, row: torch.Tensor, col: torch.Tensor) -> torch.Tensor:
        """bool, broadcast over the int64 index tensors: may query ``row`` of segment ``b`` see key ``col``?"""
        if self.anc is None:  # chains only: a query sees every key up to its own index L + c + row
            return col <= self.prefix[b] + self.cached[b] + row
        p = self.prefix[b]
        rel = col - p  # tree node of the key, when >= 0
        node = self.cached[b] + row
        ancestor = rel <= node  # chains
        if self.anc is not None:
            slot = self.tree_slot[b]
            mt = self.anc.shape[-1]
            tree_rule = self.anc[slot.clamp(min=0), node.clamp(0, mt - 1), rel.clamp(0, mt - 1)]
            ancestor = torch.where(slot >= 0, tree_rule, ancestor)
        return (col < p) | ((rel >= 0) & (rel < self.size[b]) & ancestor)

    def in_window(self, b: torch.Tensor, row: torch.Tensor, col: torch.Tensor, window: int) -> torch.Tensor:
        """q_pos - k_pos < window, positions by depth (Mistral's convention, applied to trees)."""
        p = self.prefix[b]
        q_pos = p + self._node_depth(b, self.cached[b] + row)
        rel = col - p
        k_pos = torch.where(rel < 0, col, p + self._node_depth(b, rel.clamp(min=0)))
        return (q_pos - k_pos) < window


def padded_mask(index: MaskIndex, group: torch.Tensor, q_max: int, k_max: int,
                window: int | None = None) -> torch.Tensor:
    """[g, Qmax, Kmax] bool for the segments ``group`` (int64 [g]); padded query rows see key 0 only."""
    dev = index.device
    b = group[:, None, None]
    row = torch.arange(q_max, device=dev)[None, :, None]
    col = torch.arange(k_max, device=dev)[None, None, :]
    mask = index.visible(b, row, col)
    if window is not None:
        mask &= index.in_window(b, row, col, window)
    real = row < index.n_new[b]
    return (mask & real) | (~real & (col == 0))


def flat_mask(index: MaskIndex, window: int | None = None) -> torch.Tensor:
    """Per request the row-major ``[num_new, kv_len]`` block of the mask, concatenated (flashinfer's layout)."""
    dev = index.device
    sizes = index.n_new * index.kv_len
    b = torch.repeat_interleave(torch.arange(len(sizes), device=dev), sizes, output_size=index.flat_size)
    start = torch.cumsum(sizes, 0) - sizes
    local = torch.arange(b.shape[0], device=dev) - start[b]
    row, col = local // index.kv_len[b], local % index.kv_len[b]
    mask = index.visible(b, row, col)
    if window is not None:
        mask &= index.in_window(b, row, col, window)
    return mask


@dataclass(frozen=True)
class GridMask:
    """The §2 mask on one group's padded ``[g, Qmax, Kmax]`` grid, as host arrays (``grid_mask``).

    Query row r of group member m sees key k when ``lo[m, r] <= k < hi[m, r]``, or when the flat grid index
    ``(m * Qmax + r) * Kmax + k`` is one of ``cells`` and its value is true: every listed cell is true when
    ``src`` is None, else the value of cell e is ``ancestors.view(-1)[src[e]]`` (device rows ``[B, M, M]``).
    """

    hi: np.ndarray  # [g, Qmax, 1] int64
    lo: np.ndarray | None  # [g, Qmax, 1] int64; None: 0 (no sliding window)
    cells: np.ndarray | None  # [E] int64; None: no tree cells
    src: np.ndarray | None  # [E] int64 into the device ancestor rows; None: every cell is true


def grid_mask(segments: Sequence[Segment], members: Sequence[int], q_max: int, k_max: int,
              window: int | None = None, *, device_rows: bool = False) -> GridMask:
    """The grid mask of the segments ``members`` (pure numpy, no device op).

    ``device_rows``: the trees' ancestor rows are on the device, ``[B, M, M]`` over every segment of the
    layout (``batch.DeviceNodes``: all trees of one size M, none a chain): the cells are the whole tree block
    of every row, each with ``src`` pointing at its bit. Otherwise the rows are read from the trees here and
    only the true cells are listed.
    """
    segs = [segments[b] for b in members]
    g = len(segs)
    # one pass over the segments: prefix, cached nodes, tree size, chain or not; each column [g, 1]
    prefix, cached, size, chain = np.array([(s.prefix_len, s.num_cached, s.tree.size, s.tree.is_chain)
                                            for s in segs], np.int64).reshape(g, 4, 1).transpose(1, 0, 2)
    n_new = size - cached
    chain = chain.astype(bool)
    row = np.arange(q_max)[None, :]
    node = cached + row  # [g, Q] tree node of each query row
    real = row < n_new
    hi = np.where(real, prefix + np.where(chain, node + 1, 0), 1)
    trees = [m for m in range(g) if not chain[m, 0]]
    lo = None
    if window is not None:
        depth = node.copy()  # a chain's node index is its depth
        for m in trees:
            d = segs[m].tree.depths()
            depth[m, : n_new[m, 0]] = d[cached[m, 0]:]
        lo = np.where(real, np.maximum(prefix + depth - window + 1, 0), 0)[:, :, None]
    hi = hi[:, :, None]
    if not trees:
        return GridMask(hi, lo, None, None)
    t = np.asarray(trees)
    if device_rows:
        size = segs[trees[0]].tree.size
        counts = n_new[t, 0] * size
        at = np.repeat(np.arange(len(t)), counts)
        e = np.arange(int(counts.sum())) - (np.cumsum(counts) - counts)[at]
        r, col = e // size, e % size
        m = t[at]
        tree_node = cached[m, 0] + r
        src = (np.asarray(members)[m] * size + tree_node) * size + col
    else:
        # each tree's rows below its cached nodes, flattened: the true cells only
        flat = [segs[m].tree.ancestor_matrix()[cached[m, 0]:].ravel().nonzero()[0] for m in trees]
        counts = np.fromiter((len(f) for f in flat), np.int64, len(flat))
        at = np.repeat(np.arange(len(t)), counts)
        e = np.concatenate(flat)
        sizes = np.fromiter((segs[m].tree.size for m in trees), np.int64, len(trees))[at]
        r, col = e // sizes, e % sizes
        m = t[at]
        tree_node = cached[m, 0] + r
        src = None
    cells = (m * q_max + r) * k_max + prefix[m, 0] + col
    if window is not None:  # a tree key's position is prefix + its depth
        depths = [segs[j].tree.depths() for j in trees]
        if all(d is depths[0] for d in depths):
            keep = depths[0][tree_node] - depths[0][col] < window
        else:
            dmat = np.zeros((len(trees), max(len(d) for d in depths)), np.int64)
            for i, d in enumerate(depths):
                dmat[i, : len(d)] = d
            keep = dmat[at, tree_node] - dmat[at, col] < window
        cells = cells[keep]
        src = None if src is None else src[keep]
    return GridMask(hi, lo, cells, src)


def lone_tree_cells(segment: Segment, k_max: int) -> np.ndarray:
    """``grid_mask``'s cells for one segment whose tree is not a chain, without a window or device rows, on a grid
    of ``k_max`` keys: cell (r, L + j) for every true ``anc[c + r, j]`` (L prefix, c cached nodes), as flat
    ``r * k_max + L + j``. The lone request's plans read it (issue 30: a fifth of ``grid_mask``'s cost there)."""
    tree = segment.tree
    e = tree.ancestor_matrix()[segment.num_cached :].ravel().nonzero()[0]  # flat (row, node) of every true cell
    return e // tree.size * k_max + segment.prefix_len + e % tree.size


def fill_grid_mask(cols: torch.Tensor, hi: torch.Tensor, lo: torch.Tensor | None, cells: torch.Tensor | None,
                   values: torch.Tensor | None) -> torch.Tensor:
    """[g, Qmax, Kmax] bool on the device from a ``GridMask``'s arrays there: ``cols`` = arange(Kmax),
    ``values`` the listed cells' bits (None: all true). At most five ops, whatever the batch."""
    mask = cols < hi
    if lo is not None:
        mask &= cols >= lo
    if cells is not None:
        if values is None:
            mask.view(-1)[cells] = True
        else:
            mask.put_(cells, values)  # put_ indexes the mask as 1-D: no view to make
    return mask
