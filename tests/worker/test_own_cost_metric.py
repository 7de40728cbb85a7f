"""The worker exports the engine's own cost per iteration as a Prometheus histogram."""

from __future__ import annotations

from adaserve.engine.engine import StepMetrics
from adaserve.worker.metrics import WorkerMetrics


def test_non_forward_share_histogram() -> None:
    m = WorkerMetrics(model_name="m")
    m.on_step(StepMetrics(t_step_s=0.1, t_wall_s=0.1, t_forward_s=0.096))  # 4% outside forwards
    m.on_step(StepMetrics(t_step_s=0.1, t_wall_s=0.1, t_forward_s=0.06))  # 40%
    m.on_step(StepMetrics())  # no wall time measured: not an observation

    def get(name: str, labels: dict[str, str] | None = None) -> float | None:
        return m.registry.get_sample_value(name, {**(labels or {}), "model_name": "m"})

    assert get("adaserve_iteration_non_forward_ratio_count") == 2
    assert get("adaserve_iteration_non_forward_ratio_bucket", {"le": "0.05"}) == 1
    assert get("adaserve_iteration_non_forward_ratio_bucket", {"le": "0.3"}) == 1
    assert get("adaserve_iteration_non_forward_ratio_bucket", {"le": "0.5"}) == 2
    assert abs(get("adaserve_iteration_non_forward_ratio_sum") - 0.44) < 1e-9
