"""``adaserve loadtest``: multi-SLO load through a gateway over HTTP; prints a JSON report.

Against a running gateway (``--url``, e.g. a cluster's) or one it starts itself (``--up``: ``adaserve up``
on ``--target``, by default smollm2-135m-instruct, stopped afterwards). See adaserve/bench/loadgen.py for
what is measured and how.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from adaserve.arg_types import floats
from adaserve.cli_error import CliError
from adaserve.reports import emit_report
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
    p.add_argument("--model", help="model name to request (default: the gateway's first in /v1/models)")
    p.add_argument("--rps", type=floats, default=(0.5, 1.0, 2.0), help="request rates, comma-separated")
    p.add_argument("--duration", type=float, default=30.0, help="seconds of arrivals per rate")
    p.add_argument("--mix", help="class mix, e.g. coding=0.5,chat=0.3,summarization=0.2 (default: equal)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--max-tokens", type=int, default=128, help="cap on output tokens per request")
    p.add_argument("--api-key", default=os.environ.get("ADASERVE_API_KEY"), help="[ADASERVE_API_KEY]")
    p.add_argument("--overhead", type=int, default=0, metavar="N",
                   help="also time N greedy requests direct to the worker and through the gateway "
                        "(needs --worker-url, or --up)")
    p.add_argument("--worker-url", help="a worker behind the gateway, for --overhead")
    p.add_argument("--json", type=Path, help="write the report here")
    p.add_argument("--plot", type=Path, help="attainment and TPOT per class against rate (PNG)")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    if args.overhead and not (args.worker_url or args.up):
        raise CliError("--overhead needs --worker-url (or --up, which knows its worker)")
    if args.overhead < 0:
        raise CliError("--overhead must be >= 0")
    if args.up:
        port, worker_port = free_port("127.0.0.1"), free_port("127.0.0.1")
        with local_stack(args, port, worker_port):
            report = _run(args, f"http://127.0.0.1:{port}", f"http://127.0.0.1:{worker_port}")
    else:
        report = _run(args, args.url.rstrip("/"), args.worker_url)
    from adaserve.bench.loadgen import plot_load

    emit_report(report, json_path=args.json, plot_path=args.plot, plot=plot_load)
    return 0


def _run(args: argparse.Namespace, url: str, worker_url: str | None) -> dict[str, Any]:
    try:
        return asyncio.run(_measure(args, url, worker_url))
    except ValueError as e:  # bad options, or the gateway unreachable or answering errors
        raise CliError(str(e)) from None


async def _measure(args: argparse.Namespace, url: str, worker_url: str | None) -> dict[str, Any]:
    import httpx
    from tqdm import tqdm

    from adaserve.bench import loadgen
    from adaserve.bench.workload import parse_mix

    try:
        async with httpx.AsyncClient(timeout=10) as client:
            headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
            published = await loadgen.fetch_json(client, f"{url}/v1/slo-classes", headers)
            model = args.model or (await loadgen.fetch_json(client, f"{url}/v1/models", headers))["data"][0]["id"]
    except httpx.HTTPError as e:
        raise ValueError(f"cannot reach the gateway at {url}: {e}") from None
    classes = loadgen.classes_from(published)
    mix = parse_mix(args.mix, known=[c.name for c in classes]) if args.mix else None
    cfg = loadgen.LoadConfig(url=url, model=model, rates=args.rps, duration_s=args.duration, mix=mix,
                             seed=args.seed, max_tokens_cap=args.max_tokens, api_key=args.api_key)
    report: dict[str, Any] = {"url": url, "model": model, "classes": published["data"],
                              "config": {"rps": list(args.rps), "duration_s": args.duration, "seed": args.seed,
                                         "mix": cfg.mix or loadgen.default_mix(classes),
                                         "max_tokens": args.max_tokens},
                              "rates": []}
    if args.overhead:
        print(f"loadtest: gateway overhead, {args.overhead} requests each way ...", file=sys.stderr, flush=True)
        report["overhead"] = await loadgen.measure_overhead(cfg, worker_url or "", requests=args.overhead)
    for rate in args.rps:
        workload = loadgen.build(cfg, classes, rate)
        with tqdm(total=len(workload), desc=f"{rate:g} req/s", unit="req", file=sys.stderr) as bar:
            results, wall = await loadgen.run_rate(cfg, workload, on_done=lambda: bar.update(1))
        report["rates"].append(loadgen.rate_report(rate, results, wall))
    return report


@contextmanager
def local_stack(args: argparse.Namespace, port: int, worker_port: int) -> Iterator[None]:
    """``adaserve up`` in a child process, ready before the run and stopped (drained) after it."""
    cmd = [sys.executable, "-m", "adaserve", "up", "--port", str(port), "--worker-port", str(worker_port)]
    for name in ("target", "draft", "budget"):
        if getattr(args, name) is not None:
            cmd += [f"--{name}", str(getattr(args, name))]
    # its banner would mix with the report on stdout; its progress and errors still show on stderr
    stack = ServerProcess.start(cmd, url=f"http://127.0.0.1:{port}", name="`adaserve up`", stdout=subprocess.DEVNULL)
    try:
        try:
            stack.wait_ready_blocking("/readyz", timeout_s=READY_TIMEOUT_S, interval_s=0.5)
        except NotReady as e:
            raise CliError(str(e)) from None
        yield
    finally:
        stack.stop(timeout_s=60)
