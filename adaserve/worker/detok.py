"""Incremental detokenization for streams: decode the whole output, emit the new suffix.

Decoding the full output each time (instead of token by token) keeps multi-token characters and
merges right. Two things are held back until more tokens settle them: a trailing U+FFFD (a UTF-8
character split across tokens) and a tail that could be the start of a stop string. Concatenating
every delta gives exactly the text ``adaserve generate`` writes (cut at the first stop string).
"""

from __future__ import annotations

from collections.abc import Callable


def truncate_at_stop(text: str, stops: tuple[str, ...]) -> tuple[str, bool]:
    cut = min((i for i in (text.find(s) for s in stops) if i >= 0), default=-1)
    return (text[:cut], True) if cut >= 0 else (text, False)


def _partial_stop_len(text: str, stops: tuple[str, ...]) -> int:
    """Length of the longest tail of ``text`` that is a proper prefix of some stop string."""
    best = 0
    for s in stops:
        for k in range(min(len(s) - 1, len(text)), best, -1):
            if text.endswith(s[:k]):
                best = k
                break
    return best


class IncrementalText:
    def __init__(self, decode: Callable[[list[int]], str], stops: tuple[str, ...] = ()) -> None:
        self._decode = decode
        self._stops = stops
        self.ids: list[int] = []
        self.sent = ""
        self.stopped = False  # a stop string was found in the text

    def resume(self, ids: list[int], shown: str | None) -> None:
        """Start after ``ids``, an earlier worker's output of which ``shown`` was sent (None: what this class
        would have sent itself, everything but the tail it holds back)."""
        self.ids = list(ids)
        if shown is None:
            shown = self._visible(finished=False)
        self.sent = shown

    def _visible(self, *, finished: bool) -> str:
        text, self.stopped = truncate_at_stop(self._decode(self.ids), self._stops)
        if not finished and not self.stopped:
            text = text[: len(text) - _partial_stop_len(text, self._stops)]
            text = text.rstrip("\ufffd")
        return text

    def push(self, new_ids: list[int], *, finished: bool) -> str:
        """Add tokens; return the text that can be shown now and was not shown before."""
        self.ids.extend(new_ids)
        text = self._visible(finished=finished)
        if not text.startswith(self.sent):  # decoding rewrote shown text; never un-send, only append
            return ""
        delta, self.sent = text[len(self.sent):], text
        return delta

    @property
    def text(self) -> str:
        return self.sent
