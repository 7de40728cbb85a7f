"""Option value types the subcommands share (argparse ``type=``): a bad value is argparse's one-line error."""

from __future__ import annotations

import argparse


def floats(text: str) -> tuple[float, ...]:
    """``0.5,1,2`` -> (0.5, 1.0, 2.0): request rates and the like."""
    try:
        return tuple(float(x) for x in text.split(",") if x)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated numbers, got {text!r}") from None


def fraction(text: str) -> float:
    """A number in (0, 1]: ``--kv-memory-fraction 0.9``."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number in (0, 1], got {text!r}") from None
    if not 0 < value <= 1:
        raise argparse.ArgumentTypeError(f"expected a number in (0, 1], got {text}")
    return value


def add_kv_memory_options(p: argparse.ArgumentParser, *, env: bool = False) -> None:
    """``--kv-memory-mb`` (a fixed size per model) and ``--kv-memory-fraction`` (from the device's memory)."""
    mb, frac = (" [ADASERVE_KV_MEMORY_MB]", " [ADASERVE_KV_MEMORY_FRACTION]") if env else ("", "")
    p.add_argument("--kv-memory-mb", type=int, help="KV cache memory per model, in MiB (default 256)" + mb)
    p.add_argument("--kv-memory-fraction", type=fraction,
                   help="size the KV caches from the device's memory instead, as vLLM's gpu_memory_utilization: on "
                        "CUDA this fraction of the total less what the device holds after loading and a profiling "
                        "forward; on CPU this fraction of available RAM, at most 16 GiB; wins over --kv-memory-mb"
                        + frac)


WEIGHTS = ("float", "int8", "int4", "auto")  # engine.model.quant.WEIGHTS (the CLI imports no torch to parse)


def add_weights_option(p: argparse.ArgumentParser, *, env: str | None = None, default: str | None = "float") -> None:
    """``--weights float|int8|int4|auto``, the same on every command that loads models (docs/models.md)."""
    where = f" [{env}, default {default or 'auto'}]" if env else " (default %(default)s)"
    p.add_argument("--weights", choices=WEIGHTS, default=default,
                   help="decoder linear layers served as float, int8 or int4 weight-only (on a CPU the integer "
                        "kernels where they build, ADASERVE_NATIVE_KERNELS=off for torch's; torch's on a GPU), "
                        "or auto: a GGUF model's own precision on a CPU (Q4 blocks as int4, Q8_0 as int8), "
                        "float on a GPU" + where)
