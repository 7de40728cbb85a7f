"""One way to make a PNG: a headless figure of side-by-side panels, saved and closed however the body ends."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any


@contextmanager
def panels(path: Path, n: int, *, width: float = 5.5, height: float = 4.0) -> Iterator[tuple[Any, list[Any]]]:
    """``with panels(path, 2) as (fig, axes):`` draw on ``axes``; the PNG is written to ``path`` on exit."""
    import matplotlib

    matplotlib.use("Agg")  # no display on servers and in CI
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, n, figsize=(width * n, height), squeeze=False)
    try:
        yield fig, list(axes[0])
        fig.tight_layout()
        path.parent.mkdir(parents=True, exist_ok=True)
        fig.savefig(path, dpi=120)
    finally:
        plt.close(fig)
