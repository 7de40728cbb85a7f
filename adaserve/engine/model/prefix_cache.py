"""Prefix caching's index: which full KV pages hold which tokens, and which may be evicted (issue 34).

A full page of committed KV is *keyed* by its tokens and by the key of the page before it, a chain from
the sequence's first page, so a key names the page's tokens together with everything before them:

    key(page i) = (uid of page i-1's entry, or ROOT for page 0,  the page's page_size tokens)

The chain is exact rather than hashed: the dictionary hashes the key, and equality compares the parent's
uid and every token, so two prefixes that differ anywhere never share an entry (a 64-bit hash chain would
collide one day, and serve another prompt's KV). Every entry gets a fresh uid; once an entry is evicted
its uid is never issued again, so the entries keyed under it become unreachable (and are evicted in their
turn) instead of being found under a page that now holds other tokens.

The index keeps no reference counts; the cache does (kv_cache.py). It hears when a keyed page loses its
last holder (``park``: it joins the LRU order of idle pages) and when it gains one again (``unpark``), and
gives up the least recently used idle page when the cache has no free page left (``evict``).

May import: numpy and the standard library.
"""

from __future__ import annotations

import itertools
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

ROOT = 0  # the parent uid of a sequence's first page
_uids = itertools.count(ROOT + 1)  # one counter for every index: a uid is never reused, even across resets

Key = tuple[int, tuple[int, ...]]


@dataclass
class PrefixCacheStats:
    """What prefix caching has done since the index was made (token counts, as vLLM's hit rate)."""

    queried_tokens: int = 0  # prompt tokens of the requests that looked up their prefix
    hit_tokens: int = 0  # of them, served from cached pages (not prefilled)
    evictions: int = 0  # idle keyed pages given to a new use

    @property
    def hit_rate(self) -> float:
        return self.hit_tokens / self.queried_tokens if self.queried_tokens else 0.0


class PrefixIndex:
    """Keyed pages of one cache; ``num_pages`` sizes ``keyed``, a per-page flag the cache's write guard reads."""

    def __init__(self, page_size: int, num_pages: int) -> None:
        self.page_size = page_size
        self._by_key: dict[Key, tuple[int, int]] = {}  # key -> (page, uid)
        self._of_page: dict[int, Key] = {}
        self._idle: OrderedDict[int, None] = OrderedDict()  # keyed pages nobody holds, least recently used first
        self.keyed = np.zeros(num_pages, dtype=bool)
        self.stats = PrefixCacheStats()

    # ---- what is cached ---------------------------------------------------------------------------
    @property
    def cached_pages(self) -> int:
        """Keyed pages, held by a request or idle."""
        return len(self._of_page)

    @property
    def idle_pages(self) -> int:
        return len(self._idle)

    def is_keyed(self, page: int) -> bool:
        return page in self._of_page

    def match(self, tokens: Sequence[int], max_pages: int) -> list[tuple[int, int]]:
        """(page, uid) of the cached pages of ``tokens``' longest cached prefix, at most ``max_pages`` of them."""
        ps, parent, out = self.page_size, ROOT, []
        for i in range(max_pages):
            hit = self._by_key.get((parent, tuple(tokens[i * ps : (i + 1) * ps])))
            if hit is None:
                break
            out.append(hit)
            parent = hit[1]
        return out

    def key(self, parent: int, tokens: tuple[int, ...], page: int) -> int:
        """Key ``page`` (a full page of committed KV for ``tokens`` after the prefix ``parent`` names); the uid
        that continues the chain. When another page holds the same key already, ``page`` stays unkeyed (it
        goes back to the free list when released) and the existing entry's uid continues the chain."""
        if len(tokens) != self.page_size:
            raise ValueError(f"a key covers a full page of {self.page_size} tokens, got {len(tokens)}")
        k = (parent, tokens)
        hit = self._by_key.get(k)
        if hit is not None:
            return hit[1]
        if page in self._of_page:
            raise ValueError(f"page {page} is keyed already")
        uid = next(_uids)
        self._by_key[k] = (page, uid)
        self._of_page[page] = k
        self.keyed[page] = True
        return uid

    # ---- idle pages -------------------------------------------------------------------------------
    def park(self, page: int) -> None:
        """A keyed page lost its last holder: most recently used of the idle pages."""
        self._idle[page] = None

    def unpark(self, page: int) -> None:
        """An idle page is held again."""
        del self._idle[page]

    def evict(self) -> int:
        """Forget the least recently used idle page and return it for a new use."""
        page, _ = self._idle.popitem(last=False)
        del self._by_key[self._of_page.pop(page)]
        self.keyed[page] = False
        self.stats.evictions += 1
        return page

    def clear(self) -> list[int]:
        """Forget every entry; the idle pages, to be freed. Held pages become unkeyed (freed when released)."""
        idle = list(self._idle)
        self._by_key.clear()
        self._of_page.clear()
        self._idle.clear()
        self.keyed[:] = False
        return idle
