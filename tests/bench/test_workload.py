from __future__ import annotations

import itertools
import math
from collections import Counter
from dataclasses import replace
from datetime import UTC, datetime
from pathlib import Path

import numpy as np
import pytest

from adaserve.bench import workload as wl
from adaserve.cli.generate import parse_line

# Irregular gaps (s) -> 11 rows over 10 s, observed rate 1/s, mean gap 1 s.
GAPS = [0.5, 1.5, 0.1, 2.9, 1.0, 2.0, 0.25, 0.75, 0.6, 0.4]
GENERATED = [1, 500, 50, 4, 128, 129, 7, 30, 60, 90, 3]


def write_trace(path: Path, gaps: list[float] = GAPS, generated: list[int] = GENERATED) -> Path:
    start = datetime(2023, 11, 16, 18, 17, 3, tzinfo=UTC).timestamp()
    times = np.concatenate([[0.0], np.cumsum(gaps)])
    lines = ["TIMESTAMP,ContextTokens,GeneratedTokens"]
    for t, g in zip(times, generated, strict=True):
        ticks = round((start + t) * 10_000_000)  # 100 ns ticks, printed with 7 fractional digits
        whole, frac = divmod(ticks, 10_000_000)
        stamp = datetime.fromtimestamp(whole, tz=UTC).strftime("%Y-%m-%d %H:%M:%S")
        lines.append(f"{stamp}.{frac:07d},100,{g}")
    path.write_text("\n".join(lines) + "\n")
    return path


def config(**kw: object) -> wl.WorkloadConfig:
    args: dict[str, object] = {"rate": 5.0, "duration_s": 20.0, "baseline_tpot_ms": 20.0}
    args.update(kw)
    rate, duration = args.pop("rate"), args.pop("duration_s")
    return wl.WorkloadConfig(rate, duration, **args)  # type: ignore[arg-type]


def test_deterministic_under_seed() -> None:
    a, b = wl.build_workload(config(seed=3)), wl.build_workload(config(seed=3))
    assert a == b and len(a) > 50
    assert wl.build_workload(config(seed=4)) != a
    arrivals = [r.arrival_s for r in a]
    assert arrivals == sorted(arrivals) and arrivals[0] >= 0 and arrivals[-1] < 20.0
    assert len({r.request_id for r in a}) == len(a)


def test_mix_does_not_move_arrivals() -> None:
    a = wl.build_workload(config(seed=1))
    b = wl.build_workload(config(seed=1, mix={"coding": 0.2, "chat": 0.3, "summarization": 0.5}))
    assert [r.arrival_s for r in a] == [r.arrival_s for r in b]


def test_mix_proportions() -> None:
    reqs = wl.build_workload(config(rate=400.0, duration_s=25.0))
    counts = Counter(r.slo_class for r in reqs)
    n = len(reqs)
    for name, share in wl.DEFAULT_MIX.items():
        # 5 sigma of a binomial proportion at n ~ 10k is ~0.025
        assert abs(counts[name] / n - share) < 5 * math.sqrt(share * (1 - share) / n), (name, counts)


def test_poisson_rate() -> None:
    rng = np.random.default_rng(0)
    t = wl.poisson_arrivals(50.0, 200.0, rng=rng)
    assert abs(len(t) - 10_000) < 5 * math.sqrt(10_000)
    assert np.all(np.diff(t) > 0) and t[0] >= 0 and t[-1] < 200.0
    gaps = np.diff(t)
    assert abs(gaps.mean() - 1 / 50) < 0.05 / 50
    assert abs(gaps.std() / gaps.mean() - 1.0) < 0.05  # exponential: coefficient of variation 1


def test_timestamp_parsing_keeps_seven_digits() -> None:
    ns = wl.parse_azure_timestamp("2023-11-16 18:17:03.9799600")
    expected = int(datetime(2023, 11, 16, 18, 17, 3, tzinfo=UTC).timestamp()) * 10**9 + 979_960_000
    assert ns == expected
    assert wl.parse_azure_timestamp("2023-11-16 18:17:03.9799601") - ns == 100
    assert wl.parse_azure_timestamp("2023-11-16 18:17:04") - ns == 20_040_000
    assert wl.parse_azure_timestamp("2023-11-17 00:00:00.0000000") - wl.parse_azure_timestamp(
        "2023-11-16 23:59:59.9999999") == 100
    for bad in ("2023-11-16", "16/11/2023 18:17:03", "2023-11-16 18:17:03.", "2023-13-16 18:17:03.1"):
        with pytest.raises(ValueError):
            wl.parse_azure_timestamp(bad)


