"""``adaserve bench --conversations N --turns T``: later turns resend the conversation, and with prefix caching
they prefill less (issue 34)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from adaserve.bench.multi_turn import ChatDriver, ConversationWorkload, by_turn
from adaserve.bench.runner import PREFIX_CACHE_LABEL, BenchConfig, run_bench, serve_wall
from adaserve.bench.workload import DEFAULT_CLASSES, DEFAULT_MIX, MultiTurnConfig
from adaserve.engine.config import EngineConfig
from adaserve.engine.engine import Engine
from adaserve.engine.loading.loader import load_tokenizer
from tests.engine.helpers import runner

ROOT = Path(__file__).resolve().parents[2]
DEMO = ROOT / "models" / "demo"
PAGE = 16
needs_demo = pytest.mark.skipif(not (DEMO / "target" / "config.json").is_file(),
                                reason="demo pair not in this checkout")


@needs_demo
def test_second_turn_resends_the_first_and_its_answer_and_reuses_its_kv() -> None:
    tok = load_tokenizer(DEMO / "target")
    target, draft = runner(DEMO / "target", page_size=PAGE), runner(DEMO / "draft", page_size=PAGE)
    mt = MultiTurnConfig(conversations=3, turns=2, rate=50.0, think_s=0.0, max_tokens=6, system_chars=600)
    wl = ConversationWorkload(mt, baseline_tpot_ms=30.0, classes=DEFAULT_CLASSES, mix=DEFAULT_MIX)
    drivers = {}
    for cached in (False, True):
        eng = Engine(target, draft, EngineConfig(policy="chain:2", budget=16, prefix_caching=cached))
        drivers[cached] = ChatDriver(wl, tok, lambda n: 2048 - 64 - n)
        serve_wall(eng, drivers[cached].first_turns(), drivers[cached].follow_up)
    ids = [f"conv-{i:04d}-t{k}" for i in range(3) for k in (1, 2)]
    assert sorted(drivers[True].requests) == ids and drivers[True].truncated == 0
    # lossless: the same answers, so the same histories, with and without the cache
    assert all(drivers[True].requests[r].output_ids == drivers[False].requests[r].output_ids for r in ids)
    assert all(r.metrics.cached_tokens == 0 for r in drivers[False].requests.values())
    reqs = drivers[True].requests
    for i in range(3):
        first, second = reqs[f"conv-{i:04d}-t1"], reqs[f"conv-{i:04d}-t2"]
        text1 = tok.decode(first.prompt_ids, skip_special_tokens=True)
        text2 = tok.decode(second.prompt_ids, skip_special_tokens=True)
        answer = tok.decode(first.output_ids, skip_special_tokens=True).strip()
        assert answer and text2.startswith(text1)  # the whole first turn, then its answer, then the new turn
        assert text2[len(text1):].lstrip().startswith(answer)
        assert len(second.prompt_ids) > len(first.prompt_ids) + len(first.output_ids) - 2
        # everything of the first turn but a partial last page comes from the cache
        assert second.metrics.cached_tokens >= len(first.prompt_ids) - PAGE
    turns = by_turn(drivers[True], met=set(ids))
    assert turns["2"]["requests"] == 3 and turns["2"]["slo_attainment"] == 1.0
    assert turns["2"]["mean_cached_tokens"] > turns["1"]["mean_cached_tokens"]


@needs_demo
def test_simulated_bench_runs_conversations_with_and_without_caching() -> None:
    cfg = BenchConfig(target=DEMO / "target", draft=DEMO / "draft", policies=("vllm", "chain:2"), rates=(10.0,),
                      conversations=3, turns=2, think_s=0.2, system_chars=600, output_tokens=6,
                      compare_prefix_caching=True, clock="simulated", device_profile="a100-80g-tp4/llama-3.1-70b",
                      baseline_tpot_ms=30.0)
    rep = run_bench(cfg, progress=False)
    rows = {r["policy"]: r for r in rep["results"]}
    assert set(rows) == {"vllm", "chain:2", "vllm" + PREFIX_CACHE_LABEL, "chain:2" + PREFIX_CACHE_LABEL}
    assert rep["lossless"] is True and all(r["outputs_equal_reference"] == 1.0 for r in rows.values())
    assert rep["config"]["conversations"] == {"conversations": 3, "turns": 2, "think_s": 0.2, "system_chars": 600}
    for name in ("vllm", "chain:2"):
        off, on = rows[name], rows[name + PREFIX_CACHE_LABEL]
        assert (off["prefix_caching"], on["prefix_caching"]) == (False, True)
        for r in (off, on):
            assert r["requests"] == 6 and r["prompts_truncated"] == 0
            assert r["turns"]["1"]["requests"] == r["turns"]["2"]["requests"] == 3
            assert r["goodput_window_tok_s"] is None  # later turns arrive past any window: the makespan's only
        assert off["prefix_cache"]["cached_tokens"] == 0
        assert off["prefix_cache"]["prompt_tokens"] == on["prefix_cache"]["prompt_tokens"]  # the same histories
        # the second turns prefill (and pay for) less: their history's pages come from the cache
        assert on["turns"]["2"]["mean_cached_tokens"] >= on["turns"]["1"]["mean_prompt_tokens"] - PAGE
        assert on["prefix_cache"]["prefilled_tokens"] < off["prefix_cache"]["prefilled_tokens"]
        assert on["turns"]["2"]["mean_ttft_ms"] < off["turns"]["2"]["mean_ttft_ms"]


@pytest.mark.parametrize(("args", "message"), [
    (["--turns", "3"], "--turns only apply with --conversations"),
    (["--conversations", "2", "--duration", "3"], "--duration cannot be combined with --conversations"),
    (["--conversations", "2", "--turns", "0"], "--conversations: turns must be a positive integer"),
    (["--prefix-caching", "--compare-prefix-caching"], "--prefix-caching and --compare-prefix-caching: give one"),
])
def test_bad_conversation_options_are_one_line_and_exit_2(args: list[str], message: str) -> None:
    r = subprocess.run([sys.executable, "-m", "adaserve", "bench", "--model", "demo-tiny", *args], cwd=ROOT,
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and r.stderr.strip().startswith(f"adaserve: error: {message}"), r.stderr[-2000:]
    assert "Traceback" not in r.stderr
