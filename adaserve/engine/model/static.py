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

Per forward the host builds the grid's integers (ids, positions, write slots, each row's key bounds, key slots)
as one array laid out as the bucket's ``ints`` buffer, sends it with the layout's one non-blocking copy
(staging.py) and copies it into the buffer (whose ``data_ptr`` never changes): one device op, where there used
to be ten. A forward with trees then sets its tree cells in the bucket's ``tree`` buffer. The graph covers the
model and the mask: the mask (bounds, then cells, ``Grid.mask``), embedding, layers, KV writes, attention over
the grid, the head. Planning and picking the wanted logits rows stay eager, outside the graph.

The model is nano-vllm's ``capture_cudagraph``: static buffers, one graph per batch bucket, padding to the
next bucket, one memory pool for every graph. Here the buckets also cover the rows per segment (trees) and
the key length, because the torch attention reads a dense key grid instead of a paged kernel.
"""

from __future__ import annotations

import itertools
import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TypeVar

import numpy as np
import torch

from adaserve.engine.model.attention.base import additive_mask, grid_sdpa, write_kv
from adaserve.engine.model.attention.masks import grid_mask, lone_tree_cells
from adaserve.engine.model.batch import BatchLayout, grid_key_slots
from adaserve.engine.model.kv_cache import PagedKVCache, page_slots
from adaserve.engine.model.layers import CausalLM
from adaserve.engine.model.native_kernels import NativeKernels

log = logging.getLogger(__name__)
T = TypeVar("T")
ArrayT = TypeVar("ArrayT", np.ndarray, torch.Tensor)


def out_of_memory(error: BaseException) -> bool:
    """Whether ``error`` is the device running out of memory, raised by what a capture ran (its warm-up, or an
    allocation inside the capture), after which torch's capture context has ended the capture cleanly. An error the
    capture's end raised itself (with an OOM as its context or not) is not: the allocator's state after it is not
    known, so it is left to fail."""
    return isinstance(error, torch.OutOfMemoryError) or "out of memory" in str(error).lower().split("\n", 1)[0]


BATCH_BUCKETS = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 192, 256)
MIN_KEYS = 64


def round_up(x: int, buckets: tuple[int, ...]) -> int | None:
    """The smallest bucket >= x, or None when x is past the largest."""
    return next((b for b in buckets if b >= x), None)


def pow2(x: int, lowest: int = 1) -> int:
    return max(lowest, 1 << (max(1, x) - 1).bit_length())


INT_ROWS = ("ids", "positions", "write_slots", "hi", "lo")  # the [G * Q] parts of a grid's ints, in order


def int_views(ints: ArrayT, g: int, q: int, k: int) -> tuple[ArrayT, ...]:
    """Views of a ``Grid.ints``-shaped array (a host array or the bucket's tensor): ids, positions, write slots
    ``[G * Q]``; hi, lo ``[G, Q]``; key slots ``[G, K]``."""
    gq = g * q
    rows = ints[: len(INT_ROWS) * gq].reshape(len(INT_ROWS), gq)
    keys = ints[len(INT_ROWS) * gq :].reshape(g, k)
    return rows[0], rows[1], rows[2], rows[3].reshape(g, q), rows[4].reshape(g, q), keys


def pack_ints(g: int, q: int, k: int, *, ids: np.ndarray, positions: np.ndarray, write_slots: np.ndarray,
              hi: np.ndarray, lo: np.ndarray | None, key_slots: np.ndarray) -> np.ndarray:
    """A grid's integer buffers as the one host array its single copy sends (``Grid.ints``' layout, ``int_views``):
    five ``[G * Q]`` parts (``INT_ROWS``; ``lo`` None: zeros, no sliding window), then the ``[G, K]`` key slots."""
    lo = np.zeros(g * q, np.int64) if lo is None else lo
    out = np.concatenate((ids, positions, write_slots, hi, lo, key_slots), axis=None, dtype=np.int64,
                         casting="unsafe")
    if out.size != len(INT_ROWS) * g * q + g * k:
        raise ValueError(f"{out.size} integers for a ({g}, {q}, {k}) grid")
    return out


@dataclass
class Grid:
    """One bucket's persistent buffers; on CUDA its graph, whose output is ``logits``.

    The integer buffers are views of one ``ints`` tensor, so a forward fills them all with one copy. The mask
    is not a buffer: the captured function makes it (``mask``) from the row bounds and the tree cells.
    """

    g: int
    q: int
    k: int
    ints: torch.Tensor  # [5 * G * Q + G * K] int64: the views below (pack_ints lays a host array out alike)
    tree: torch.Tensor  # [G, Q, K] bool: keys a row sees besides its bounds (its tree cells); zero when none
    cols: torch.Tensor  # [K] int64: 0 .. K - 1
    logits: torch.Tensor | None = None  # [G*Q, V] float32, written by each run
    graph: torch.cuda.CUDAGraph | None = None
    eager: bool = False  # its capture ran out of memory: this bucket runs its function eagerly from then on
    has_cells: bool = False  # ``tree`` holds set cells, cleared by the next ``set_cells``
    ids: torch.Tensor = field(init=False)  # [G*Q]
    positions: torch.Tensor = field(init=False)  # [G*Q]
    write_slots: torch.Tensor = field(init=False)  # [G*Q]
    hi: torch.Tensor = field(init=False)  # [G, Q, 1]: row (b, r) sees keys lo <= j < hi ...
    lo: torch.Tensor = field(init=False)  # [G, Q, 1]  (... read only with a sliding window) ...
    key_slots: torch.Tensor = field(init=False)  # [G, K]  ... and its tree cells; key j is cache slot key_slots[b, j]

    def __post_init__(self) -> None:
        self.ids, self.positions, self.write_slots, hi, lo, self.key_slots = int_views(self.ints, self.g, self.q,
                                                                                       self.k)
        self.hi, self.lo = hi[..., None], lo[..., None]

    @classmethod
    def empty(cls, g: int, q: int, k: int, device: torch.device) -> Grid:
        return cls(g, q, k, torch.zeros(len(INT_ROWS) * g * q + g * k, dtype=torch.int64, device=device),
                   torch.zeros((g, q, k), dtype=torch.bool, device=device), torch.arange(k, device=device))

    def data_ptrs(self) -> tuple[int, ...]:
        return tuple(t.data_ptr() for t in (self.ints, self.tree, self.cols))

    def mask(self, window: bool) -> torch.Tensor:
        """[G, Q, K] bool, made on the device (inside the graph): row (b, r) sees key j when
        ``lo <= j < hi`` (``lo`` read only with a sliding ``window``) or when its tree cell is set."""
        mask = self.cols < self.hi
        if window:
            mask &= self.cols >= self.lo
        return mask.logical_or_(self.tree)

    def set_cells(self, cells: torch.Tensor | None, values: torch.Tensor | None) -> None:
        """This forward's tree cells (flat ``[G, Q, K]`` indices; ``values`` their bits, None: all set), the last
        forward's cleared first: at most two ops, none while neither forward has any (decoding, chains)."""
        if self.has_cells:
            self.tree.zero_()
        self.has_cells = cells is not None
        if cells is None:
            return
        if values is None:
            self.tree.view(-1).index_fill_(0, cells, True)
        else:
            self.tree.put_(cells, values)


