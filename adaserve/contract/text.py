"""Text that cannot be sent on: strings holding lone surrogates.

JSON's ``\\ud800`` escape decodes to a Python string that UTF-8 cannot encode. Such a prompt used to pass
validation and fail later (the gateway's request to a worker, a tokenizer), as a 500 that also dropped the
client's keep-alive connection. The edges of the gateway and the worker refuse it instead, naming where it is.
"""

from __future__ import annotations

from typing import Any


def unencodable(value: Any) -> str | None:
    """Where in ``value`` (parsed JSON: dicts, lists, strings, ...) a string or key cannot be encoded as UTF-8,
    as a field path (``messages[0].content``), or None. Iterative, and each step remembers only its parent: JSON
    may nest deeper than Python recurses, and copying paths would be quadratic in the depth."""
    steps: list[tuple[int, Any]] = []  # (parent step, key or index) for each container visited
    todo: list[tuple[int, Any, Any]] = [(-1, None, value)]  # (parent step, key, value)
    while todo:
        parent, key, v = todo.pop()
        if isinstance(v, str):
            if not _encodes(v):
                return _path(steps, parent, key)
        elif isinstance(v, dict | list):
            steps.append((parent, key))
            me = len(steps) - 1
            if isinstance(v, dict):
                for k, item in v.items():
                    if isinstance(k, str) and not _encodes(k):
                        return f"{_path(steps, parent, key)} (a key)"
                    if isinstance(item, str | dict | list):
                        todo.append((me, k, item))
            else:  # token id lists are long: only what can hold text is visited
                todo.extend((me, i, item) for i, item in enumerate(v) if isinstance(item, str | dict | list))
    return None


def _path(steps: list[tuple[int, Any]], parent: int, key: Any) -> str:
    keys = [] if key is None else [key]
    while parent >= 0:
        parent, k = steps[parent]
        if k is not None:
            keys.append(k)
    # written out here, not error_fields.field_path: the contract imports nothing outside itself
    out = ""
    for k in reversed(keys):
        out += f"[{k}]" if isinstance(k, int) else (f".{k}" if out else str(k))
    return out or "body"


def _encodes(s: str) -> bool:
    try:
        s.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def check_encodable(value: Any) -> Any:
    """A ``model_validator(mode="before")``: ValueError naming the field whose text is not valid Unicode."""
    where = unencodable(value)
    if where is not None:
        raise ValueError(f"{where}: text is not valid Unicode (it holds a lone surrogate such as \\ud800); "
                         "send UTF-8 text")
    return value
