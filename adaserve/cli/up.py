"""``adaserve up``: the whole system on one machine, one command: a worker on SmolLM2-135M-Instruct with its
distilled draft (or the given model) in a child process, and the gateway in this one, with in-process state
unless ``--redis-url``.

With no classes file, the three default SLO classes are scaled to this machine once the worker has measured
what a lone request of each gets (``lone_tpot_ms_by_class``, speculation included, or what the gateway
predicts for one if that is slower: ``lone_bases``; ``slo.local_classes``): every default class is then
feasible on a laptop, as the gateway itself judges it. Each class is printed with its target and how a lone request
of it fares as the gateway judges it (``slo.class_feasibility``, the verdict /v1/slo-classes shows and
admission acts on). Ctrl-C (or SIGTERM) stops the gateway, then drains and stops the worker.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import socket
import sys
from collections.abc import Mapping
from typing import Any

from adaserve.cli.arg_types import add_kv_memory_options, add_weights_option
from adaserve.cli_error import CliError
from adaserve.engine.loading.catalog import DEFAULT_MODEL, NAMES, ModelNotFoundError, check_ref, served_name
from adaserve.server_process import NotReady, ServerProcess, free_port

READY_TIMEOUT_S = 900.0  # a first start converts the model, materialises the draft and profiles the machine


def add_parser(sub: Any) -> None:
    p = sub.add_parser("up", help=f"serve locally: gateway + one worker ({DEFAULT_MODEL} by default)")
    p.add_argument("--model", help=f"{DEFAULT_MODEL} (default, with its distilled draft), demo-tiny (the tiny "
                   "test pair), a .gguf file or a Hugging Face directory")
    p.add_argument("--target", dest="model", help=argparse.SUPPRESS)  # the worker's spelling of --model
    p.add_argument("--draft", help="draft model, same forms (default: the named model's own; none for a path)")
    p.add_argument("--model-name", help="name clients pass as 'model' (default: the model's name)")
    p.add_argument("--host", default="127.0.0.1", help="gateway bind address (default 127.0.0.1)")
    p.add_argument("--port", type=int, default=8080, help="gateway port (default 8080)")
    p.add_argument("--worker-port", type=int, default=0, help="worker port (default: any free port)")
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    p.add_argument("--tensor-parallel-size", type=int, default=1, metavar="N",
                   help="the worker shards the target over N ranks, one process per device (CPU: gloo)")
    p.add_argument("--policy", default="adaserve")
    p.add_argument("--budget", type=int, help="fixed token budget (default: profiled)")
    add_kv_memory_options(p)
    p.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=True,
                   help="the worker reuses the KV of cached prompt prefixes (default on)")
    # the worker loads, profiles and serves them: the derived classes come from them too
    add_weights_option(p, default="auto")
    p.add_argument("--redis-url", help="keep request records in this Redis (default: in-process)")
    p.add_argument("--slo-classes-file", help="JSON list of SLO classes (default: coding, "
                   "chat and summarization scaled to this machine's per-token latency)")
    p.add_argument("--api-keys-file", help="JSON API keys; unset = no authentication")
    p.add_argument("--ready-timeout", type=float, default=READY_TIMEOUT_S, metavar="SECONDS",
                   help=f"how long to wait for the worker to load, profile and warm up (default "
                        f"{READY_TIMEOUT_S:.0f}; a first start on a slow or busy CPU can need more)")
    p.set_defaults(func=run)


def resolve_models(args: argparse.Namespace) -> tuple[str, str | None, str]:
    """(model reference, draft reference, served name), checked without loading or converting anything."""
    ref = args.model or DEFAULT_MODEL
    try:
        check_ref(ref)
        if args.draft is not None:
            check_ref(args.draft)
    except ModelNotFoundError as e:
        raise CliError(str(e)) from None
    if ref not in NAMES and args.draft is None and args.policy != "incremental":
        raise CliError(f"policy {args.policy} speculates and {ref} brings no draft: give --draft, "
                       "or --policy incremental")
    if args.tensor_parallel_size != 1:  # a size the model cannot take, refused before a worker starts
        from adaserve.engine.ranks import check_size

        try:
            check_size(ref, args.tensor_parallel_size)
        except ValueError as e:
            raise CliError(str(e)) from None
    return ref, args.draft, args.model_name or served_name(ref)


def banner(url: str, model: str, slo_classes: list[str], cls: str, keys: bool) -> str:
    """What to paste: a coding request by curl (the tightest class), a streamed chat by the openai client."""
    auth = ' -H "Authorization: Bearer $KEY"' if keys else ""
    coding = "coding" if "coding" in slo_classes else cls
    return f"""
