"""``python -m adaserve.gateway``: the gateway alone (the container's command), configured by
``ADASERVE_GATEWAY_*`` and the options of ``adaserve gateway``.

Does not go through ``adaserve.cli``, whose other subcommands import the engine: the gateway image has no torch.
"""

from __future__ import annotations

import argparse
import sys

from adaserve import gateway_cmd
from adaserve.cli_error import EXIT_USAGE, CliError


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="python -m adaserve.gateway")
    gateway_cmd.add_parser(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(["gateway", *argv])
    try:
        return gateway_cmd.run(args)
    except CliError as e:
        print(f"adaserve: error: {e}", file=sys.stderr)
        return EXIT_USAGE


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
