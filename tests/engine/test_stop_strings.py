"""Incremental stop-string matching finds what a search of the whole decoded output finds, token by token."""

from __future__ import annotations

import numpy as np
import pytest

from adaserve.engine.stop_strings import StopStringMatcher

# a byte-level stand-in: tokens are bytes, some multi-byte UTF-8 characters span two or three tokens
TEXT = "Hello, wörld! ÄÖÜ → ok\n###\nend — fin ### done"
IDS = list(TEXT.encode("utf-8"))


def decode(ids: list[int]) -> str:
    return bytes(ids).decode("utf-8", errors="replace")


def full_search(ids: list[int], stops: tuple[str, ...]) -> int | None:
    return next((k for k in range(1, len(ids) + 1) if any(s in decode(ids[:k]) for s in stops)), None)


@pytest.mark.parametrize("stops", [("###",), ("→",), ("ö",), ("wörld",), ("\n",), ("zz",), ("ok\n#", "fin"),
                                   ("d — f",), ("H",)])
def test_matches_the_full_decode(stops: tuple[str, ...]) -> None:
    m = StopStringMatcher(stops, decode)
    got = None
    for k, t in enumerate(IDS, start=1):
        if m.push(t):
            got = k
            break
    assert got == full_search(IDS, stops)


def test_chunks_of_tokens_and_random_stops() -> None:
    rng = np.random.default_rng(0)
    for _ in range(50):
        a = int(rng.integers(0, len(TEXT) - 1))
        stop = TEXT[a : a + int(rng.integers(1, 6))]
        m = StopStringMatcher((stop,), decode)
        at, found = 0, None
        while at < len(IDS) and found is None:
            n = int(rng.integers(1, 5))  # an iteration emits several tokens at once
            k = m.first_stop(IDS[at : at + n])
            found = None if k is None else at + k
            at += n
        assert found == full_search(IDS, (stop,))


def test_each_token_decodes_a_bounded_window() -> None:
    """The cost per token does not grow with the output: every decode reads a few tokens only."""
    seen: list[int] = []

    def counting(ids: list[int]) -> str:
        seen.append(len(ids))
        return decode(ids)

    m = StopStringMatcher(("never",), counting)
    assert m.first_stop(IDS * 20) is None
    assert max(seen) <= 6
