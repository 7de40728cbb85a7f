"""Forward times of published architectures with random weights: what a device profile needs, without the
checkpoint (issue 30: a measured Llama-3.1-8B profile for the simulated clock; the default model's forward
times on a GPU the default model's file could not travel to).

A forward's time does not depend on the weights' values, only on the shapes and the dtype, so a model of
the architecture with random bf16 weights costs what the real one costs. Acceptance does depend on the
values: nothing here measures speculation, only forwards.

- ``ARCHITECTURES``: the published ``config.json`` fields of the architectures profiled, by name;
- :func:`random_model`: one of them (or any Hugging Face config dict) built on a device, weights drawn
  N(0, 0.02), norms 1;
- :func:`profile_pair`: the profiler's roofline tables for a target and a draft, in the form
  ``adaserve profile --json`` writes, so ``device_model.profile_from_measured`` reads it;
- :func:`decode_times`: one forward of ``batch`` requests adding ``new`` tokens each over ``context``
  cached tokens, eager and on static shapes (CUDA graphs on a GPU), median milliseconds;
- :func:`search_times`: one draft beam search as the engine runs it (the plan, the catch-up forward of each
  root, ``depth`` levels of picks and forwards, the trees' one copy to the host), and per draft step (the
  search over its depth): on static shapes with the torch picks a GPU runs, the levels are the draft's steps
  (speculation/draft_steps.py), one graph replay each, so this is what a draft step costs in the engine now,
  where ``decode_times`` times a whole laid-out forward.

Runs on a CPU too (the tests use a tiny architecture), the same functions a GPU runs.
May import: torch, adaserve.engine (model, cost, speculation).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import sys
import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from adaserve.engine.config import EngineConfig
from adaserve.engine.cost.profiler import ProfilerConfig, device_name, profile_runner
from adaserve.engine.model.batch import Segment
from adaserve.engine.model.config import ModelConfig
from adaserve.engine.model.kv_cache import KVCacheConfig, SequenceKV
from adaserve.engine.model.layers import CausalLM
from adaserve.engine.model.rope import Rotary
from adaserve.engine.model.runner import ModelRunner
from adaserve.engine.model.tree import TokenTree
from adaserve.engine.speculation import draft_steps
from adaserve.engine.speculation.speculate import DraftInput, beam_search

_LLAMA3_ROPE = {"rope_type": "llama3", "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                "original_max_position_embeddings": 8192}

# the models' published config.json fields (Hugging Face hub), as far as the engine reads them
ARCHITECTURES: dict[str, dict[str, Any]] = {
    "llama-3.1-8b": {
        "model_type": "llama", "vocab_size": 128256, "hidden_size": 4096, "intermediate_size": 14336,
        "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128,
        "rms_norm_eps": 1e-5, "rope_theta": 500000.0, "max_position_embeddings": 131072,
        "tie_word_embeddings": False, "rope_scaling": {**_LLAMA3_ROPE, "factor": 8.0},
    },
    "llama-3.2-1b": {
        "model_type": "llama", "vocab_size": 128256, "hidden_size": 2048, "intermediate_size": 8192,
        "num_hidden_layers": 16, "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 64,
        "rms_norm_eps": 1e-5, "rope_theta": 500000.0, "max_position_embeddings": 131072,
        "tie_word_embeddings": True, "rope_scaling": {**_LLAMA3_ROPE, "factor": 32.0},
    },
    "smollm2-135m": {
        "model_type": "llama", "vocab_size": 49152, "hidden_size": 576, "intermediate_size": 1536,
        "num_hidden_layers": 30, "num_attention_heads": 9, "num_key_value_heads": 3, "head_dim": 64,
        "rms_norm_eps": 1e-5, "rope_theta": 100000.0, "max_position_embeddings": 8192,
        "tie_word_embeddings": True,
    },
}


def architecture(name_or_config: str | Mapping[str, Any]) -> ModelConfig:
    if isinstance(name_or_config, str):
        if name_or_config not in ARCHITECTURES:
            raise ValueError(f"unknown architecture {name_or_config!r}; known: {', '.join(ARCHITECTURES)}")
        return ModelConfig.from_dict(dict(ARCHITECTURES[name_or_config]))
    return ModelConfig.from_dict(dict(name_or_config))


@torch.no_grad()
def random_model(arch: str | Mapping[str, Any], *, device: torch.device, dtype: torch.dtype,
                 seed: int = 0) -> CausalLM:
    """The architecture with weights drawn N(0, 0.02) (norm scales 1), built on ``device`` in ``dtype``."""
    cfg = architecture(arch)
    with torch.device("meta"):
        model = CausalLM(cfg)
    model = model.to(dtype).to_empty(device=device)  # the dtype first: no float32 copy of an 8B model
    gen = torch.Generator(device=device).manual_seed(seed)
    for name, p in model.named_parameters():
        if name.endswith("norm.weight"):  # RMSNorm scales
            p.fill_(1.0)
        elif name.endswith(".bias"):
            p.zero_()
        else:
            p.normal_(0.0, 0.02, generator=gen)
    if cfg.tie_word_embeddings:
        model.lm_head.weight = model.model.embed_tokens.weight
    model.rotary = Rotary(cfg).to(device)  # its buffer is computed, never drawn
    if device.type == "cuda":  # as the loader serves a float model on a GPU
        model.fuse_projections()
    model.tune_kernels()  # CPU: the fastest few-row products (a no-op on a GPU)
    return model.requires_grad_(False).eval()


def runner_for(model: CausalLM, *, kv_bytes: int, static_shapes: bool) -> ModelRunner:
    """A runner with the torch attention backend (the one CUDA graphs capture in this engine)."""
    return ModelRunner(model, EngineConfig(attention="torch", kv=KVCacheConfig(memory_bytes=kv_bytes),
                                           static_shapes=static_shapes))


def profile_pair(target: ModelRunner, draft: ModelRunner, cfg: ProfilerConfig, *,
                 progress: bool = True) -> dict[str, Any]:
    """Both models' roofline tables and cost-model fits (profiler.profile_runner), as ``adaserve profile
    --json`` lays them out: ``device_model.profile_from_measured`` turns this into a device profile."""
    return {"device": device_name(target.device),
            "target": profile_runner(target, cfg, label="target", progress=progress),
            "draft": profile_runner(draft, cfg, label="draft", progress=progress)}


@dataclass(frozen=True)
class DecodeProbe:
    batch: int  # requests in the forward
    new: int  # new tokens per request (1: decoding; more: a chain to verify)
    context: int  # cached tokens per request


@contextlib.contextmanager
def _segments(runner: ModelRunner, probe: DecodeProbe) -> Iterator[list[Segment]]:
    seqs = [SequenceKV() for _ in range(probe.batch)]
    try:
        for s in seqs:  # the prefix only has to exist in the cache: its values do not change the time
            runner.cache.ensure(s, probe.context)
            runner.cache.truncate(s, probe.context)
        yield [Segment(s, probe.context, TokenTree.chain([1] * probe.new)) for s in seqs]
    finally:
        for s in seqs:
            runner.cache.release(s)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def decode_times(runner: ModelRunner, probe: DecodeProbe, *, repeats: int = 30, warmup: int = 5) -> dict[str, Any]:
    """Median and spread (ms) of one whole forward (planning included), host waiting for the device after; and the
    median of the model's own part by its device timer (``CausalLM.timer``: CUDA events around a graph's replay or
    an eager forward's kernels; wall time on a CPU), so that ``host_median_ms``, the whole less that part, is what
    the host added around it: building the layout, filling the bucket's buffers, the launches, the logits rows."""
    timer, failed = runner.model.timer, len(runner.capture_failures)
    with _segments(runner, probe) as segs:
        flags = [True] * len(segs)
        samples, device = [], []
        for i in range(warmup + repeats):
            _sync(runner.device)
            d0 = timer.seconds
            t0 = time.perf_counter()
            runner.forward(segs, all_logits=flags)
            _sync(runner.device)
            t = time.perf_counter() - t0
            if i >= warmup:
                samples.append(1e3 * t)
                device.append(1e3 * (timer.seconds - d0))
    pairs = sorted(zip(samples, device, strict=True))
    whole = [w for w, _ in pairs]
    host = sorted(w - d for w, d in pairs)
    return {"batch": probe.batch, "new": probe.new, "context": probe.context,
            "static_shapes": runner.static is not None, "median_ms": statistics.median(whole),
            "min_ms": whole[0], "p90_ms": whole[int(0.9 * (len(whole) - 1))], "repeats": repeats,
            "device_median_ms": statistics.median(device), "host_median_ms": statistics.median(host),
            "capture_failures": len(runner.capture_failures) - failed}


