"""Assembling an engine from model directories and options: the one place entry points share."""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np
import torch

from adaserve.engine.config import EngineConfig
from adaserve.engine.cost.profiler import Profile, profile_models
from adaserve.engine.engine import Engine
from adaserve.engine.loading.catalog import TOKENIZER_FILES
from adaserve.engine.loading.loader import load_model, load_tokenizer, trim_heap
from adaserve.engine.model import native_kernels
from adaserve.engine.model.config import UnsupportedModelError
from adaserve.engine.model.kv_cache import KVCacheConfig, bytes_per_token
from adaserve.engine.model.kv_sizing import KVSizingError, device_memory, kv_budget_bytes, pages_for_budget
from adaserve.engine.model.layers import CausalLM
from adaserve.engine.model.quant import WEIGHTS
from adaserve.engine.model.runner import ModelRunner
from adaserve.engine.ranks import start_target
from adaserve.engine.speculation.adaptive import AdaptiveConfig, bounds_for_device, speculation_floor
from adaserve.engine.speculation.grammar import GrammarCompiler
from adaserve.engine.speculation.policies import make_policy

log = logging.getLogger(__name__)




def _interpolated(table: Sequence[dict[str, Any]]) -> Callable[[int], float]:
    """Seconds of a profiled forward at k tokens, between the table's points linearly."""
    ns = np.array([float(r["n_tokens"]) for r in table])
    ts = np.array([float(r["latency_ms"]) / 1e3 for r in table])
    return lambda k: float(np.interp(k, ns, ts))


def adaptive_for(cfg: AdaptiveConfig, data: dict[str, Any], *, pinned: set[str] = frozenset()) -> AdaptiveConfig:
    """``cfg`` with the tree bounds the profiled draft:target cost ratio allows (adaptive.bounds_for_device),
    except the ``pinned`` fields the user set. Unchanged without a draft profile."""
    if "draft" not in data:
        return cfg
    t_target = float(data["target"]["table"][0]["latency_ms"]) / 1e3  # n = 1 at the reference context
    t_draft = float(data["draft"]["table"][0]["latency_ms"]) / 1e3
    dtable = data["draft"].get("table") or []
    tuned = bounds_for_device(cfg, t_target_s=t_target, t_draft_s=t_draft, draft_budget=int(data["draft"]["budget"]),
                              t_verify=_interpolated(data["target"]["table"]),
                              t_draft_at=_interpolated(dtable) if dtable else None)
    return replace(tuned, **{k: getattr(cfg, k) for k in pinned})


def with_profile(cfg: EngineConfig, prof: Profile, *, pinned: set[str] = frozenset()) -> EngineConfig:
    """``cfg`` as a served engine runs it after profiling: the profile's budget and both cost models, and the tree
    bounds its draft:target ratio allows (``adaptive_for``, the ``pinned`` fields kept)."""
    adaptive = adaptive_for(cfg.adaptive, prof.data, pinned=pinned)
    # deeper or wider trees than the defaults need a larger floor under B (adaptive.speculation_floor)
    return replace(cfg, budget=max(prof.budget, speculation_floor(adaptive)), target_cost=prof.target_cost,
                   draft_cost=prof.draft_cost, adaptive=adaptive)


def kv_from_memory(models: Sequence[CausalLM], cfg: EngineConfig, fraction: float,
                   device: torch.device) -> KVCacheConfig:
    """The caches' size from what the device has left (model/kv_sizing.py): after the models are loaded and,
    on CUDA, after a profiling forward of the most tokens one forward takes, whose peak is set aside; with static
    shapes on CUDA (graphs) each model's peak is set aside once more, for its graphs' own memory pool."""
    peaks = [activation_peak(m, cfg, device) for m in models]
    graphs = sum(peaks) if device.type == "cuda" and cfg.static_shapes else 0
    free, total = device_memory(device)
    budget = kv_budget_bytes(fraction, device_type=device.type, total=total, free=free,
                             activation_peak=max(peaks, default=0), graph_reserve=graphs)
    per_token = [bytes_per_token(m.cfg, m.lm_head.weight.dtype) for m in models]  # the runner's cache dtype
    return replace(cfg.kv, num_pages=pages_for_budget(budget, per_token, cfg.kv.page_size))


