"""The ``adaserve`` command line. Subcommands live in their own modules of this package; this one dispatches.

Contract: a user error (unreadable input, missing model directory, unsupported architecture, bad
option) prints one line ``adaserve: error: ...`` to stderr and exits with code 2; never a traceback.
"""

from __future__ import annotations

import argparse
import logging
import sys

from adaserve import __version__
from adaserve.allocator import AllocatorError, reexec_if_wanted
from adaserve.cli_error import EXIT_USAGE, CliError


def build_parser() -> argparse.ArgumentParser:
    from adaserve.cli import bench, gateway, generate, loadtest, microbench, profile, replay, up, worker

    parser = argparse.ArgumentParser(prog="adaserve", description="SLO-customized speculative decoding")
    parser.add_argument("--version", action="version", version=f"adaserve {__version__}")
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    sub = parser.add_subparsers(dest="command", required=True)
    generate.add_parser(sub)
    profile.add_parser(sub)
    bench.add_parser(sub)
    worker.add_parser(sub)
    gateway.add_parser(sub)
    up.add_parser(sub)
    loadtest.add_parser(sub)
    microbench.add_parser(sub)
    replay.add_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    if argv is None:  # from the command line: an engine command first re-executes itself on TCMalloc (allocator.py)
        try:
            reexec_if_wanted(sys.argv[1:])
        except AllocatorError as e:
            print(f"adaserve: error: {e}", file=sys.stderr)
            return EXIT_USAGE
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
