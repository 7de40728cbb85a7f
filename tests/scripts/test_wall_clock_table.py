"""scripts/wall-clock-table.py: per-seed gaps of one system to the others, and the 95% interval of their mean."""

from __future__ import annotations

from types import ModuleType

import pytest

from tests.scripts.helpers import load_script


@pytest.fixture(scope="module")
def table() -> ModuleType:
    return load_script("wall-clock-table.py")


def doc(**attainment: float) -> dict:
    return {"results": [{"rate_rps": 6, "policy": p.replace("_", "+"), "slo_attainment": a, "mean_tpot_ms": 1.0}
                        for p, a in attainment.items()]}


def test_the_interval_is_students_t_over_the_paired_gaps(table: ModuleType) -> None:
    assert table.ci95([0.1]) is None  # one file: no spread to read
    lo, hi = table.ci95([0.1, 0.3])  # mean 0.2, sd 0.1414, t(1) 12.706: 0.2 -+ 12.706 * 0.1
    assert lo == pytest.approx(0.2 - 1.2706, abs=1e-4) and hi == pytest.approx(0.2 + 1.2706, abs=1e-4)
    assert table.ci95([0.05] * 5) == [0.05, 0.05]


def test_a_summary_pairs_each_file_and_counts_files_ahead_and_behind(table: ModuleType) -> None:
    docs = [doc(adaserve_ours=0.5, smartspec=0.4, chain_4=0.6), doc(adaserve_ours=0.5, smartspec=0.6, chain_4=0.3),
            doc(adaserve_ours=0.7, smartspec=0.5, chain_4=0.6)]
    s = table.summary(docs, "adaserve+ours")
    (row,) = s["rates"]
    assert row["gap_vs"]["smartspec"] == [0.1, -0.1, 0.2]
    assert row["gap_to_best_other"] == pytest.approx([-0.1, -0.1, 0.1])
    assert row["gap_ci95_vs"]["smartspec"][0] < row["gap_mean_vs"]["smartspec"] < row["gap_ci95_vs"]["smartspec"][1]
    assert "smartspec +0.067" in table.markdown(s) and ", 2 / 1" in table.markdown(s)
