"""``adaserve replay run``: a small sweep end to end (JSON, partial file, plot), and its one-line errors."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from adaserve.bench.sim.agreement import AgreementPool, AgreementTrace
from adaserve.cli.main import main


def write_trace(path: Path, n: int = 24) -> Path:
    ratios = (1.2, -50.0, -150.0)
    path.write_text(json.dumps([{"emission_time_ms": 150.0 * i, "input_length": 40 + 10 * i, "output_length": 24,
                                 "prompt": f"prompt {i}", "slo_ratio": ratios[i % 3]} for i in range(n)]))
    return path


def write_pool(path: Path) -> Path:
    rng = np.random.default_rng(0)

    def rec(cls: str) -> AgreementTrace:
        q = np.sort(rng.dirichlet(np.ones(6), size=24)[:, :4], axis=1)[:, ::-1]
        return AgreementTrace(cls, q, rng.choice([0, 0, 0, 1, -1], size=24))

    AgreementPool({c: [rec(c), rec(c)] for c in ("coding", "chat", "summarization")}, {"model": "test"}).save(path)
    return path


def test_a_small_sweep_writes_its_cells_points_and_plot(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    trace, pool = write_trace(tmp_path / "t.json"), write_pool(tmp_path / "pool.npz")
    out, png = tmp_path / "out.json", tmp_path / "out.png"
    rc = main(["replay", "run", "--pool", str(pool), "--trace-json", str(trace),
               "--systems", "vllm,vllm-spec:2,adaserve", "--seeds", "0,1", "--json", str(out), "--plot", str(png)])
    assert rc == 0
    result = json.loads(out.read_text())
    assert len(result["cells"]) == 3 * 2
    assert {p["system"] for p in result["points"]} == {"vllm", "vllm-spec:2", "adaserve"}
    assert result["pool"]["sha256"] and result["sweep_wall_s"] > 0
    for c in result["cells"]:
        assert c["requests"] == 24 and 0.0 <= c["slo_attainment"] <= 1.0
        # TTFT against fixed targets, alone and with the TPOT target: never more often both than either
        t = c["ttft"]
        assert t["p50_ms"] <= t["p90_ms"] and set(t["within"]) == {"1s", "2s", "5s"}
        for k, share in t["within_and_tpot_met"].items():
            assert share <= min(t["within"][k], c["slo_attainment"])
    assert png.stat().st_size > 0
    assert not (tmp_path / "out.partial.json").exists()  # kept while running, removed at the end
    # plain decoding draws nothing from the pool: every seed gives the same schedule
    vllm = [c for c in result["cells"] if c["system"] == "vllm"]
    assert vllm[0]["mean_tpot_ms"] == vllm[1]["mean_tpot_ms"]


@pytest.mark.parametrize(("args", "message"), [
    (["--systems", "nonsense"], "unknown policy"),
    (["--seeds", "x"], "--seeds"),
    (["--jobs", "0"], "--jobs"),
    (["--systems", "adaserve|budget"], "FIELD=VALUE"),
    (["--systems", "adaserve|slo_order=random"], "slo_order"),
    (["--prefill-ttft-ms", "0"], "--prefill-ttft-ms"),
])
def test_bad_options_are_one_line_and_exit_2(tmp_path: Path, capsys: pytest.CaptureFixture[str], args: list[str],
                                             message: str) -> None:
    trace, pool = write_trace(tmp_path / "t.json"), write_pool(tmp_path / "pool.npz")
    rc = main(["replay", "run", "--pool", str(pool), "--trace-json", str(trace), *args])
    err = capsys.readouterr().err
    assert rc == 2
    assert message in err and "Traceback" not in err


def test_a_file_that_is_not_a_pool_is_one_line_and_exit_2(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    trace = write_trace(tmp_path / "t.json")
    (tmp_path / "bad.npz").write_text("nope")
    rc = main(["replay", "run", "--pool", str(tmp_path / "bad.npz"), "--trace-json", str(trace)])
    assert rc == 2
    assert "not an agreement pool" in capsys.readouterr().err


def test_a_system_can_set_engine_fields_over_its_preset() -> None:
    from adaserve.bench.replay_sweep import SweepSettings, engine_config
    from adaserve.bench.sim.device_model import load_profile_file

    device = load_profile_file("artifact/llama-3.1-70b")
    cfg = engine_config("adaserve|budget=1024;slo_margin=0.5;d_max=6", device, SweepSettings())
    assert (cfg.budget, cfg.slo_margin, cfg.adaptive.d_max) == (1024, 0.5, 6)
    assert cfg.max_batch == 64 and cfg.budget_rule == "knee"  # the preset's own fields stay
