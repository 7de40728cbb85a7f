"""``adaserve gateway``: the OpenAI-compatible gateway in front of registered workers (docs/gateway.md).

The options and the run are the gateway package's own (adaserve/gateway/options.py), shared with
``python -m adaserve.gateway``; this only mounts them under the ``adaserve`` command.
"""

from __future__ import annotations

from typing import Any

from adaserve.gateway import options


def add_parser(sub: Any) -> None:
    p = sub.add_parser("gateway", help="the OpenAI-compatible gateway: SLO classes, routing, admission")
    options.add_arguments(p)
    p.set_defaults(func=options.run)
