"""Documents as the services write them, for tests of their readers."""

from __future__ import annotations

from typing import Any

# A registration as a worker writes it (adaserve/worker/published.py `registration`, docs/worker.md).
REGISTRATION: dict[str, Any] = {
    "schema": 1,
    "worker_id": "adaserve-worker-7d9f-abcde",
    "address": "http://10.0.3.17:8000/",
    "status": "ready",
    "version": "0.1.0",
    "models": {"name": "target", "target": "/models/target", "draft": "/models/draft", "drafts": []},
    "device": "NVIDIA H100 80GB HBM3",
    "device_type": "cuda",
    "budget": 582,
    "budget_source": "profile",
    "profile_cached": True,
    "cost_model": {"source": "profile",
                   "target": {"alpha": 1.1e-7, "gamma": 2.0e-5, "delta": 0.011},
                   "draft": {"alpha": 2.0e-8, "gamma": 4.0e-6, "delta": 0.002}},
    "policy": "adaserve",
    "max_depth": 4,
    "max_context": 2048,
    "unloaded_tpot_ms": 21.5,
    "lone_tpot_ms": 14.2,
    "capacity": {"max_active_requests": 64, "max_batch": 64},
    "load": {"active": 3, "active_by_class": {"chat": 2, "coding": 1}, "waiting": 0, "running": 3, "kv_usage": 0.12,
             "context_tokens": 1730},
    "acceptance": {"steps": 64, "mean_accepted_per_verification": 1.7, "acceptance_rate": 0.31},
    "slo_attainment": {"chat": {"finished": 120, "met": 117, "attainment": 0.975}},
    "measured": {"iterations": [{"requests": 1, "steps": 32, "iteration_ms": 31.0, "tokens_verified": 9.0,
                                 "tokens_per_request": 2.2,
                                 "tokens_by_class": {"chat": {"tokens": 2.2, "decodes": 30}}},
                                {"requests": 3, "steps": 32, "iteration_ms": 38.5, "tokens_verified": 24.0,
                                 "tokens_per_request": 1.9,
                                 "tokens_by_class": {"chat": {"tokens": 1.7, "decodes": 60},
                                                     "coding": {"tokens": 2.3, "decodes": 30}}}],
                 "classes": {"chat": {"finished": 32, "met": 31, "attainment": 0.96875, "tpot_ms": 21.0,
                                      "ttft_ms": 48.0, "min_ttft_ms": 31.0, "accepted_per_verification": 1.6},
                             "coding": {"finished": 12, "met": 12, "attainment": 1.0, "tpot_ms": 17.5,
                                        "ttft_ms": 52.0, "min_ttft_ms": 40.0, "accepted_per_verification": 2.0}}},
    "slo_classes": {"chat": 50.0},
    "started_at": 1763730000.1,
    "updated_at": 1763730420.6,
    "heartbeat_s": 2.0,
    "ttl_s": 10.0,
}
