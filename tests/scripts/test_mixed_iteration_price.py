"""scripts/mixed-iteration-price.py: each pricing is what its commit's engine computes for the same forward, a short run
records mixed and decode-only forwards and prices them three ways, and a bad argument is a CLI error."""

from __future__ import annotations

import subprocess
import sys

import pytest

from adaserve.engine.cost.cost_model import CostModel
from adaserve.engine.cost.profiler import ProfilerConfig
from adaserve.engine.cost.timing import OnlineCostModel, PromptLoad
from tests.scripts.helpers import SCRIPTS, load_script

MODEL = CostModel(alpha=1e-6, gamma=1.2e-4, delta=4e-3, beta=3e-7)


def test_the_own_keys_price_is_the_engines() -> None:
    """A forward of 8 decoding requests (2,400 cached tokens, a token each) beside chunks of 100 over 50 and 20 over
    0: "own-keys" is the engine's ``for_batch`` with the chunks' ``PromptLoad``, "spread" spreads every token over the
    decoding requests' context, and SmartSpec's model has no cells."""
    mixed = load_script("mixed-iteration-price.py")
    models = {"smartspec": CostModel(1e-6, 1.2e-4, 4e-3), "cached-cells": MODEL, "chunk-cells": MODEL}
    chunks = [(100, 50), (20, 0)]
    got = mixed.prices(models, (2400, 8, 128, chunks, 0.05))
    engine = OnlineCostModel(MODEL, frozen=True).for_batch(8, PromptLoad.of(chunks))
    assert got["own-keys"] == pytest.approx(engine(2400, 128), rel=1e-12)
    assert got["spread"] == pytest.approx(MODEL.predict(2400, 128, 2400 * 128 / 8), rel=1e-12)
    assert got["smartspec"] == pytest.approx(models["smartspec"].predict(2400, 128), rel=1e-12)
    # without a chunk the two cell pricings differ only by the tokens' own keys
    plain = mixed.prices(models, (2400, 8, 8, [], 0.01))
    assert plain["own-keys"] - plain["spread"] == pytest.approx(MODEL.beta * 8, rel=1e-9)


def test_a_short_run_prices_mixed_and_decode_forwards() -> None:
    mixed = load_script("mixed-iteration-price.py")
    report = mixed.run("demo-tiny", decoding=2, prompt_tokens=32, every=4, chunk=16, iterations=12, warmup=1,
                       probes=ProfilerConfig(max_tokens=32, repeats=1, warmup=0))
    assert set(report["fits"]) == {"smartspec", "cached-cells", "chunk-cells"}
    assert "beta" not in report["fits"]["smartspec"]
    for name in ("smartspec", "spread", "own-keys"):
        kinds = report["pricings"][name]
        assert kinds["mixed"]["iterations"] >= 4 and kinds["decode"]["iterations"] >= 4
        assert kinds["mixed"]["mean_abs_error"] >= 0 and kinds["mixed"]["median_ratio"] > 0
    assert report["mean_chunk_tokens"] == 16 and report["median_measured_ms"]["mixed"] > 0


def test_bad_arguments_are_cli_errors() -> None:
    out = subprocess.run([sys.executable, str(SCRIPTS / "mixed-iteration-price.py"), "--every", "0"],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 2 and "--every must be at least 1" in out.stderr and "Traceback" not in out.stderr
