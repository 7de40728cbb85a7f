"""Stop strings, matched as tokens arrive: each token costs a decode of a few tokens, not of the whole output.

The output's text grows by pieces (incremental detokenization, as vLLM does it): a new token's piece is
``decode(ids[prefix:])`` minus ``decode(ids[prefix:read])``, where ``ids[prefix:read]`` are the tokens of
the previous piece, decoded again as context (so merges and leading spaces come out as in a full
decode). A piece ending in U+FFFD is a UTF-8 character split across tokens: it is held back until the
next token completes it. A stop string completed by a new token ends inside that token's piece and
starts at most ``len(stop) - 1`` characters before it, so only the piece plus that tail of the earlier
text is searched.
"""

from __future__ import annotations

from collections.abc import Callable


class StopStringMatcher:
    def __init__(self, stops: tuple[str, ...], decode: Callable[[list[int]], str]) -> None:
        self.stops = stops
        self.decode = decode
        self.keep = max((len(s) for s in stops), default=1) - 1  # characters a match can reach back
        self.ids: list[int] = []
        self.prefix = self.read = 0  # ids[prefix:read]: the tokens of the last piece
        self.tail = ""  # the last ``keep`` characters of the text so far

    def push(self, token: int) -> bool:
        """Add one output token; True when the text now contains a stop string (it ends in this token)."""
        self.ids.append(token)
        before = self.decode(self.ids[self.prefix : self.read])
        text = self.decode(self.ids[self.prefix :])
        if len(text) <= len(before) or text.endswith("\ufffd"):
            return False  # no settled text yet
        window = self.tail + text[len(before) :]
        self.prefix, self.read = self.read, len(self.ids)
        self.tail = window[-self.keep :] if self.keep else ""
        return any(s in window for s in self.stops)

    def first_stop(self, tokens: list[int]) -> int | None:
        """Push ``tokens`` one by one; the count up to and including the one completing a stop string."""
        for k, t in enumerate(tokens, start=1):
            if self.push(t):
                return k
        return None
