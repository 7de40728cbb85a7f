"""``freeze_long_lived`` (loader.py): what a serving process holds once loaded is left out of Python's full
collections until ``thaw``; garbage made before the freeze is freed by it, objects made after it are collected as
before."""

from __future__ import annotations

import gc
import weakref

from adaserve.engine.loading.loader import freeze_long_lived, thaw


class Node:
    other: Node


def lost_cycle() -> weakref.ref[Node]:
    """Two objects that only reach each other: garbage for the cycle collector alone."""
    a, b = Node(), Node()
    a.other, b.other = b, a
    return weakref.ref(a)


def test_what_is_alive_at_the_freeze_is_left_out_of_full_collections_until_thawed() -> None:
    before = lost_cycle()  # garbage already: the freeze's own collection frees it, it is not frozen
    kept = Node()
    kept.other = kept
    held = weakref.ref(kept)
    try:
        frozen = freeze_long_lived()
        assert before() is None
        assert frozen > 1000 and gc.get_freeze_count() == frozen
        del kept
        gc.collect()
        assert held() is not None  # garbage now, but frozen: no full collection walked it
        after = lost_cycle()
        gc.collect()
        assert after() is None  # made after the freeze: collected as before
    finally:
        thaw()
    assert gc.get_freeze_count() == 0
    gc.collect()
    assert held() is None  # thawed: the next collection frees it
