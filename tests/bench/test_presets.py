"""The bench's named systems (adaserve/bench/presets.py): each name resolves to its system's engine settings,
bad names are one-line errors, and a simulated bench runs them all, every one the target's own tokens."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from adaserve.bench.presets import PRESETS, VLLM_PREFILL_TOKENS, resolve
from adaserve.bench.runner import BenchConfig, named_variant
from adaserve.cli.main import main
from adaserve.engine.config import EngineConfig
from adaserve.engine.speculation.adaptive import CHAIN_DEPTH, AdaptiveConfig

BASE = EngineConfig()


def config(name: str) -> EngineConfig:
    preset = resolve(name)
    assert preset is not None, name
    return preset.engine_config(BASE)


def test_vllm_prefills_whole_prompts_alone() -> None:
    c = config("vllm")
    assert (c.policy, c.max_batch, c.prefill_mode, c.prefill_chunk, c.prefill_rule) == (
        "incremental", 512, "separate", VLLM_PREFILL_TOKENS, "fixed")


def test_sarathi_chunks_2048_beside_decodes() -> None:
    c = config("sarathi")
    assert (c.policy, c.max_batch, c.prefill_mode, c.prefill_chunk) == ("incremental", 2048, "mixed", 2048)


@pytest.mark.parametrize("k", [1, 4, 6, 8, 12])
def test_vllm_spec_is_a_chain_under_vllms_admission(k: int) -> None:
    c = config(f"vllm-spec:{k}")
    assert (c.policy, c.max_batch, c.prefill_mode) == (f"chain:{k}", 512, "separate")
    assert resolve(f"vllm-spec:{k}@ucb").policy == f"chain:{k}@ucb"  # a draft selector carries over


@pytest.mark.parametrize("name", ["adaserve", "adaserve-paper"])
def test_adaserve_is_the_papers_configuration(name: str) -> None:
    c = config(name)
    assert (c.policy, c.max_batch, c.prefill_chunk, c.prefill_mode, c.prefill_rule) == (
        "adaserve", 64, 1024, "mixed", "fixed")
    assert (c.budget_rule, c.node_value) == ("knee", "draft")
    a = c.adaptive
    assert (a.d_min, a.d_max, a.w_max, a.depth_rule) == (4, 8, 3, "eq8")
    assert a.b1 == BASE.adaptive.b1  # the device-tuned constants stay the bench's


@pytest.mark.parametrize(("name", "field", "value"), [
    ("adaserve+goodput-budget", "budget_rule", "goodput"),
    ("adaserve+slo-prefill", "prefill_rule", "slo"),
    ("adaserve+learned-values", "node_value", "learned"),
])
def test_each_refinement_changes_one_setting(name: str, field: str, value: str) -> None:
    paper, c = config("adaserve"), config(name)
    assert getattr(c, field) == value != getattr(paper, field)
    assert {k for k in vars(c) if getattr(c, k) != getattr(paper, k)} == {field}
    assert config("adaserve+goodput-depth").adaptive.depth_rule == "goodput"


def test_ours_is_the_engines_defaults() -> None:
    assert config("adaserve+ours") == BASE  # the bench's adaserve before issue 29
    assert BASE.policy == "adaserve" and BASE.budget_rule == "goodput" and BASE.max_batch == 64  # serving unchanged


def test_ours_variants_change_one_setting_each() -> None:
    assert config("adaserve+ours+goodput-shape") == EngineConfig(adaptive=AdaptiveConfig(depth_rule="goodput"))
    assert not BASE.host_cost and config("adaserve+ours+host-cost") == EngineConfig(host_cost=True)
    # chains whatever the device's bounds allow: width 1, and chains as deep as the goodput rule may go
    wide = EngineConfig(adaptive=AdaptiveConfig(d_max=3, w_max=2))
    chains = resolve("adaserve+ours+chains")
    assert chains is not None
    assert chains.engine_config(wide) == EngineConfig(adaptive=AdaptiveConfig(d_max=CHAIN_DEPTH, w_max=1))
    eq8 = EngineConfig(adaptive=AdaptiveConfig(d_max=3, w_max=2, depth_rule="eq8"))
    assert chains.engine_config(eq8).adaptive == AdaptiveConfig(d_max=3, w_max=1, depth_rule="eq8")


def test_engine_policies_keep_their_meaning() -> None:
    for name in ("specinfer", "incremental", "chain:4", "smartspec", "beam:3,2"):
        assert resolve(name) is None
        v = named_variant(name, 32)
        assert (v.label, v.policy, v.preset) == (name, name, None)
    v = named_variant("vllm-spec:4", 32)
    assert (v.label, v.policy, v.preset.name) == ("vllm-spec:4", "chain:4", "vllm-spec:4")
    assert named_variant("hf", 32).preset is None
    assert all(resolve(n) is not None for n in PRESETS)


@pytest.mark.parametrize(("bad", "says"), [
    ("vllm-spec:0", "K >= 1, got '0'"), ("vllm-spec:x", "K >= 1, got 'x'"), ("vllm-spec:", "got ''"),
    ("vllm-spec:-2", "got '-2'"), ("vlm", "or a bench system: vllm, sarathi"), ("vllm@nope", "selector 'nope'"),
])
def test_bad_names_are_one_line_errors(bad: str, says: str) -> None:
    with pytest.raises(ValueError) as e:
        BenchConfig(target=Path("t"), draft=Path("d"), policies=(bad,))
    assert "\n" not in str(e.value) and says in str(e.value)


def test_the_systems_on_a_simulated_bench(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Every named system runs end to end, reports its settings, and emits the target's own greedy tokens."""
    rows = [{"emission_time_ms": 50.0 * i, "input_length": 10, "output_length": 5 + i % 3,
             "prompt": f"def f{i}(x):\n    return x * {i}\n" * (1 + i % 4), "slo_ratio": 1.2 if i % 2 else -50.0}
            for i in range(8)]
    trace = tmp_path / "emission_tiny.json"
    trace.write_text(json.dumps(rows))
    out = tmp_path / "r.json"
    monkeypatch.setenv("ADASERVE_FEW_ROW_KERNELS", "off")
    names = ["vllm", "sarathi", "vllm-spec:2", "adaserve", "adaserve+ours", "specinfer"]
    code = main(["bench", "--model", "demo-tiny", "--clock", "simulated", "--device-profile", "artifact/llama-3.1-70b",
                 "--policies", ",".join(names), "--trace-json", str(trace), "--json", str(out)])
    assert code == 0
    rep = json.loads(out.read_text())
    assert rep["lossless"] is True  # vllm is incremental decoding: the reference
    by = {r["policy"]: r for r in rep["results"]}
    assert set(by) == set(names)
    assert by["vllm"]["system"]["prefill_mode"] == "separate" and by["specinfer"]["system"] is None
    assert by["adaserve"]["system"]["tree"]["d_max"] == 8 and by["adaserve+ours"]["system"]["policy"] == "adaserve"
    for r in rep["results"]:
        assert r["outputs_equal_reference"] == 1.0 and r["requests"] == 8
        assert r["goodput_window_tok_s"] is not None


