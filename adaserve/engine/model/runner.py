"""A model, its KV cache and its attention backend: one ragged forward per call."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import NamedTuple, Protocol

import numpy as np
import torch

from adaserve.engine.model.attention import make_backend
from adaserve.engine.model.batch import DeviceNodes, Segment, build_layout
from adaserve.engine.model.kv_cache import KVCacheConfig, PagedKVCache
from adaserve.engine.model.layers import CausalLM
from adaserve.engine.model.quant import Int8Head
from adaserve.engine.model.static import StaticForward


def chunk_cells(new: int, cached: int) -> int:
    """The attention cells of one sequence's ``new`` tokens over its ``cached`` ones, counted as a causal chunk: the
    chunk's token j (from 0) attends to the cached keys and to the chunk's keys 0 .. j, so ``new * cached +
    new (new + 1) / 2``. What the cost model's beta prices (engine/cost/cost_model.py); a tree's nodes see fewer of
    the new keys (their ancestors), tens of cells against a verification's thousands."""
    return new * cached + new * (new + 1) // 2


class ForwardRecord(NamedTuple):
    """What one forward did, for whoever listens (the simulated clock prices it by a device model). A named tuple:
    made after every forward, at a fraction of a frozen dataclass's cost (issue 30)."""

    n_new: int  # tokens computed
    n_context: int  # cached tokens they attended to (every segment's prefix and cached tree nodes)
    wall_s: float  # host time the call took (no device sync: exact on CPU only)
    n_cells: int  # the attention cells: each segment's new tokens over its cached ones as a causal chunk, summed
    # (``chunk_cells``)


def joined_rows(parts: list[torch.Tensor]) -> torch.Tensor:
    """``torch.cat(parts)`` of 2-D row blocks, without the copy when they are consecutive blocks of one tensor
    (``ModelRunner.forward``'s per-segment logits are): a view of those rows instead (issue 30: a level's
    or a verification's logits are [rows, V], and copying them cost as much as reducing them)."""
    first = parts[0]
    if first.dim() == 2 and first.is_contiguous():
        rows, width = first.shape
        at = first.storage_offset() + rows * width
        storage = first.untyped_storage().data_ptr()
        for p in parts[1:]:
            if (p.dim() != 2 or p.shape[1] != width or not p.is_contiguous() or p.dtype != first.dtype
                    or p.storage_offset() != at or p.untyped_storage().data_ptr() != storage):
                break
            rows += p.shape[0]
            at += p.shape[0] * width
        else:
            return first.as_strided((rows, width), (width, 1))
    return torch.cat(parts)


class ForwardSettings(Protocol):
    """What a runner reads of its configuration: ``engine.config.EngineConfig`` is one."""

    @property
    def attention(self) -> str: ...  # one of attention.ATTENTION_BACKENDS

    @property
    def kv(self) -> KVCacheConfig: ...

    @property
    def static_shapes(self) -> bool: ...  # decode-sized forwards on padded static buffers (static.py)


