"""Lone-request TPOT, 8-concurrent throughput and resident memory of the default pair with float32, int8 and int4
weights, with and without speculation, on this machine's CPU (or its GPU, ``--device cuda``), all in one run;
prints JSON (issue 35).

    PYTHONPATH=. python scripts/weights-bench.py --threads 1,2 --tokens 48 --repeats 3 \\
        --llama-bench /path/to/llama-bench > docs/results/weights-cpu.json

Every engine (weights x policy) is built first with ``build_engine`` (a fixed budget: no profiling), then the
cells run in rounds: each round times every (threads, weights, policy) cell once, and ``llama-bench`` on the
same GGUF at the same thread counts when ``--llama-bench`` is given, so a load that comes and goes on a shared
machine lands on every cell alike; each figure is reported as the median of the rounds with its min and max.
A cell decodes ``--tokens`` greedy tokens of one request (TPOT: decode time / tokens after the first; wall and
process CPU time) and of ``--concurrency`` requests at once (throughput: tokens / wall time).

``float`` is the dequantized GGUF in float32; ``int8`` the GGUF converted with --weights int8 (Q4_1 re-quantized
per row); ``int4`` with --weights int4 (the file's Q4_1 blocks as they are: what --weights auto serves). The draft
(bfloat16 on disk) is quantized at load to the same kind; quantized models serve their LM head and embedding in
int8 (quant.py). Resident memory: each option's engine is built again in a fresh process, which decodes one
request and reports its RSS (``--kv-mb`` of KV cache per model; the imports and tokenizer alone are reported too).
``--memory-only`` runs just those, ``--repeats`` fresh processes per option (no timing, light on a shared machine):

    PYTHONPATH=. python scripts/weights-bench.py --memory-only --workers --weights int4,float --repeats 3 \\
        > docs/results/weights-rss-cpu.json

On a GPU (``--device cuda``; scripts/gpu-checklist.sh runs it) the same cells run there: torch's CUDA int4 and int8
kernels (quant.py), the float option in the GPU's default dtype; ``--threads`` then only sets the host's threads, the
CPU column is the host's time per token, and the memory cells add the device memory the engine holds
(``torch.cuda.memory_allocated``, and its peak). No llama.cpp peer runs there.

``--workers`` also starts a worker process per option and repeat (``adaserve worker``, local mode, the same
settings), which holds what a deployed worker does beyond the engine (the HTTP server; a second tokenizer
where the model needs transformers' own).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import torch

from adaserve.engine.build import build_engine
from adaserve.engine.loading.catalog import DEFAULT_MODEL, resolve, smollm2_gguf
from adaserve.engine.loading.chat import instruction_ids
from adaserve.engine.model import native_kernels
from adaserve.engine.model.quant import served_weights, weight_bytes
from adaserve.engine.request import Request
from adaserve.engine.speculation.sampling import SamplingParams

PROMPTS = [
    "Write a Python function that reverses a linked list.",
    "Explain what a hash table is.",
    "List three uses of the Fourier transform.",
    "Summarize the plot of Hamlet in two sentences.",
    "What is the capital of Australia, and why not Sydney?",
    "Give me a haiku about autumn rain.",
    "How do I read a CSV file with pandas?",
    "Describe the water cycle for a ten-year-old.",
]


def run(eng: Any, prompts: list[list[int]], tokens: int) -> tuple[float, float, int, list[Request]]:
    """Wall and CPU seconds of decoding ``tokens`` per prompt after the first step (prefill), tokens decoded."""
    reqs = [Request(f"r{i}", p, SamplingParams(max_tokens=tokens, ignore_eos=True)) for i, p in enumerate(prompts)]
    for r in reqs:
        eng.add_request(r)
    eng.step()  # prefill (and first tokens) outside the clock
    t0, c0 = time.perf_counter(), time.process_time()
    while eng.has_work:
        eng.step()
    return time.perf_counter() - t0, time.process_time() - c0, sum(len(r.output_ids) - 1 for r in reqs), reqs


def spread(xs: list[float], digits: int = 2) -> dict[str, float]:
    return {
        "median": round(statistics.median(xs), digits),
        "min": round(min(xs), digits),
        "max": round(max(xs), digits),
    }


def status_mb(pid: int | str = "self") -> dict[str, int]:
    out = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        key, _, value = line.partition(":")
        if key in ("VmRSS", "RssAnon", "RssFile", "VmHWM"):
            out[key] = int(value.split()[0]) // 1024
    return out


def bench_engine(pair: Any, policy: str, weights: str, *, profiled: bool = False, device: str = "cpu",
                 **kw: Any) -> Any:
    """The engine every cell uses: the pair, ``policy`` at a fixed B = 32, unprofiled, quiet. ``profiled``: as a
    worker builds it instead (this machine's measured costs, budget and tree bounds, which may turn
    speculation off where no tree is predicted to pay: adaptive.plain_rate)."""
    if profiled:
        return build_engine(target=pair.target, draft=pair.draft, policy=policy, weights=weights, progress=False,
                            profile=True, device=device, **kw)
    return build_engine(target=pair.target, draft=pair.draft, policy=policy, budget=32, weights=weights,
                        progress=False, profile=False, device=device, **kw)


def speculated_share(eng: Any) -> float | None:
    """Of the engine's recent decoding iterations (its history window), the share that drafted a tree."""
    steps = [m for m in eng.history if m.n_decode > 0]
    return sum(m.depth > 0 for m in steps) / len(steps) if steps else None


