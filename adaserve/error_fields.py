"""How the worker and the gateway name the field a validation error is about (no torch: the gateway image)."""

from __future__ import annotations

from collections.abc import Sequence
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


def validation_message(errors: Sequence[Any]) -> tuple[str, str | None]:
    """Pydantic's errors as one message naming every field (``max_tokens: ...; top_p: ...``) and the first
    field's path (None for a rule over the whole body, which names its fields itself): OpenAI's ``message`` and
    ``param`` of a 400, at the gateway and at a worker's OpenAI routes."""
    parts = []
    for e in errors:
        where = field_path(tuple(e.get("loc", ())))
        msg = str(e.get("msg", "")).removeprefix("Value error, ")
        parts.append(f"{where}: {msg}" if where and where != "body" else msg)
    param = field_path(tuple(errors[0].get("loc", ()))) if errors else None
    return "; ".join(parts) or "invalid request", (None if param == "body" else param) or None
