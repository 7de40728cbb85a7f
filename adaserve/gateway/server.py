"""Running the gateway: settings -> Gateway -> uvicorn. Shared by ``adaserve gateway``, ``python -m
adaserve.gateway`` (the container's command) and ``adaserve up``."""

from __future__ import annotations

import logging
import signal
from types import FrameType

import uvicorn

from adaserve.access_log import QuietProbes
from adaserve.gateway.app import create_app
from adaserve.gateway.service import Gateway


class GatewayServer(uvicorn.Server):
    """SIGTERM is the normal way a pod or ``adaserve up`` stops: shut down gracefully and exit 0, instead of
    uvicorn re-raising the signal afterwards (status 143). SIGINT keeps uvicorn's behaviour."""

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        if sig == signal.SIGTERM:
            self.should_exit = True
        else:
            super().handle_exit(sig, frame)


def make_server(gateway: Gateway) -> uvicorn.Server:
    settings = gateway.settings
    logging.getLogger("adaserve").setLevel(settings.log_level.upper())
    logging.getLogger("uvicorn.access").addFilter(QuietProbes())
    config = uvicorn.Config(create_app(gateway), host=settings.host, port=settings.port,
                            log_level=settings.log_level, timeout_graceful_shutdown=10, lifespan="on")
    return GatewayServer(config)