def device_mb(device: str) -> dict[str, float] | None:
    """On CUDA the device memory torch holds for this process (MB): allocated now, and the peak; None on a CPU."""
    if device != "cuda":
        return None
    return {"allocated": round(torch.cuda.memory_allocated() / 2**20, 1),
            "max_allocated": round(torch.cuda.max_memory_allocated() / 2**20, 1)}


def rss_child(weights: str, policy: str, kv_mb: int, device: str = "cpu") -> None:
    """In a fresh process: RSS with imports and tokenizer only, then with the engine built and one request run
    (on CUDA, the device memory too). The tokenizer is loaded as the engine loads it (``load_tokenizer``), so the
    first figure is a worker's."""
    from adaserve.engine.loading.loader import load_tokenizer

    torch.set_num_threads(1)
    pair = resolve(DEFAULT_MODEL, progress=False, weights=weights)
    load_tokenizer(pair.target)
    base = status_mb()
    built = bench_engine(pair, policy, weights, kv_memory_mb=kv_mb, device=device)
    run(built.engine, [instruction_ids(built.tokenizer, PROMPTS[0])], 8)
    print(
        json.dumps(
            {
                "weights": weights,
                "policy": policy,
                "kv_mb_per_model": kv_mb,
                "imports_and_tokenizer": base,
                "engine_after_one_request": status_mb(),
                "device": device,
                "device_mb_after_one_request": device_mb(device),
                "weight_mb": {
                    "target": round(weight_bytes(built.engine.target.model) / 2**20, 1),
                    "draft": round(weight_bytes(built.engine.draft.model) / 2**20, 1)
                    if built.engine.draft is not None
                    else 0,
                },
            }
        )
    )


def memory_cell(weights: str, kv_mb: int, device: str = "cpu") -> dict[str, Any]:
    """``rss_child`` in a fresh process, for the adaserve policy."""
    out = subprocess.run(
        [sys.executable, __file__, "--rss-child", weights, "adaserve", "--kv-mb", str(kv_mb), "--device", device],
        capture_output=True,
        text=True,
        check=True,
        env={**os.environ},
    ).stdout
    return json.loads(out.strip().splitlines()[-1])


def worker_cell(weights: str, kv_mb: int) -> dict[str, Any]:
    """A worker process (``adaserve worker``, local mode, the adaserve policy at B = 32, one torch thread): its
    RSS once ready (model loaded, warmed up) and after one chat request of 8 tokens. Beyond ``rss_child``'s
    engine it holds the HTTP server's imports (and, for a transformers tokenizer, the event loop's own copy:
    worker/runtime.py)."""
    import httpx

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cmd = [sys.executable, "-m", "adaserve", "worker", "--weights", weights, "--budget", "32", "--kv-memory-mb",
           str(kv_mb), "--host", "127.0.0.1", "--port", str(port)]
    url = f"http://127.0.0.1:{port}"
    proc = subprocess.Popen(cmd, env={**os.environ, "ADASERVE_TORCH_THREADS": "1"}, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    try:
        deadline = time.time() + 600
        while proc.poll() is None and time.time() < deadline:
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(f"{url}/readyz", timeout=2).status_code == 200:
                    break
            time.sleep(0.5)
        else:
            raise RuntimeError(f"worker {' '.join(cmd)} did not get ready")
        ready = status_mb(proc.pid)
        body = {"model": DEFAULT_MODEL, "messages": [{"role": "user", "content": PROMPTS[0]}], "max_tokens": 8,
                "temperature": 0}
        httpx.post(f"{url}/v1/chat/completions", json=body, timeout=300).raise_for_status()
        return {"weights": weights, "policy": "adaserve", "kv_mb_per_model": kv_mb, "ready": ready,
                "after_one_request": status_mb(proc.pid)}
    finally:
        proc.terminate()
        proc.wait(60)


def machine(device: str = "cpu") -> dict[str, Any]:
    from adaserve.bench.engine_only import source_version  # here: the memory cells' children do not import it

    cpu = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                if line.startswith("model name")), "") if Path("/proc/cpuinfo").is_file() else ""
    return {
        "host": platform.node(),
        "device": torch.cuda.get_device_name() if device == "cuda" else "cpu",
        "cpu": cpu or platform.processor() or platform.machine(),
        "torch": torch.__version__,
        "cores": os.cpu_count(),
        "load_average_at_end": os.getloadavg(),
        "source": source_version(),
        # which CPU kernels the quantized layers ran on (ADASERVE_NATIVE_KERNELS and what it chose here)
        "cpu_kernels": {"mode": native_kernels.mode(),
                        "chosen": "integer" if native_kernels.chosen() is not None else "torch",
                        "flags": list(native_kernels.build_flags()) if native_kernels.supported_cpu() else []},
    }


