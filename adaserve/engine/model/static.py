"""The static-shape forward: persistent buffers per shape bucket, a CUDA graph per bucket on a GPU, and
the very same function called eagerly on a CPU, so every CPU test runs the path a GPU replays (issue 30).

A forward whose segments each bring at most ``max_rows`` new tokens (decoding, beam steps, verification
trees; not prefill chunks) is laid out on a grid ``[G, Q]``: segment b's new token i is grid row
``b * Q + i``, with G the batch and Q the most new tokens of a segment, each rounded up to a bucket. Keys
are read from a ``[G, K]`` table of cache slots, K the longest key length rounded up to a power of two.
Padding (rows past a segment's new tokens, segments past the batch) writes its K/V into the cache's
scratch page and sees key 0 only; nothing real reads the scratch page, and attention, norms and linear
layers are row-wise, so padded rows cannot change a real row's logits (the poison test holds them to
bit-identity).

Per forward the host builds the grid's index arrays, sends them in one non-blocking copy with the mask's
per-segment vectors (staging.py), builds the mask on the device, copies everything into the bucket's
buffers (whose ``data_ptr`` never changes) and replays. The graph covers the model: embedding, layers,
KV writes, attention over the grid, the head. Planning (grid, mask) and picking the wanted logits rows
stay eager, outside the graph.

The model is nano-vllm's ``capture_cudagraph``: static buffers, one graph per batch bucket, padding to the
next bucket, one memory pool for every graph. Here the buckets also cover the rows per segment (trees) and
the key length, because the torch attention reads a dense key grid instead of a paged kernel.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from adaserve.engine.model.attention.base import additive_mask, grid_sdpa, write_kv
from adaserve.engine.model.attention.masks import fill_grid_mask, grid_mask
from adaserve.engine.model.batch import BatchLayout
from adaserve.engine.model.kv_cache import PagedKVCache
from adaserve.engine.model.layers import CausalLM
from adaserve.engine.model.native_kernels import NativeKernels

BATCH_BUCKETS = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 192, 256)
MIN_KEYS = 64


def round_up(x: int, buckets: tuple[int, ...]) -> int | None:
    """The smallest bucket >= x, or None when x is past the largest."""
    return next((b for b in buckets if b >= x), None)


def pow2(x: int, lowest: int = 1) -> int:
    return max(lowest, 1 << (max(1, x) - 1).bit_length())


@dataclass
class Grid:
    """One bucket's persistent buffers; on CUDA its graph, whose output is ``logits``."""

    g: int
    q: int
    k: int
    ids: torch.Tensor  # [G*Q] int64
    positions: torch.Tensor  # [G*Q] int64
    write_slots: torch.Tensor  # [G*Q] int64
    key_slots: torch.Tensor  # [G, K] int64
    mask: torch.Tensor  # [G, 1, Q, K] bool
    logits: torch.Tensor | None = None  # [G*Q, V] float32, written by each run
    graph: torch.cuda.CUDAGraph | None = None

    def data_ptrs(self) -> tuple[int, ...]:
        return tuple(t.data_ptr() for t in (self.ids, self.positions, self.write_slots, self.key_slots, self.mask))


class GridAttention:
    """Attention over a grid's buffers: no per-forward state, so a captured graph replays it as is."""

    name = "grid"

    def __init__(self, grid: Grid, *, head_dim: int, native: NativeKernels | None = None) -> None:
        self.grid = grid
        self.scale = head_dim**-0.5
        self.native = native  # a model on the integer kernels attends with them, as the eager torch backend does
        self._bias: torch.Tensor | None = None  # the mask as 0 / -inf, made by the forward's first layer

    def plan(self, layout: BatchLayout, cache: PagedKVCache) -> None:  # the grid is filled by StaticForward
        pass

    def forward(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                cache: PagedKVCache) -> torch.Tensor:
        g = self.grid
        write_kv(layer, k, v, cache, g.write_slots)
        if self.native is not None:  # as the eager backend (torch_sdpa.py)
            return self.native.attend(q.view(g.g, g.q, *q.shape[1:]), cache.k[layer], cache.v[layer], g.key_slots,
                                      g.mask[:, 0], self.scale)
        grid, slots = (*g.key_slots.shape, *cache.k.shape[2:]), g.key_slots.view(-1)  # index_select: see torch_sdpa
        kp = cache.k[layer].index_select(0, slots).view(grid)  # [G, K, Hkv, D], cast in grid_sdpa
        vp = cache.v[layer].index_select(0, slots).view(grid)
        qp = q.view(g.g, g.q, *q.shape[1:])
        if layer == 0 or self._bias is None:  # once per forward, not once per layer (SDPA would convert the
            # boolean mask to this very tensor in every layer: the same values, two kernels a layer more)
            self._bias = additive_mask(g.mask, q)  # float64 on a CPU, as the eager path (base.sum_dtype)
        out = grid_sdpa(qp.transpose(1, 2), kp.transpose(1, 2), vp.transpose(1, 2), self._bias,
                        self.scale).transpose(1, 2)  # [G, Q, H, D]
        return out.reshape(q.shape)


