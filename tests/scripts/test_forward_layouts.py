"""scripts/forward-layouts.py: layouts parse to the sequences, tokens and contexts they name, a short run times each
model over each layout beside the profile's prediction, and a bad layout is a CLI error (exit 2, no traceback)."""

from __future__ import annotations

import subprocess
import sys

import pytest

from tests.scripts.helpers import SCRIPTS, load_script


def test_a_layout_names_its_sequences_tokens_and_contexts() -> None:
    layouts = load_script("forward-layouts.py")
    assert layouts.parse_layout("4x3@200") == (4, 3, [200, 200, 200, 200])
    assert layouts.parse_layout("5x1@100-300") == (5, 1, [100, 150, 200, 250, 300])
    assert layouts.parse_layout("1x2@10-30") == (1, 2, [10])
    for bad in ("4x3", "0x1@5", "2x1@30-10", "ax1@5"):
        with pytest.raises(ValueError, match="layout"):
            layouts.parse_layout(bad)


def test_a_short_run_times_each_model_over_each_layout() -> None:
    layouts = load_script("forward-layouts.py")
    report = layouts.run("demo-tiny", ["2x1@16", "2x2@8-24"], models=("target", "draft"), repeats=2, warmup=0)
    rows = report["forwards"]
    assert [(r["model"], r["layout"]) for r in rows] == [("target", "2x1@16"), ("target", "2x2@8-24"),
                                                       ("draft", "2x1@16"), ("draft", "2x2@8-24")]
    assert rows[1]["tokens"] == 4 and rows[1]["n_context"] == 32 and rows[1]["longest_context"] == 24
    assert rows[1]["n_cells"] == 2 * 8 + 3 + 2 * 24 + 3  # two tokens over 8 and 24 keys, each chunk of 2: 3 more
    assert all(r["ms"] > 0 and r["predicted_ms"] > 0 and r["spread"] >= 0 for r in rows)
    assert set(report["attention"]) == {"target", "draft"}


def test_a_bad_layout_is_a_cli_error() -> None:
    out = subprocess.run([sys.executable, str(SCRIPTS / "forward-layouts.py"), "--layouts", "32x1"],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 2 and "SEQSxTOKENS@CONTEXT" in out.stderr and "Traceback" not in out.stderr


def test_the_fits_tell_the_cells_from_the_context_read() -> None:
    """Layouts timed by a forward that reads each sequence's keys once per new token (its context and its chunk's keys
    up to itself): the model with the cells fits them exactly, SmartSpec's does not, most of all on decode-sized
    batches."""
    layouts = load_script("forward-layouts.py")

    def cells(seqs: int, per: int, ctx: int) -> int:
        return seqs * (per * ctx + per * (per + 1) // 2)

    def ms(seqs: int, per: int, ctx: int) -> float:  # 4 ms + 0.1 ms a token + 1 us a context token + 0.5 us a cell
        return 4.0 + 0.1 * seqs * per + 1e-3 * seqs * ctx + 5e-4 * cells(seqs, per, ctx)

    grid = [(s, p, c) for s in (1, 8, 32) for p in (1, 2, 4, 8) for c in (64, 256, 512)]
    rows = [{"model": "target", "sequences": s, "tokens": s * p, "n_context": s * c, "n_cells": cells(s, p, c),
             "ms": ms(s, p, c)} for s, p, c in grid]
    fitted = layouts.fits(rows)["target"]
    assert fitted["cells"]["mean_rel_error"] < 1e-6
    assert fitted["cells"]["cost_model"]["beta"] == pytest.approx(5e-7, rel=1e-6)
    assert fitted["smartspec"]["mean_rel_error"] > 0.02 and "beta" not in fitted["smartspec"]["cost_model"]
    assert fitted["smartspec"]["decode_mean_rel_error"] > fitted["cells"]["decode_mean_rel_error"]


def test_probe_contexts_fit_one_set_of_probes_each_way() -> None:
    """``--probe-contexts``: the profiler's probes, timed once, fitted per list of contexts (a context's probes over at
    most 8 sequences, or the number after an x); each fit predicts every layout and reports its errors."""
    layouts = load_script("forward-layouts.py")
    assert layouts.parse_probe_set("16,8,32x2:4") == ((8, 8, 0), (16, 8, 0), (32, 2, 4))
    sets = ("8,16", "8,16,32", "8,16,32x2", "8,16,32x2:4")
    report = layouts.run("demo-tiny", ["8x1@16", "1x4@32"], models=("target",), repeats=1, warmup=0,
                         probe_sets=[layouts.parse_probe_set(t) for t in sets], probe_rounds=1)
    fits = report["probe_fits"]["target"]
    assert set(fits) == set(sets)
    assert fits["8,16,32"]["cost_model"] != fits["8,16,32x2"]["cost_model"]  # other probes, timed apart
    assert fits["8,16,32x2"]["cost_model"] != fits["8,16,32x2:4"]["cost_model"]  # the same, fewer of them fitted
    assert all(f["mean_rel_error"] >= 0 and f["cost_model"]["delta"] >= 0 for f in fits.values())
    assert fits["8,16"]["decode_mean_rel_error"] >= 0  # 8x1 is decode-sized
    assert all(set(r["probe_fits_ms"]) == set(fits) and min(r["probe_fits_ms"].values()) > 0
               for r in report["forwards"])


@pytest.mark.parametrize("bad", ["64", "64,x", "0,64", "64,256x0", "64,64x2", "64,256:-1", "64,256:y"])
def test_bad_probe_contexts_are_cli_errors(bad: str, capsys: pytest.CaptureFixture[str]) -> None:
    """Refused by the argument parser (exit 2, a message), before any model loads: in-process, no interpreter start."""
    with pytest.raises(SystemExit) as exit_:
        load_script("forward-layouts.py").main(["--layouts", "8x1@16", "--probe-contexts", bad])
    assert exit_.value.code == 2 and "--probe-contexts" in capsys.readouterr().err
