"""The prefix index alone: exact chained keys, duplicates, LRU eviction of idle pages."""

from __future__ import annotations

import pytest

from adaserve.engine.model.prefix_cache import ROOT, PrefixIndex


def test_a_key_names_the_page_and_everything_before_it() -> None:
    idx = PrefixIndex(page_size=2, num_pages=8)
    a = idx.key(ROOT, (1, 2), page=0)
    b = idx.key(a, (3, 4), page=1)
    assert idx.match([1, 2, 3, 4, 5], max_pages=2) == [(0, a), (1, b)]
    assert idx.match([1, 2, 3, 4], max_pages=1) == [(0, a)]  # never more than asked
    # the same second page after another first page is another prefix: no hit past the first difference
    assert idx.match([9, 2, 3, 4], max_pages=2) == []
    assert idx.match([1, 2, 3, 5], max_pages=2) == [(0, a)]
    assert idx.cached_pages == 2 and idx.keyed[[0, 1]].all() and not idx.keyed[2]


def test_a_duplicate_key_keeps_the_first_page_and_continues_its_chain() -> None:
    idx = PrefixIndex(page_size=2, num_pages=8)
    a = idx.key(ROOT, (1, 2), page=0)
    assert idx.key(ROOT, (1, 2), page=5) == a  # a second request computed the same page
    assert not idx.is_keyed(5) and idx.cached_pages == 1
    with pytest.raises(ValueError, match="full page"):
        idx.key(a, (3,), page=6)
    with pytest.raises(ValueError, match="keyed already"):
        idx.key(a, (3, 4), page=0)


def test_eviction_takes_the_least_recently_idle_page_and_orphans_its_chain() -> None:
    idx = PrefixIndex(page_size=1, num_pages=8)
    a = idx.key(ROOT, (1,), page=0)
    b = idx.key(a, (2,), page=1)
    idx.key(ROOT, (7,), page=2)
    for p in (1, 0, 2):  # a release parks its last page first
        idx.park(p)
    idx.unpark(2)  # page 2 held again: not evictable
    assert idx.idle_pages == 2
    assert idx.evict() == 1 and idx.evict() == 0
    assert idx.stats.evictions == 2 and idx.match([1, 2], 2) == []
    # page 0 keyed again under a new uid: the old chain's children cannot be reached through it
    a2 = idx.key(ROOT, (1,), page=0)
    assert a2 != a and idx.match([1, 2], 2) == [(0, a2)]
    assert b not in {uid for _, uid in idx.match([1, 2], 2)}


def test_clear_returns_the_idle_pages() -> None:
    idx = PrefixIndex(page_size=1, num_pages=4)
    idx.key(ROOT, (1,), page=3)
    idx.key(ROOT, (2,), page=1)
    idx.park(3)
    assert idx.clear() == [3]
    assert idx.cached_pages == 0 and not idx.keyed.any() and idx.match([1], 1) == []
