"""Option value types the subcommands share (argparse ``type=``): a bad value is argparse's one-line error."""

from __future__ import annotations

import argparse


def floats(text: str) -> tuple[float, ...]:
    """``0.5,1,2`` -> (0.5, 1.0, 2.0): request rates and the like."""
    try:
        return tuple(float(x) for x in text.split(",") if x)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated numbers, got {text!r}") from None


WEIGHTS = ("float", "int8", "int4", "auto")  # engine.model.quant.WEIGHTS (the CLI imports no torch to parse)


def add_weights_option(p: argparse.ArgumentParser, *, env: str | None = None, default: str | None = "float") -> None:
    """``--weights float|int8|int4|auto``, the same on every command that loads models (docs/models.md)."""
    where = f" [{env}, default float]" if env else " (default %(default)s)"
    p.add_argument("--weights", choices=WEIGHTS, default=default,
                   help="decoder linear layers served as float, int8 or int4 weight-only (torch's packed kernels), "
                        "or auto: a GGUF model's own precision (Q4 blocks as int4, Q8_0 as int8)" + where)