class ModelRunner:
    def __init__(self, model: CausalLM, cfg: ForwardSettings | None = None) -> None:
        self.model = model
        self.device = model.lm_head.weight.device
        self.dtype = model.lm_head.weight.dtype
        kv = cfg.kv if cfg is not None else KVCacheConfig()
        self.cache = PagedKVCache(model.cfg, kv, dtype=self.dtype, device=self.device)
        self.backend = make_backend(cfg.attention if cfg is not None else "auto", model.cfg, self.device,
                                    native=model.attention_kernels())
        # static shapes: CUDA graphs replayed on a GPU, the same function called eagerly on a CPU
        self.static = StaticForward(model, self.cache) if cfg is not None and cfg.static_shapes else None
        self.forward_listeners: list[Callable[[ForwardRecord], None]] = []
        self.last_forward: ForwardRecord | None = None  # the latest call's counts (the engine times drafts by it)
        # the latest ``forward``'s logits rows' first maxima when its LM head found them (an int8 head on the integer
        # kernels: Int8Head.last_argmax), [rows] int64 in the logits' row order; else None. A greedy draw at a row whose
        # logits nothing changed takes it instead of scanning the vocabulary again (verify.draw_at_nodes)
        self.last_argmax: torch.Tensor | None = None

    @property
    def capture_failures(self) -> list[str]:
        """The static path's CUDA graph captures that ran out of memory (``StaticForward.try_capture``: those shapes
        run eagerly, slower than their graphs would); none without static shapes, and none on a CPU."""
        return [] if self.static is None else list(self.static.capture_failures)

    def compute(self, segments: list[Segment], rows: list[int], on_device: DeviceNodes | None = None) -> torch.Tensor:
        """One forward over ``segments`` (their pages already allocated): logits ``[len(rows), V]`` of the
        flat token rows ``rows``. A tensor-parallel worker rank calls this with the rows it is sent (none).
        ``on_device``: the new tokens' ids and ancestor rows already on the device (beam levels)."""
        layout = build_layout(segments, page_size=self.cache.page_size, device=self.device, on_device=on_device)
        shape = self.static.bucket(layout) if self.static is not None else None
        if self.static is not None and shape is not None:
            return self.static.forward(layout, rows, shape)
        every = len(rows) == layout.num_tokens  # rows are distinct and increasing: every row, in order
        if not every:
            layout.stage.put("logits_rows", rows)  # sent with the layout's and the backend's arrays, in one copy
        self.backend.plan(layout, self.cache)
        # ``forward``, not ``nn.Module.__call__``: the engine puts no hooks on its models, and the call's hook checks
        # cost tens of microseconds cold on a CPU, five times a speculative iteration (issue 30); so do levels.py and
        # static.py. A benchmark that watches the forwards wraps ``forward`` (engine_only.ForwardClock, OpCount)
        logits = self.model.forward(layout.input_ids, layout.positions, backend=self.backend, cache=self.cache,
                                    logits_rows=None if every else layout.stage.get("logits_rows"))
        head = self.model.lm_head
        drawn = head.last_argmax if isinstance(head, Int8Head) else None
        self.last_argmax = drawn if drawn is not None and drawn.shape[0] == logits.shape[0] else None
        return logits

    def close(self) -> None:
        """Nothing to stop here; a tensor-parallel runner stops its other ranks (parallel.py)."""

    @property
    def tensor_parallel_size(self) -> int:
        """Ranks the model is sharded over (parallel.py); 1 here."""
        return 1

    @property
    def vocab_size(self) -> int:
        return self.model.cfg.vocab_size

    def forward(self, segments: list[Segment], *, all_logits: list[bool],
                on_device: DeviceNodes | None = None) -> list[torch.Tensor]:
        """Run every segment's new tokens in one forward.

        Returns, per segment, logits ``[num_new, V]`` when ``all_logits[i]`` else ``[1, V]`` (its
        last new token: enough for a prefill chunk). With ``on_device`` the new tokens' ids (and the trees'
        ancestor rows) are read from the device, and the segments' trees give only their shape.
        """
        logits, counts = self._forward(segments, all_logits, on_device)
        # ``split_with_sizes``: ``torch.split``'s op without its Python layer (a block a segment: 32 at 32 requests)
        return [logits] if len(counts) == 1 else list(logits.split_with_sizes(counts))

    def forward_joined(self, segments: list[Segment], *, all_logits: list[bool],
                       on_device: DeviceNodes | None = None) -> torch.Tensor:
        """``forward``'s logits as one tensor, the segments' rows one after another: no per-segment split for a
        caller that reads every row at once (beam search's first forward: one row per request)."""
        return self._forward(segments, all_logits, on_device)[0]

    def _forward(self, segments: list[Segment], all_logits: list[bool],
                 on_device: DeviceNodes | None) -> tuple[torch.Tensor, list[int]]:
        """The forward's logits rows and each segment's number of them."""
        t0 = time.perf_counter()
        self.last_argmax = None  # set by ``compute``'s eager path only (not the static path's buffers)
        if len(all_logits) != len(segments):
            raise ValueError(f"{len(all_logits)} all_logits flags for {len(segments)} segments")
        for s in segments:
            self.cache.ensure(s.seq, s.kv_len)
        counts = [s.tree.size - s.num_cached for s in segments]  # each segment's new tokens
        total = sum(counts)
        cached = [s.prefix_len + s.num_cached for s in segments]
        n_context = sum(cached)
        n_cells = sum(map(chunk_cells, counts, cached))
        if all(all_logits):
            rows = list(range(total))
        else:  # a segment without all_logits gives its last row only
            n_new = np.array(counts, np.int64)
            counts_np = np.where(np.asarray(all_logits, bool), n_new, 1)
            ends = np.cumsum(n_new)
            starts = np.cumsum(counts_np) - counts_np  # where each segment's picked rows begin in ``rows``
            rows = (np.arange(int(counts_np.sum())) + np.repeat(ends - counts_np - starts, counts_np)).tolist()
            counts = counts_np.tolist()
        logits = self.compute(segments, rows, on_device)
        self.record(n_new=total, n_context=n_context, n_cells=n_cells, t0=t0)
        return logits, counts

    def record(self, *, n_new: int, n_context: int, n_cells: int, t0: float) -> None:
        """Tell the listeners about a forward that began at ``perf_counter()`` ``t0`` and has just returned
        (``forward`` and a beam level's forward, levels.py)."""
        rec = ForwardRecord(n_new=n_new, n_context=n_context, wall_s=time.perf_counter() - t0, n_cells=n_cells)
        self.last_forward = rec
        for listener in self.forward_listeners:
            listener(rec)
