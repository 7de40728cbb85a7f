"""What a worker tells others about itself: ``GET /v1/profile`` and its Redis registration (docs/worker.md)."""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

from adaserve import __version__
from adaserve.engine.build import BuiltEngine
from adaserve.engine.profiler import device_name
from adaserve.worker.settings import WorkerSettings

if TYPE_CHECKING:
    from adaserve.worker.runtime import Runtime

SCHEMA_VERSION = 1


def profile_info(built: BuiltEngine, settings: WorkerSettings) -> dict[str, Any]:
    """Budget, cost model and device."""
    engine, prof = built.engine, built.profile
    return {
        "device": prof.device if prof else device_name(engine.target.device),
        "device_type": settings.device,
        "budget": engine.cfg.budget,
        "budget_source": "profile" if prof else "fixed",
        "profile_cached": prof.cached if prof else None,
        "cost_model": {
            # profiled, or (with a fixed budget) what the engine has learnt from its own forwards so far
            "source": "profile" if prof else "online",
            "target": engine.target_time.model.to_dict(),
            "draft": engine.draft_time.model.to_dict() if engine.draft is not None else None,
        },
        "policy": settings.policy,
        # D: draft steps per iteration at most (0: no speculation); the gateway's iteration-time estimate
        "max_depth": engine.policy.max_shape.depth if engine.policy.max_shape is not None else 0,
        "max_context": engine.max_context,
    }


def active_by_class(runtime: Runtime) -> dict[str, int]:
    out: dict[str, int] = {}
    for flight in list(runtime.active.values()):
        out[flight.slo_class] = out.get(flight.slo_class, 0) + 1
    return out


def context_tokens(runtime: Runtime) -> int:
    """KV tokens the worker's requests hold now (prompt + output): what each verification reads."""
    engine = runtime.built.engine if runtime.built else None
    if engine is None:
        return 0
    return sum(len(r.prompt_ids) + len(r.output_ids) for r in [*engine.running, *engine.waiting])


def registration(runtime: Runtime) -> dict[str, Any]:
    """The JSON a worker keeps in Redis."""
    s = runtime.settings
    built = runtime.built
    engine = built.engine if built else None
    return {
        "schema": SCHEMA_VERSION,
        "worker_id": s.worker_id,
        "address": s.address,
        "status": runtime.state.value,
        "version": __version__,
        "models": {"name": s.served_model_name, "target": str(s.target), "draft": str(s.draft) if s.draft else None},
        **(profile_info(built, s) if built else {}),
        "capacity": {"max_active_requests": s.max_active_requests,
                     "max_batch": engine.cfg.max_batch if engine else None},
        "load": {
            "active": len(runtime.active),
            "active_by_class": active_by_class(runtime),
            "waiting": len(engine.waiting) if engine else 0,
            "running": len(engine.running) if engine else 0,
            "kv_usage": engine.kv_usage() if engine else 0.0,
            "context_tokens": context_tokens(runtime),
        },
        "acceptance": runtime.metrics.recent_acceptance(),
        "slo_attainment": runtime.metrics.attainment(),
        "slo_classes": s.slo_classes,
        "started_at": runtime.started_at,
        "updated_at": time.time(),
        "heartbeat_s": s.heartbeat_s,
        "ttl_s": s.registration_ttl_s,
    }