def memory_only(labels: list[str], kv_mb: int, repeats: int, workers: bool, device: str = "cpu") -> None:
    """Each option's ``rss_child`` ``repeats`` times (fresh processes, rounds alternating the options), the
    median RSS after one request, and each option's ratio to float32's where float is among them; with
    ``workers``, the same for worker processes (``worker_cell``)."""
    runs: dict[str, list[dict[str, Any]]] = {label: [] for label in labels}
    worker_runs: dict[str, list[dict[str, Any]]] = {label: [] for label in labels}
    for _ in range(repeats):
        for label in labels:
            runs[label].append(memory_cell(label, kv_mb, device))
            if workers:
                worker_runs[label].append(worker_cell(label, kv_mb))

    def ratios(median: dict[str, float]) -> dict[str, float] | None:
        return {label: round(median["float"] / m, 3) for label, m in median.items()} if "float" in median else None

    median = {label: statistics.median(r["engine_after_one_request"]["VmRSS"] for r in rs)
              for label, rs in runs.items()}
    worker_median = {label: statistics.median(r["after_one_request"]["VmRSS"] for r in rs)
                     for label, rs in worker_runs.items() if rs}
    print(
        json.dumps(
            {
                "machine": machine(device),
                "command": " ".join(["python", "scripts/weights-bench.py", *sys.argv[1:]]),
                "model": DEFAULT_MODEL,
                "gguf": smollm2_gguf().name,
                "policy": "adaserve",
                "budget": 32,
                "kv_mb_per_model": kv_mb,
                "threads": 1,
                "few_row_kernels": os.environ.get("ADASERVE_FEW_ROW_KERNELS", "on"),
                "median_vmrss_mb_after_one_request": median,
                "float_over": ratios(median),
                "runs": runs,
                "workers": {"median_vmrss_mb_after_one_request": worker_median, "float_over": ratios(worker_median),
                            "runs": worker_runs} if workers else "not run",
            },
            indent=1,
        )
    )


