"""A beam search's draft levels, planned once per speculation instead of once per level (issue 30).

Beam search (speculation/speculate.py) feeds the draft one level of every request's candidate tree at a time:
level l's ``sizes[l]`` new nodes of each request, which see the request's committed prefix (``L_b`` keys: the
root sits at key index ``L_b``) and their ancestors in the tree. Every tree has the same number of nodes at
every level, and the picks never shape a level, so what the host prepares for level l depends only on l, the
sizes and each request's ``L_b``:

    tree nodes before the level   c = sizes[0] + ... + sizes[l-1];  after it  s = c + sizes[l]
    position of a new node        L_b + l                            (its depth is l)
    write slot of new node r      slot of key index L_b + c + r
    key slots                     [n, K] with K = max_b L_b + s: key k of request b is key min(k, L_b + s - 1)
    mask row bounds               a tree row sees keys [0, L_b) and its ancestors' cells L_b + j, j < s
                                  (chains, width 1: keys [0, L_b + s), and no cells)

``BeamLevels`` computes every level's arrays in one host pass, stages them together and sends them in one
copy; a level's forward then reads its slices, builds its mask from the ancestor rows on the device
(``masks.fill_grid_mask``: the tree cells of level l are each row's first s bits) and runs the model: with the
torch backend on its single grid (``TorchAttention.use_grid``), on the static path through the bucket's buffers
(the arrays padded to the bucket as ``StaticForward._fill`` pads them; a CUDA graph replays there). These are
the arrays, bit for bit, that ``build_layout`` with ``TorchAttention.plan`` or ``StaticForward._fill`` compute
from the level's own layout: ``tests/engine/speculation/test_beam_on_device.py`` holds the trees to that.

On a CPU whose kernels pick the levels (``host_masks``: speculate.beam_search decides) a lone request's torch-grid
masks are made in host memory instead, by numpy, when the levels are planned: a level's bounds as a slice, its tree
cells copied as one block from the ancestor rows (which the picks kernel grows there) right before its forward,
instead of the device's staged arrays and five ops; the same bits (tests/engine/model/test_levels.py). A batch keeps
the device's masks: made by numpy too they read a tie at 32 requests (docs/benchmarks.md, eighteenth round), not
worth a second batch mask path.

One request without a sliding window is planned in slices of its slots (``_plan_lone``; on static buckets, a GPU's
path, ``_plan_lone_static``, padded to each bucket), held to the batch plan's arrays by
tests/engine/model/test_levels.py.

The flashinfer backend, tensor parallel ranks and a level no static bucket fits lay out each level from its
placeholder trees, as any forward (``"laid_out"``): one plan and one copy per level, as before.

With ``pending`` (each request's tokens the draft has not seen, the root last) the plan also holds level 0, the
catch-up forward that feeds them (``catch_up``), on the torch backend's grid or on the static bucket its chains
would take: the arrays ``build_layout`` and ``TorchAttention.plan`` (or ``StaticForward._fill``) make for those
chains, so one speculation plans and copies once (issue 30). The other backends lay the catch-up out as before
(``folds_catch_up`` is False).
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Sequence
from typing import NamedTuple

import numpy as np
import torch

from adaserve.engine.model.attention.masks import fill_grid_mask
from adaserve.engine.model.attention.torch_sdpa import TorchAttention, group_segments
from adaserve.engine.model.batch import DeviceNodes, Segment, page_table
from adaserve.engine.model.kv_cache import SequenceKV, page_slots
from adaserve.engine.model.runner import ModelRunner, chunk_cells, joined_rows
from adaserve.engine.model.staging import HostStage
from adaserve.engine.model.static import INT_ROWS, int_views, pack_ints
from adaserve.engine.model.tree import TokenTree


class _HostMask(NamedTuple):
    """A lone request's level mask made in host memory (``host_masks``): its bounds set when planned, its tree cells
    filled from the ancestor rows before its forward, as one block (rows r, keys L + j from ancestor rows c + r,
    columns j < s)."""

    grid: np.ndarray  # [1, Q, K] bool
    tensor: torch.Tensor  # the same memory, as the [1, 1, Q, K] the attention reads (``use_grid``)
    block: tuple[int, int, int, int] | None = None  # (L, c, a, s); None: a chain's, complete when planned


def _padded(real: np.ndarray, fill: int, g: int, q: int) -> np.ndarray:
    """[n, a, ...] real rows into a [G, Q, ...] grid, padding rows and segments with ``fill``."""
    if real.shape[:2] == (g, q):
        return real
    out = np.full((g, q, *real.shape[2:]), fill, np.int64)
    out[: real.shape[0], : real.shape[1]] = real
    return out


class BeamLevels:
    """The draft forwards of levels 1 .. len(sizes) - 1 of a beam search over ``seqs``.

    ``sizes[l]``: nodes per tree at level l (``sizes[0] == 1``, the root). Each sequence's ``length`` counts its
    committed tokens, the root last; with ``pending`` its committed tokens before the catch-up (``catch_up``),
    which the caller commits once the search is done (until then ``truncate`` would drop the levels' pages).
    ``forward(l, ids, ancestors)`` runs level l and returns its logits ``[n * sizes[l], V]``, request-major.

    Each level runs one of three ways, chosen here: on the torch backend's grid (``"torch"``: ``[n, sizes[l]]``
    rows, exactly the arrays ``TorchAttention.plan`` would make), on a static bucket (``"static"``: the same
    arrays padded to the bucket's ``[G, Q]`` rows and K keys, as ``StaticForward._fill`` pads them), or laid out
    from a placeholder tree like any forward (``"laid_out"``: flashinfer, tensor parallel ranks, a level past
    the static buckets, the static path's poison test).
    """

    def __init__(self, runner: ModelRunner, seqs: Sequence[SequenceKV], sizes: Sequence[int],
                 pending: Sequence[Sequence[int]] | None = None, *, host_masks: bool = False) -> None:
        if len(sizes) < (1 if pending is not None else 2) or sizes[0] != 1 or min(sizes) < 1:
            raise ValueError(f"beam levels need the root and at least one level of nodes, got sizes {list(sizes)}")
        if pending is not None and (len(pending) != len(seqs) or min(map(len, pending), default=1) < 1):
            raise ValueError("the catch-up needs every sequence's pending tokens, the root last")
        self.runner, self.seqs, self.sizes = runner, list(seqs), list(sizes)
        # L_b: each root's key index (the committed tokens before it; with ``pending``, the catch-up's too)
        waiting = [0] * len(self.seqs) if pending is None else [len(p) for p in pending]
        self.prefix = np.fromiter((s.length + w - 1 for s, w in zip(self.seqs, waiting, strict=True)), np.int64,
                                  len(self.seqs))
        # the reductions' C forms (ufuncs), not the methods' Python layer (issue 30: planned once an iteration)
        self.context = int(np.add.reduce(self.prefix))  # the committed keys all requests' roots see
        # the catch-up's attention cells: each sequence's pending tokens as a chunk over its committed keys
        self._catch_up_cells = (0 if pending is None
                                else sum(map(chunk_cells, waiting, (s.length for s in self.seqs))))
        self._longest = int(np.maximum.reduce(self.prefix))  # the longest root's key index
        self.pending = None if pending is None else [list(p) for p in pending]
        self.ends = list(itertools.accumulate(self.sizes))  # tree size after each level (Python ints)
        self.stage = HostStage(runner.device)
        # per level: how, G, Q, K; level 0 is the catch-up (planned only with ``pending``, on the torch grid or a
        # static bucket)
        self._grids: list[tuple[str, int, int, int]] = [self._how_catch_up()]
        # a lone request's torch-grid masks made on the host (a CPU's, ``host_masks``), by level
        self._host_masks = host_masks and runner.device.type == "cpu"
        self.masks: dict[int, _HostMask] = {}
        self._rows: tuple[torch.Tensor, np.ndarray] | None = None  # the ancestor rows the host masks read, as numpy
        # where a static level's integers[, tree cells, sources] sit in "static.levels"
        self._static_at: dict[int, list[slice]] = {}
        self._plan()

    @property
    def tree_size(self) -> int:
        """S: each tree's nodes after the last level, the side of the ancestor rows ``forward`` reads."""
        return self.ends[-1]

    @property
    def folds_catch_up(self) -> bool:
        """Level 0, the catch-up forward, runs from this plan (``catch_up``); otherwise the caller lays it out."""
        return self._grids[0][0] in ("torch", "static")

    def _how_catch_up(self) -> tuple[str, int, int, int]:
        """How the catch-up runs: on a static bucket (the one its chains laid out would take: G the batch's bucket,
        Q the most pending tokens', K the longest context's), or on the torch backend's grid when
        ``TorchAttention.plan`` would put its chains in one group (G = n, Q = the most pending tokens, K = the
        longest context), else not here."""
        runner = self.runner
        if self.pending is None or type(runner).compute is not ModelRunner.compute:
            return "", 0, 0, 0
        counts = [len(p) for p in self.pending]
        if runner.static is not None:
            shape = runner.static.shape_for(len(counts), max(counts), self._longest + 1)
            if shape is None or runner.static.poison is not None:
                return "", 0, 0, 0
            return "static", *shape
        if not isinstance(runner.backend, TorchAttention) or len(group_segments(counts)) != 1:
            return "", 0, 0, 0
        return "torch", len(counts), max(counts), self._longest + 1

    def _how(self, level: int) -> tuple[str, int, int, int]:
        """How level ``level`` runs, and its grid: (G, Q, K)."""
        runner, n, a = self.runner, len(self.seqs), self.sizes[level]
        keys = self._longest + self.ends[level]
        if type(runner).compute is not ModelRunner.compute:  # a runner that lays out its own forwards
            return "laid_out", 0, 0, 0
        if runner.static is not None:
            shape = runner.static.shape_for(n, a, keys)
            if shape is None or runner.static.poison is not None:
                return "laid_out", 0, 0, 0
            return "static", *shape
        if isinstance(runner.backend, TorchAttention):
            return "torch", n, a, keys
        return "laid_out", 0, 0, 0

    def _plan(self) -> None:
        """Every planned level's host arrays, staged for one copy (the first level's forward sends them)."""
        self._grids += [self._how(level) for level in range(1, len(self.sizes))]
        if all(how in ("laid_out", "") for how, *_ in self._grids):
            return
        cache = self.runner.cache
        for s, end in zip(self.seqs, (self.prefix + self.ends[-1]).tolist(), strict=True):
            cache.ensure(s, end)  # the deepest level's pages: every level's slots exist from here on
        lone = len(self.seqs) == 1 and self.runner.model.cfg.sliding_window is None
        # the ways the fed levels run; none at all for a one-level search (depth 1: the catch-up alone, the policies'
        # usual pick at one request, which took the batch plan and the device's mask before)
        levels = {how for how, *_ in self._grids[1:]}
        if lone and self._grids[0][0] != "static" and levels <= {"torch"}:
            self._plan_lone()
        elif lone and self._grids[0][0] in ("static", "") and levels <= {"static"}:
            self._plan_lone_static()
        else:
            self._plan_batch()

    def _plan_lone(self) -> None:
        """``_plan_batch``'s arrays for one request on the torch grid, without a sliding window, in a few slices of
        its slots (issue 30: at one request the batch's padding and per-request index arithmetic were most of the
        plan's host time). L: the root's key index; slot[i]: the cache slot of key index i. Level l, c tree nodes
        before it and s after (a = s - c new), S the last level's s:

            positions    L + l, a of them           write slots   slot[L + c : L + s]
            key slots    slot[0 : K], K = L + s     (one request: no key is padding)
            hi           L + s (a chain sees its own nodes through the bound), L (a tree)
            cells        r * K + L + j              src           (c + r) * S + j        (r < a, j < s)

        The catch-up's p pending tokens sit at key indices P .. L (P = L + 1 - p): positions P .. L, write slots
        slot[P : L + 1], key slots slot[0 : L + 1], hi P + r + 1 for row r, logits row p - 1 (when p > 1).
        The same arrays as ``_plan_batch`` (tests/engine/model/test_levels.py)."""
        seq, ps, put, host = self.seqs[0], self.runner.cache.page_size, self.stage.put, self._host_masks
        lone, side = int(self.prefix[0]), self.tree_size
        slot = seq.slots(0, lone + side, ps)
        if self.folds_catch_up:
            assert self.pending is not None
            p = len(self.pending[0])
            first = lone + 1 - p
            put("0.ids", np.asarray(self.pending[0], np.int64))
            put("0.positions", np.arange(first, lone + 1))
            put("0.write_slots", slot[first : lone + 1])
            put("0.key_slots", slot[: lone + 1].reshape(1, lone + 1))
            if host:  # row r sees keys j <= P + r (a few rows: a slice each)
                grid = np.zeros((1, p, lone + 1), bool)
                for r in range(p):
                    grid[0, r, : first + r + 1] = True
                self.masks[0] = _HostMask(grid, torch.from_numpy(grid[:, None]))
            else:
                put("0.hi", np.arange(first + 1, lone + 2).reshape(1, p, 1))
            if p > 1:
                put("0.logits_rows", np.array([p - 1]))
        for level in range(1, len(self.sizes)):
            c, size = self.ends[level - 1], self.ends[level]
            a, k = size - c, lone + size
            chain = size == level + 1  # one node per level so far
            put(f"{level}.positions", np.array([lone + level] * a))  # one call (np.full is two and a Python frame)
            put(f"{level}.write_slots", slot[lone + c : lone + size])
            put(f"{level}.key_slots", slot[:k].reshape(1, k))
            if host:  # a chain's rows see every key; a tree's the prefix, then its cells (``_host_mask``)
                if chain:
                    grid = np.ones((1, a, k), bool)
                else:
                    grid = np.zeros((1, a, k), bool)
                    grid[0, :, :lone] = True
                self.masks[level] = _HostMask(grid, torch.from_numpy(grid[:, None]),
                                              block=None if chain else (lone, c, a, size))
                continue
            put(f"{level}.hi", np.full((1, a, 1), k if chain else lone))
            if not chain:
                j, r = np.arange(size), np.arange(a)[:, None]
                put(f"{level}.cells", (r * k + (lone + j)).ravel())
                put(f"{level}.src", ((c + r) * side + j).ravel())

    def _plan_lone_static(self) -> None:
        """``_plan_batch``'s arrays for one request on static buckets (a GPU's path: G = 1), without a sliding window:
        ``_plan_lone``'s arrays padded to each bucket's Q rows and K keys, written into the bucket's integer layout
        (``static.int_views``). A padded row has position 0, writes to the scratch slot and sees key 0 only (hi 1);
        key k past the level's last real key L + s - 1 repeats that key's slot (masked). The catch-up's p pending
        tokens fill rows 0 .. p - 1 of its bucket, with key slots up to key L (``_plan_catch_up``). The same arrays
        as ``_plan_batch`` (tests/engine/model/test_levels.py)."""
        seq, ps, put = self.seqs[0], self.runner.cache.page_size, self.stage.put
        scratch = self.runner.cache.scratch_slot
        lone, side = int(self.prefix[0]), self.tree_size
        slot = seq.slots(0, lone + side, ps)

        def bucket(q: int, k: int, rows: int, last_key: int) -> tuple[np.ndarray, ...]:
            """A bucket's integers, ids 0 and lo 0, padded rows set, key slots up to key ``last_key``, the rest
            repeating it; returns the array and its views (ids, positions, write slots, hi)."""
            host = np.zeros(len(INT_ROWS) * q + k, np.int64)
            ids, positions, write_slots, hi, _, keys = int_views(host, 1, q, k)
            write_slots[rows:] = scratch
            hi[0, rows:] = 1
            keys[0, : last_key + 1] = slot[: last_key + 1]
            keys[0, last_key + 1 :] = slot[last_key]
            return host, ids, positions, write_slots, hi

        if self.folds_catch_up:
            assert self.pending is not None
            q, k = self._grids[0][2:]
            p = len(self.pending[0])
            first = lone + 1 - p
            host, ids, positions, write_slots, hi = bucket(q, k, p, lone)
            ids[:p] = self.pending[0]
            positions[:p] = np.arange(first, lone + 1)
            write_slots[:p] = slot[first : lone + 1]
            hi[0, :p] = positions[:p] + 1
            put("0.ints", host)
            put("0.at", np.array([p - 1]))
        parts: list[np.ndarray] = []  # every level's integers, then (a tree's level) its cells and their sources
        offset = 0
        for level in range(1, len(self.sizes)):
            q, k = self._grids[level][2:]
            c, size = self.ends[level - 1], self.ends[level]
            a = size - c
            chain = size == level + 1  # one node per level so far
            host, _, positions, write_slots, hi = bucket(q, k, a, lone + size - 1)
            positions[:a] = lone + level
            write_slots[:a] = slot[lone + c : lone + size]
            hi[0, :a] = lone + size if chain else lone  # a chain sees its own nodes through the bound
            put(f"{level}.at", np.arange(a))
            level_parts = [host]
            if not chain:  # cells r * K + L + j, their bits (c + r) * S + j of the ancestor rows
                j, r = np.arange(size), np.arange(a)[:, None]
                level_parts += [(r * k + (lone + j)).ravel(), ((c + r) * side + j).ravel()]
            spans = []
            for x in level_parts:
                spans.append(slice(offset, offset + x.size))
                offset += x.size
            self._static_at[level] = spans
            parts += level_parts
        if parts:  # none for a one-level search: the catch-up alone
            put("static.levels", np.concatenate(parts))

    def _plan_batch(self) -> None:
        """``_plan`` for any batch, grid and window (``_plan_lone`` is its one-request case)."""
        cache = self.runner.cache
        ps = cache.page_size
        n, prefix = len(self.seqs), self.prefix
        table = page_table([s.pages for s in self.seqs], prefix + self.ends[-1], ps)
        # [n, pages * P]: the cache slot of every key index of each sequence, up to the deepest level's (issue 30:
        # one lookup per array below, not the page arithmetic of each)
        slots = page_slots(table, ps)
        b = np.arange(n)[:, None]
        # slots[b, i] as one flat take: half the cost of numpy's two-array indexing at 32 requests
        flat, row0 = slots.ravel(), b * slots.shape[1]
        scratch = cache.scratch_slot
        window = self.runner.model.cfg.sliding_window
        depths = np.arange(len(self.sizes)).repeat(self.sizes)  # of every tree node
        side = self.tree_size  # of the [n, S, S] ancestor rows every level reads
        put = self.stage.put
        if self.folds_catch_up:
            self._plan_catch_up(flat, row0, window)
        statics: list[np.ndarray] = []  # the static levels' integers, tree cells and sources, level after level
        for level, (how, g, q, k) in enumerate(self._grids):
            if level == 0 or how == "laid_out":
                continue
            first = len(statics)
            c, a, size = self.ends[level - 1], self.sizes[level], self.ends[level]
            chain = size == level + 1  # one node per level so far

            index = prefix[:, None] + c + np.arange(a)  # [n, a] key index of each new node
            # flat [G * Q], as the forward reads them
            positions = _padded((prefix + level).repeat(a).reshape(n, a), 0, g, q).ravel()
            write_slots = _padded(flat[row0 + index], scratch, g, q).ravel()
            k_idx = np.minimum(np.arange(k)[None, :], (prefix + size - 1)[:, None])  # padding: the last real key
            keys = flat[row0 + k_idx]
            keys = keys if g == n else np.concatenate([keys, np.full((g - n, k), scratch)])
            hi = prefix + size if chain else prefix  # chains see their own nodes through the bound
            hi = _padded(hi.repeat(a).reshape(n, a, 1), 1, g, q)  # padding: key 0 only
            lo = None
            if window is not None:  # positions by depth: a new node is at L_b + level
                lo = np.maximum(prefix + level - window + 1, 0)
                lo = _padded(lo.repeat(a).reshape(n, a, 1), 0, g, q)
            if how == "static":  # the bucket's integers as one array (its ids come from the picks)
                statics.append(pack_ints(g, q, k, ids=np.zeros(g * q, np.int64), positions=positions,
                                         write_slots=write_slots, hi=hi, lo=lo, key_slots=keys))
                put(f"{level}.at", (b * q + np.arange(a)).ravel())  # grid row of each real token
            else:
                put(f"{level}.positions", positions)
                put(f"{level}.write_slots", write_slots)
                put(f"{level}.key_slots", keys)
                put(f"{level}.hi", hi)
                if lo is not None:
                    put(f"{level}.lo", lo)
            if not chain:
                # tree cell (b, r, j): key L_b + j of row r, its value ancestor bit [b, c + r, j] of the [n, S, S]
                # rows; with a window only the keys within it (query depth ``level``, key depth depths[j])
                j = np.flatnonzero(level - depths[:size] < window) if window is not None else np.arange(size)
                r = np.arange(a)[None, :, None]
                cells = ((b[:, :, None] * q + r) * k + prefix[:, None, None] + j).ravel()
                src = ((b[:, :, None] * side + c + r) * side + j).ravel()
                if how == "static" and g > n:  # as many as the bucket's G requests would have (the draft's steps,
                    # draft_steps.py, keep them in buffers of one size): the rest set key 0 of a padded row, which
                    # sees it anyway, to bit [0, 0, 0] (a root is its own ancestor: true)
                    extra = (g - n) * cells.size // n
                    cells = np.concatenate([cells, np.full(extra, (g - 1) * q * k)])
                    src = np.concatenate([src, np.zeros(extra, np.int64)])
                if how == "static":
                    statics += [cells, src]
                else:
                    put(f"{level}.cells", cells)
                    put(f"{level}.src", src)
            if how == "static":  # where the level's arrays sit in the static levels' one array
                at = sum(x.size for x in statics[:first])
                ends = np.cumsum([at] + [x.size for x in statics[first:]]).tolist()
                self._static_at[level] = [slice(a, b) for a, b in itertools.pairwise(ends)]
        if statics:
            put("static.levels", np.concatenate(statics))

    def _plan_catch_up(self, slots: np.ndarray, row0: np.ndarray, window: int | None) -> None:
        """The catch-up's arrays, as ``build_layout`` and ``TorchAttention.plan`` (or ``StaticForward._fill``) make
        them for the chains of pending tokens (prefix ``P_b = L_b + 1 - p_b``, p_b tokens; n requests on a grid of
        G = n segments, or on a static bucket of G >= n):

            token r of request b        key index P_b + r = its position; grid row b * Q + r
            key k of request b          key min(k, L_b)   (padding repeats the last real key; padded segments
                                        read the scratch slot)
            mask bound                  hi = P_b + r + 1 for a real row, 1 for a padding row; with a window
                                        lo = max(P_b + r - window + 1, 0), 0 for padding
            logits rows                 each request's last token (on the torch grid none staged when every
                                        row is one)

        ``slots`` [n * K'] flat: the cache slot of each sequence's key indices, sequence b's from ``row0[b]``
        (``_plan``). On a static bucket the integers are one array laid out as its buffer (``static.int_views``).
        """
        how, g, q, k = self._grids[0]
        assert self.pending is not None
        put, n = self.stage.put, len(self.pending)
        counts = np.fromiter(map(len, self.pending), np.int64, n)
        seg = np.arange(n).repeat(counts)
        starts = counts.cumsum() - counts  # each request's first flat token
        r = np.arange(len(seg)) - starts[seg]
        first = self.prefix + 1 - counts  # P_b
        index = first[seg] + r
        tokens = np.concatenate(self.pending) if n > 1 else np.asarray(self.pending[0], np.int64)
        k_idx = np.minimum(np.arange(k)[None, :], self.prefix[:, None])
        if how == "static":
            at = seg * q + r  # grid row of each pending token
            host = np.empty(len(INT_ROWS) * g * q + g * k, np.int64)
            ids, positions, write_slots, hi, lo, keys = int_views(host, g, q, k)
            ids[:], positions[:], write_slots[:], hi[:], lo[:] = 0, 0, self.runner.cache.scratch_slot, 1, 0
            ids[at], positions[at], write_slots[at] = tokens, index, slots[row0[seg, 0] + index]
            hi.ravel()[at] = index + 1
            if window is not None:
                lo.ravel()[at] = np.maximum(index - window + 1, 0)
            keys[:n] = slots[row0 + k_idx]
            keys[n:] = self.runner.cache.scratch_slot
            put("0.ints", host)
            put("0.at", np.arange(n) * q + counts - 1)  # each request's last token: its root
            return
        put("0.ids", tokens)
        put("0.positions", index)
        put("0.write_slots", slots[row0[seg, 0] + index])
        if g > 1:
            put("0.rows", seg * q + r)
        put("0.key_slots", slots[row0 + k_idx])
        row = np.arange(q)[None, :]
        real = row < counts[:, None]
        put("0.hi", np.where(real, first[:, None] + row + 1, 1)[:, :, None])
        if window is not None:
            put("0.lo", np.where(real, np.maximum(first[:, None] + row - window + 1, 0), 0)[:, :, None])
        if len(seg) != g:
            put("0.logits_rows", starts + counts - 1)

    def static_shape(self) -> tuple[tuple[int, int, int], ...] | None:
        """Each fed level's static bucket (G, Q, K), levels 1 .. len(sizes) - 1, or None unless every one of them runs
        on one (then the draft's steps can run them: speculation/draft_steps.py)."""
        levels = self._grids[1:]
        if not levels or any(how != "static" for how, *_ in levels):
            return None
        return tuple((g, q, k) for _, g, q, k in levels)

    def static_inputs(self, level: int) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
        """A static level's staged arrays on the device: its bucket's integers (ids zero), its tree cells' flat
        places in the bucket's [G, Q, K] tree buffer and their sources in the [G, S, S] ancestor rows (None for a
        chain's level), the cells padded to the bucket's G requests: views of ``static_levels()``."""
        block = self.static_levels()
        ints, *cells_src = [block[span] for span in self.static_offsets(level)]
        cells, src = cells_src or (None, None)
        return ints, cells, src

    def static_levels(self) -> torch.Tensor:
        """Every static level's arrays, one after another, as one device tensor (the draft's steps copy it once)."""
        return self.stage.get("static.levels")

    def static_offsets(self, level: int) -> list[slice]:
        """Where level ``level``'s integers[, tree cells, sources] sit in ``static_levels()``."""
        if level not in self._static_at:
            raise ValueError(f"level {level} does not run on a static bucket")
        return self._static_at[level]

    def report(self, level: int, t0: float) -> None:
        """Tell the runner's listeners about level ``level``'s forward, begun at ``perf_counter()`` ``t0`` (as
        ``forward`` does, for a caller that ran the level itself)."""
        n, a, c = len(self.seqs), self.sizes[level], self.ends[level - 1]
        # a request's a nodes read its root's keys and the c tree nodes before the level, counted as a chunk (each
        # sees itself; one another's keys are masked out, a few cells): chunk_cells(a, L_b + c) summed
        self.runner.record(n_new=n * a, n_context=self.context + n * c,
                           n_cells=a * (self.context + n * c) + n * chunk_cells(a, 0), t0=t0)

    def _host_mask(self, level: int, ancestors: torch.Tensor | None) -> torch.Tensor:
        """Level ``level``'s host mask with its tree cells filled from ``ancestors`` ([1, S, S] on the CPU): the bits
        ``fill_grid_mask`` sets on the device, copied by numpy."""
        m = self.masks[level]
        if ancestors is not None and m.block is not None:
            if self._rows is None or self._rows[0] is not ancestors:  # one numpy view a search, not one a level
                self._rows = (ancestors, ancestors.numpy())
            lone, c, a, s = m.block
            m.grid[0, :, lone : lone + s] = self._rows[1][0, c : c + a, :s]
        return m.tensor

    def catch_up(self) -> torch.Tensor:
        """The catch-up forward planned here (``folds_catch_up``): logits ``[n, V]`` of each request's last pending
        token, the root, exactly as ``ModelRunner.forward`` of the chains with ``all_logits`` False computes them;
        reported to the runner's listeners like any forward. The caller commits the pending tokens afterwards."""
        if not self.folds_catch_up:
            raise ValueError("the catch-up is not planned here: lay it out (ModelRunner.forward)")
        t0 = time.perf_counter()
        runner, get, stage = self.runner, self.stage.get, self.stage
        how, g, q, k = self._grids[0]
        assert self.pending is not None
        if how == "static":  # one copy of the bucket's integers, no tree cells
            static = runner.static
            assert static is not None
            grid = static.grid((g, q, k))
            grid.ints.copy_(get("0.ints"))
            grid.set_cells(None, None)
            logits = static.run(grid, get("0.at"))
        else:
            backend = runner.backend
            assert isinstance(backend, TorchAttention)
            if 0 in self.masks:
                mask = self.masks[0].tensor
            else:
                lo = get("0.lo") if runner.model.cfg.sliding_window is not None else None
                mask = fill_grid_mask(backend.columns(k, runner.device), get("0.hi"), lo, None, None)
            backend.use_grid(get("0.write_slots"), get("0.key_slots"), mask, get("0.rows") if g > 1 else None)
            rows = get("0.logits_rows") if "0.logits_rows" in stage else None
            logits = runner.model.forward(get("0.ids"), get("0.positions"), backend=backend, cache=runner.cache,
                                          logits_rows=rows)
        n_new = sum(map(len, self.pending))
        runner.record(n_new=n_new, n_context=self.context + len(self.seqs) - n_new, n_cells=self._catch_up_cells,
                      t0=t0)
        return logits

    def forward(self, level: int, ids: torch.Tensor, ancestors: torch.Tensor | None) -> torch.Tensor:
        """Level ``level``'s logits ``[n * sizes[level], V]``; ``ids`` [n * sizes[level]] its picked tokens in
        request-major order, ``ancestors`` [n, S, S] (S = ``tree_size``) the trees' ancestor rows, filled for every
        node up to this level's (None while every tree is a chain; later rows are not read). Reports the forward
        to the runner's listeners, as ``ModelRunner.forward`` does."""
        want = (len(self.seqs), self.tree_size, self.tree_size)
        if ancestors is not None and tuple(ancestors.shape) != want:
            raise ValueError(f"ancestor rows of shape {tuple(ancestors.shape)}, expected {want}")
        how, g, q, k = self._grids[level]
        if how == "laid_out":
            return self._forward_laid_out(level, ids, ancestors)
        t0 = time.perf_counter()
        runner, get = self.runner, self.stage.get
        tree = self.ends[level] > level + 1  # not a chain: the tree cells read the ancestor rows
        if tree and ancestors is None:
            raise ValueError("trees that are not chains need their ancestor rows on the device")
        if how == "torch":
            backend = runner.backend
            assert isinstance(backend, TorchAttention)
            if level in self.masks:  # made on the host
                mask = self._host_mask(level, ancestors)
            else:
                cells = values = None
                if tree:
                    assert ancestors is not None
                    cells, values = get(f"{level}.cells"), torch.take(ancestors, get(f"{level}.src"))
                lo = get(f"{level}.lo") if runner.model.cfg.sliding_window is not None else None
                mask = fill_grid_mask(backend.columns(k, runner.device), get(f"{level}.hi"), lo, cells, values)
            backend.use_grid(get(f"{level}.write_slots"), get(f"{level}.key_slots"), mask)
            logits = runner.model.forward(ids, get(f"{level}.positions"), backend=backend, cache=runner.cache)
        else:  # the bucket's buffers: one copy of the integers, the picked ids, the tree cells (the graph masks)
            static = runner.static
            assert static is not None
            ints, cells, src = self.static_inputs(level)  # cells only for a tree's level
            values = None if cells is None or ancestors is None or src is None else torch.take(ancestors, src)
            grid = static.grid((g, q, k))
            at = get(f"{level}.at")
            grid.ints.copy_(ints)
            grid.ids.index_copy_(0, at, ids)
            grid.set_cells(cells, values)
            logits = static.run(grid, at)
        self.report(level, t0)
        return logits

    def _forward_laid_out(self, level: int, ids: torch.Tensor, ancestors: torch.Tensor | None) -> torch.Tensor:
        """The level as any forward: each request's segment with a placeholder tree of the level's shape (each
        level hangs off the previous level's first node), laid out and planned by the runner."""
        size, c = self.ends[level], self.ends[level - 1]
        parents = np.full(size, -1, np.int64)
        for lv in range(1, level + 1):
            parents[self.ends[lv - 1] : self.ends[lv]] = self.ends[lv - 2] if lv > 1 else 0
        tree = TokenTree.trusted(np.zeros(size, np.int64), parents, np.zeros(size))
        segs = [Segment(s, p, tree, num_cached=c) for s, p in zip(self.seqs, self.prefix.tolist(), strict=True)]
        rows = None if tree.is_chain or ancestors is None else ancestors[:, :size, :size]  # the tree so far
        out = self.runner.forward(segs, all_logits=[True] * len(segs), on_device=DeviceNodes(ids, rows))
        return joined_rows(out)
