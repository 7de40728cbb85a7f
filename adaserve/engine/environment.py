"""The engine's ``ADASERVE_*`` switches, read at each call and cheaply (issue 30).

Switches such as ``ADASERVE_NATIVE_KERNELS`` and ``ADASERVE_DRAFT_STEPS`` are read every time a search or a plan asks,
so that a test's ``monkeypatch.setenv``, the microbench's ``mock.patch.dict`` and ``--kernels-ab``'s blocks take
effect at once. ``os.environ.get`` of an unset variable raises and catches a KeyError inside: ~1 us in a warm loop,
but ~17 us right after a forward, whose weights leave that path cold, and a lone speculative iteration read three
such switches. ``env`` reads the mapping's own dict instead: one dict miss for an unset variable.

May import the standard library only.
"""

from __future__ import annotations

import os


def env(name: str) -> str | None:
    """``os.environ.get(name)``, read from the mapping's own dict where it has one (CPython's ``os._Environ``, which
    ``os.environ[...] = ...``, ``del``, ``monkeypatch.setenv`` and ``mock.patch.dict`` all write through); else from
    ``os.environ.get``."""
    data, encode = getattr(os.environ, "_data", None), getattr(os.environ, "encodekey", None)
    if not isinstance(data, dict) or encode is None:
        return os.environ.get(name)
    raw = data.get(encode(name))
    return None if raw is None else os.environ.decodevalue(raw)
