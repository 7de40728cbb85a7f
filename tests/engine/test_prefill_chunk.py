"""The SLO-aware prefill chunk (adaserve.engine.prefill_chunk): shrink when decoding requests' TPOT
targets need it, grow back when they have slack, never below the smallest chunk."""

from __future__ import annotations

import math

import pytest

from adaserve.engine.config import EngineConfig
from adaserve.engine.prefill_chunk import (
    DecodingSLO,
    PrefillTTFT,
    chunk_grid,
    slo_prefill_chunk,
    ttft_floor,
    ttft_left_s,
)
from adaserve.engine.speculation.selection import slo_requirement

# a forward: 24 ms plus 0.25 ms per prompt token (the simulated A100's target past its knee, roughly)
T0, PER_TOKEN = 0.024, 0.00025


def t_iter(p: int) -> float:
    return T0 + PER_TOKEN * p


def on_pace(tpot_s: float, tokens: int, lead_s: float = 0.0) -> DecodingSLO:
    """A request that has emitted ``tokens`` in exactly tokens * tpot, less ``lead_s`` (ahead when > 0)."""
    return DecodingSLO(elapsed_s=tokens * tpot_s - lead_s, tokens_so_far=tokens, tpot_slo_s=tpot_s)


def test_grid_halves_from_max_down_to_min():
    assert chunk_grid(32, 256) == [256, 128, 64, 32]
    assert chunk_grid(20, 256) == [256, 128, 64, 32, 20]
    assert chunk_grid(256, 256) == [256]
    for bad in ((0, 8), (9, 8)):
        with pytest.raises(ValueError):
            chunk_grid(*bad)


def test_no_decoding_request_takes_the_whole_chunk():
    assert slo_prefill_chunk([], min_chunk=32, max_chunk=256, t_iter=t_iter, tokens_per_iter=1.0) == 256


def test_slack_keeps_the_whole_chunk():
    relaxed = [on_pace(0.151, 10, lead_s=0.2), on_pace(0.050, 20, lead_s=0.1)]  # ahead of their SLOs
    assert slo_prefill_chunk(relaxed, min_chunk=32, max_chunk=256, t_iter=t_iter, tokens_per_iter=1.0) == 256


def test_a_tight_request_shrinks_the_chunk_to_what_it_can_afford():
    # 30.3 ms per token, on pace, emitting 2 tokens per iteration: the iteration may last up to 60.6 ms,
    # i.e. at most (60.6 - 24) / 0.25 = 146 prompt tokens: 128 on the grid
    tight = on_pace(0.0303, 40)
    got = slo_prefill_chunk([tight], min_chunk=32, max_chunk=256, t_iter=t_iter, tokens_per_iter=2.0)
    assert got == 128
    need = slo_requirement(elapsed_s=tight.elapsed_s, tokens_so_far=tight.tokens_so_far, t_iter_s=t_iter(got),
                           tpot_slo_s=tight.tpot_slo_s)
    assert need <= 2.0
    # one token per iteration: even the smallest chunk (32 ms) misses 30.3 ms, so no chunk saves it and
    # prefill is not held back for it
    assert slo_prefill_chunk([tight], min_chunk=32, max_chunk=256, t_iter=t_iter, tokens_per_iter=1.0) == 256
    # with 1.1 tokens: 33.3 ms allows 37 prompt tokens, so the smallest chunk
    assert slo_prefill_chunk([tight], min_chunk=32, max_chunk=256, t_iter=t_iter, tokens_per_iter=1.1) == 32


def test_a_request_no_chunk_can_save_does_not_stop_prefill():
    lost = DecodingSLO(elapsed_s=5.0, tokens_so_far=10, tpot_slo_s=0.0303)  # far behind whatever we do
    relaxed = on_pace(0.151, 10, lead_s=0.2)
    assert slo_prefill_chunk([lost, relaxed], min_chunk=32, max_chunk=256, t_iter=t_iter,
                             tokens_per_iter=1.0) == 256


