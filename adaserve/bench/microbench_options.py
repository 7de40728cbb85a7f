"""Settings of the micro-benchmarks (``adaserve microbench``), without torch: the CLI builds its parser from
these before any model loads (``engine_only.py``: the engine's own cost; ``peer_compare.py``: the engine
against Hugging Face transformers on the same model)."""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from pathlib import Path

# speculation on (adaserve) / off; "chain": a fixed 4-token chain (vLLM-Spec(4)), the yardstick a tree must beat
MODES = {"spec": "adaserve", "plain": "incremental", "chain": "chain:4"}
DEFAULT_MODEL = "smollm2-135m-instruct"


@dataclass(frozen=True)
class EngineOnlyConfig:
    batches: tuple[int, ...] = (1, 8, 16, 32)
    modes: tuple[str, ...] = ("spec", "plain")
    prompt_tokens: int = 128  # each prompt's tail, at most this many tokens
    warmup_steps: int = 3
    steps: int = 16  # timed iterations per cell
    count_steps: int = 2  # untimed iterations after them whose host-device crossings are counted (0: none)
    repeats: int = 3  # cells run this many times, interleaved (the machine is shared: report the spread)
    budget: int = 32  # B; the profiled knee of the default pair on the development CPU
    kv_memory_mb: int = 512
    static_shapes: bool = False  # both models' decode-sized forwards on padded static buffers (model/static.py)
    host_cost: bool = False  # the shape rules price the engine's host time too (EngineConfig.host_cost)
    # the engine as served: budget, cost models and tree bounds from the pair's start-up profile (build_engine's);
    # off: ``budget`` and cost models that start from a flat guess and learn from the cell's own forwards
    profiled: bool = False
    # both models' decoder linears as quant.py serves them (checked there): float (the issue-30 figures' setting),
    # int8, int4, or auto (a GGUF model's own precision, what ``adaserve up`` serves on a CPU); the CLI's --weights
    weights: str = "float"

    def __post_init__(self) -> None:
        if not self.batches or min(self.batches) < 1:
            raise ValueError("batches must be positive integers")
        if not self.modes or any(m not in MODES for m in self.modes):
            raise ValueError(f"modes must be among {', '.join(MODES)}")
        for name in ("prompt_tokens", "steps", "repeats", "budget", "kv_memory_mb"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1")
        if self.warmup_steps < 0:
            raise ValueError("warmup_steps must be >= 0")
        if self.count_steps < 0:
            raise ValueError("count_steps must be >= 0")


@dataclass(frozen=True)
class PeerConfig:
    concurrency: int = 16  # requests of the concurrent scenario (the other scenario is one request)
    max_tokens: int = 128  # the single request's cap; the concurrent ones draw theirs from [min_tokens, this]
    min_tokens: int = 32
    arrival_rate: float | None = None  # requests/s of the concurrent scenario (Poisson); None: all at once
    prompt_tokens: int = 256
    repeats: int = 3
    budget: int = 32
    kv_memory_mb: int = 512
    seed: int = 0

    def __post_init__(self) -> None:
        for name in ("concurrency", "max_tokens", "min_tokens", "prompt_tokens", "repeats", "budget", "kv_memory_mb"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1")
        if self.min_tokens > self.max_tokens:
            raise ValueError("min_tokens must be <= max_tokens")
        if self.arrival_rate is not None and not self.arrival_rate > 0:
            raise ValueError("arrival_rate must be > 0")


def _ints(text: str) -> tuple[int, ...]:
    try:
        return tuple(int(x) for x in text.split(",") if x)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None


def add_common(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=DEFAULT_MODEL, help="a named model with its own draft")
    p.add_argument("--threads", type=int, help="torch threads (default: torch's)")
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    p.add_argument("--json", type=Path, help="also write the report here")


def add_engine_only(p: argparse.ArgumentParser) -> None:
    d = EngineOnlyConfig()
    p.add_argument("--batches", type=_ints, default=d.batches, help="concurrent requests, comma-separated")
    p.add_argument("--modes", default=",".join(d.modes),
                   help="comma-separated: spec (adaserve), plain (incremental), chain (chain:4)")
    p.add_argument("--steps", type=int, default=d.steps, help="timed iterations per cell")
    p.add_argument("--warmup", type=int, default=d.warmup_steps, help="untimed iterations after prefill")
    p.add_argument("--count-steps", type=int, default=d.count_steps,
                   help="iterations after the timed ones whose host-device crossings are counted (0: none)")
    p.add_argument("--repeats", type=int, default=d.repeats, help="runs of every cell (or scenario), interleaved")
    p.add_argument("--prompt-tokens", type=int, help=f"tokens per prompt (default {d.prompt_tokens}; "
                   f"{PeerConfig().prompt_tokens} with --peer)")
    p.add_argument("--budget", type=int, default=d.budget, help="tokens per verification (B)")
    p.add_argument("--static-shapes", action="store_true",
                   help="decode-sized forwards on padded static buffers (CUDA graphs on a GPU)")
    p.add_argument("--host-cost", action="store_true",
                   help="the adaptive policies' shape rules price the engine's host time beside the forwards")
    p.add_argument("--profiled", action="store_true",
                   help="the engine as served: budget, cost models and tree bounds from the pair's start-up profile "
                        "(replaces --budget)")


def add_peer(p: argparse.ArgumentParser) -> None:
    d = PeerConfig()
    p.add_argument("--concurrency", type=int, default=d.concurrency, help="requests in the concurrent scenario")
    p.add_argument("--max-tokens", type=int, default=d.max_tokens, help="output cap per request")
    p.add_argument("--min-tokens", type=int, default=d.min_tokens,
                   help="the concurrent requests' caps are drawn from [min, max]")
    p.add_argument("--arrival-rate", type=float, help="Poisson arrivals (req/s) instead of all at once")
    p.add_argument("--seed", type=int, default=d.seed)


def engine_only_config(args: argparse.Namespace) -> EngineOnlyConfig:
    d = EngineOnlyConfig()
    return EngineOnlyConfig(batches=tuple(args.batches), modes=tuple(m for m in args.modes.split(",") if m),
                            prompt_tokens=args.prompt_tokens or d.prompt_tokens, warmup_steps=args.warmup,
                            steps=args.steps, count_steps=getattr(args, "count_steps", d.count_steps),
                            repeats=args.repeats, budget=args.budget,
                            static_shapes=getattr(args, "static_shapes", d.static_shapes),
                            host_cost=getattr(args, "host_cost", d.host_cost),
                            profiled=getattr(args, "profiled", d.profiled),
                            weights=getattr(args, "weights", d.weights))


def peer_config(args: argparse.Namespace) -> PeerConfig:
    d = PeerConfig()
    return PeerConfig(concurrency=args.concurrency, max_tokens=args.max_tokens, min_tokens=args.min_tokens,
                      arrival_rate=args.arrival_rate, prompt_tokens=args.prompt_tokens or d.prompt_tokens,
                      repeats=args.repeats, budget=args.budget, seed=args.seed)
