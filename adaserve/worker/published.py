"""What a worker tells others about itself: ``GET /v1/profile`` and its registration (the schema is
adaserve/contract/registration.py)."""

from __future__ import annotations

import time
from collections import Counter

from adaserve import __version__
from adaserve.contract.registration import (
    Acceptance,
    Capacity,
    ClassAttainment,
    CostModels,
    Load,
    ModelNames,
    Profile,
    Registration,
)
from adaserve.engine.build import BuiltEngine
from adaserve.engine.cost.profiler import device_name
from adaserve.engine.engine import Engine
from adaserve.engine.model.quant import served_description
from adaserve.worker.lone import Lone
from adaserve.worker.measurements import Measurements
from adaserve.worker.metrics import WorkerMetrics
from adaserve.worker.settings import WorkerSettings


def profile_info(built: BuiltEngine, settings: WorkerSettings, *, lone: Lone | None = None) -> Profile:
    """Budget, cost model and device; ``lone``: each kind of request's TPOT served alone, measured at warm-up."""
    engine, prof = built.engine, built.profile
    return Profile(
        device=prof.device if prof else device_name(engine.target.device),
        device_type=settings.device,
        budget=engine.cfg.budget,
        budget_source="profile" if prof else "fixed",
        profile_cached=prof.cached if prof else None,
        # profiled, or (with a fixed budget) what the engine has learnt from its own forwards so far
        cost_model=CostModels(
            source="profile" if prof else "online",
            target=engine.target_time.model.to_dict(),
            draft=engine.draft_time.model.to_dict() if engine.draft is not None else None,
        ),
        policy=settings.policy,
        # D: draft steps per iteration at most (0: no speculation); the gateway's iteration-time estimate
        max_depth=engine.policy.max_shape.depth if engine.policy.max_shape is not None else 0,
        max_context=engine.max_context,
        kv_capacity_tokens=engine.target.cache.capacity_tokens,
        unloaded_tpot_ms=unloaded_tpot_ms(built),
        lone_tpot_ms=lone.median_ms if lone else None,
        lone_tpot_ms_by_class=dict(lone.by_class) if lone and lone.by_class else None,
    )


UNLOADED_CONTEXT = 256  # the profiler's default probe context: a short chat turn plus its answer


def unloaded_tpot_ms(built: BuiltEngine) -> float:
    """One target forward of one token over ``UNLOADED_CONTEXT`` tokens: measured by the profile when there
    is one (its first table row), else predicted by the engine's cost model."""
    prof = built.profile
    if prof is not None and prof.data.get("target", {}).get("table"):
        return float(prof.data["target"]["table"][0]["latency_ms"])
    return 1e3 * built.engine.target_time.model.predict(UNLOADED_CONTEXT, 1)


def context_tokens(engine: Engine) -> int:
    """KV tokens the worker's requests hold now (prompt + output): what each verification reads."""
    return sum(len(r.prompt_ids) + len(r.output_ids) for r in [*engine.running, *engine.waiting])


def model_names(s: WorkerSettings, built: BuiltEngine | None = None) -> ModelNames:
    """What the worker serves: the name, the target, and its draft (the first, profiled one) or drafts; once
    loaded, how the target's weights are served (quant.served_description)."""
    refs = s.draft_refs
    return ModelNames(name=s.served_model_name, target=str(s.target), draft=refs[0] if refs else None,
                      drafts=refs if len(refs) > 1 else [],
                      weights=served_description(built.engine.target.model) if built else None)


def registration(s: WorkerSettings, *, status: str, built: BuiltEngine | None, active_classes: list[str],
                 metrics: WorkerMetrics, measurements: Measurements, lone: Lone | None,
                 started_at: float) -> Registration:
    """The document a worker keeps in Redis and serves at ``GET /v1/status``; ``active_classes``: the SLO
    class of each request in flight (Runtime.registration gathers all of this)."""
    engine = built.engine if built else None
    profile = profile_info(built, s, lone=lone) if built else Profile()
    return Registration(
        **dict(profile),
        worker_id=s.worker_id,
        address=s.address,
        status=status,
        version=__version__,
        models=model_names(s, built),
        capacity=Capacity(max_active_requests=s.max_active_requests,
                          max_batch=engine.cfg.max_batch if engine else None),
        load=Load(
            active=len(active_classes),
            active_by_class=dict(Counter(active_classes)),
            waiting=len(engine.waiting) if engine else 0,
            running=len(engine.running) if engine else 0,
            kv_usage=engine.kv_usage() if engine else 0.0,
            context_tokens=context_tokens(engine) if engine else 0,
        ),
        acceptance=Acceptance(**metrics.recent_acceptance()),
        slo_attainment={c: ClassAttainment(**a) for c, a in metrics.attainment().items()},
        measured=measurements.measured(),
        slo_classes=s.slo_classes,
        started_at=started_at,
        updated_at=time.time(),
        heartbeat_s=s.heartbeat_s,
        ttl_s=s.registration_ttl_s,
    )
