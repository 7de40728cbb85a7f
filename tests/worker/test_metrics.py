"""The worker's prefix-cache series read the target cache's own counts (issue 34)."""

from __future__ import annotations

from pathlib import Path

from adaserve.engine.request import Request
from adaserve.engine.speculation.sampling import SamplingParams
from adaserve.worker.metrics import WorkerMetrics
from tests.engine.helpers import engine


def test_prefix_cache_hits_pages_and_evictions(target_dir: Path) -> None:
    m = WorkerMetrics(model_name="m")

    def get(name: str) -> float | None:
        return m.registry.get_sample_value(name, {"model_name": "m"})

    assert get("adaserve_prefix_cache_queries_total") == 0 and get("adaserve_prefix_cache_hit_ratio") == 0
    eng = engine(target_dir, None, "incremental", prefill_chunk=64)
    m.bind_engine(eng)
    prompt = list(range(2, 19))  # 17 tokens: four full pages of 4
    for i in range(2):
        eng.add_request(Request(f"r{i}", prompt, SamplingParams(max_tokens=5, ignore_eos=True)))
        while eng.has_work:
            eng.step()
    assert get("adaserve_prefix_cache_queries_total") == 34
    assert get("adaserve_prefix_cache_hits_total") == 16  # the second request's four pages
    assert get("adaserve_prefix_cache_hit_ratio") == 16 / 34
    # the prompt's four pages, and one of its last token and the first four outputs (the same twice: kept once)
    assert get("adaserve_prefix_cache_pages") == 5
    assert get("adaserve_prefix_cache_evictions_total") == 0
    assert get("adaserve_kv_cache_used_pages") == 0  # idle cached pages count as free
