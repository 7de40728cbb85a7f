"""``adaserve microbench``: the engine's own cost per iteration, or (``--peer``) the engine against transformers.

Without ``--peer``: at each batch size, with and without speculation, the share of an iteration's wall time
spent outside model forwards (adaserve/bench/engine_only.py). With ``--peer``: decode throughput and
per-token latency of the engine against Hugging Face ``generate`` on the same model, one request and
``--concurrency`` requests (adaserve/bench/peer_compare.py). Both print JSON.
"""

from __future__ import annotations

import argparse
from typing import Any

from adaserve.cli.arg_types import add_weights_option
from adaserve.cli_error import CliError


def add_parser(sub: Any) -> None:
    from adaserve.bench.microbench_options import add_common, add_engine_only, add_peer

    p = sub.add_parser("microbench", help="the engine's own cost per iteration; --peer: against transformers")
    p.add_argument("--peer", action="store_true",
                   help="compare with Hugging Face transformers' generate on the same model instead")
    add_common(p)
    add_engine_only(p)
    add_weights_option(p)  # the engine-only cells' models; the peer races transformers on the float model
    add_peer(p)
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from adaserve.engine.loading.catalog import ModelNotFoundError
    from adaserve.engine.model.config import UnsupportedModelError

    try:
        if args.peer:
            if args.weights != "float":
                raise ValueError("--weights sets the engine-only cells' models: --peer races transformers on the "
                                 "float model")
            from adaserve.bench.peer_compare import run_from_args
        else:
            from adaserve.bench.engine_only import run_from_args
        run_from_args(args)
    except (ValueError, FileNotFoundError, ModelNotFoundError, UnsupportedModelError) as e:
        raise CliError(str(e)) from None
    return 0