def llama_bench(binary: str, threads: int, tokens: int) -> float:
    """llama.cpp's own generation speed on the same GGUF: ms per token of ``tokens`` generated (llama-bench tg)."""
    out = subprocess.run(
        [binary, "-m", str(smollm2_gguf()), "-t", str(threads), "-p", "0", "-n", str(tokens), "-r", "1", "-o", "json"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    return 1e3 / float(json.loads(out)[0]["avg_ts"])


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--threads", default="1,2")
    ap.add_argument("--tokens", type=int, default=48)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--concurrency", type=int, default=8)
    ap.add_argument("--weights", default="int4,int8,float")
    ap.add_argument("--policies", default="incremental,adaserve")
    ap.add_argument("--kv-mb", type=int, default=16, help="KV cache per model in the memory cells")
    ap.add_argument("--llama-bench", default="", help="a llama-bench binary: the peer, same GGUF and threads")
    ap.add_argument("--profiled", action="store_true",
                    help="engines built as a worker builds them (profiled costs and bounds) instead of B = 32")
    ap.add_argument("--memory-only", action="store_true",
                    help="only the resident-memory cells, --repeats fresh processes per option")
    ap.add_argument("--workers", action="store_true",
                    help="with --memory-only: also measure worker processes (adaserve worker, local mode)")
    ap.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                    help="where the engines run (cuda: no llama.cpp peer, no worker cells)")
    ap.add_argument("--rss-child", nargs=2, metavar=("WEIGHTS", "POLICY"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.device == "cuda" and not torch.cuda.is_available():
        ap.error("--device cuda: no CUDA device here")
    if args.device == "cuda" and (args.llama_bench or args.workers):
        ap.error("--device cuda runs neither the llama.cpp peer nor worker cells")
    for name in ("concurrency", "tokens", "repeats"):
        if getattr(args, name) < 1:
            ap.error(f"--{name} must be at least 1")
    if args.rss_child:
        rss_child(*args.rss_child, args.kv_mb, args.device)
        return
    if args.memory_only:
        memory_only(args.weights.split(","), args.kv_mb, args.repeats, args.workers, args.device)
        return
    threads = [int(t) for t in args.threads.split(",")]
    engines: dict[tuple[str, str], Any] = {}
    for label in args.weights.split(","):
        pair = resolve(DEFAULT_MODEL, progress=False, weights=label)
        for policy in args.policies.split(","):
            engines[label, policy] = bench_engine(pair, policy, label, profiled=args.profiled, device=args.device)
    samples: dict[tuple[int, str, str], dict[str, list[float]]] = {}
    outputs: dict[tuple[int, str, str], list[int]] = {}
    peer: dict[int, list[float]] = {t: [] for t in threads}
    for rnd in range(args.repeats):
        for t in threads:
            torch.set_num_threads(t)
            for (label, policy), built in engines.items():
                eng = built.engine
                prompts = [instruction_ids(built.tokenizer, p) for p in PROMPTS[: args.concurrency]]
                run(eng, prompts[:1], 4)  # warm-up
                eng.history.clear()  # each run's own iterations for speculated_share
                lone_s, lone_cpu, lone_n, lone = run(eng, prompts[:1], args.tokens)
                lone_spec = speculated_share(eng)
                eng.history.clear()
                many_s, _, many_n, _ = run(eng, prompts, args.tokens)
                cell = samples.setdefault((t, label, policy), {"wall": [], "cpu": [], "tps": [], "spec_lone": [],
                                                               "spec_many": []})
                cell["spec_lone"].append(lone_spec)
                cell["spec_many"].append(speculated_share(eng))
                cell["wall"].append(1e3 * lone_s / lone_n)
                cell["cpu"].append(1e3 * lone_cpu / lone_n)
                cell["tps"].append(many_n / many_s)
                outputs[t, label, policy] = lone[0].output_ids
                print(
                    f"round {rnd} threads {t} {label} {policy}: {1e3 * lone_s / lone_n:.1f} ms/token",
                    file=sys.stderr,
                    flush=True,
                )
            if args.llama_bench:
                peer[t].append(llama_bench(args.llama_bench, t, args.tokens))
                print(f"round {rnd} threads {t} llama.cpp: {peer[t][-1]:.1f} ms/token", file=sys.stderr, flush=True)
    cells = []
    for (t, label, policy), s in samples.items():
        eng = engines[label, policy].engine
        cells.append(
            {
                "weights": label,
                "served": served_weights(eng.target.model),
                "policy": policy,
                "threads": t,
                "lone_tpot_ms": spread(s["wall"]),
                "lone_cpu_ms_per_token": spread(s["cpu"]),
                f"concurrent{args.concurrency}_tokens_per_s": spread(s["tps"], 1),
                "target_weight_mb": round(weight_bytes(eng.target.model) / 2**20, 1),
                # the share of decoding iterations that drafted a tree, after the lone and the concurrent runs
                "speculated_share_lone": s["spec_lone"],
                f"speculated_share_concurrent{args.concurrency}": s["spec_many"],
                "lone_output_same_as_incremental": outputs[t, label, policy] == outputs[t, label, "incremental"]
                if (t, label, "incremental") in outputs
                else None,
                "lone_output_head": outputs[t, label, policy][:12],
            }
        )
    memory = [memory_cell(label, args.kv_mb, args.device) for label in args.weights.split(",")]
    print(
        json.dumps(
            {
                "machine": machine(args.device),
                "model": DEFAULT_MODEL,
                "gguf": smollm2_gguf().name,
                "tokens": args.tokens,
                "repeats": args.repeats,
                "budget": "profiled" if args.profiled else 32,
                "profiled": args.profiled,
                "cells": cells,
                "memory": memory,
                "peer": {"llama.cpp llama-bench tg, ms per token": {str(t): spread(v) for t, v in peer.items() if v}}
                if args.llama_bench
                else "none run",
            },
            indent=1,
        )
    )


if __name__ == "__main__":
    main()