@dataclass(frozen=True)
class SearchProbe:
    batch: int  # requests searched together
    depth: int  # levels of each tree (draft steps)
    width: int  # nodes kept per level
    context: int  # cached tokens per request, the root's included


def search_times(runner: ModelRunner, probe: SearchProbe, *, repeats: int = 30, warmup: int = 5) -> dict[str, Any]:
    """Median and spread (ms) of one beam search of ``probe``'s shape, host waiting for the device after, and per
    draft step (the search over its depth: each step one level's picks and, below the last, its forward; the plan,
    the roots' catch-up forward and the copy to the host shared among them); the model's own part by its device
    timer, as in ``decode_times``. Each search feeds one pending token a request (the root, at key index
    ``context - 1``), as an iteration after a one-token acceptance does, and is undone after. ``steps``: the
    levels ran as the draft's steps (static shapes, the torch picks: a GPU's path)."""
    timer, failed = runner.model.timer, len(runner.capture_failures)
    seqs = [SequenceKV() for _ in range(probe.batch)]
    try:
        for s in seqs:  # the prefix only has to exist in the cache: its values do not change the time
            runner.cache.ensure(s, probe.context)
            runner.cache.truncate(s, probe.context - 1)
        samples, device = [], []
        for i in range(warmup + repeats):
            inputs = [DraftInput(s, [1]) for s in seqs]
            _sync(runner.device)
            d0 = timer.seconds
            t0 = time.perf_counter()
            beam_search(runner, inputs, depth=probe.depth, width=probe.width)
            _sync(runner.device)
            t = time.perf_counter() - t0
            for s in seqs:  # the search committed the root: back to the same context for the next
                runner.cache.truncate(s, probe.context - 1)
            if i >= warmup:
                samples.append(1e3 * t)
                device.append(1e3 * (timer.seconds - d0))
    finally:
        for s in seqs:
            runner.cache.release(s)
    whole = sorted(samples)
    search = statistics.median(whole)
    steps = runner.static is not None and draft_steps.shapes_made(runner.static) > 0
    return {"batch": probe.batch, "depth": probe.depth, "width": probe.width, "context": probe.context,
            "static_shapes": runner.static is not None, "steps": steps, "search_median_ms": search,
            "search_min_ms": whole[0], "search_p90_ms": whole[int(0.9 * (len(whole) - 1))], "repeats": repeats,
            "step_median_ms": search / probe.depth, "device_median_ms": statistics.median(device),
            "host_median_ms": statistics.median(sorted(w - d for w, d in zip(samples, device, strict=True))),
            "capture_failures": len(runner.capture_failures) - failed}


