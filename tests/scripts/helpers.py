"""What the scripts' tests share: a script under scripts/ loaded as a module (its name has dashes)."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from types import ModuleType

SCRIPTS = Path(__file__).resolve().parents[2] / "scripts"


def load_script(file_name: str) -> ModuleType:
    """scripts/``file_name`` as a module, run once (its ``main`` not called)."""
    path = SCRIPTS / file_name
    spec = importlib.util.spec_from_file_location(path.stem.replace("-", "_"), path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module
