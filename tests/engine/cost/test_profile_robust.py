"""A start-up profile cannot cripple the engine: interleaved rounds, a checked table, re-measurement,
no cache for a noisy table, and never a budget below what one request needs to speculate.

The timings are recorded tables fed through the profiler's timer hook; only the tiny test checkpoint
is loaded (for the probe limit, the device name and the model identity).
"""

from __future__ import annotations

import itertools
import json
import logging
from collections.abc import Callable
from pathlib import Path

import pytest

from adaserve.engine.config import EngineConfig
from adaserve.engine.cost.profile_cache import ProfileCache
from adaserve.engine.cost.profiler import (
    ProfilerConfig,
    check_timings,
    measure_interleaved,
    profile_models,
    profile_runner,
    summarise_timings,
)
from adaserve.engine.model.runner import ModelRunner
from adaserve.engine.speculation.adaptive import speculation_floor
from tests.engine.helpers import runner

GRID = [2**i for i in range(9)]  # 1 .. 256: the CPU grid
# measured on this project's machine (issue 14), ms for n = 1, 2, 4, ..., 256 at context 256
BUSY_MS = dict(zip(GRID, [148, 828, 48, 790, 956, 93, 412, 1204, 556], strict=True))
QUIET_MS = dict(zip(GRID, [6.9, 9.1, 12.3, 15.3, 23.4, 23.6, 28.9, 33.3, 49.0], strict=True))
# the recorded tables' two contexts only (no CPU context: ``probe_plan`` would add 1,024 over the sequences the test
# runner's cache holds)
CFG = ProfilerConfig(max_tokens=256, context=256, fit_contexts=(64, 256), cpu_contexts=(), repeats=5, warmup=1)
PROBES = [(c, n) for c in (64, 256) for n in GRID]
CALLS_PER_ATTEMPT = len(PROBES) * (CFG.warmup + CFG.repeats)


def recorded(ms: dict[int, float]) -> Callable[[int, int], float]:
    """A timer that replays a table: context 64 reads 0.9x the context-256 figure."""
    return lambda n, c: ms[n] / 1e3 * (0.9 if c == 64 else 1.0)


