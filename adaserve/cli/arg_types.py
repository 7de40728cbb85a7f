"""Option value types the subcommands share (argparse ``type=``): a bad value is argparse's one-line error."""

from __future__ import annotations

import argparse


def floats(text: str) -> tuple[float, ...]:
    """``0.5,1,2`` -> (0.5, 1.0, 2.0): request rates and the like."""
    try:
        return tuple(float(x) for x in text.split(",") if x)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated numbers, got {text!r}") from None
