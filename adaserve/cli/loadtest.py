"""``adaserve loadtest``: multi-SLO load through a gateway over HTTP; prints a JSON report.

Against a running gateway (``--url``, e.g. a cluster's) or one it starts itself (``--up``: ``adaserve up``
on ``--target``, by default smollm2-135m-instruct, stopped afterwards). ``--compare`` (with ``--up``) also starts
a plain load balancer in front of the same worker (``adaserve gateway --routing least-loaded --admission none``,
the same classes) and runs every rate through both, alternating; ``--compare-url`` names one already running.
``--load`` gives the rates as multiples of the fleet's capacity (``--capacity-rps``, or measured first by a closed
loop through the plain load balancer when there is one). See adaserve/bench/loadgen.py for what is measured.
``--conversations N`` also runs N multi-turn conversations (adaserve/bench/conversations.py): whether each turn
goes back to the worker holding its history, and each turn's TTFT.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import os
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from adaserve.cli.arg_types import floats
from adaserve.cli.reports import emit_report
from adaserve.cli_error import CliError
from adaserve.server_process import NotReady, ServerProcess, free_port

READY_TIMEOUT_S = 900.0


def add_parser(sub: Any) -> None:
    p = sub.add_parser("loadtest", help="SLO attainment per class against request rate, through the gateway")
    where = p.add_mutually_exclusive_group(required=True)
    where.add_argument("--url", help="a running gateway, e.g. http://127.0.0.1:8080")
    where.add_argument("--up", action="store_true", help="start `adaserve up` for the run and stop it after")
    p.add_argument("--target", help="with --up: the model to serve, as `adaserve up --model` takes it "
                   "(default smollm2-135m-instruct; demo-tiny for the tiny test pair)")
    p.add_argument("--draft", help="with --up: its draft (default: the named model's own)")
    p.add_argument("--budget", type=int, help="with --up: fixed token budget (default: profiled)")
    p.add_argument("--slo-classes-file", type=Path, help="with --up: the classes, as `adaserve up` takes them "
                   "(default: the three default classes scaled to the machine)")
    p.add_argument("--model", help="model name to request (default: the gateway's first in /v1/models)")
    p.add_argument("--rps", type=floats, help="request rates, comma-separated (default 0.5,1,2, none with only "
                   "--sequential or --overhead)")
    p.add_argument("--load", type=floats, help="rates as multiples of the capacity instead, e.g. 0.25,0.5,1,2,3")
    p.add_argument("--capacity-rps", type=float, help="with --load: the capacity (default: measured first)")
    p.add_argument("--probe-s", type=float, default=30.0, help="capacity probe: seconds of closed-loop load")
    p.add_argument("--probe-concurrency", type=int, default=8, help="capacity probe: clients sending at once")
    p.add_argument("--compare", action="store_true",
                   help="with --up: also run every rate through a plain load balancer (least-loaded, no admission)")
    p.add_argument("--compare-url", help="a running plain load balancer to run every rate through as well")
    p.add_argument("--duration", type=float, default=30.0, help="seconds of arrivals per rate")
    p.add_argument("--mix", help="class mix, e.g. coding=0.5,chat=0.3,summarization=0.2 (default: equal)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--max-tokens", type=int, default=128, help="cap on output tokens per request")
    p.add_argument("--api-key", default=os.environ.get("ADASERVE_API_KEY"), help="[ADASERVE_API_KEY]")
    p.add_argument("--overhead", type=int, default=0, metavar="N",
                   help="also time N greedy requests direct to the worker and through the gateway "
                        "(needs --worker-url, or --up)")
    p.add_argument("--worker-url", help="a worker behind the gateway, for --overhead")
    p.add_argument("--sequential", type=int, default=0, metavar="N",
                   help="first, N requests of each class one at a time: refused, queued, the gateway's and the "
                        "worker's TTFT and attainment")
    p.add_argument("--conversations", type=int, default=0, metavar="N",
                   help="also N multi-turn conversations sharing a system prompt: the share of later turns served "
                        "by their previous turn's worker (prefix affinity) and TTFT per turn")
    p.add_argument("--turns", type=int, default=2, help="with --conversations: turns per conversation")
    p.add_argument("--conversation-rate", type=float, default=0.5,
                   help="with --conversations: conversations started per second")
    p.add_argument("--think-s", type=float, default=1.0, help="with --conversations: pause before a next turn")
    p.add_argument("--turn-tokens", type=int, default=32, help="with --conversations: each answer's length")
    p.add_argument("--system-chars", type=int, default=2400,
                   help="with --conversations: the shared system prompt's length in characters")
    p.add_argument("--conversation-class", help="with --conversations: the SLO class (default: the gateway's)")
    p.add_argument("--json", type=Path, help="write the report here")
    p.add_argument("--plot", type=Path, help="attainment and TPOT per class against rate (PNG)")
    p.set_defaults(func=run)


DEFAULT_RPS = (0.5, 1.0, 2.0)
PLAIN = {"routing": "least-loaded", "admission": "none"}  # the comparison: what a user would put in front of workers


def run(args: argparse.Namespace) -> int:
    if args.overhead and not (args.worker_url or args.up):
        raise CliError("--overhead needs --worker-url (or --up, which knows its worker)")
    if args.overhead < 0 or args.sequential < 0 or args.conversations < 0:
        raise CliError("--overhead, --sequential and --conversations must be >= 0")
    if args.conversations:
        from adaserve.bench.workload import MultiTurnConfig

        try:  # checked now: a bad value is one line, before anything starts
            args.multi_turn = MultiTurnConfig(
                conversations=args.conversations, turns=args.turns, rate=args.conversation_rate,
                think_s=args.think_s, max_tokens=args.turn_tokens, min_tokens=min(4, args.turn_tokens),
                system_chars=args.system_chars, seed=args.seed)
        except (ValueError, TypeError) as e:
            raise CliError(f"--conversations: {e}") from None
    if args.compare and not args.up:
        raise CliError("--compare starts a plain load balancer beside `adaserve up`: it needs --up "
                       "(or give a running one with --compare-url)")
    if args.capacity_rps is not None and not args.capacity_rps > 0:
        raise CliError("--capacity-rps must be positive")
    if args.load is not None and any(not x > 0 for x in args.load):
        raise CliError("--load multiples must be positive")
    if args.rps is None:
        args.rps = () if args.load is None and (args.sequential or args.overhead or args.conversations) \
            else DEFAULT_RPS
    if args.up:
        port, worker_port = free_port("127.0.0.1"), free_port("127.0.0.1")
        with local_stack(args, port, worker_port) as plain_url:
            report = _run(args, f"http://127.0.0.1:{port}", f"http://127.0.0.1:{worker_port}", plain_url)
    else:
        report = _run(args, args.url.rstrip("/"), args.worker_url, args.compare_url)
    from adaserve.bench.loadgen import plot_load

    emit_report(report, json_path=args.json, plot_path=args.plot, plot=plot_load)
    return 0


def _run(args: argparse.Namespace, url: str, worker_url: str | None, plain_url: str | None) -> dict[str, Any]:
    import httpx

    try:
        return asyncio.run(_measure(args, url, worker_url, plain_url))
    except ValueError as e:  # bad options, or the gateway unreachable or answering errors
        raise CliError(str(e)) from None
    except httpx.TransportError as e:  # a server that answered at first stopped answering during the run
        raise CliError(f"lost the connection during the run ({url}, or the worker or balancer beside it): "
                       f"{e or type(e).__name__}") from None


def gateway_settings(args: argparse.Namespace) -> dict[str, Any]:
    """What shapes the admission of the gateway `--up` starts: its settings as the environment leaves them."""
    from adaserve.gateway.settings import GatewaySettings

    if not args.up:
        return {"given": "a running gateway (--url): its settings are its own"}
    s = GatewaySettings(workers=["http://worker"])
    return {k: getattr(s, k) for k in ("routing", "prefix_index_blocks", "admission", "on_overload",
                                       "on_infeasible", "queue_timeout_s", "max_queued", "refresh_s")}


async def _measure(args: argparse.Namespace, url: str, worker_url: str | None,
                   plain_url: str | None) -> dict[str, Any]:
    import httpx

    from adaserve.bench import loadgen
    from adaserve.bench.workload import parse_mix
    from adaserve.contract.slo import slo_met  # the one rule the worker and the gateway judge by

    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    try:
        async with httpx.AsyncClient(timeout=10) as client:
            published = await loadgen.fetch_json(client, f"{url}/v1/slo-classes", headers)
            model = args.model or (await loadgen.fetch_json(client, f"{url}/v1/models", headers))["data"][0]["id"]
            worker = await loadgen.fetch_json(client, f"{worker_url}/v1/profile", {}) if worker_url else None
    except httpx.HTTPError as e:
        raise ValueError(f"cannot reach the gateway at {url}: {e}") from None
    classes = loadgen.classes_from(published)
    ttft = {c["name"]: c.get("ttft_ms") for c in published["data"]}
    mix = parse_mix(args.mix, known=[c.name for c in classes]) if args.mix else None
    cfg = loadgen.LoadConfig(url=url, model=model, rates=args.rps or DEFAULT_RPS, duration_s=args.duration, mix=mix,
                             seed=args.seed, max_tokens_cap=args.max_tokens, api_key=args.api_key)
    systems: dict[str, dict[str, Any]] = {"adaserve": {"url": url, "settings": gateway_settings(args), "rates": []}}
    if plain_url:
        systems["plain"] = {"url": plain_url, "settings": {**PLAIN, "queue_timeout_s": 2.0}, "rates": []}
    report: dict[str, Any] = {
        "url": url, "model": model, "classes": published["data"],
        "config": {"command": "adaserve " + " ".join(sys.argv[1:]),
                   "rps": list(args.rps) if args.load is None else None, "load": args.load,
                   "duration_s": args.duration, "seed": args.seed, "mix": cfg.mix or loadgen.default_mix(classes),
                   "max_tokens": args.max_tokens, "target": args.target, "budget": args.budget,
                   "slo_classes_file": str(args.slo_classes_file) if args.slo_classes_file else None,
                   "torch_threads": os.environ.get("ADASERVE_TORCH_THREADS"), "worker": worker},
        "capacity": None, "systems": systems, "rates": systems["adaserve"]["rates"]}
    if args.overhead:
        print(f"loadtest: gateway overhead, {args.overhead} requests each way ...", file=sys.stderr, flush=True)
        report["overhead"] = await loadgen.measure_overhead(cfg, worker_url or "", requests=args.overhead)
    if args.sequential:
        print(f"loadtest: {args.sequential} requests of each class, one at a time ...", file=sys.stderr, flush=True)
        report["sequential"] = await loadgen.measure_sequential(cfg, classes, each=args.sequential)
    if args.conversations:
        report["multi_turn"] = await _conversations(args, cfg)
    rates = list(args.rps)
    if args.load is not None:
        capacity = await _capacity(args, cfg, classes, plain_url or url)
        report["capacity"] = capacity
        rates = [x * capacity["capacity_rps"] for x in args.load]
    cap = report["capacity"]["capacity_rps"] if report["capacity"] else None
    for rate in rates:  # every rate through each system in turn: a slow spell of a shared machine hits both
        for name, system in systems.items():
            at = dataclasses.replace(cfg, url=system["url"])
            ids: list[str] = []
            verdicts: list[dict[str, Any]] = []
            before = await loadgen.fetch_text(at, "/metrics")
            watch = asyncio.create_task(loadgen.watch_classes(at, verdicts))
            try:
                results, wall = await _one_rate(at, classes, rate, name, ids)
            finally:
                watch.cancel()
            row = loadgen.rate_report(rate, results, wall, rule=slo_met, ttft_of=ttft.get, capacity_rps=cap)
            row["refusals"] = loadgen.refusals_between(before, await loadgen.fetch_text(at, "/metrics"))
            row["verdicts"] = verdicts
            row["prediction"] = loadgen.prediction_report(await loadgen.fetch_records(at, ids))
            system["rates"].append(row)
    return report


async def _capacity(args: argparse.Namespace, cfg: Any, classes: Any, url: str) -> dict[str, Any]:
    from adaserve.bench import loadgen

    if args.capacity_rps is not None:
        return {"given": True, "capacity_rps": args.capacity_rps,
                "mean_tokens_per_request": loadgen.mean_tokens(cfg, classes)}
    print(f"loadtest: capacity, {args.probe_concurrency} clients back to back for {args.probe_s:g}s at {url} ...",
          file=sys.stderr, flush=True)
    return {"given": False, **await loadgen.probe_capacity(cfg, classes, url=url, concurrency=args.probe_concurrency,
                                                           duration_s=args.probe_s)}


async def _conversations(args: argparse.Namespace, cfg: Any) -> dict[str, Any]:
    from tqdm import tqdm

    from adaserve.bench.conversations import measure_conversations

    mt = args.multi_turn
    with tqdm(total=mt.conversations * mt.turns, desc="conversations", unit="turn", file=sys.stderr) as bar:
        return await measure_conversations(cfg, mt, slo_class=args.conversation_class,
                                           on_turn=lambda: bar.update(1))


async def _one_rate(cfg: Any, classes: Any, rate: float, name: str, ids: list[str]) -> tuple[list[Any], float]:
    from tqdm import tqdm

    from adaserve.bench import loadgen

    workload = loadgen.build(cfg, classes, rate)
    with tqdm(total=len(workload), desc=f"{name} {rate:.3g} req/s", unit="req", file=sys.stderr) as bar:
        return await loadgen.run_rate(cfg, workload, on_done=lambda: bar.update(1), ids=ids)


@contextmanager
def local_stack(args: argparse.Namespace, port: int, worker_port: int) -> Iterator[str | None]:
    """``adaserve up`` in a child process, ready before the run and stopped (drained) after it; with ``--compare``
    also a plain load balancer in front of its worker, with the same classes: its URL is what this yields."""
    cmd = [sys.executable, "-m", "adaserve", "up", "--port", str(port), "--worker-port", str(worker_port)]
    for name in ("target", "draft", "budget", "slo_classes_file"):
        if getattr(args, name) is not None:
            cmd += [f"--{name.replace('_', '-')}", str(getattr(args, name))]
    # its banner would mix with the report on stdout; its progress and errors still show on stderr
    url = f"http://127.0.0.1:{port}"
    stack = ServerProcess.start(cmd, url=url, name="`adaserve up`", stdout=subprocess.DEVNULL)
    plain: ServerProcess | None = None
    try:
        try:
            stack.wait_ready_blocking("/readyz", timeout_s=READY_TIMEOUT_S, interval_s=0.5)
            if args.compare:
                plain = _plain_gateway(url, f"http://127.0.0.1:{worker_port}")
        except NotReady as e:
            raise CliError(str(e)) from None
        yield plain.url if plain is not None else None
    finally:
        if plain is not None:
            plain.stop(timeout_s=30)
        stack.stop(timeout_s=60)


def _plain_gateway(url: str, worker_url: str) -> ServerProcess:
    """``adaserve gateway --routing least-loaded --admission none`` before ``worker_url``, with ``url``'s classes."""
    import httpx

    published = httpx.get(f"{url}/v1/slo-classes", timeout=10).json()
    model = httpx.get(f"{url}/v1/models", timeout=10).json()["data"][0]["id"]
    classes = [{"name": c["name"], "tpotMs": c["tpot_ms"], "ttftMs": c["ttft_ms"], "priority": c["priority"],
                "sheddable": c["sheddable"]} for c in published["data"]]
    port = free_port("127.0.0.1")
    cmd = [sys.executable, "-m", "adaserve", "gateway", "--port", str(port), "--workers", worker_url,
           "--model-name", model, "--routing", PLAIN["routing"], "--admission", PLAIN["admission"],
           "--default-slo-class", published["default"], "--log-level", "warning"]
    env = {k: v for k, v in os.environ.items() if not k.startswith("ADASERVE_GATEWAY_")}
    env["ADASERVE_GATEWAY_SLO_CLASSES"] = json.dumps(classes)
    plain = ServerProcess.start(cmd, url=f"http://127.0.0.1:{port}", name="the plain load balancer", env=env,
                                stdout=subprocess.DEVNULL)
    plain.wait_ready_blocking("/readyz", timeout_s=120, interval_s=0.5)
    return plain
