"""Access-log hygiene shared by the worker and the gateway (no torch here: the gateway image has none)."""

from __future__ import annotations

import logging

PROBE_PATHS = ("/healthz", "/readyz", "/metrics")


class QuietProbes(logging.Filter):
    """Keep successful probes and scrapes (every few seconds, forever) out of the access log."""

    def filter(self, record: logging.LogRecord) -> bool:
        args = record.args
        if not isinstance(args, tuple) or len(args) < 5:
            return True
        path, status = args[2], args[4]
        return not (isinstance(path, str) and path.startswith(PROBE_PATHS) and isinstance(status, int)
                    and status < 400)
