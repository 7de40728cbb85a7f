"""The multi-turn benchmark's driver: later turns resend the conversation and hit the prefix cache (issue 34)."""

from __future__ import annotations

from pathlib import Path

from adaserve.bench import prefix_reuse
from adaserve.bench.workload import MultiTurnConfig, build_conversations, system_prompt
from adaserve.engine.config import EngineConfig
from adaserve.engine.engine import Engine
from adaserve.engine.loading.loader import load_tokenizer
from tests.engine.helpers import runner

DEMO = Path(__file__).resolve().parents[2] / "models" / "demo"


def test_later_turns_reuse_the_history_and_answers_do_not_change() -> None:
    tok = load_tokenizer(DEMO / "target")
    target, draft = runner(DEMO / "target", page_size=16), runner(DEMO / "draft", page_size=16)
    cfg = MultiTurnConfig(conversations=3, turns=2, rate=50.0, think_s=0.0, max_tokens=6, system_chars=600)
    convs, system = build_conversations(cfg), system_prompt(cfg.system_chars)
    runs = {}
    for cached in (True, False):
        eng = Engine(target, draft, EngineConfig(policy="adaserve", budget=16, prefix_caching=cached))
        runs[cached] = prefix_reuse.serve_conversations(eng, tok, system, convs, think_s=cfg.think_s)
    assert [(t.conversation_id, t.turn) for t in runs[True]] == [(f"conv-{i:04d}", k) for i in range(3) for k in (1, 2)]
    assert [t.output_ids for t in runs[True]] == [t.output_ids for t in runs[False]]
    assert all(t.cached_tokens == 0 for t in runs[False])
    for first, second in zip(runs[True][::2], runs[True][1::2], strict=True):
        # the second turn's prompt holds the first's: its pages (all but a partial one) come from the cache
        assert second.prompt_tokens > first.prompt_tokens
        assert second.cached_tokens >= first.prompt_tokens - 2 * 16
    assert prefix_reuse.summary(runs[True])["2"]["n"] == 3
