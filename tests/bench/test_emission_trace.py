"""The artifact's trace format (``--trace-json``): read and checked, classes named from their SLOs, fixed lengths."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

import pytest

from adaserve.bench import emission_trace as et
from adaserve.bench.runner import BenchConfig, prompt_limit
from adaserve.bench.workload import WorkloadRequest
from adaserve.cli.main import main


def row(t_ms: float, ratio: float, *, out: int = 8, prompt: str = "def f(x):\n", n_in: int = 5) -> dict[str, Any]:
    return {"emission_time_ms": t_ms, "input_length": n_in, "output_length": out, "prompt": prompt,
            "slo_ratio": ratio}


# the paper's three classes, as the artifact writes them: 1.2 x baseline, 50 ms, 150 ms; listed out of order
ROWS = [row(0.0, 1.2), row(2000.0, -150.0, out=12), row(500.0, -50.0), row(1000.0, 1.2, out=6)]


def write(path: Path, rows: Any) -> Path:
    path.write_text(json.dumps(rows, indent=2))
    return path


def test_reads_sorts_and_identifies_the_file(tmp_path: Path) -> None:
    path = write(tmp_path / "emission_small.json", ROWS)
    trace = et.read_emission_trace(path)
    assert [r.emission_s for r in trace.requests] == [0.0, 0.5, 1.0, 2.0]
    assert trace.name == "emission_small.json"
    assert trace.sha256 == hashlib.sha256(path.read_bytes()).hexdigest()
    assert trace.window_s == 2.0 and trace.rate_rps == 2.0  # 4 requests over [0, 2 s]


def test_classes_are_named_from_their_slos() -> None:
    assert [et.class_name(r) for r in (1.2, -50.0, -150.0)] == ["coding", "chat", "summarization"]
    assert et.class_name(0.6) == "0.6x-baseline" and et.class_name(-80.0) == "80ms"  # Figure 11's scaled coding


def test_slos_follow_the_ratio_the_baseline_and_the_scale(tmp_path: Path) -> None:
    trace = et.read_emission_trace(write(tmp_path / "t.json", ROWS))
    reqs = et.TraceWorkload(trace, baseline_tpot_ms=30.0).build()
    assert {r.slo_class: r.tpot_slo_ms for r in reqs} == {"coding": pytest.approx(36.0), "chat": 50.0,
                                                          "summarization": 150.0}
    scaled = et.TraceWorkload(trace, baseline_tpot_ms=30.0, slo_scale=2.0).build()
    assert [s.tpot_slo_ms for s in scaled] == [pytest.approx(2 * r.tpot_slo_ms) for r in reqs]
    wl = et.TraceWorkload(trace, baseline_tpot_ms=30.0)
    assert wl.mix == {"coding": 0.5, "chat": 0.25, "summarization": 0.25} and wl.rate == 2.0 and wl.duration_s == 2.0


def test_outputs_are_fixed_lengths_that_ignore_eos_and_may_be_capped(tmp_path: Path) -> None:
    trace = et.read_emission_trace(write(tmp_path / "t.json", ROWS))
    reqs = et.TraceWorkload(trace, baseline_tpot_ms=30.0).build()
    assert [r.max_tokens for r in reqs] == [8, 8, 6, 12] and all(r.ignore_eos for r in reqs)
    assert [r.request_id for r in reqs] == ["req-00000", "req-00001", "req-00002", "req-00003"]
    capped = et.TraceWorkload(trace, baseline_tpot_ms=30.0, max_tokens_cap=7)
    assert [r.max_tokens for r in capped.build()] == [7, 7, 6, 7]
    info = capped.describe()
    assert info["outputs_capped"] == 3 and info["sha256"] == trace.sha256 and info["requests"] == 4
    assert info["classes"]["coding"] == {"slo_ratio": 1.2, "requests": 2, "tpot_slo_ms": pytest.approx(36.0)}


@pytest.mark.parametrize(("content", "message"), [
    (None, "cannot read"),
    ("{not json", "not JSON"),
    ('{"emission_time_ms": 0}', "non-empty JSON list"),
    ("[]", "non-empty JSON list"),
    (json.dumps([row(0, 1.2), {k: v for k, v in row(1, 1.2).items() if k != "prompt"}]), r"request 1: missing.*prompt"),
    (json.dumps([row(-1.0, 1.2)]), "emission_time_ms must be a number >= 0"),
    (json.dumps([row(0, 0.0)]), "slo_ratio must be a non-zero number"),
    (json.dumps([row(0, 1.2, out=0)]), "output_length must be an integer >= 1"),
    (json.dumps([row(0, 1.2, prompt="")]), "prompt must be a non-empty string"),
    (json.dumps([{**row(0, 1.2), "output_length": True}]), "output_length"),
])
def test_bad_traces_are_refused_with_the_file_and_the_request(tmp_path: Path, content: str | None,
                                                              message: str) -> None:
    path = tmp_path / "bad.json"
    if content is not None:
        path.write_text(content)
    with pytest.raises(ValueError, match=message) as e:
        et.read_emission_trace(path)
    assert str(path) in str(e.value) and "\n" not in str(e.value)


@pytest.mark.parametrize("extra", [[], ["--rps", "3"]])
def test_the_cli_reports_a_bad_trace_in_one_line_with_exit_code_2(tmp_path: Path, capsys: pytest.CaptureFixture,
                                                                  extra: list[str]) -> None:
    bad = write(tmp_path / "bad.json", [row(-5.0, 1.2)]) if not extra else write(tmp_path / "ok.json", ROWS)
    code = main(["bench", "--model", "demo-tiny", "--trace-json", str(bad), *extra])
    err = capsys.readouterr().err
    assert code == 2 and err.startswith("adaserve: error: ") and err.count("\n") == 1, err
    assert ("--rps cannot be combined" in err) if extra else ("emission_time_ms" in err)


def test_prompts_are_cut_to_what_the_context_leaves() -> None:
    w = WorkloadRequest("r", 0.0, "chat", "hi", max_tokens=256, tpot_slo_ms=50.0, ignore_eos=True)
    assert prompt_limit(w, room=2048, max_prompt_tokens=None) == 2048 - 256
    assert prompt_limit(w, room=2048, max_prompt_tokens=512) == 512
    with pytest.raises(ValueError, match="no room for a prompt"):
        prompt_limit(w, room=256, max_prompt_tokens=None)


def test_a_trace_sets_arrivals_and_classes_so_the_bench_refuses_what_would_contradict_it(tmp_path: Path) -> None:
    base = {"target": tmp_path, "draft": tmp_path, "trace_json": tmp_path / "t.json", "max_tokens_cap": None}
    BenchConfig(**base)  # no cap: the trace's own lengths
    for bad, match in (({"trace": tmp_path / "a.csv"}, "no trace or mix"),
                       ({"mix": {"coding": 1.0}}, "no trace or mix"),
                       ({"sweep": "urgent-share", "values": (0.5,)}, "urgent-share"),
                       ({"policies": ("incremental", "hf")}, "end-of-sequence"),
                       ({"output_tokens": 64}, "output lengths"), ({"slo_classes": "paper"}, "output lengths")):
        with pytest.raises(ValueError, match=match):
            BenchConfig(**{**base, **bad})  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="left open"):
        BenchConfig(target=tmp_path, draft=tmp_path, max_tokens_cap=None)