class StaticForward:
    """Static-shape forwards of one model over its cache; ``graphs`` (CUDA only) captures each bucket once."""

    def __init__(self, model: CausalLM, cache: PagedKVCache, *, max_batch: int = 256, max_rows: int = 32,
                 graphs: bool | None = None) -> None:
        self.model, self.cache = model, cache
        self.device = model.lm_head.weight.device
        self.batch_buckets = (*(b for b in BATCH_BUCKETS if b < max_batch), max_batch)
        self.max_rows = max_rows
        self.max_keys = pow2(model.cfg.max_position_embeddings, MIN_KEYS)
        self.graphs = self.device.type == "cuda" if graphs is None else graphs
        if self.graphs and self.device.type != "cuda":
            raise ValueError("CUDA graphs need a CUDA device")
        self._grids: dict[tuple[int, int, int], Grid] = {}
        self._pool: tuple[int, int] | None = None  # the graphs' shared memory pool
        # poison test only: fills padded rows, padded segments' masks and the scratch page with garbage
        self.poison: np.random.Generator | None = None

    def bucket(self, layout: BatchLayout) -> tuple[int, int, int] | None:
        """(G, Q, K) for this layout, or None when it does not fit a static shape (eager then)."""
        return self.shape_for(len(layout.segments), int(np.diff(layout.qo_indptr).max()), max(layout.kv_lens))

    def shape_for(self, segments: int, rows: int, keys: int) -> tuple[int, int, int] | None:
        """(G, Q, K) for a forward of ``segments`` segments with at most ``rows`` new tokens and ``keys`` keys
        each, or None when it does not fit a static shape."""
        g = round_up(segments, self.batch_buckets)
        if g is None or rows > self.max_rows or keys > self.max_keys:
            return None
        return g, pow2(rows), min(self.max_keys, pow2(keys, MIN_KEYS))

    def grid(self, shape: tuple[int, int, int]) -> Grid:
        grid = self._grids.get(shape)
        if grid is None:
            g, q, k = shape
            dev = self.device

            def ints(*size: int) -> torch.Tensor:
                return torch.zeros(size, dtype=torch.int64, device=dev)

            grid = Grid(g, q, k, ints(g * q), ints(g * q), ints(g * q), ints(g, k),
                        torch.zeros((g, 1, q, k), dtype=torch.bool, device=dev))
            self._grids[shape] = grid
        return grid

    def forward(self, layout: BatchLayout, rows: list[int], shape: tuple[int, int, int]) -> torch.Tensor:
        """Logits ``[len(rows), V]`` of the layout's flat token rows ``rows``, through the bucket ``shape``."""
        grid = self.grid(shape)
        self._fill(grid, layout, rows)
        return self.run(grid, layout.stage.get("static.rows"))

    def run(self, grid: Grid, rows: torch.Tensor) -> torch.Tensor:
        """Run the model over ``grid``'s filled buffers: the logits of its grid rows ``rows``."""
        self._runner(grid)()
        assert grid.logits is not None
        return grid.logits[rows]  # a new tensor: the next run may overwrite

    # ---- filling the buffers (eager, before the replay) ----------------------------------------------
    def _fill(self, grid: Grid, layout: BatchLayout, rows: list[int]) -> None:
        b_real = len(layout.segments)
        indptr = np.asarray(layout.qo_indptr)
        n_new = np.diff(indptr)
        kv_lens = np.asarray(layout.kv_lens, np.int64)
        seg = np.repeat(np.arange(b_real), n_new)
        at = seg * grid.q + np.arange(indptr[-1]) - indptr[seg]  # grid row of each real token
        ids = np.zeros(grid.g * grid.q, np.int64)
        pos = np.zeros(grid.g * grid.q, np.int64)
        slots = np.full(grid.g * grid.q, self.cache.scratch_slot, np.int64)
        if self.poison is not None:
            ids = self.poison.integers(0, self.model.cfg.vocab_size, ids.shape)
            pos = self.poison.integers(0, self.model.cfg.max_position_embeddings, pos.shape)
            slots = self.cache.scratch_slot + self.poison.integers(0, self.cache.page_size, slots.shape)
        pos[at], slots[at] = layout.position_ids, layout.slots
        if layout.ids is not None:  # else the ids are on the device only (beam levels): scattered there below
            ids[at] = layout.ids
        # key k of a real segment: its cache slot (keys past kv_len repeat the last real one, masked)
        ps = layout.page_size
        k_idx = np.minimum(np.arange(grid.k)[None, :], kv_lens[:, None] - 1)
        keys = np.full((grid.g, grid.k), self.cache.scratch_slot, np.int64)
        keys[:b_real] = np.take_along_axis(layout.page_table, k_idx // ps, 1) * ps + k_idx % ps
        stage = layout.stage
        for name, arr in (("ids", ids), ("positions", pos), ("write_slots", slots), ("keys", keys),
                          ("rows", at[np.asarray(rows, np.int64)])):
            stage.put(f"static.{name}", arr)
        if layout.ids is None:
            stage.put("static.at", at)
        # the mask as row bounds and tree cells (masks.grid_mask, issue 30: a few device ops, not the rule
        # evaluated on the whole grid); beam levels' ancestor rows are on the device (batch.DeviceNodes)
        device_rows = layout.ids is None and "mask.anc" in stage
        gm = grid_mask(layout.segments, range(b_real), grid.q, grid.k, self.model.cfg.sliding_window,
                       device_rows=device_rows)
        parts = {name: arr for name in ("hi", "lo", "cells", "src") if (arr := getattr(gm, name)) is not None}
        for name, arr in parts.items():
            stage.put(f"static.mask.{name}", arr)
        anc = stage.get("mask.anc").reshape(-1) if device_rows else None  # the first read: one copy
        got = {name: stage.get(f"static.mask.{name}") if name in parts else None
               for name in ("hi", "lo", "cells", "src")}
        values = None if got["src"] is None or anc is None else anc[got["src"]]
        mask = fill_grid_mask(torch.arange(grid.k, device=layout.device), got["hi"], got["lo"], got["cells"], values)
        grid.ids.copy_(stage.get("static.ids"))
        if layout.ids is None:
            grid.ids.index_copy_(0, stage.get("static.at"), layout.input_ids)
        grid.positions.copy_(stage.get("static.positions"))
        grid.write_slots.copy_(stage.get("static.write_slots"))
        grid.key_slots.copy_(stage.get("static.keys"))
        grid.mask[:b_real, 0].copy_(mask)
        if b_real < grid.g:  # padded segments see key 0 only
            grid.mask[b_real:].zero_()
            grid.mask[b_real:, :, :, 0] = True
        if self.poison is not None:
            garbage = torch.rand(grid.mask[b_real:].shape, generator=torch.Generator().manual_seed(0)) < 0.5
            grid.mask[b_real:].copy_(garbage)
            scratch = slice(self.cache.scratch_slot, self.cache.scratch_slot + self.cache.page_size)
            self.cache.k[:, scratch].normal_()
            self.cache.v[:, scratch].normal_()

    # ---- running: the function, eagerly or as a captured graph ---------------------------------------
    def _function(self, grid: Grid) -> Callable[[], torch.Tensor]:
        """What a graph captures: the model over the grid's buffers (untimed: the replay is timed)."""
        attention = GridAttention(grid, head_dim=self.model.cfg.head_dim, native=self.model.attention_kernels())

        def run() -> torch.Tensor:
            return self.model._logits(grid.ids, grid.positions, attention, self.cache, None)

        return run

    def _runner(self, grid: Grid) -> Callable[[], None]:
        """The eager call goes through the module (its timer, and any hooks on it); a replay is timed alone."""
        if not self.graphs:
            attention = GridAttention(grid, head_dim=self.model.cfg.head_dim, native=self.model.attention_kernels())

            def eager() -> None:
                grid.logits = self.model(grid.ids, grid.positions, backend=attention, cache=self.cache)

            return eager
        if grid.graph is None:
            self._capture(grid, self._function(grid))
        graph = grid.graph
        assert graph is not None

        def replay() -> None:
            with self.model.timer.region(self.device):
                graph.replay()

        return replay

    def _capture(self, grid: Grid, fn: Callable[[], torch.Tensor]) -> None:
        """Warm up on a side stream (lazy initialisations must not be captured), then capture ``fn``.

        The warm-up runs on the buffers already filled for this forward, so its KV writes are the ones the
        replay makes again: the same values in the same slots.
        """
        stream = torch.cuda.Stream(self.device)
        stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream):
            fn()
        torch.cuda.current_stream(self.device).wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self._pool):
            grid.logits = fn()
        self._pool = graph.pool()
        grid.graph = graph