class Phases:
    """Replays one table per measurement attempt (``calls`` forwards each), the last one from then on."""

    def __init__(self, *tables: dict[int, float], calls: int = CALLS_PER_ATTEMPT) -> None:
        self.timers, self.calls, self.n = [recorded(t) for t in tables], calls, 0

    def __call__(self, n: int, c: int) -> float:
        self.n += 1
        return self.timers[min((self.n - 1) // self.calls, len(self.timers) - 1)](n, c)


@pytest.fixture(scope="module")
def tgt(target_dir: Path) -> ModelRunner:
    return runner(target_dir)


# ---- interleaving ---------------------------------------------------------------------------------


def test_rounds_visit_every_probe_once_each_in_a_new_order():
    calls: list[tuple[int, int]] = []
    out = measure_interleaved(lambda n, c: calls.append((c, n)) or 1e-3, PROBES, rounds=4, warmup=2, seed=1)
    warm, timed = calls[: 2 * len(PROBES)], calls[2 * len(PROBES):]
    assert warm == [p for p in PROBES for _ in range(2)]  # each probe warmed up before any is timed
    rounds = [timed[i: i + len(PROBES)] for i in range(0, len(timed), len(PROBES))]
    assert len(rounds) == 4 and all(sorted(r) == sorted(PROBES) for r in rounds)
    assert len({tuple(r) for r in rounds}) == 4 and all(r != PROBES for r in rounds)  # shuffled, differently
    assert {c: {n: len(xs) for n, xs in d.items()} for c, d in out.items()} == {c: dict.fromkeys(GRID, 4)
                                                                               for c in (64, 256)}


def test_interleaving_survives_a_slow_spell_that_sequential_timing_does_not():
    """A burst of load over 18 consecutive forwards: sequential probes take it whole, interleaved ones
    at most two rounds of five, which the median ignores."""
    quiet = recorded(QUIET_MS)

    def machine() -> Callable[[int, int], float]:
        count = itertools.count()
        return lambda n, c: quiet(n, c) * (10.0 if 30 <= next(count) < 48 else 1.0)

    interleaved = measure_interleaved(machine(), PROBES, rounds=5, warmup=0, seed=3)
    timer = machine()
    sequential = {c: {n: [timer(n, c) for _ in range(5)] for n in GRID} for c in (64, 256)}
    assert check_timings(interleaved).ok
    assert not check_timings(sequential).ok


# ---- re-measure, refuse to cache, floor the budget ----------------------------------------------


def test_noisy_table_is_measured_again_then_used_uncached(tgt: ModelRunner, caplog: pytest.LogCaptureFixture):
    calls = itertools.count()
    timer = recorded(BUSY_MS)
    with caplog.at_level(logging.WARNING, logger="adaserve.engine.cost.profiler"):
        out = profile_runner(tgt, CFG, label="target", progress=False, attempts=3,
                             timer=lambda n, c: (next(calls), timer(n, c))[1])
    assert next(calls) == 3 * CALLS_PER_ATTEMPT  # three full measurements
    assert out["check"]["ok"] is False and out["check"]["attempts"] == 3 and out["check"]["problems"]
    assert sum("too noisy" in r.getMessage() for r in caplog.records) == 3
    assert "measuring again" in caplog.records[0].getMessage()


def test_noisy_then_quiet_table_is_remeasured_and_passes(tgt: ModelRunner):
    out = profile_runner(tgt, CFG, label="target", progress=False, timer=Phases(BUSY_MS, QUIET_MS))
    assert out["check"] == {"ok": True, "problems": [], "attempts": 2}
    assert [r["latency_ms"] for r in out["table"]] == pytest.approx(list(QUIET_MS.values()))
    assert out["budget"] == 8


def test_when_every_attempt_fails_the_least_implausible_is_kept(tgt: ModelRunner):
    one_dip = {**QUIET_MS, 64: 0.5 * QUIET_MS[32]}  # a single probe far too fast
    out = profile_runner(tgt, CFG, label="target", progress=False, timer=Phases(BUSY_MS, one_dip, BUSY_MS))
    assert out["check"]["attempts"] == 3 and not out["check"]["ok"]
    assert len(out["check"]["problems"]) == 2  # the dip, at each context
    assert [r["latency_ms"] for r in out["table"]] == pytest.approx(list(one_dip.values()))


def test_busy_table_is_not_cached_and_budget_stays_at_the_floor(
        tmp_path: Path, target_dir: Path, tgt: ModelRunner, caplog: pytest.LogCaptureFixture):
    """The issue's 'done when': a noisy, non-monotone table gets re-measured, then a refusal to cache,
    never B below what the engine needs to speculate for one request."""
    cache = ProfileCache(tmp_path)
    with caplog.at_level(logging.WARNING, logger="adaserve.engine.cost.profiler"):
        prof = profile_models(tgt, None, target_path=target_dir, draft_path=None, cfg=CFG, cache=cache,
                              progress=False, timers=(recorded(BUSY_MS), None))
    a = EngineConfig().adaptive
    assert prof.knee == 2  # what the busy machine's knee says ...
    assert prof.budget == speculation_floor(a) >= 1 + a.d_max * a.w_max  # ... and what the engine runs with
    assert not prof.cached and prof.problems and prof.data["target"]["check"]["attempts"] == 3
    assert list(tmp_path.iterdir()) == []  # refused to cache
    assert any("not cached" in r.getMessage() for r in caplog.records)
    again = profile_models(tgt, None, target_path=target_dir, draft_path=None, cfg=CFG, cache=cache,
                           progress=False, timers=(recorded(QUIET_MS), None))
    assert not again.cached and not again.problems  # the next start measures again, and keeps a clean table
    assert again.knee == 8 and again.budget == speculation_floor()
    assert len(list(tmp_path.iterdir())) == 1


def test_quiet_table_is_cached_and_reused(tmp_path: Path, target_dir: Path, tgt: ModelRunner):
    cache = ProfileCache(tmp_path)
    first = profile_models(tgt, None, target_path=target_dir, draft_path=None, cfg=CFG, cache=cache,
                           progress=False, timers=(recorded(QUIET_MS), None))
    assert first.problems == () and first.data["target"]["check"]["attempts"] == 1
    again = profile_models(tgt, None, target_path=target_dir, draft_path=None, cfg=CFG, cache=cache,
                           progress=False, timers=(recorded(BUSY_MS), None))  # not called: from the cache
    assert again.cached and again.budget == first.budget == max(8, speculation_floor())
    assert again.to_dict()["budget"] == again.budget and again.to_dict()["budget_floor"] == speculation_floor()
    big = profile_models(tgt, None, target_path=target_dir, draft_path=None, cfg=CFG, cache=cache,
                         progress=False, min_budget=33)  # an engine with d_max=8, w_max=4 needs more
    assert big.cached and big.knee == 8 and big.budget == 33


@pytest.mark.parametrize("spoil", ["busy_table", "marked_noisy", "missing_cost_model"])
def test_cached_profile_that_fails_the_check_is_ignored(tmp_path: Path, target_dir: Path, tgt: ModelRunner,
                                                        caplog: pytest.LogCaptureFixture, spoil: str):
    """A table cached before the check existed (or edited since) costs a re-profile, not a crippled engine."""
    cache = ProfileCache(tmp_path)
    profile_models(tgt, None, target_path=target_dir, draft_path=None, cfg=CFG, cache=cache, progress=False,
                   timers=(recorded(QUIET_MS), None))
    path = next(tmp_path.iterdir())
    doc = json.loads(path.read_text())
    part = doc["data"]["target"]
    if spoil == "busy_table":
        busy = summarise_timings({c: {n: [recorded(BUSY_MS)(n, c)] for n in GRID} for c in (64, 256)},
                                 context=256)
        part.update(table=busy["table"], budget=busy["budget"])
        part.pop("check")  # as an older engine wrote it
    elif spoil == "marked_noisy":
        part["check"]["ok"] = False
    else:
        del part["cost_model"]
    path.write_text(json.dumps(doc))
    with caplog.at_level(logging.WARNING, logger="adaserve.engine.cost.profiler"):
        prof = profile_models(tgt, None, target_path=target_dir, draft_path=None, cfg=CFG, cache=cache,
                              progress=False, timers=(recorded(QUIET_MS), None))
    assert not prof.cached and prof.knee == 8
    assert any("ignoring the cached profile" in r.getMessage() for r in caplog.records)


def test_summarise_recorded_quiet_table_is_pure_and_complete():
    timings = {c: {n: [recorded(QUIET_MS)(n, c)] * 3 for n in GRID} for c in (64, 256)}
    out = summarise_timings(timings, context=256)
    assert out["budget"] == 8 and out["check"] == {"ok": True, "problems": []}
    assert [r["n_tokens"] for r in out["table"]] == GRID and all(r["spread"] == 0.0 for r in out["table"])
    assert out["fit"]["mean_rel_error"] < 0.2 and set(out["cost_model"]) == {"alpha", "gamma", "delta"}
    json.dumps(out, allow_nan=False)  # what the cache stores


def test_attempts_must_be_positive(tgt: ModelRunner):
    with pytest.raises(ValueError):
        profile_runner(tgt, CFG, label="target", progress=False, attempts=0, timer=recorded(QUIET_MS))


# ---- a dip among few rows that every round shows (issue 14) --------------------------------------

# this CPU at context 64: t(n=2) ~30% below t(n=1), every round (a faster few-rows kernel for two rows)
DIP_MS = {**QUIET_MS, 1: 1.45 * QUIET_MS[2]}


def test_a_reproducible_dip_is_cached_and_reused(tmp_path: Path, target_dir: Path, tgt: ModelRunner):
    cache = ProfileCache(tmp_path)
    first = profile_models(tgt, None, target_path=target_dir, draft_path=None, cfg=CFG, cache=cache,
                           progress=False, timers=(recorded(DIP_MS), None))
    assert first.problems == () and first.data["target"]["check"]["attempts"] == 1  # measured once
    assert len(list(tmp_path.iterdir())) == 1  # and cached
    rows = first.data["target"]["table"]
    assert [len(r["rounds_ms"]) for r in rows] == [CFG.repeats] * len(GRID)  # the evidence is kept
    again = profile_models(tgt, None, target_path=target_dir, draft_path=None, cfg=CFG, cache=cache,
                           progress=False, timers=(recorded(BUSY_MS), None))  # not called: from the cache
    assert again.cached and again.knee == first.knee


def test_a_dip_the_rounds_disagree_on_is_measured_again_and_not_cached(tmp_path: Path, target_dir: Path,
                                                                        tgt: ModelRunner):
    """The same medians, but n=2 is cheaper than n=1 in only some rounds: noise, as before."""
    cache = ProfileCache(tmp_path)
    seen: dict[tuple[int, int], int] = {}

    def flaky(n: int, c: int) -> float:
        seen[(n, c)] = seen.get((n, c), 0) + 1
        k = (seen[(n, c)] - 1) % (CFG.warmup + CFG.repeats) + 1  # the call's place in its attempt
        if n == 1:  # after one warm-up: slow in rounds 1-3 (the median), as fast as n=2 in rounds 4-5
            return recorded(DIP_MS)(n, c) * (1.0 if k <= 1 + 3 else 0.6)
        return recorded(DIP_MS)(n, c)

    prof = profile_models(tgt, None, target_path=target_dir, draft_path=None, cfg=CFG, cache=cache,
                          progress=False, timers=(flaky, None))
    assert not prof.cached and prof.data["target"]["check"]["attempts"] == 3
    assert any("below t(n=1)" in p for p in prof.problems)
    assert list(tmp_path.iterdir()) == []


def test_a_cached_dip_without_its_rounds_is_measured_again(tmp_path: Path, target_dir: Path, tgt: ModelRunner):
    """An older file kept no rounds: its dip cannot be shown reproducible, so it is re-profiled."""
    cache = ProfileCache(tmp_path)
    cfg = ProfilerConfig(max_tokens=256, context=64, fit_contexts=(64, 256), repeats=5, warmup=1)
    profile_models(tgt, None, target_path=target_dir, draft_path=None, cfg=cfg, cache=cache, progress=False,
                   timers=(recorded(DIP_MS), None))
    path = next(tmp_path.iterdir())
    doc = json.loads(path.read_text())
    for row in doc["data"]["target"]["table"]:
        del row["rounds_ms"]
    path.write_text(json.dumps(doc))
    prof = profile_models(tgt, None, target_path=target_dir, draft_path=None, cfg=cfg, cache=cache,
                          progress=False, timers=(recorded(DIP_MS), None))
    assert not prof.cached and prof.problems == ()