def activation_peak(model: CausalLM, cfg: EngineConfig, device: torch.device) -> int:
    """Bytes a forward of the most tokens one forward takes (a prefill chunk, or a verification of the
    budget) allocates at its peak beyond what is held before it; 0 on a CPU (not measured there)."""
    if device.type != "cuda":
        return 0
    from adaserve.engine.model.batch import Segment
    from adaserve.engine.model.kv_cache import SequenceKV
    from adaserve.engine.model.tree import TokenTree

    tokens = max(cfg.prefill_chunk, cfg.budget)
    probe = ModelRunner(model, replace(cfg, kv=replace(cfg.kv, num_pages=-(-tokens // cfg.kv.page_size)),
                                       static_shapes=False))
    torch.cuda.synchronize(device)
    before = torch.cuda.memory_allocated(device)
    torch.cuda.reset_peak_memory_stats(device)
    with torch.inference_mode():
        probe.forward([Segment(SequenceKV(), 0, TokenTree.chain([0] * tokens))], all_logits=[True])
    torch.cuda.synchronize(device)
    peak = torch.cuda.max_memory_allocated(device) - before
    del probe
    torch.cuda.empty_cache()
    return max(0, int(peak))


class EngineBuildError(Exception):
    """Models or options that cannot make an engine; the message is meant for the user."""


@dataclass
class BuiltEngine:
    engine: Engine
    tokenizer: Any | None
    profile: Profile | None = None


def resolve_device(name: str) -> torch.device:
    if name == "cuda" and not torch.cuda.is_available():
        raise EngineBuildError("--device cuda requested but no CUDA device is available")
    if name not in ("cpu", "cuda"):
        raise EngineBuildError(f"unknown device {name!r}: use cpu or cuda")
    return torch.device(name)


DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


def resolve_dtype(name: str) -> torch.dtype | None:
    """None for "auto" (the loader's per-device default)."""
    if name == "auto":
        return None
    if name not in DTYPES:
        raise EngineBuildError(f"unknown dtype {name!r}: use auto, {', '.join(DTYPES)}")
    return DTYPES[name]


def build_engine(*, target: Path, draft: Path | None, extra_drafts: Sequence[Path] = (), device: str = "cpu",
                 policy: str = "adaserve",
                 budget: int | None = None, attention: str = "auto", kv_memory_mb: int = 256,
                 kv_memory_fraction: float | None = None,
                 dtype: str = "auto", weights: str = "auto", max_depth: int | None = None,
                 max_width: int | None = None,
                 profile: bool = True, force_profile: bool = False, progress: bool = True,
                 tensor_parallel_size: int = 1, prefix_caching: bool = True,
                 static_shapes: bool | None = None) -> BuiltEngine:
    """Load models, profile (or reuse the cached profile) unless ``budget`` is given, build the engine.

    ``max_depth`` / ``max_width`` bound the adaptive tree shape (Eq. 8-9) of the policies that use it.
    ``extra_drafts``: more drafts beside ``draft``; each request then speculates on one of them at a time,
    chosen by the policy's draft selector (``POLICY@SELECTOR``, default ucb; multi_draft.py). Only the
    first draft is profiled; the others start from its cost scaled by their size and learn online.
    ``weights`` (float, int8, int4, auto): how every model's decoder layers are served (loader.load_model;
    ``auto``, the default, serves what the directories hold: pass the same option to ``catalog.resolve``,
    which converts a GGUF model for it); the profile is measured on the models as served.
    ``tensor_parallel_size`` > 1 shards the target over that many ranks, this process rank 0 and the others
    child processes (ranks.py, model/parallel.py); the drafts run whole on rank 0.
    ``kv_memory_fraction`` (instead of ``kv_memory_mb`` per model): the caches are sized from the device's
    memory once the models are loaded, one token capacity for every model (model/kv_sizing.py).
    ``prefix_caching``: reuse cached prompt prefixes' KV (EngineConfig.prefix_caching).
    ``static_shapes`` (EngineConfig.static_shapes; model/static.py): None is on for CUDA with one rank, where
    the captured graphs are the fast path (docs/benchmarks.md, "GPU: NVIDIA H200"), and off on a CPU, where
    padding costs more than it saves; graphs under tensor parallelism are refused.
    """
    dev = resolve_device(device)
    dt = resolve_dtype(dtype)
    if weights not in WEIGHTS:
        raise EngineBuildError(f"unknown weights {weights!r}: use {', '.join(WEIGHTS)}")
    try:  # every option is checked here, before the slow part
        bounds = {k: v for k, v in (("d_max", max_depth), ("w_max", max_width)) if v is not None}
        if static_shapes is None:
            static_shapes = dev.type == "cuda" and tensor_parallel_size == 1
        cfg = EngineConfig(policy=policy, attention=attention, kv=KVCacheConfig(memory_bytes=kv_memory_mb * 2**20),
                           adaptive=AdaptiveConfig(**bounds), prefix_caching=prefix_caching,
                           static_shapes=static_shapes,
                           **({"budget": budget} if budget is not None else {}))
        speculates = make_policy(policy, cfg).max_shape is not None
    except ValueError as e:
        raise EngineBuildError(str(e)) from None
    if tensor_parallel_size < 1:
        raise EngineBuildError(f"tensor parallel size must be at least 1, got {tensor_parallel_size}")
    if speculates and draft is None:
        raise EngineBuildError(f"policy {policy!r} speculates: give a draft model with --draft")
    if kv_memory_fraction is not None and not 0 < kv_memory_fraction <= 1:
        raise EngineBuildError(f"the KV memory fraction must be in (0, 1], got {kv_memory_fraction}")
    try:
        draft_paths = [draft, *extra_drafts] if draft is not None and speculates else []
        if tensor_parallel_size > 1:
            if kv_memory_fraction is not None:
                raise EngineBuildError("a KV memory fraction is not supported with tensor parallelism yet: give the "
                                       "KV memory in MiB")
            runners: list[ModelRunner] = [start_target(target, tensor_parallel_size, device=dev, settings=cfg,
                                                       dtype=dt, weights=weights, progress=progress)]
            runners += [ModelRunner(load_model(p, device=dev, dtype=dt, progress=progress, weights=weights), cfg)
                        for p in draft_paths]
        else:
            models = [load_model(p, device=dev, dtype=dt, progress=progress, weights=weights)
                      for p in [target, *draft_paths]]
            if kv_memory_fraction is not None:
                cfg = replace(cfg, kv=kv_from_memory(models, cfg, kv_memory_fraction, dev))
            runners = [ModelRunner(m, cfg) for m in models]
    except KVSizingError as e:
        raise EngineBuildError(str(e)) from None
    except (FileNotFoundError, UnsupportedModelError, ValueError) as e:
        raise EngineBuildError(str(e)) from None
    tgt, drf, extra = runners[0], (runners[1] if len(runners) > 1 else None), runners[2:]
    if dev.type == "cpu":  # the CPU kernels (beam picks, argmax) built now, not during the first request
        native_kernels.chosen()
    cache = tgt.cache
    log.info("KV cache: %d tokens per model (%d pages of %d; %.1f MiB for the target, %d model(s)%s)",
             cache.capacity_tokens, cache.num_pages, cache.page_size, cache.k.nbytes * 2 / 2**20, len(runners),
             f", sized from {kv_memory_fraction:g} of the {dev.type} memory" if kv_memory_fraction is not None
             else f", {kv_memory_mb} MiB each")
    prof = None
    if budget is None and profile:
        drf_path = draft if drf is not None else None
        prof = profile_models(tgt, drf, target_path=target, draft_path=drf_path, cfg=cfg.profiler,
                              force=force_profile, progress=progress)
        cfg = with_profile(cfg, prof, pinned=set(bounds))
    try:
        engine = Engine(tgt, [drf, *extra] if drf is not None and extra else drf, cfg)
    except ValueError as e:  # e.g. a draft selector pinning a draft there is not (spin@d2 with two drafts)
        raise EngineBuildError(str(e)) from None
    tokenizer = None
    if any((target / f).is_file() for f in TOKENIZER_FILES):
        try:
            tokenizer = load_tokenizer(target)
        except Exception as e:  # an odd tokenizer raises many types (tokenizers, jinja2, transformers); it is optional
            first_line = str(e).splitlines()[0] if str(e) else type(e).__name__
            log.warning("cannot load the tokenizer in %s (%s): only prompt_token_ids inputs will work",
                        target, first_line)
    if tokenizer is not None:
        engine.detokenize = lambda ids: tokenizer.decode(ids, skip_special_tokens=True)
        # structured output: llguidance's view of the vocabulary is built on the first constrained request
        engine.grammars = GrammarCompiler.from_hf(tokenizer, vocab_size=engine.target.vocab_size,
                                                  stop_ids=engine.stop_ids)
    trim_heap()  # what loading, profiling and the tokenizer freed (~40 MB on the default int4 pair)
    return BuiltEngine(engine, tokenizer, prof)