def test_the_tightest_savable_request_decides_and_growth_follows_its_slack():
    tight, relaxed = on_pace(0.0303, 40), on_pace(0.151, 10)
    shrunk = slo_prefill_chunk([tight, relaxed], min_chunk=32, max_chunk=256, t_iter=t_iter, tokens_per_iter=2.0)
    ahead = on_pace(0.0303, 40, lead_s=0.05)  # the same request 50 ms ahead: the chunk grows back
    grown = slo_prefill_chunk([ahead, relaxed], min_chunk=32, max_chunk=256, t_iter=t_iter, tokens_per_iter=2.0)
    assert shrunk == 128 and grown == 256


def test_tokens_per_iteration_counts_the_bonus_token():
    with pytest.raises(ValueError):
        slo_prefill_chunk([on_pace(0.03, 1)], min_chunk=32, max_chunk=256, t_iter=t_iter, tokens_per_iter=0.5)


def test_config_checks_the_rule_and_the_smallest_chunk():
    assert EngineConfig().prefill_rule == "fixed"  # the behaviour before the rule, for every policy
    for kw in ({"prefill_rule": "adaptive"}, {"prefill_min_chunk": 0}):
        with pytest.raises(ValueError):
            EngineConfig(**kw)
    assert EngineConfig(prefill_chunk=8, prefill_rule="slo").prefill_min_chunk == 32  # the engine caps it at 8


# ---- TTFT: the chunk never starves a prompt whose first token can still be on time ------------------------
def test_a_prompt_on_its_ttft_deadline_lifts_the_chunk_a_tight_decoder_asked_to_shrink():
    tight = on_pace(0.0303, 40)  # alone it would shrink the chunk to 128 (the test above)
    # 1000 prompt tokens due in 0.2 s: at 128 a token 8 iterations of 56 ms (0.45 s); at 256, 4 of 88 ms (0.35 s);
    # at 512, 2 of 152 ms (0.30 s); only all of it in one (1024: 280 ms) would do, and that is late too: hopeless
    late = PrefillTTFT(remaining=1000, left_s=0.2)
    kw = {"min_chunk": 32, "max_chunk": 1024, "t_iter": t_iter, "tokens_per_iter": 2.0}
    assert slo_prefill_chunk([tight], **kw, prefilling=[late]) == 128  # no chunk saves it: the decoder decides
    due = PrefillTTFT(remaining=1000, left_s=0.4)  # 0.4 s: 256 (4 x 88 ms) is the smallest chunk on time
    assert slo_prefill_chunk([tight], **kw, prefilling=[due]) == 256
    assert ttft_floor([due], chunk_grid(32, 1024), t_iter) == 256
    relaxed = PrefillTTFT(remaining=1000, left_s=30.0)  # time enough at the smallest chunk
    assert slo_prefill_chunk([tight], **kw, prefilling=[relaxed]) == 128


def test_prompts_are_due_in_prefill_order_and_tokens_ahead_count():
    grid = chunk_grid(32, 1024)
    first = PrefillTTFT(remaining=600, left_s=math.inf)  # no target of its own, but its tokens go first
    second = PrefillTTFT(remaining=100, left_s=0.3)  # 700 tokens must be in: 3 x 88 ms at 256, not 6 x 56 at 128
    assert ttft_floor([first, second], grid, t_iter) == 256
    assert ttft_floor([second, first], grid, t_iter) == 32  # first in line: 100 tokens, 4 x 32 ms at 32
    assert ttft_floor([first], grid, t_iter) == 0  # nobody with a target: no floor
    assert ttft_floor([PrefillTTFT(remaining=0, left_s=-1.0)], grid, t_iter) == 0


def test_ttft_left_and_the_default_target():
    assert ttft_left_s(10.0, 500.0, 10.2) == pytest.approx(0.3)
    assert ttft_left_s(10.0, None, 10.2) == math.inf
    assert EngineConfig().prefill_ttft_ms is None or EngineConfig().prefill_ttft_ms > 0
    for bad in (0.0, -5.0, float("nan")):
        with pytest.raises(ValueError, match="prefill_ttft_ms"):
            EngineConfig(prefill_ttft_ms=bad)