class GridAttention:
    """Attention over a grid's buffers: no per-forward state, so a captured graph replays it as is."""

    name = "grid"

    def __init__(self, grid: Grid, *, head_dim: int, window: bool, native: NativeKernels | None = None) -> None:
        self.grid = grid
        self.scale = head_dim**-0.5
        self.window = window  # the model has a sliding window: the mask reads the grid's lower bounds
        self.native = native  # a model on the integer kernels attends with them, as the eager torch backend does
        self._mask: torch.Tensor | None = None  # made by the forward's first layer (``Grid.mask``): bool [G, Q, K]
        # for the native kernels, else 0 / -inf [G, 1, Q, K]

    def plan(self, layout: BatchLayout, cache: PagedKVCache) -> None:  # the grid is filled by StaticForward
        pass

    def forward(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                cache: PagedKVCache) -> torch.Tensor:
        g = self.grid
        write_kv(layer, k, v, cache, g.write_slots)
        if layer == 0 or self._mask is None:  # once per forward, not once per layer (SDPA would convert a
            # boolean mask to the additive one in every layer: the same values, two kernels a layer more)
            mask = g.mask(self.window)
            # float64 on a CPU, as the eager path (base.sum_dtype)
            self._mask = mask if self.native is not None else additive_mask(mask[:, None], q)
        if self.native is not None:  # as the eager backend (torch_sdpa.py)
            return self.native.attend(q.view(g.g, g.q, *q.shape[1:]), cache.k[layer], cache.v[layer], g.key_slots,
                                      self._mask, self.scale)
        grid, slots = (*g.key_slots.shape, *cache.k.shape[2:]), g.key_slots.view(-1)  # index_select: see torch_sdpa
        kp = cache.k[layer].index_select(0, slots).view(grid)  # [G, K, Hkv, D], cast in grid_sdpa
        vp = cache.v[layer].index_select(0, slots).view(grid)
        qp = q.view(g.g, g.q, *q.shape[1:])
        out = grid_sdpa(qp.transpose(1, 2), kp.transpose(1, 2), vp.transpose(1, 2), self._mask,
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
        # captures that ran out of memory, "what: reason" each; what they captured runs eagerly instead
        self.capture_failures: list[str] = []
        # poison test only: fills padded rows, padded segments' masks and the scratch page with garbage
        self.poison: np.random.Generator | None = None

    def bucket(self, layout: BatchLayout) -> tuple[int, int, int] | None:
        """(G, Q, K) for this layout, or None when it does not fit a static shape (eager then)."""
        indptr = layout.qo_indptr  # a short list: Python's max over it, not numpy's conversion of it
        rows = indptr[1] - indptr[0] if len(indptr) == 2 else max(b - a for a, b in itertools.pairwise(indptr))
        return self.shape_for(len(layout.segments), int(rows), max(layout.kv_lens))

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
            grid = self._grids[shape] = Grid.empty(*shape, self.device)
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
        """The grid's buffers for ``layout``: its integers in one copy (from the layout's one transfer), then, on a
        layout whose ids are on the device (beam levels), those ids, and on one with trees, their cells. A decode
        or chain forward makes one op here; the mask is made inside the graph (``Grid.mask``).

        The host writes the integers straight into one array laid out as ``Grid.ints`` (``int_views``). Row
        bounds need no tree walk: a new token at position p (its prefix plus its depth) has key index p on a
        chain, so a chain's row sees keys ``[0, p + 1)``; a tree's row sees its prefix and, through its cells,
        its ancestors (``masks.grid_mask``); with a window, keys from ``p - window + 1`` on, tree or chain."""
        g, q, k = grid.g, grid.q, grid.k
        segments = layout.segments
        b_real = len(segments)
        scratch = self.cache.scratch_slot
        indptr = layout.qo_indptr
        if q == 1:  # one new token per segment (decoding): segment b's token is grid row b
            at = np.arange(b_real)
        elif b_real == 1:  # one segment: its tokens are the first rows
            at = np.arange(indptr[1])
        else:
            n_new = np.diff(indptr)
            seg = np.repeat(np.arange(b_real), n_new)
            at = seg * q + np.arange(indptr[-1]) - np.asarray(indptr)[seg]  # grid row of each real token
        host = np.empty(len(INT_ROWS) * g * q + g * k, np.int64)
        ids, pos, slots, hi, lo, keys = int_views(host, g, q, k)
        if self.poison is not None:
            ids[:] = self.poison.integers(0, self.model.cfg.vocab_size, ids.shape)
            pos[:] = self.poison.integers(0, self.model.cfg.max_position_embeddings, pos.shape)
            slots[:] = scratch + self.poison.integers(0, self.cache.page_size, slots.shape)
        else:
            ids[:] = 0
            pos[:] = 0
            slots[:] = scratch
        positions = layout.position_ids
        pos[at], slots[at] = positions, layout.slots
        if layout.ids is not None:  # else the ids are on the device only (beam levels): scattered there below
            ids[at] = layout.ids
        # key j of a real segment: its cache slot (keys past kv_len repeat the last real one, masked); padded
        # segments read the scratch slot
        ps = layout.page_size
        if b_real == 1:
            kv = layout.kv_lens[0]
            got = page_slots(layout.page_table[0], ps)[:kv]
            keys[0, :kv] = got
            keys[0, kv:] = got[-1]
        else:
            keys[:b_real] = grid_key_slots(layout.page_table, np.asarray(layout.kv_lens, np.int64), k, ps)
        keys[b_real:] = scratch
        # row bounds: padded rows (and padded segments' rows) see key 0 only
        hi[:] = 1
        window = self.model.cfg.sliding_window
        device_rows = layout.ids is None and "mask.anc" in layout.stage
        tree_cells = tree_src = None  # the trees' cells (flat [G, Q, K]); with device rows, their bits' sources
        if all(s.tree.is_chain for s in segments):
            hi.ravel()[at] = positions + 1
        elif b_real == 1 and window is None and not device_rows:  # a lone tree: its rows see the prefix, its cells
            hi[0, : len(at)] = segments[0].prefix_len
            tree_cells = lone_tree_cells(segments[0], k)
        else:
            # the cells (within the window, which the bounds below apply to the rest)
            gm = grid_mask(segments, range(b_real), q, k, window, device_rows=device_rows)
            hi[:b_real] = gm.hi[:, :, 0]
            tree_cells, tree_src = gm.cells, gm.src
        lo[:] = 0
        if window is not None:
            lo.ravel()[at] = np.maximum(positions - window + 1, 0)
        padded = None
        if self.poison is not None:  # padded rows: any bounds that leave them a key (their values stay finite)
            padded = np.ones(g * q, bool)
            padded[at] = False
            hi.ravel()[padded] = self.poison.integers(1, k + 1, int(padded.sum()))
            lo.ravel()[padded] = self.poison.integers(0, hi.ravel()[padded])
        stage = layout.stage
        stage.put("static.ints", host)
        stage.put("static.rows", at if len(rows) == len(at) else at[np.asarray(rows, np.int64)])
        if layout.ids is None:
            stage.put("static.at", at)
        if tree_cells is not None:
            stage.put("static.mask.cells", tree_cells)
            if tree_src is not None:
                stage.put("static.mask.src", tree_src)
        grid.ints.copy_(stage.get("static.ints"))  # the first read: the layout's one transfer
        if layout.ids is None:
            grid.ids.index_copy_(0, stage.get("static.at"), layout.input_ids)
        cells = values = None
        if tree_cells is not None:
            cells = stage.get("static.mask.cells")
            if tree_src is not None:
                values = stage.get("mask.anc").reshape(-1)[stage.get("static.mask.src")]
        grid.set_cells(cells, values)
        if padded is not None:
            garbage = torch.rand((int(padded.sum()), k), generator=torch.Generator().manual_seed(0)) < 0.5
            grid.tree.view(g * q, k)[torch.from_numpy(np.flatnonzero(padded))] = garbage.to(grid.tree.device)
            grid.has_cells = True
            scratch_page = slice(scratch, scratch + self.cache.page_size)
            self.cache.k[:, scratch_page].normal_()
            self.cache.v[:, scratch_page].normal_()

    # ---- running: the function, eagerly or as a captured graph ---------------------------------------
    def _function(self, grid: Grid) -> Callable[[], torch.Tensor]:
        """What a graph captures: the model over the grid's buffers (untimed: the replay is timed)."""
        attention = self._attention(grid)

        def run() -> torch.Tensor:
            return self.model._logits(grid.ids, grid.positions, attention, self.cache, None)

        return run

    def _attention(self, grid: Grid) -> GridAttention:
        cfg = self.model.cfg
        return GridAttention(grid, head_dim=cfg.head_dim, window=cfg.sliding_window is not None,
                             native=self.model.attention_kernels())

    def eager_function(self, grid: Grid) -> Callable[[], torch.Tensor]:
        """``_function`` as a CPU calls it: through the module's ``forward`` (its timer, and any wrapper a benchmark
        put on it), not ``nn.Module.__call__``, as every engine forward is (runner.py)."""
        attention = self._attention(grid)

        def run() -> torch.Tensor:
            return self.model.forward(grid.ids, grid.positions, backend=attention, cache=self.cache)

        return run

    def _runner(self, grid: Grid) -> Callable[[], None]:
        """The eager call goes through the module (its timer, and any hooks on it); a replay is timed alone. A
        bucket whose capture ran out of memory (``try_capture``) runs eagerly, as on a CPU, and so does every bucket
        while ``graphs`` is off (scripts/gpu-trace.py turns it off after capturing, to time eager against replay)."""
        if grid.graph is None and self.graphs and not grid.eager:
            captured = self.try_capture(f"bucket {(grid.g, grid.q, grid.k)}", self._function(grid))
            if captured is None:
                grid.eager = True
            else:
                grid.graph, grid.logits = captured
        graph = grid.graph
        if graph is None or not self.graphs:
            fn = self.eager_function(grid)

            def eager() -> None:
                grid.logits = fn()

            return eager

        def replay() -> None:
            with self.model.timer.region(self.device):
                graph.replay()

        return replay

    def try_capture(self, what: str, fn: Callable[[], T], *,
                    own_pool: bool = False) -> tuple[torch.cuda.CUDAGraph, T] | None:
        """``capture``, or None where it runs out of device memory: the graphs are captured lazily, the first time
        a shape is met while serving, after the KV cache took its share of the device, so a capture may find too
        little left. Then the caller runs ``fn`` eagerly instead (slower, the same outputs) and nothing else
        fails: the memory the failed capture held is given back and the failure recorded (``capture_failures``)
        and logged once per shape. ``own_pool``: the graph in a memory pool of its own (the draft's steps)."""
        try:
            pool = torch.cuda.graph_pool_handle() if own_pool else None
            return self.capture(fn, pool)
        except RuntimeError as e:  # torch.OutOfMemoryError is one
            if not out_of_memory(e):
                raise
            reason = str(e).splitlines()[0] if str(e) else type(e).__name__
        self.capture_failures.append(f"{what}: {reason}")
        log.warning("CUDA graph capture of the %s ran out of memory (%s): it runs eagerly from now on; give the KV "
                    "cache less (--kv-memory-fraction or --kv-memory-mb) to leave the graphs room", what, reason)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            torch.cuda.empty_cache()
        return None

    def capture(self, fn: Callable[[], T], pool: tuple[int, int] | None = None) -> tuple[torch.cuda.CUDAGraph, T]:
        """Warm up on a side stream (lazy initialisations must not be captured), then capture ``fn`` into a CUDA
        graph: the graph, and ``fn``'s outputs, which each replay overwrites. In ``pool`` when given (the draft's
        steps keep one pool per search shape, replayed in the order captured: speculation/draft_steps.py), else in
        the pool every bucket's graph of this model shares.

        The warm-up runs on the buffers already filled for this forward, so its KV writes are the ones the
        replay makes again: the same values in the same slots.
        """
        stream = torch.cuda.Stream(self.device)
        stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream):
            fn()
        torch.cuda.current_stream(self.device).wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self._pool if pool is None else pool):
            out = fn()
        if pool is None:
            self._pool = graph.pool()
        return graph, out