def test_read_trace(tmp_path: Path) -> None:
    trace = wl.read_trace(write_trace(tmp_path / "t.csv"))
    np.testing.assert_allclose(np.diff(trace.arrival_s), GAPS, atol=1e-6)
    assert trace.arrival_s[0] == 0.0
    assert trace.observed_rate == pytest.approx(1.0, abs=1e-6)
    assert trace.generated_tokens.tolist() == GENERATED


def test_trace_rescaling_gives_the_rate_and_respects_duration(tmp_path: Path) -> None:
    trace = wl.read_trace(write_trace(tmp_path / "t.csv"))
    assert trace.period_s == pytest.approx(11.0)
    # 4/s for 2.5 s -> N = 10 rows; t[10] = 10 s, so every gap is multiplied by s = 2.5 / 10.
    t, gen = wl.rescale_trace(trace, 4.0, 2.5)
    assert len(t) == 10 and t[0] == 0.0 and t[-1] < 2.5
    np.testing.assert_allclose(np.diff(t), np.array(GAPS[:9]) / 4, atol=1e-6)  # the burst shape is kept
    assert gen.tolist() == GENERATED[:10]
    # The realised mean rate is the requested one, and nothing arrives after the duration.
    for rate, duration in [(1.0, 3.0), (3.0, 7.0), (0.5, 40.0), (13.0, 1.7)]:
        t, _ = wl.rescale_trace(trace, rate, duration)
        assert len(t) == round(rate * duration) and t[-1] < duration
        assert np.all(np.diff(t) > 0)
    # Longer than the trace: repeated with period 11 s (one mean gap, 1 s, after the last row).
    t, gen = wl.rescale_trace(trace, 4.0, 100.0)
    assert len(t) == 400 and t[-1] < 100.0
    assert (t[11] - t[10]) / (t[1] - t[0]) == pytest.approx(1.0 / GAPS[0])
    assert gen[11:22].tolist() == GENERATED
    assert len(wl.rescale_trace(trace, 0.1, 1.0)[0]) == 0


def test_trace_workload_lengths_and_rate(tmp_path: Path) -> None:
    path = write_trace(tmp_path / "t.csv")
    reqs = wl.build_workload(config(rate=2.2, duration_s=5.0, trace=path, mix={"coding": 1.0}))
    assert len(reqs) == 11
    assert [r.max_tokens for r in reqs] == [min(max(g, 4), 128) for g in GENERATED]
    assert reqs[-1].arrival_s == pytest.approx(10.0 * 5.0 / 11.0)
    capped = wl.build_workload(config(rate=2.2, duration_s=5.0, trace=path, max_tokens_cap=32, min_tokens=8))
    assert {r.max_tokens for r in capped} <= set(range(8, 33)) and max(r.max_tokens for r in capped) == 32


def test_bad_trace(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="cannot read"):
        wl.read_trace(tmp_path / "missing.csv")
    bad = tmp_path / "bad.csv"
    bad.write_text("TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:17:03.1,1,2\nyesterday,1,2\n")
    with pytest.raises(ValueError, match="line 3"):
        wl.read_trace(bad)
    bad.write_text("time,tokens\n1,2\n")
    with pytest.raises(ValueError, match="missing column"):
        wl.read_trace(bad)
    bad.write_text("TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:17:03.1,1,2\n")
    with pytest.raises(ValueError, match="at least 2 rows"):
        wl.read_trace(bad)


def test_default_output_lengths_in_class_ranges() -> None:
    reqs = wl.build_workload(config(rate=50.0, duration_s=10.0))
    for r in reqs:
        lo, hi = wl.DEFAULT_OUTPUT_TOKENS[r.slo_class]
        assert lo <= r.max_tokens <= min(hi, 128)
    short = wl.build_workload(config(rate=50.0, duration_s=10.0, max_tokens_cap=40))
    assert max(r.max_tokens for r in short) == 40


