"""Where the engine keeps what it measures once per machine: start-up profiles and kernel plans.

A leaf: it imports nothing from adaserve, so every room of the engine may use it (cost/profile_cache.py
keeps profiles here, model/few_rows.py its kernel plans). Converted models have their own directory
(loading/gguf.py, ``$ADASERVE_MODEL_CACHE``).
"""

from __future__ import annotations

import os
from pathlib import Path

CACHE_DIR_ENV = "ADASERVE_CACHE_DIR"


def default_cache_dir() -> Path:
    """``$ADASERVE_CACHE_DIR`` if set and non-empty, else ``~/.cache/adaserve/profiles``."""
    env = os.environ.get(CACHE_DIR_ENV)
    if env:
        return Path(env).expanduser()
    return Path.home() / ".cache" / "adaserve" / "profiles"
