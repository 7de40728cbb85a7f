"""A request is validated once, by Engine.check_request, whichever way it comes in."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest

from adaserve.engine.loop import EngineLoop
from adaserve.engine.request import Request
from adaserve.engine.speculation.sampling import SamplingParams
from tests.engine.helpers import engine


def ok(**kw: object) -> Request:
    args = {"request_id": "r", "prompt_ids": [5, 6, 7], "params": SamplingParams(max_tokens=4, ignore_eos=True)}
    return Request(**{**args, **kw})  # type: ignore[arg-type]


BAD = [
    ("request_id", {"request_id": ""}),
    ("prompt_ids", {"prompt_ids": []}),
    ("prompt_ids", {"prompt_ids": [5, 10**6]}),
    ("stop_token_ids", {"params": SamplingParams(max_tokens=4, stop_token_ids=(-1,))}),
    ("tpot_slo_ms", {"tpot_slo_ms": 0.0}),
    ("tpot_slo_ms", {"tpot_slo_ms": float("nan")}),
    ("tpot_slo_ms", {"tpot_slo_ms": 5e-324}),  # a denormal: 0 s once divided by 1000 (the fuzz test found it)
    ("max_tokens", {"params": SamplingParams(max_tokens=10**6)}),
]


@pytest.mark.parametrize(("field", "kw"), BAD, ids=[f"{f}-{i}" for i, (f, _) in enumerate(BAD)])
def test_every_entry_refuses_a_bad_request_naming_the_field(field: str, kw: dict, target_dir: Path) -> None:
    eng = engine(target_dir, None, "incremental", budget=8)
    with pytest.raises(ValueError, match=f"^{field}"):
        eng.add_request(ok(**kw))
    loop = EngineLoop(eng)  # not started: submit refuses before anything is queued
    with pytest.raises(ValueError, match=f"^{field}"):
        loop.submit(ok(**kw), lambda ev: None)
    assert not eng.waiting and not loop._inbox


def test_a_clashing_id_is_refused_but_the_first_request_runs(target_dir: Path) -> None:
    eng = engine(target_dir, None, "incremental", budget=8)
    eng.add_request(ok())
    with pytest.raises(ValueError, match=r"^request_id"):
        eng.add_request(ok())
    while eng.has_work:
        eng.step()
    assert len(eng.history) > 0


def test_the_loop_checks_a_request_once(target_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    eng = engine(target_dir, None, "incremental", budget=8)
    calls: list[str] = []
    check = eng.check_request
    monkeypatch.setattr(eng, "check_request", lambda req: (calls.append(req.request_id), check(req))[1])
    loop = EngineLoop(eng).start()
    done = threading.Event()
    loop.submit(ok(), lambda ev: done.set() if ev.finished else None)
    assert done.wait(60)
    loop.stop()
    assert calls == ["r"]


def test_the_slo_phase_target_adds_the_margin_only_for_requests_with_an_slo() -> None:
    from adaserve.engine.request import requirement

    with_slo = Request("a", [1, 2], SamplingParams(max_tokens=4), tpot_slo_ms=50.0)
    with_slo.metrics.first_token_s = 0.0
    with_slo.output_ids = [7, 8]
    without = Request("b", [1, 2], SamplingParams(max_tokens=4))
    base = requirement(with_slo, now_s=0.1, t_iter_s=0.05)
    assert base == pytest.approx((0.1 + 0.05) / 0.05 - 1)
    assert requirement(with_slo, now_s=0.1, t_iter_s=0.05, margin=2.0) == pytest.approx(base + 2.0)
    assert requirement(without, now_s=0.1, t_iter_s=0.05, margin=2.0) == 0.0
