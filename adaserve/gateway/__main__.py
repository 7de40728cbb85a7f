"""``python -m adaserve.gateway``: the gateway alone (the container's command), configured by
``ADASERVE_GATEWAY_*`` and the options of ``adaserve gateway``.

Does not go through ``adaserve.cli.main``, whose other subcommands import the engine: the gateway image has no torch.
"""

from __future__ import annotations

import argparse
import sys

from adaserve.cli_error import EXIT_USAGE, CliError
from adaserve.gateway import options


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="python -m adaserve.gateway",
                                     description="the OpenAI-compatible gateway: SLO classes, routing, admission")
    options.add_arguments(parser)
    args = parser.parse_args(argv)
    try:
        return options.run(args)
    except CliError as e:
        print(f"adaserve: error: {e}", file=sys.stderr)
        return EXIT_USAGE


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
