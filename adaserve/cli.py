"""The ``adaserve`` command line. Subcommands live in their own modules; this file only dispatches.

Contract: a user error (unreadable input, missing model directory, unsupported architecture, bad
option) prints one line ``adaserve: error: ...`` to stderr and exits with code 2; never a traceback.
"""

from __future__ import annotations

import argparse
import logging
import sys

from adaserve import __version__
from adaserve.cli_error import EXIT_USAGE, CliError


def build_parser() -> argparse.ArgumentParser:
    from adaserve import (
        bench_cmd,
        gateway_cmd,
        generate_cmd,
        loadtest_cmd,
        microbench_cmd,
        profile_cmd,
        up_cmd,
        worker_cmd,
    )

    parser = argparse.ArgumentParser(prog="adaserve", description="SLO-customized speculative decoding")
    parser.add_argument("--version", action="version", version=f"adaserve {__version__}")
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    sub = parser.add_subparsers(dest="command", required=True)
    generate_cmd.add_parser(sub)
    profile_cmd.add_parser(sub)
    bench_cmd.add_parser(sub)
    worker_cmd.add_parser(sub)
    gateway_cmd.add_parser(sub)
    up_cmd.add_parser(sub)
    loadtest_cmd.add_parser(sub)
    microbench_cmd.add_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.DEBUG if args.verbose else logging.WARNING,
                        format="%(levelname)s %(name)s: %(message)s")
    try:
        return int(args.func(args) or 0)
    except CliError as e:
        print(f"adaserve: error: {e}", file=sys.stderr)
        return EXIT_USAGE
    except KeyboardInterrupt:
        print("adaserve: interrupted", file=sys.stderr)
        return 130