def test_the_paper_preset_orders_its_slo_phase_as_the_artifacts_scheduler() -> None:
    from adaserve.bench.presets import resolve
    from adaserve.engine.config import EngineConfig

    assert resolve("adaserve").engine_config(EngineConfig()).slo_order == "smallest-need"
    assert resolve("adaserve+text-order").engine_config(EngineConfig()).slo_order == "largest-need"
    with pytest.raises(ValueError, match="slo_order"):
        EngineConfig(slo_order="random")


def test_the_slo_margin_is_ours_not_the_papers() -> None:
    from adaserve.bench.presets import resolve
    from adaserve.engine.config import EngineConfig

    assert EngineConfig().slo_margin == 2.0
    assert resolve("adaserve").engine_config(EngineConfig()).slo_margin == 0.0
    assert resolve("adaserve+slo-margin").engine_config(EngineConfig()).slo_margin == 2.0
    assert resolve("adaserve+ours").engine_config(EngineConfig()).slo_margin == 2.0
    for bad in (-1.0, float("nan")):
        with pytest.raises(ValueError, match="slo_margin"):
            EngineConfig(slo_margin=bad)


def test_the_slo_phase_floor_is_ours_not_the_papers() -> None:
    from adaserve.bench.presets import resolve
    from adaserve.engine.config import EngineConfig

    assert EngineConfig().slo_floor == "price"
    assert resolve("adaserve").engine_config(EngineConfig()).slo_floor == "none"  # Algorithm 2 as written
    assert resolve("adaserve+slo-floor").engine_config(EngineConfig()).slo_floor == "price"
    assert resolve("adaserve+ours").engine_config(EngineConfig()).slo_floor == "price"
    with pytest.raises(ValueError, match="slo_floor"):
        EngineConfig(slo_floor="half")
