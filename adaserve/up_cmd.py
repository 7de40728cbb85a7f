"""``adaserve up``: the whole system on one machine, one command: a worker on the demo pair (or given
models) in a child process, and the gateway in this one, with in-process state unless ``--redis-url``.

Ctrl-C (or SIGTERM) stops the gateway, then drains and stops the worker.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import socket
import sys
from pathlib import Path
from typing import Any

from adaserve.cli_error import CliError
from adaserve.server_process import NotReady, ServerProcess, free_port

DEMO = Path("models/demo")
READY_TIMEOUT_S = 600.0


def add_parser(sub: Any) -> None:
    p = sub.add_parser("up", help="serve locally: gateway + one worker (the demo pair by default)")
    p.add_argument("--target", type=Path, help=f"target model directory (default {DEMO}/target)")
    p.add_argument("--draft", type=Path, help=f"draft model directory (default {DEMO}/draft with the demo target)")
    p.add_argument("--model-name", help="name clients pass as 'model' (default: 'demo', or the target dir name)")
    p.add_argument("--host", default="127.0.0.1", help="gateway bind address (default 127.0.0.1)")
    p.add_argument("--port", type=int, default=8080, help="gateway port (default 8080)")
    p.add_argument("--worker-port", type=int, default=0, help="worker port (default: any free port)")
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    p.add_argument("--policy", default="adaserve")
    p.add_argument("--budget", type=int, help="fixed token budget (default: profiled)")
    p.add_argument("--redis-url", help="keep request records in this Redis (default: in-process)")
    p.add_argument("--slo-classes-file", type=Path, help="JSON list of SLO classes (default coding/chat/summarization)")
    p.add_argument("--api-keys-file", type=Path, help="JSON API keys; unset = no authentication")
    p.set_defaults(func=run)


def resolve_models(args: argparse.Namespace) -> tuple[Path, Path | None, str]:
    target = args.target or DEMO / "target"
    draft = args.draft if args.draft is not None else (DEMO / "draft" if args.target is None else None)
    for role, path in (("target", target), ("draft", draft)):
        if path is not None and not (path / "config.json").is_file():
            hint = " (run from the repository root, or give --target/--draft)" if args.target is None else ""
            raise CliError(f"{role} model directory {path} not found{hint}")
    name = args.model_name or ("demo" if args.target is None else target.resolve().name)
    return target, draft, name


def banner(url: str, model: str, slo_classes: list[str], cls: str, keys: bool) -> str:
    """What to paste: ``cls`` is the class the examples name (the configured default)."""
    auth = ' -H "Authorization: Bearer $KEY"' if keys else ""
    return f"""
adaserve is up: {url}   (model "{model}", SLO classes: {', '.join(slo_classes)})

  curl -s {url}/v1/completions -H 'content-type: application/json' -H 'X-SLO-Class: {cls}'{auth} \\
      -d '{{"model": "{model}", "prompt": "def fibonacci(n):", "max_tokens": 32, "temperature": 0}}'

  python - <<'PY'
from openai import OpenAI
client = OpenAI(base_url="{url}/v1", api_key="{'$KEY' if keys else 'none'}")
stream = client.chat.completions.create(model="{model}", stream=True, max_tokens=32, temperature=0,
    messages=[{{"role": "user", "content": "Write a Python function that reverses a list."}}],
    extra_headers={{"X-SLO-Class": "{cls}"}})
for chunk in stream:
    print(chunk.choices[0].delta.content or "", end="", flush=True)
print()
PY

Also: {url}/v1/models  {url}/v1/slo-classes  {url}/metrics   (Ctrl-C stops everything)
"""


def run(args: argparse.Namespace) -> int:
    from adaserve.cli_settings import load
    from adaserve.gateway.server import make_server
    from adaserve.gateway.service import Gateway
    from adaserve.gateway.settings import GatewaySettings

    target, draft, model = resolve_models(args)
    worker_port = args.worker_port or free_port("127.0.0.1")
    worker_url = f"http://127.0.0.1:{worker_port}"
    given: dict[str, Any] = {"host": args.host, "port": args.port, "workers": [worker_url], "model_name": model,
                             "log_level": "warning"}
    for name in ("redis_url", "slo_classes_file", "api_keys_file"):
        if getattr(args, name) is not None:
            given[name] = getattr(args, name)
    settings = load(GatewaySettings, given, options=tuple(given), env_prefix="ADASERVE_GATEWAY_")
    try:
        gateway = Gateway(settings)
    except ValueError as e:
        raise CliError(str(e)) from None
    catalog = gateway.catalog
    server = make_server(gateway)
    if args.port:
        _check_port_free(args.host, args.port)  # before minutes of model loading, not after

    cmd = [sys.executable, "-m", "adaserve", "worker", "--target", str(target), "--host", "127.0.0.1",
           "--port", str(worker_port), "--device", args.device, "--policy", args.policy, "--log-level", "warning",
           "--worker-id", "local-worker"]
    if draft is not None:
        cmd += ["--draft", str(draft)]
    if args.budget is not None:
        cmd += ["--budget", str(args.budget)]
    env = {**os.environ, "ADASERVE_MODEL_NAME": model, "ADASERVE_DEFAULT_SLO_CLASS": catalog.default,
           "ADASERVE_SLO_CLASSES": json.dumps({c.name: c.tpot_ms for c in catalog.classes.values()})}
    env.pop("ADASERVE_REDIS_URL", None)  # the gateway polls this worker directly
    print(f"adaserve: starting a worker on {target}" + (f" + {draft}" if draft else "") +
          f" ({args.device}); loading, profiling and warming up ...", file=sys.stderr, flush=True)
    worker = ServerProcess.start(cmd, url=worker_url, name="the worker", env=env)
    try:
        return asyncio.run(_serve(server, worker, model, list(catalog.classes), catalog.default,
                                  keys=args.api_keys_file is not None))
    finally:
        worker.stop(timeout_s=40)  # drains: in-flight requests finish


def _check_port_free(host: str, port: int) -> None:
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError as e:
            raise CliError(f"cannot listen on {host}:{port}: {e.strerror} (use --port)") from None


async def _serve(server: Any, worker: ServerProcess, model: str, classes: list[str], default_class: str, *,
                 keys: bool) -> int:
    # the gateway listens while the worker loads; one that cannot (its port taken) ends the wait at once
    gateway = asyncio.create_task(server.serve())
    try:
        await worker.wait_ready("/readyz", timeout_s=READY_TIMEOUT_S, give_up=gateway.done)
    except NotReady as e:
        server.should_exit = True
        await gateway
        raise CliError(str(e)) from None
    if not gateway.done():
        while not server.started and not gateway.done():
            await asyncio.sleep(0.05)
        host, port = server.config.host, server.config.port
        shown = "127.0.0.1" if host in ("0.0.0.0", "::") else host
        print(banner(f"http://{shown}:{port}", model, classes, default_class, keys), flush=True)
    watch = asyncio.create_task(_watch_worker(server, worker))
    await gateway
    watch.cancel()
    code = worker.proc.poll()
    if code is not None and code not in (0, -signal.SIGTERM):
        raise CliError(f"the worker exited with status {code}")
    return 0


async def _watch_worker(server: Any, worker: ServerProcess) -> None:
    """A worker that dies takes the gateway down with it: nothing would answer anyway."""
    while worker.proc.poll() is None:
        await asyncio.sleep(0.5)
    print(f"adaserve: the worker exited (status {worker.proc.returncode}); stopping", file=sys.stderr, flush=True)
    server.should_exit = True
