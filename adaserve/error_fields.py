"""How the worker and the gateway name the field a validation error is about (no torch: the gateway image)."""

from __future__ import annotations

from typing import Any

# FastAPI's first element says where the value came from; the field's own name is what a client knows
SOURCES = ("body", "query", "path", "header")


def field_path(loc: tuple[Any, ...]) -> str:
    """('body', 'prompt_token_ids', 2) -> 'prompt_token_ids[2]'; ('header', 'X-SLO-Class') -> 'X-SLO-Class';
    ('body',) -> 'body' (the body as a whole, e.g. a rule between fields)."""
    parts = list(loc[1:]) if len(loc) > 1 and loc[0] in SOURCES else list(loc)
    out = ""
    for p in parts:
        out += f"[{p}]" if isinstance(p, int) else (f".{p}" if out else str(p))
    return out
