"""``adaserve bench --conversations N --turns T``: multi-turn chat as the bench's workload (issue 34).

The conversations are ``workload.build_conversations``' (the same as ``adaserve loadtest --conversations`` and
``bench/prefix_reuse.py``): one shared system prompt, conversation starts at ``--rps`` conversations per second
(Poisson, or an Azure trace's timestamps rescaled to it), chat prompts as user turns. What the bench adds:

- an SLO class per conversation, drawn from the mix (every turn of a conversation keeps it: the application's
  tier, not the text; the text is chat throughout), its TPOT SLO as the generated workload sets it;
- turn k+1 arrives ``think_s`` after turn k's answer ended, on the run's clock (simulated or wall), its prompt
  the whole conversation so far (system prompt, every earlier user turn and answer, the new user turn) as real
  chat clients resend it, rendered as the worker renders ``messages`` (``prefix_reuse.prompt_ids``);
- every answer decodes exactly its length, end-of-sequence ignored, so every system sees the same histories when
  it is lossless (the bench's reference check compares every turn's tokens, later turns included).

A prompt longer than the bench's prompt limit keeps its last tokens, as every bench prompt does; that cuts the
conversation's start, so its cached prefix is lost: such turns are counted (``prompts_truncated``).
"""

from __future__ import annotations

import statistics
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from adaserve.bench.prefix_reuse import prompt_ids
from adaserve.bench.workload import (
    Conversation,
    MultiTurnConfig,
    SLOClass,
    build_conversations,
    conversation_turns,
    system_prompt,
)
from adaserve.engine.request import Request
from adaserve.engine.speculation.sampling import SamplingParams

# the class draw's own stream: the conversations' starts and turns stay where build_conversations puts them
CLASS_STREAM = 34


@dataclass(frozen=True)
class ConversationWorkload:
    """The multi-turn workload of one sweep point: conversations, their classes and SLOs."""

    config: MultiTurnConfig
    baseline_tpot_ms: float
    classes: tuple[SLOClass, ...]
    mix: Mapping[str, float]
    slo_scale: float = 1.0

    @property
    def rate(self) -> float:
        """Conversations started per second."""
        return self.config.rate

    @property
    def duration_s(self) -> float:
        """The span the conversations start over, ``conversations / rate`` (later turns arrive past it)."""
        return self.config.conversations / self.config.rate

    @property
    def turns(self) -> int:
        """Requests this workload makes: every turn of every conversation."""
        return len(self.conversations()) * self.config.turns

    def conversations(self) -> list[Conversation]:
        return build_conversations(self.config)

    def class_of(self, n: int) -> list[str]:
        """The SLO classes of ``n`` conversations, drawn from the mix; deterministic under the seed."""
        names = [k for k, v in self.mix.items() if v > 0]
        rng = np.random.default_rng([self.config.seed, CLASS_STREAM])
        idx = rng.choice(len(names), size=n, p=[self.mix[k] for k in names])
        return [names[int(i)] for i in idx]

    def slo_ms(self, name: str) -> float:
        cls = next(c for c in self.classes if c.name == name)
        return cls.tpot_slo_ms(self.baseline_tpot_ms, slo_scale=self.slo_scale)


@dataclass
class ChatDriver:
    """One run of a ConversationWorkload on one engine: the first turns, and each later turn when the answer
    before it is done. ``limit``: the most prompt tokens a turn of ``max_tokens`` output may keep."""

    workload: ConversationWorkload
    tokenizer: Any
    limit: Callable[[int], int]
    seed: int = 0
    requests: dict[str, Request] = field(default_factory=dict)  # every turn made, by request id
    classes: dict[str, str] = field(default_factory=dict)
    turn_of: dict[str, int] = field(default_factory=dict)
    truncated: int = 0

    def __post_init__(self) -> None:
        self.system = system_prompt(self.workload.config.system_chars)
        self.convs = self.workload.conversations()
        self.conv_class = self.workload.class_of(len(self.convs))
        self.answers: list[list[str]] = [[] for _ in self.convs]
        self.conv_of: dict[str, int] = {}

    def first_turns(self) -> list[tuple[float, Request]]:
        return [(c.start_s, self._turn(i)) for i, c in enumerate(self.convs)]

    def follow_up(self, request_id: str, now_s: float) -> list[tuple[float, Request]]:
        """``request_id`` finished at ``now_s`` (seconds from the run's start): its conversation's next turn,
        due ``think_s`` later, or nothing after the last turn."""
        i = self.conv_of[request_id]
        done = self.requests[request_id]
        # a chat client keeps the answer's text as the API returns it: decoded, without surrounding whitespace
        self.answers[i].append(self.tokenizer.decode(done.output_ids, skip_special_tokens=True).strip())
        if len(self.answers[i]) >= len(self.convs[i].user_turns):
            return []
        return [(now_s + self.workload.config.think_s, self._turn(i))]

    def _turn(self, i: int) -> Request:
        c, k = self.convs[i], len(self.answers[i])
        ids = prompt_ids(self.tokenizer, conversation_turns(self.system, c.user_turns, self.answers[i]))
        limit = self.limit(c.max_tokens[k])
        if len(ids) > limit:
            self.truncated += 1
            ids = ids[-limit:]
        rid = f"{c.conversation_id}-t{k + 1}"
        name = self.conv_class[i]
        req = Request(rid, ids, SamplingParams(max_tokens=c.max_tokens[k], seed=self.seed, ignore_eos=True),
                      tpot_slo_ms=self.workload.slo_ms(name))
        self.requests[rid], self.classes[rid], self.turn_of[rid], self.conv_of[rid] = req, name, k + 1, i
        return req


def by_turn(driver: ChatDriver, met: set[str]) -> dict[str, dict[str, Any]]:
    """Per turn number: requests, SLO attainment (``met``: the ids that met theirs), TTFT (mean, median, p90),
    mean prompt and cached tokens. Turn 1 has only the shared system prompt to reuse; later turns their whole
    history."""
    groups: dict[int, list[Request]] = {}
    for rid, req in driver.requests.items():
        groups.setdefault(driver.turn_of[rid], []).append(req)
    out = {}
    for k, reqs in sorted(groups.items()):
        ttft = [r.metrics.ttft_ms for r in reqs if r.metrics.ttft_ms is not None]
        out[str(k)] = {
            "requests": len(reqs),
            "slo_attainment": sum(r.request_id in met for r in reqs) / len(reqs),
            "mean_ttft_ms": statistics.fmean(ttft) if ttft else None,
            "median_ttft_ms": statistics.median(ttft) if ttft else None,
            "p90_ttft_ms": float(np.percentile(ttft, 90)) if ttft else None,
            "mean_prompt_tokens": statistics.fmean(len(r.prompt_ids) for r in reqs),
            "mean_cached_tokens": statistics.fmean(r.metrics.cached_tokens for r in reqs),
        }
    return out
