"""The command line's error contract, importable without the subcommands (the slim gateway image needs this).

A user error (unreadable input, missing model directory, unsupported architecture, bad option) prints
one line ``adaserve: error: ...`` to stderr and exits with code 2; never a traceback.
"""

from __future__ import annotations

EXIT_USAGE = 2


class CliError(Exception):
    """A user-facing error: printed as one line, exit code 2."""
