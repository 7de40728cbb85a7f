"""The ``adaserve`` command: main.py dispatches, one module per subcommand (bench, gateway, generate,
loadtest, microbench, profile, up, worker), and the helpers only they use (arg_types.py, reports.py).

Each subcommand imports the package it runs inside the function that needs it, so ``adaserve --help``
loads no torch. This package is the top of the house: it may import anything, and nothing imports it.
Command-line pieces the gateway's own entry point shares (``adaserve.cli_error``, ``adaserve.cli_settings``)
stay at the package root for that reason.
"""