adaserve is up: {url}   (model "{model}", SLO classes: {', '.join(slo_classes)})

  curl -s {url}/v1/chat/completions -H 'content-type: application/json' -H 'X-SLO-Class: {coding}'{auth} \\
      -d '{{"model": "{model}", "max_tokens": 96, "temperature": 0,
           "messages": [{{"role": "user", "content": "Write a Python function that reverses a list."}}]}}'

  python - <<'PY'
from openai import OpenAI
client = OpenAI(base_url="{url}/v1", api_key="{'$KEY' if keys else 'none'}")
stream = client.chat.completions.create(model="{model}", stream=True, max_tokens=48, temperature=0,
    messages=[{{"role": "user", "content": "What is the capital of France?"}}],
    extra_headers={{"X-SLO-Class": "{cls}"}})
for chunk in stream:
    print(chunk.choices[0].delta.content or "", end="", flush=True)
print()
PY

Also: {url}/v1/models  {url}/v1/slo-classes  {url}/metrics   (Ctrl-C stops everything)
"""


def class_lines(classes: list[Any], judged: Mapping[str, Mapping[str, Any]], *, unloaded_tpot_ms: float | None,
                lone_tpot_ms: float | None = None) -> str:
    """One line per class: its targets and how a lone request of it fares, as the gateway judges it
    (``judged``: class name -> ``slo.class_feasibility``, what /v1/slo-classes shows and admission acts on)."""
    words = {"plain": "met by plain decoding", "speculation": "needs speculation to be met",
             "infeasible": "INFEASIBLE on this machine, even for a lone request (served best effort)",
             None: "not judged"}
    base = f"{unloaded_tpot_ms:.1f} ms" if unloaded_tpot_ms else "unknown"
    lone = f", a lone request served: {lone_tpot_ms:.1f} ms" if lone_tpot_ms else ""
    out = [f"adaserve: SLO classes (this machine's per-token latency: one forward {base}{lone}):"]
    for c in classes:
        ttft = f", TTFT {c.ttft_ms:.0f} ms" if c.ttft_ms else ""
        verdict = judged.get(c.name, {})
        predicted = verdict.get("lone_tpot_ms")
        alone = f" (alone: {predicted:.0f} ms predicted)" if predicted else ""
        out.append(f"  {c.name:<14} TPOT {c.tpot_ms:.0f} ms{ttft}, priority {c.priority}: "
                   f"{words[verdict.get('feasibility')]}{alone}")
    return "\n".join(out)


def lone_bases(reg: Any) -> dict[str, float]:
    """What each default class is scaled from: the slower of the TPOT a lone request of it measurably got at the
    worker's warm-up and what the gateway predicts for one from the worker's measured curve. The gateway judges
    feasibility and admits by its prediction, so a target under it would make the class infeasible at once."""
    from adaserve.gateway.directory import worker_view
    from adaserve.gateway.prediction import lone_tpot_ms
    from adaserve.gateway.slo import DEFAULT_CLASSES

    view, measured = worker_view(reg), reg.lone_tpot_ms_by_class or {}
    out = {}
    for c in DEFAULT_CLASSES:
        figures = [f for f in (measured.get(c.name), lone_tpot_ms(view, c.name)) if f is not None]
        if figures:
            out[c.name] = max(figures)
    return out


def run(args: argparse.Namespace) -> int:
    from adaserve.cli_settings import load
    from adaserve.gateway.keys import load_keys
    from adaserve.gateway.settings import GatewaySettings
    from adaserve.gateway.slo import load_catalog

    ref, draft, model = resolve_models(args)
    if not args.ready_timeout > 0:  # also refuses nan
        raise CliError(f"--ready-timeout must be a positive number of seconds, not {args.ready_timeout}")
    worker_port = args.worker_port or free_port("127.0.0.1")
    worker_url = f"http://127.0.0.1:{worker_port}"
    given: dict[str, Any] = {"host": args.host, "port": args.port, "workers": [worker_url], "model_name": model,
                             "log_level": "warning"}
    for name in ("redis_url", "slo_classes_file", "api_keys_file"):
        if getattr(args, name) is not None:
            given[name] = getattr(args, name)
    settings = load(GatewaySettings, given, options=tuple(given), env_prefix="ADASERVE_GATEWAY_")
    derive = settings.slo_classes_file is None and settings.slo_classes is None
    try:  # the class and key files, checked before minutes of model loading (the gateway reads them again)
        catalog = load_catalog(file=settings.slo_classes_file, inline=settings.slo_classes,
                               default=settings.default_slo_class)
        load_keys(settings.api_keys_file, classes=list(catalog.classes))
    except ValueError as e:
        raise CliError(str(e)) from None
    if args.port:
        _check_port_free(args.host, args.port)

    cmd = [sys.executable, "-m", "adaserve", "worker", "--target", ref, "--model-name", model, "--host", "127.0.0.1",
           "--port", str(worker_port), "--device", args.device, "--policy", args.policy, "--log-level", "warning",
           "--worker-id", "local-worker", "--weights", args.weights,
           "--tensor-parallel-size", str(args.tensor_parallel_size)]
    if draft is not None:
        cmd += ["--draft", draft]
    if args.budget is not None:
        cmd += ["--budget", str(args.budget)]
    if args.kv_memory_mb is not None:
        cmd += ["--kv-memory-mb", str(args.kv_memory_mb)]
    if args.kv_memory_fraction is not None:
        cmd += ["--kv-memory-fraction", repr(args.kv_memory_fraction)]
    if not args.enable_prefix_caching:
        cmd += ["--no-enable-prefix-caching"]
    env = {**os.environ, "ADASERVE_DEFAULT_SLO_CLASS": catalog.default}
    if not derive:  # derived classes are known only once the worker has profiled; requests carry their targets
        env["ADASERVE_SLO_CLASSES"] = json.dumps({c.name: c.tpot_ms for c in catalog.classes.values()})
    env.pop("ADASERVE_REDIS_URL", None)  # the gateway polls this worker directly
    print(f"adaserve: starting a worker on {ref}" + (f" + {draft}" if draft else "") +
          f" ({args.device}); loading, profiling and warming up ...", file=sys.stderr, flush=True)
    worker = ServerProcess.start(cmd, url=worker_url, name="the worker", env=env)
    # Until the gateway serves (and installs its own handlers), SIGTERM must still stop the worker below:
    # minutes of model loading would otherwise leave it running, orphaned, on its port.
    previous = signal.signal(signal.SIGTERM, _interrupt)
    try:
        return asyncio.run(_serve(settings, worker, derive=derive, keys=args.api_keys_file is not None,
                                  ready_timeout_s=args.ready_timeout))
    finally:
        signal.signal(signal.SIGTERM, previous)
        worker.stop(timeout_s=40)  # drains: in-flight requests finish


def _interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt  # the CLI turns it into exit 130 after the finally blocks ran


def _check_port_free(host: str, port: int) -> None:
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError as e:
            raise CliError(f"cannot listen on {host}:{port}: {e.strerror} (use --port)") from None


async def _serve(settings: Any, worker: ServerProcess, *, derive: bool, keys: bool, ready_timeout_s: float) -> int:
    import httpx

    from adaserve.contract.registration import parse_registration
    from adaserve.gateway.server import make_server
    from adaserve.gateway.service import Gateway
    from adaserve.gateway.slo import class_feasibility, load_catalog, local_classes

    try:
        await worker.wait_ready("/readyz", timeout_s=ready_timeout_s)
    except NotReady as e:
        hint = "" if e.returncode is not None else " (a slow or busy machine may need a longer --ready-timeout)"
        raise CliError(f"{e}{hint}") from None
    try:
        async with httpx.AsyncClient(timeout=10.0) as client:
            status = (await client.get(f"{worker.url}/v1/status")).raise_for_status().json()
    except (httpx.HTTPError, ValueError) as e:
        raise CliError(f"the worker was ready but its status could not be read: {e}") from None
    reg = parse_registration(status)
    if reg is None:
        raise CliError("the worker was ready but its status is not a registration document")
    unloaded, lone = reg.unloaded_tpot_ms, reg.lone_tpot_ms
    if reg.models.weights is not None:
        print(f"adaserve: weights {reg.models.weights}", file=sys.stderr, flush=True)
    if reg.kv_capacity_tokens is not None:
        print(f"adaserve: the KV cache holds {reg.kv_capacity_tokens} tokens", file=sys.stderr, flush=True)
    # what a lone request measurably gets, speculation included; else one profiled forward (a fixed --budget
    # skips profiling: the latency is then a guess, and the absolute defaults are kept)
    base = lone or (unloaded if reg.budget_source == "profile" else None)
    if derive and base:
        classes = [c.model_dump(by_alias=True, exclude_none=True) for c in local_classes(base, lone_bases(reg))]
        # the same three classes as the defaults, so the same default class
        default = settings.default_slo_class or load_catalog(file=None, inline=None, default=None).default
        settings = settings.model_copy(update={"slo_classes": json.dumps(classes), "default_slo_class": default})
    try:
        gateway = Gateway(settings)
    except ValueError as e:
        raise CliError(str(e)) from None
    catalog = gateway.catalog
    server = make_server(gateway)
    serving = asyncio.create_task(server.serve())
    while not server.started and not serving.done():
        await asyncio.sleep(0.05)
    if server.started:  # the gateway has read the worker: its own verdicts, the ones admission acts on
        workers = gateway.directory.usable()
        judged = {c.name: class_feasibility(c, workers, margin=settings.slo_margin) for c in catalog.classes.values()}
        print(class_lines(list(catalog.classes.values()), judged, unloaded_tpot_ms=unloaded, lone_tpot_ms=lone),
              file=sys.stderr, flush=True)
        host, port = server.config.host, server.config.port
        shown = "127.0.0.1" if host in ("0.0.0.0", "::") else host
        print(banner(f"http://{shown}:{port}", settings.model_name, list(catalog.classes), catalog.default, keys),
              flush=True)
    watch = asyncio.create_task(_watch_worker(server, worker))
    await serving
    watch.cancel()
    code = worker.proc.poll()
    if code is not None and code not in (0, -signal.SIGTERM):
        raise CliError(f"the worker exited with status {code}")
    if not server.started:
        raise CliError(f"the gateway could not listen on {settings.host}:{settings.port} (see above)")
    return 0


async def _watch_worker(server: Any, worker: ServerProcess) -> None:
    """A worker that dies takes the gateway down with it: nothing would answer anyway."""
    while worker.proc.poll() is None:
        await asyncio.sleep(0.5)
    print(f"adaserve: the worker exited (status {worker.proc.returncode}); stopping", file=sys.stderr, flush=True)
    server.should_exit = True