@pytest.mark.parametrize("scale", [1.0, 0.5, 3.0])
def test_slos_are_multipliers_times_baseline_times_scale(scale: float) -> None:
    reqs = wl.build_workload(config(rate=20.0, baseline_tpot_ms=25.0, slo_scale=scale))
    mult = {"coding": 1.2, "chat": 2.0, "summarization": 6.0}
    assert {r.slo_class for r in reqs} == set(mult)
    for r in reqs:
        assert r.tpot_slo_ms == pytest.approx(mult[r.slo_class] * 25.0 * scale)
    paper = wl.build_workload(config(rate=20.0, baseline_tpot_ms=25.0, slo_scale=scale, classes=wl.PAPER_CLASSES))
    table2 = {"coding": 1.2 * 25.0, "chat": 50.0, "summarization": 150.0}
    for r in paper:
        assert r.tpot_slo_ms == pytest.approx(table2[r.slo_class] * scale)


def test_parse_mix() -> None:
    assert wl.parse_mix("coding=0.6,chat=0.2,summarization=0.2") == pytest.approx(wl.DEFAULT_MIX)
    assert wl.parse_mix(" coding = 0.5 , chat=0.5 ") == {"coding": 0.5, "chat": 0.5}
    mix = wl.parse_mix("coding=0.3333,chat=0.3333,summarization=0.3334")
    assert math.fsum(mix.values()) == pytest.approx(1.0, abs=1e-12)


