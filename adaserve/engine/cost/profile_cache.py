"""The on-disk profile cache: one JSON file per (device, model, dtype, engine version).

A restart reuses the budget and cost model measured last time instead of profiling again; a bad or
foreign file costs a re-profile, never a crash.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import tempfile
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from adaserve.engine.cache_dir import default_cache_dir

logger = logging.getLogger(__name__)

__all__ = ["ProfileCache", "ProfileKey"]

# 2: the cost model's attention cells (beta): a profile fitted without them is measured again
# 3: the cells count each chunk's own keys (runner.chunk_cells): beta was fitted on the cached keys alone
_CACHE_FORMAT = 3


@dataclass(frozen=True)
class ProfileKey:
    """What a profile depends on. ``model`` is an identity string built by the caller (e.g. a hash of the
    config plus the weight files' names, sizes and mtimes); ``device`` e.g. "NVIDIA H100 80GB HBM3"."""

    device: str
    model: str
    dtype: str
    engine_version: str

    def __post_init__(self) -> None:
        for name in ("device", "model", "dtype", "engine_version"):
            v = getattr(self, name)
            if not isinstance(v, str) or not v.strip():
                raise ValueError(f"ProfileKey.{name} must be a non-empty string, got {v!r}")

    def to_dict(self) -> dict[str, str]:
        return asdict(self)

    def digest(self) -> str:
        """Stable hex id: sha256 of the canonical JSON of the fields (independent of Python's hash seed)."""
        canon = json.dumps(self.to_dict(), sort_keys=True, separators=(",", ":"), ensure_ascii=True)
        return hashlib.sha256(canon.encode("ascii")).hexdigest()[:32]


class ProfileCache:
    """JSON files ``<dir>/<key digest>.json`` holding ``{"format", "key", "data"}``.

    ``load`` returns None on a miss and on anything unreadable (corrupt JSON, wrong format, a file whose
    stored key is not the one asked for): a bad cache costs a re-profile, never a crash; the problem is
    logged. ``save`` writes a temporary file in the same directory and ``os.replace``s it into place, so
    a reader sees the old file or the new one, never half of one.
    """

    def __init__(self, dir: str | os.PathLike[str] | None = None) -> None:
        self.dir = Path(dir).expanduser() if dir is not None else default_cache_dir()

    def path_for(self, key: ProfileKey) -> Path:
        return self.dir / f"{key.digest()}.json"

    def load(self, key: ProfileKey) -> dict[str, Any] | None:
        if not isinstance(key, ProfileKey):
            raise ValueError(f"key must be a ProfileKey, got {type(key).__name__}")
        path = self.path_for(key)
        try:
            text = path.read_text(encoding="utf-8")
        except FileNotFoundError:
            return None
        except (OSError, UnicodeDecodeError) as e:
            logger.warning("profile cache %s unreadable (%s); treating as missing", path, e)
            return None
        try:
            doc = json.loads(text)
        except (json.JSONDecodeError, RecursionError) as e:
            logger.warning("profile cache %s is corrupt (%s); treating as missing", path, e)
            return None
        if not isinstance(doc, dict) or doc.get("format") != _CACHE_FORMAT or not isinstance(
            doc.get("data"), dict
        ):
            logger.warning("profile cache %s has an unexpected layout; treating as missing", path)
            return None
        if doc.get("key") != key.to_dict():
            logger.warning("profile cache %s belongs to another key; treating as missing", path)
            return None
        return doc["data"]

    def save(self, key: ProfileKey, data: Mapping[str, Any]) -> Path:
        """Write ``data`` (JSON-serialisable, finite floats) for ``key``; returns the file path.

        ValueError for data JSON cannot hold; OSError (unwritable directory, full disk) propagates: the
        caller decides whether serving without a cached profile is acceptable.
        """
        if not isinstance(key, ProfileKey):
            raise ValueError(f"key must be a ProfileKey, got {type(key).__name__}")
        if not isinstance(data, Mapping):
            raise ValueError(f"data must be a mapping, got {type(data).__name__}")
        doc = {"format": _CACHE_FORMAT, "key": key.to_dict(), "data": dict(data)}
        try:
            text = json.dumps(doc, sort_keys=True, indent=1, allow_nan=False)
        except (TypeError, ValueError) as e:
            raise ValueError(f"profile data is not JSON-serialisable: {e}") from e
        self.dir.mkdir(parents=True, exist_ok=True)
        path = self.path_for(key)
        fd, tmp = tempfile.mkstemp(prefix=f".{path.stem}.", suffix=".tmp", dir=self.dir)
        try:
            with os.fdopen(fd, "w", encoding="utf-8") as f:
                f.write(text)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, path)
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
            raise
        return path
