"""The gateway's command-line options, over its ``ADASERVE_GATEWAY_*`` environment variables, and running a
gateway from them: the one definition behind ``adaserve gateway`` and ``python -m adaserve.gateway``.

Lives in the gateway package so that the container's command (``__main__``) needs nothing above it but the
CLI's error contract; ``adaserve/cli/gateway.py`` only mounts these options as a subcommand.
"""

from __future__ import annotations

import argparse
import asyncio
from pathlib import Path

from adaserve.cli_error import CliError
from adaserve.cli_settings import load
from adaserve.gateway.settings import GatewaySettings
from adaserve.redis_client import check_credentials

# option -> settings field of the same name; every other field comes from the environment only
OPTIONS = ("host", "port", "redis_url", "redis_prefix", "workers", "model_name", "slo_classes_file",
           "default_slo_class", "api_keys_file", "routing", "prefix_index_blocks", "admission", "on_overload",
           "on_infeasible", "queue_timeout_s", "max_attempts", "rate_limit_fail_open", "strict_openai_fields",
           "log_level")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--host", help="bind address [ADASERVE_GATEWAY_HOST, default 127.0.0.1]")
    p.add_argument("--port", type=int, help="[ADASERVE_GATEWAY_PORT, default 8080]")
    p.add_argument("--redis-url", help="workers' registry and shared state [ADASERVE_GATEWAY_REDIS_URL]")
    p.add_argument("--redis-prefix", help="key prefix [ADASERVE_GATEWAY_REDIS_PREFIX, default adaserve]")
    p.add_argument("--workers", help="comma-separated worker URLs, instead of Redis registrations")
    p.add_argument("--model-name", help="the model served [ADASERVE_GATEWAY_MODEL_NAME]")
    p.add_argument("--slo-classes-file", type=Path, help="JSON list of SLO classes")
    p.add_argument("--default-slo-class", help="class of requests that name none")
    p.add_argument("--api-keys-file", type=Path, help='JSON {"keys": [...]}; unset = no authentication')
    p.add_argument("--routing", choices=["headroom", "least-loaded", "round-robin"])
    p.add_argument("--prefix-index-blocks", type=int,
                   help="prefix affinity: text blocks remembered per worker, 0 = off "
                        "[ADASERVE_GATEWAY_PREFIX_INDEX_BLOCKS, default 32768]")
    p.add_argument("--admission", choices=["slo", "none"],
                   help="slo: admit where every target should hold (default); none: a plain load balancer")
    p.add_argument("--on-overload", choices=["best-effort", "refuse"],
                   help="non-sheddable requests still without headroom when their wait is over [default refuse]")
    p.add_argument("--on-infeasible", choices=["best-effort", "refuse"],
                   help="classes no worker can meet even alone [default best-effort]")
    p.add_argument("--queue-timeout-s", type=float, help="wait for headroom before 503")
    p.add_argument("--max-attempts", type=int, help="workers tried before the first token")
    p.add_argument("--rate-limit-fail-open", action="store_const", const=True,
                   help="with Redis unreachable, serve rate-limited API keys unchecked instead of 503 "
                        "[ADASERVE_GATEWAY_RATE_LIMIT_FAIL_OPEN, default off: fail closed]")
    p.add_argument("--strict-openai-fields", action="store_const", const=True,
                   help="refuse request bodies with fields adaserve does not know with 400 "
                        "[ADASERVE_GATEWAY_STRICT_OPENAI_FIELDS, default off: ignore them and name them in the "
                        "X-Ignored-Fields header]")
    p.add_argument("--log-level", choices=["critical", "error", "warning", "info", "debug"])


def load_settings(args: argparse.Namespace) -> GatewaySettings:
    """The options given, over the environment; CliError naming the option and the variable if one is bad."""
    given = {name: getattr(args, name, None) for name in OPTIONS}
    given = {k: v for k, v in given.items() if v is not None}
    if "workers" in given:
        given["workers"] = [u.strip() for u in given["workers"].split(",") if u.strip()]
    return load(GatewaySettings, given, options=OPTIONS, env_prefix="ADASERVE_GATEWAY_")


def run(args: argparse.Namespace) -> int:
    """Serve until SIGTERM or Ctrl-C; CliError for bad settings or an unreadable class or key file."""
    from adaserve.gateway.server import make_server
    from adaserve.gateway.service import Gateway

    settings = load_settings(args)
    try:
        gateway = Gateway(settings)  # reads the class and key files: a bad one is a message, not a traceback
    except ValueError as e:
        raise CliError(str(e)) from None
    if settings.redis_url:  # wrong credentials are a setting no retry fixes: stop now, not on the first request
        refused = asyncio.run(check_credentials(settings.redis_url, settings.redis_auth))
        if refused:
            raise CliError(f"{refused} (ADASERVE_GATEWAY_REDIS_PASSWORD, ADASERVE_GATEWAY_REDIS_USERNAME, "
                           "ADASERVE_GATEWAY_REDIS_TLS_CA_FILE)")
    make_server(gateway).run()
    return 0