@pytest.mark.parametrize(("text", "message"), [
    ("coding=0.6,poetry=0.4", "unknown class"),
    ("coding=1.2,chat=-0.2", "non-negative"),
    ("coding=0.6,chat=0.6", "sum to 1"),
    ("coding", "NAME=SHARE"),
    ("coding=lots", "not a number"),
    ("coding=0.5,coding=0.5", "twice"),
    ("", "empty"),
])
def test_bad_mix(text: str, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        wl.parse_mix(text)


@pytest.mark.parametrize(("kw", "message"), [
    ({"rate": 0.0}, "rate"),
    ({"rate": -1.0}, "rate"),
    ({"rate": float("nan")}, "rate"),
    ({"duration_s": 0.0}, "duration_s"),
    ({"duration_s": float("inf")}, "duration_s"),
    ({"baseline_tpot_ms": 0.0}, "baseline_tpot_ms"),
    ({"slo_scale": -2.0}, "slo_scale"),
    ({"seed": -1}, "seed"),
    ({"max_tokens_cap": 2}, "max_tokens_cap"),
    ({"min_tokens": 0}, "min_tokens"),
    ({"max_prompt_chars": 0}, "max_prompt_chars"),
    ({"mix": {"coding": 0.5}}, "sum to 1"),
    ({"mix": {"poetry": 1.0}}, "unknown class"),
    ({"output_tokens": {"coding": (10, 5), "chat": (1, 2), "summarization": (1, 2)}}, "output_tokens"),
])
def test_bad_config(kw: dict[str, object], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        config(**kw)


def test_bad_slo_class() -> None:
    with pytest.raises(ValueError, match="exactly one"):
        wl.SLOClass("chat", tpot_multiplier=2.0, tpot_ms=50.0, share=0.2)
    with pytest.raises(ValueError, match="exactly one"):
        wl.SLOClass("chat", tpot_multiplier=None, tpot_ms=None, share=0.2)
    with pytest.raises(ValueError, match="tpot_ms"):
        wl.SLOClass("chat", tpot_multiplier=None, tpot_ms=-5.0, share=0.2)
    with pytest.raises(ValueError, match="prompt source"):
        config(classes=(*wl.DEFAULT_CLASSES, wl.SLOClass("poetry", 3.0, None, 0.0)))


def test_humaneval_prompts_come_from_the_package() -> None:
    prompts = wl.humaneval_prompts()
    assert len(prompts) == 164
    assert prompts[0].startswith("from typing import List")
    assert "def has_close_elements(" in prompts[0]
    reqs = wl.build_workload(config(mix={"coding": 1.0}))
    assert {r.slo_class for r in reqs} == {"coding"}
    assert all(r.prompt in prompts for r in reqs)


def test_stdlib_prompt_sources() -> None:
    chat, docs = wl.chat_prompts(), wl.summarization_prompts()
    assert len(chat) > 100 and len(docs) > 50
    assert len(set(chat)) == len(chat)
    assert any(p.startswith("Explain what the Python module `json` does: ") for p in chat)
    assert max(len(p) for p in chat) < 400
    lo, hi = wl.SUMMARY_CHARS
    for p in docs:
        assert p.startswith("Summarize the following code from the Python module `")
        body = p.split("\n\n", 1)[1]
        assert lo <= len(body) <= hi


def test_max_prompt_chars_truncates_at_a_line() -> None:
    reqs = wl.build_workload(config(mix={"summarization": 1.0}, max_prompt_chars=500))
    assert reqs and all(len(r.prompt) <= 500 for r in reqs)
    assert all(r.prompt.endswith("\n") for r in reqs)


def test_jsonl_is_accepted_by_generate(tmp_path: Path) -> None:
    reqs = wl.build_workload(config(rate=10.0, duration_s=3.0))
    path = tmp_path / "out" / "w.jsonl"
    wl.write_jsonl(reqs, path)
    lines = path.read_text().splitlines()
    assert len(lines) == len(reqs)
    for i, (line, req) in enumerate(zip(lines, reqs, strict=True)):
        parsed = parse_line(line, i + 1)
        assert parsed.prompt == req.prompt
        assert parsed.params.max_tokens == req.max_tokens
        assert parsed.tpot_slo_ms == req.tpot_slo_ms
        assert parsed.arrival_s == req.arrival_s


def test_config_is_frozen_and_mix_normalised() -> None:
    cfg = config(mix={"coding": 0.5000001, "chat": 0.4999999})
    assert math.fsum(cfg.mix.values()) == pytest.approx(1.0, abs=1e-12)
    with pytest.raises(AttributeError):
        cfg.rate = 3.0  # type: ignore[misc]
    assert replace(cfg, seed=9).seed == 9


def test_fixed_output_tokens_ignore_eos_and_leave_the_rest_of_the_schedule_alone(tmp_path: Path) -> None:
    path = write_trace(tmp_path / "t.csv")
    for kw in ({}, {"trace": path}):
        drawn = wl.build_workload(config(rate=2.2, duration_s=5.0, **kw))
        fixed = wl.build_workload(config(rate=2.2, duration_s=5.0, fixed_output_tokens=256, **kw))
        assert {r.max_tokens for r in fixed} == {256} and all(r.ignore_eos for r in fixed)  # past the 128 cap too
        assert not any(r.ignore_eos for r in drawn)
        assert [(r.arrival_s, r.slo_class, r.prompt) for r in fixed] == [(r.arrival_s, r.slo_class, r.prompt)
                                                                         for r in drawn]
    with pytest.raises(ValueError, match="fixed_output_tokens"):
        config(fixed_output_tokens=0)


# ---- multi-turn conversations (issue 34) ---------------------------------------------------------------
def test_conversations_are_deterministic_and_share_one_system_prompt(tmp_path: Path) -> None:
    cfg = wl.MultiTurnConfig(conversations=6, turns=3, rate=2.0, max_tokens=40, seed=3)
    convs = wl.build_conversations(cfg)
    assert convs == wl.build_conversations(cfg) and convs != wl.build_conversations(replace(cfg, seed=4))
    assert [c.conversation_id for c in convs] == [f"conv-{i:04d}" for i in range(6)]
    assert convs[0].start_s == 0 and all(a.start_s <= b.start_s for a, b in itertools.pairwise(convs))
    assert all(len(c.user_turns) == 3 and c.max_tokens == (40, 40, 40) for c in convs)
    assert set(convs[0].user_turns) <= set(wl.chat_prompts())
    system = wl.system_prompt(cfg.system_chars)
    assert system.startswith(wl.SYSTEM_HEADER) and 1000 < len(system) <= cfg.system_chars
    # a trace's rows start the conversations at the requested rate; its GeneratedTokens set the first answer
    traced = wl.build_conversations(replace(cfg, trace=write_trace(tmp_path / "t.csv"), conversations=5, rate=1.0))
    assert [c.max_tokens[0] for c in traced] == [4, 40, 40, 4, 40]  # 1, 500, 50, 4, 128 clipped to [4, 40]
    assert traced[-1].start_s < 5.0 and all(c.max_tokens[1:] == (40, 40) for c in traced)


def test_a_turn_resends_the_conversation_so_far() -> None:
    msgs = wl.conversation_turns("sys", ["q1", "q2", "q3"], ["a1", "a2"])
    assert [(m["role"], m["content"]) for m in msgs] == [
        ("system", "sys"), ("user", "q1"), ("assistant", "a1"), ("user", "q2"), ("assistant", "a2"), ("user", "q3")]
    with pytest.raises(ValueError, match="no user turn"):
        wl.conversation_turns("sys", ["q1"], ["a1"])
    with pytest.raises(ValueError, match="turns"):
        wl.MultiTurnConfig(turns=0)
