"""``adaserve bench`` with two drafts: Spin's policies, fixed-draft baselines, draft shares and regret;
and the price of a second draft on a simulated device."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from adaserve.bench.runner import draft_label
from adaserve.bench.sim.device_model import Roofline, load_profile_file, scaled_draft

ROOT = Path(__file__).resolve().parents[2]
DEMO = ROOT / "models" / "demo"
PAPER = "a100-80g-tp4/llama-3.1-70b"


def test_second_draft_is_priced_by_its_size() -> None:
    device = load_profile_file(PAPER)
    half = scaled_draft(device.draft, params_ratio=0.5, kv_ratio=0.5)
    assert isinstance(half, Roofline) and isinstance(device.draft, Roofline)
    fixed = device.draft.hw.fixed_s
    # memory-bound at one token: the streamed part halves, the fixed per-forward time stays
    assert half.seconds(1, 0) - fixed == pytest.approx((device.draft.seconds(1, 0) - fixed) / 2)
    assert half.model.layers == device.draft.model.layers // 2


def test_draft_label_drops_the_cache_key() -> None:
    assert draft_label(Path("/c/smollm2-draft-small-0123456789abcdef")) == "smollm2-draft-small"
    assert draft_label(Path("models/demo/draft")) == "draft"


@pytest.mark.skipif(not (DEMO / "target" / "config.json").is_file(), reason="demo pair not in this checkout")
def test_bench_with_two_drafts_reports_shares_and_regret(tmp_path: Path) -> None:
    out = tmp_path / "drafts.json"
    # the second draft is the target itself: a large, always-right draft, priced by its size
    res = subprocess.run(
        [sys.executable, "-m", "adaserve", "bench", "--target", str(DEMO / "target"), "--draft", str(DEMO / "draft"),
         "--draft", str(DEMO / "target"), "--clock", "simulated", "--device-profile", PAPER,
         "--policies", "incremental,spin,spin-eps,spin-length,spin@d0,spin@d1,adaserve", "--duration", "1.0",
         "--max-tokens", "10", "--rps", "6", "--json", str(out)],
        capture_output=True, text=True, timeout=900)
    assert res.returncode == 0, res.stderr[-3000:]
    rep = json.loads(out.read_text())
    assert rep["lossless"] is True
    assert rep["config"]["draft_names"] == ["draft", "target"]
    prices = rep["simulation"]["draft_t1_ms"]
    assert prices["target"] > prices["draft"]  # the larger draft costs more per forward
    rows = {r["policy"]: r for r in rep["results"]}
    for label in ("spin", "spin-eps", "spin-length", "adaserve"):
        drafts = rows[label]["drafts"]
        assert drafts["slots"] > 0 and sum(sum(v.values()) for v in drafts["served_by_class"].values()) > 0
        assert len(drafts["slot_order"]) == drafts["slots"] and set(drafts["slot_order"]) <= {"0", "1"}
    assert all(set(v) == {"target"} for v in rows["spin@d1"]["drafts"]["served_by_class"].values())
    regret = rep["draft_regret"]["6"]
    assert set(regret) == {"spin", "spin-eps", "spin-length"}  # adaserve has no fixed-draft variant here
    assert regret["spin"]["best_fixed"] in ("spin@d0", "spin@d1")
