"""How every benchmark command hands over its report: JSON on stdout, and on request a file and a PNG."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any


def emit_report(report: dict[str, Any], *, json_path: Path | None, plot_path: Path | None,
                plot: Callable[[dict[str, Any], Path], None]) -> None:
    """Print ``report`` as JSON; also write it to ``json_path`` and draw it with ``plot`` into ``plot_path``."""
    text = json.dumps(report, indent=2)
    if json_path:
        json_path.parent.mkdir(parents=True, exist_ok=True)
        json_path.write_text(text + "\n")
    if plot_path:
        plot(report, plot_path)
    print(text)