# ---- the command line: python -m adaserve.bench.random_arch {profile,forwards,searches} ... ------------


def load_named(ref: str, *, device: torch.device, dtype: torch.dtype) -> tuple[CausalLM, str]:
    """An architecture name or a ``config.json`` path (random weights), or a model the catalog knows (its own
    weights)."""
    if ref in ARCHITECTURES:
        return random_model(ref, device=device, dtype=dtype), f"{ref} (random weights)"
    if ref.endswith(".json"):
        return random_model(json.loads(Path(ref).read_text()), device=device, dtype=dtype), f"{ref} (random weights)"
    from adaserve.engine.loading.catalog import model_dir
    from adaserve.engine.loading.loader import load_model

    return load_model(model_dir(ref, progress=False), device=device, dtype=dtype, weights="float"), ref


def _ints(text: str) -> tuple[int, ...]:
    return tuple(int(x) for x in text.split(",") if x)


def _shapes(text: str) -> tuple[tuple[int, int], ...]:
    """``4x2,2x2`` as ((4, 2), (2, 2)): tree depth by width, each at least 1."""
    try:
        shapes = tuple((int(d), int(w)) for d, w in (x.split("x") for x in text.split(",") if x))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected DxW shapes like 4x2,2x2, got {text!r}") from None
    if not shapes or min(min(s) for s in shapes) < 1:
        raise argparse.ArgumentTypeError(f"every depth and width must be >= 1, got {text!r}")
    return shapes


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m adaserve.bench.random_arch", description=__doc__.split("\n\n")[0])
    p.add_argument("what", choices=["profile", "forwards", "searches"],
                   help="profile: roofline tables of target and draft (a device profile); forwards: decode "
                        "forward times of each model, eager and on static shapes; searches: the draft's beam "
                        "searches and their steps, eager and on static shapes (search_times)")
    p.add_argument("--target", default="llama-3.1-8b",
                   help=f"one of {', '.join(ARCHITECTURES)}, a config.json (random weights) or a model")
    p.add_argument("--draft", default="llama-3.2-1b", help="the same forms")
    p.add_argument("--device", default="cuda", choices=["cpu", "cuda"])
    p.add_argument("--kv-gib", type=float, default=4.0, help="KV cache per model")
    p.add_argument("--max-tokens", type=int, default=None, help="profile: largest n (default 1024 on CUDA)")
    p.add_argument("--contexts", type=_ints, default=(64, 256, 1024), help="profile: contexts per request")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--batches", type=_ints, default=(1, 8, 32), help="forwards: requests per forward")
    p.add_argument("--new", type=_ints, default=(1,), help="forwards: new tokens per request")
    p.add_argument("--context", type=int, default=256, help="forwards, searches: cached tokens per request")
    p.add_argument("--shapes", type=_shapes, default=((4, 2),), help="searches: DxW tree shapes, comma-separated")
    p.add_argument("--json", type=Path, required=True)
    args = p.parse_args(argv)
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        print("random_arch: no CUDA device here", file=sys.stderr)
        return 2
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    kv = int(args.kv_gib * 2**30)
    roles = (("draft", args.draft),) if args.what == "searches" else (("target", args.target), ("draft", args.draft))
    models = {role: load_named(ref, device=device, dtype=dtype) for role, ref in roles}
    out: dict[str, Any] = {"device": device_name(device), "dtype": str(dtype).removeprefix("torch."),
                           "torch": torch.__version__, "models": {r: name for r, (_, name) in models.items()}}
    if args.what == "profile":
        cfg = ProfilerConfig(max_tokens=args.max_tokens, context=256 if 256 in args.contexts else args.contexts[0],
                             fit_contexts=args.contexts, repeats=args.repeats)
        t, d = (runner_for(models[r][0], kv_bytes=kv, static_shapes=True) for r in ("target", "draft"))
        t0 = time.perf_counter()
        out.update(profile_pair(t, d, cfg))
        out["settings"] = {"static_shapes": True, "attention": "torch", "contexts": list(args.contexts),
                           "repeats": args.repeats, "seconds": time.perf_counter() - t0}
    elif args.what == "searches":
        rows = []
        for static in (False, True):
            r = runner_for(models["draft"][0], kv_bytes=kv, static_shapes=static)
            for b in args.batches:
                for depth, width in args.shapes:
                    row = search_times(r, SearchProbe(b, depth, width, args.context), repeats=args.repeats)
                    rows.append(row)
                    print(json.dumps(row), file=sys.stderr)
            del r
        out["searches"] = rows
    else:
        rows = []
        for role, (model, _) in models.items():
            for static in (False, True):
                r = runner_for(model, kv_bytes=kv, static_shapes=static)
                for b in args.batches:
                    for n in args.new:
                        row = {"model": role, **decode_times(r, DecodeProbe(b, n, args.context),
                                                              repeats=args.repeats)}
                        rows.append(row)
                        print(json.dumps(row), file=sys.stderr)
                del r
        out["forwards"] = rows
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(out, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
