"""The paged KV cache the engine owns, and the page accounting that keeps it from leaking.

Storage is one tensor per K and V, ``[num_layers, (num_pages + 1) * page_size, kv_heads, head_dim]``: a
token's *slot* is ``page * page_size + offset``. Viewed per layer as ``[num_pages + 1, page_size, ...]``
it is the paged layout flashinfer reads. The last page is scratch, outside the accounting: padded rows of
a static-shape forward write their K/V there.

Accounting per sequence: ``length`` tokens hold committed KV; pages cover ``allocated`` >= length
slots. A verification step may write a whole tree past ``length``; afterwards the engine calls
``truncate`` to the committed length, which returns every page beyond it. Rejected tree nodes
therefore cannot keep pages alive.

Prefix caching (``enable_prefix_caching``; issue 34, docs/architecture.md §3): a full page of committed KV
whose tokens the sequence can name (``SequenceKV.tokens``) is keyed in a ``PrefixIndex`` when ``truncate``
or ``release`` commits past its end, and a new sequence starts from the pages of its prompt's longest
cached prefix (``reuse_prefix``). Pages carry reference counts; a keyed page nobody holds stays cached,
idle, until an allocation finds no free page and evicts the least recently used one. Every write lands
at or past a sequence's committed length, and a shared or keyed page lies wholly before it, so no write
reaches one; ``move_many`` checks that for the compaction it is given.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np
import torch

from adaserve.engine.checks import at_least
from adaserve.engine.model.config import ModelConfig
from adaserve.engine.model.prefix_cache import ROOT, PrefixCacheStats, PrefixIndex
from adaserve.engine.model.staging import HostStage


@dataclass(frozen=True)
class KVCacheConfig:
    """The paged KV cache of one model (kv_cache.py)."""

    page_size: int = 16  # tokens per page
    num_pages: int | None = None  # explicit size; else derived from memory_bytes
    memory_bytes: int = 256 * 2**20

    def __post_init__(self) -> None:
        at_least("KVCacheConfig", "page_size", self.page_size, 1)
        if self.num_pages is not None:
            at_least("KVCacheConfig", "num_pages", self.num_pages, 1)
        else:
            at_least("KVCacheConfig", "memory_bytes", self.memory_bytes, 1)


class OutOfPagesError(RuntimeError):
    """The cache has no free page for a write the scheduler allowed: an accounting bug upstream."""


class SharedPageWriteError(RuntimeError):
    """A write aimed at a page another sequence shares, or one the prefix cache keyed: a bug upstream."""


# ``SequenceKV.slots`` of at most this many tokens are computed one by one: fewer calls than the array lookup's five
SHORT_SLOTS = 32


def page_slots(pages: np.ndarray, page_size: int) -> np.ndarray:
    """``[..., P]`` page ids -> ``[..., P * page_size]``: the cache slot of every key index those pages cover, in
    order (key index i lies in slot ``pages[i // page_size] * page_size + i % page_size``). Laid out by broadcasting,
    with no division and no gather per key (issue 30: a 32-request grid of 1,600 keys took 0.33 ms by the division's
    formula on an AVX2 EPYC, 0.17 ms this way; ``batch.grid_key_slots``)."""
    pages = np.asarray(pages, np.int64)
    return (pages[..., None] * page_size + np.arange(page_size)).reshape(*pages.shape[:-1], -1)


@dataclass
class SequenceKV:
    """One request's view of the cache: its pages and how many leading slots hold committed KV.

    With prefix caching, ``tokens(start)`` gives the sequence's known tokens from ``start`` on (the tokens
    whose KV the leading slots hold, perhaps fewer than ``length`` while the latest are being emitted),
    and ``keys`` the prefix index's uids of its leading full pages, in order."""

    pages: list[int] = field(default_factory=list)
    length: int = 0
    tokens: Callable[[int], Sequence[int]] | None = field(default=None, repr=False, compare=False)
    keys: list[int] = field(default_factory=list, repr=False, compare=False)

    def slot(self, index: int, page_size: int) -> int:
        return self.pages[index // page_size] * page_size + index % page_size

    def slots(self, start: int, stop: int, page_size: int) -> np.ndarray:
        """Cache slots of token indices ``start`` .. ``stop - 1`` (int64 array)."""
        if stop - start <= SHORT_SLOTS:  # a handful (a verification's new tokens): Python ints, one numpy call
            pages = self.pages
            return np.array([pages[i // page_size] * page_size + i % page_size for i in range(start, stop)], np.int64)
        first, end = start // page_size, -(-stop // page_size)  # the pages spanning the range
        if end > len(self.pages):
            raise IndexError(f"token index {stop - 1} is past the sequence's {len(self.pages)} pages")
        return page_slots(self.pages[first:end], page_size)[start - first * page_size : stop - first * page_size]


def bytes_per_token(model: ModelConfig, dtype: torch.dtype) -> int:
    """K and V of one token in every layer."""
    return 2 * model.num_layers * model.num_kv_heads * model.head_dim * dtype.itemsize


def num_pages(model: ModelConfig, cfg: KVCacheConfig, dtype: torch.dtype) -> int:
    """Pages of ``model``'s cache under ``cfg``: its explicit count, else as many as its memory holds."""
    return cfg.num_pages or max(1, cfg.memory_bytes // (bytes_per_token(model, dtype) * cfg.page_size))


class PagedKVCache:
    def __init__(self, model: ModelConfig, cfg: KVCacheConfig, *, dtype: torch.dtype,
                 device: torch.device) -> None:
        self.page_size = cfg.page_size
        self.num_pages = num_pages(model, cfg, dtype)
        # one page past the accounted ones is scratch: padded rows of a static-shape forward write there
        # (static.py), and no sequence ever owns it
        self.scratch_page = self.num_pages
        shape = (model.num_layers, (self.num_pages + 1) * self.page_size, model.num_kv_heads, model.head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)
        self._free: list[int] = list(range(self.num_pages - 1, -1, -1))
        self._refs = np.zeros(self.num_pages, dtype=np.int32)  # sequences holding each page
        self.prefix: PrefixIndex | None = None  # prefix caching, when enabled
        self.move_listeners: list[Callable[[np.ndarray, np.ndarray], None]] = []

    @property
    def scratch_slot(self) -> int:
        """A slot no sequence owns: where padding writes its K/V."""
        return self.scratch_page * self.page_size

    # ---- accounting -----------------------------------------------------------------------------
    @property
    def free_pages(self) -> int:
        """Pages an allocation may take: free ones and cached ones nobody holds (evicted on demand)."""
        return len(self._free) + (self.prefix.idle_pages if self.prefix is not None else 0)

    @property
    def capacity_tokens(self) -> int:
        return self.num_pages * self.page_size

    def pages_for(self, n_tokens: int) -> int:
        return -(-n_tokens // self.page_size)

    def ensure(self, seq: SequenceKV, n_tokens: int) -> None:
        """Allocate pages so that slots [0, n_tokens) exist for ``seq``."""
        need = self.pages_for(n_tokens) - len(seq.pages)
        if need > self.free_pages:
            raise OutOfPagesError(f"need {need} pages, {self.free_pages} free")
        for _ in range(max(0, need)):
            seq.pages.append(self._take())

    def truncate(self, seq: SequenceKV, n_tokens: int) -> None:
        """Keep slots [0, n_tokens) as committed; free every page past them. With prefix caching, key the full
        committed pages whose tokens are known."""
        if n_tokens > len(seq.pages) * self.page_size:
            raise ValueError("cannot commit more tokens than were allocated")
        seq.length = n_tokens
        if self.prefix is not None:
            self._publish(seq)
        del seq.keys[n_tokens // self.page_size :]
        keep = self.pages_for(n_tokens)
        while len(seq.pages) > keep:
            self._drop(seq.pages.pop())

    def release(self, seq: SequenceKV) -> None:
        """Give back every page (the last first, so a cached prefix is evicted from its end)."""
        if self.prefix is not None:
            self._publish(seq)  # what became known since the last truncate (the final tokens)
        self.truncate(seq, 0)

    def _take(self) -> int:
        if self._free:
            page = self._free.pop()
        elif self.prefix is not None and self.prefix.idle_pages:
            page = self.prefix.evict()
        else:
            raise OutOfPagesError("no free page")
        self._refs[page] = 1
        return page

    def _drop(self, page: int) -> None:
        self._refs[page] -= 1
        if self._refs[page] > 0:
            return
        if self.prefix is not None and self.prefix.is_keyed(page):
            self.prefix.park(page)
        else:
            self._free.append(page)

    # ---- prefix caching -------------------------------------------------------------------------
    def enable_prefix_caching(self, enabled: bool) -> None:
        """Keep full committed pages for reuse (or stop); either way, forget what was kept so far (an engine
        built over runners another engine used starts cold)."""
        if self.prefix is not None:
            self._free.extend(self.prefix.clear())
        self.prefix = PrefixIndex(self.page_size, self.num_pages) if enabled else None

    @property
    def prefix_stats(self) -> PrefixCacheStats:
        """Lookups, hits and evictions since prefix caching was (re-)enabled; zeros when it is off."""
        return self.prefix.stats if self.prefix is not None else PrefixCacheStats()

    @property
    def cached_pages(self) -> int:
        """Pages the prefix cache keys, held or idle."""
        return self.prefix.cached_pages if self.prefix is not None else 0

    def reuse_prefix(self, seq: SequenceKV, tokens: Sequence[int], *, limit: int) -> int:
        """Start the empty ``seq`` from the cached pages of the longest cached prefix of ``tokens[:limit]``
        (whole pages only) and return how many tokens they hold: its committed length. Counts ``tokens``
        as queried and the reused ones as hits."""
        if self.prefix is None:
            return 0
        if seq.pages or seq.length:
            raise ValueError("a prefix is reused by an empty sequence")
        self.prefix.stats.queried_tokens += len(tokens)
        for page, uid in self.prefix.match(tokens, max(0, limit) // self.page_size):
            if self._refs[page] == 0:
                self.prefix.unpark(page)
            self._refs[page] += 1
            seq.pages.append(page)
            seq.keys.append(uid)
        seq.length = len(seq.pages) * self.page_size
        self.prefix.stats.hit_tokens += seq.length
        return seq.length

    def _publish(self, seq: SequenceKV) -> None:
        """Key ``seq``'s full committed pages past those already keyed, as far as its tokens are known."""
        assert self.prefix is not None
        ps, done = self.page_size, len(seq.keys)
        if seq.tokens is None or seq.length // ps <= done:
            return
        toks = seq.tokens(done * ps)
        full = min(seq.length, done * ps + len(toks)) // ps
        for i in range(done, full):
            parent = seq.keys[-1] if seq.keys else ROOT
            seq.keys.append(self.prefix.key(parent, tuple(toks[(i - done) * ps : (i - done + 1) * ps]), seq.pages[i]))

    # ---- data movement --------------------------------------------------------------------------
    def move_slots(self, seq: SequenceKV, src: list[int], dst: list[int]) -> None:
        """Copy KV of token indices ``src`` to ``dst`` in every layer (used to compact accepted paths)."""
        self.move_many([(seq, src, dst)])

    def move_many(self, moves: list[tuple[SequenceKV, list[int], list[int]]]) -> None:
        """Every sequence's (src, dst) token moves in one gather/scatter over all layers.

        The gather reads every source before the scatter writes, so any order is safe; sequences own
        disjoint slots past their committed lengths, so their moves never collide. With prefix caching a
        destination in a shared or keyed page raises ``SharedPageWriteError`` before anything moves.
        """
        # the moving tokens' slots one by one (``SequenceKV.slot``): a request moves a handful (its accepted path's
        # nodes off the first branch), fewer than the numpy calls per request that an array lookup took (issue 30)
        ps = self.page_size
        s_all: list[int] = []
        d_all: list[int] = []
        for seq, src, dst in moves:
            if len(src) != len(dst):
                raise ValueError("src and dst must have the same length")
            if src == dst:  # nothing moves (a lone root, or a path along the first nodes)
                continue
            for a, b in zip(src, dst, strict=True):
                if a != b:
                    s_all.append(seq.slot(a, ps))
                    d_all.append(seq.slot(b, ps))
        if not s_all:
            return
        if self.prefix is not None:  # the destinations' pages, each once, read as Python ints (a handful of them)
            refs, keyed = self._refs, self.prefix.is_keyed
            if bad := sorted(p for p in {d // ps for d in d_all} if refs[p] != 1 or keyed(p)):
                raise SharedPageWriteError(f"a KV move would write a shared or cached page: {bad}")
        self.move_slot_arrays(np.array(s_all, np.int64), np.array(d_all, np.int64))

    def move_slot_arrays(self, src: np.ndarray, dst: np.ndarray) -> None:
        """Copy KV of cache slots ``src`` to ``dst`` (int64) in every layer; every listener hears of it first
        (a tensor-parallel rank 0 sends the move to the other ranks' shards, parallel.py)."""
        for listener in self.move_listeners:
            listener(src, dst)
        if self.k.is_cpu:  # the arrays are the indices: nothing to send (issue 30: the stage's join, ~25 us)
            s_idx = torch.from_numpy(np.ascontiguousarray(src, np.int64))
            d_idx = torch.from_numpy(np.ascontiguousarray(dst, np.int64))
        else:
            stage = HostStage(self.k.device)  # sources and destinations in one non-blocking copy
            stage.put("src", src)
            stage.put("dst", dst)
            s_idx, d_idx = stage.get("src"), stage.get("dst")
        # index_select and index_copy_ over the slot dimension: the copy ``k[:, dst] = k[:, src]`` makes (the
        # sources are read whole before any write), at half its cost on a CPU (issue 30)
        self.k.index_copy_(1, d_idx, self.k.index_select(1, s_idx))
        self.v.index_copy_(1, d_idx, self.v.index_select(1, s_idx))
