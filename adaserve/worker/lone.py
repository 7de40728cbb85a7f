"""What a lone request gets on this worker, measured at warm-up: one request of each kind the default SLO
classes serve, each served with nothing else running (speculation included).

A lone request's speed depends on how well the draft guesses it and on its prompt's length. On the 2-core CPU
the README's short coding request alone got 26 ms per token where HumanEval prompts alone got 48 ms and long
summarization prompts 91 ms (docs/results/loadtest-cpu-smollm2-admission.json, ``sequential``): one figure for
all made ``adaserve up`` derive a coding class that its own coding requests could not meet. So each class is
measured on a prompt shaped like that class's traffic (the loadtest's prompt sources, bench/workload.py: a
HumanEval-style function to complete, a short question, "summarize this" over ~2,000 characters of Python),
and the worker publishes each class's figure and their median.
"""

from __future__ import annotations

import inspect
import logging
import statistics
import textwrap
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from adaserve.engine.engine import Engine, StepMetrics
from adaserve.engine.loading.chat import chat_text, has_chat_template
from adaserve.engine.request import Request
from adaserve.engine.speculation.sampling import SamplingParams

log = logging.getLogger(__name__)

# Tokens each lone request generates. A request's pace drifts as it goes (its context grows, and past its answer's
# natural end the draft guesses worse), and client requests run up to 128 tokens: with 32, the derived coding
# target was one HumanEval requests missed even alone (an engine-only check of six HumanEval prompts on the 2-core
# CPU, not kept as a result file: median 58 ms per token over 32 tokens, 71 ms over 128).
LONE_TOKENS = 96
SUMMARY_CHARS = 2000  # the summarization prompt's document, cut at a line boundary


def _summary_document() -> str:
    """About SUMMARY_CHARS characters of a standard-library module's source, as the loadtest's summaries are."""
    source = inspect.getsource(textwrap)
    return source[: source.rfind("\n", 0, SUMMARY_CHARS) + 1]


LONE_PROMPTS: dict[str, str] = {
    "coding": (
        "def rolling_max(values: list[int], window: int) -> list[int]:\n"
        '    """Return, for each position i of values, the largest of the last `window` values up to and\n'
        "    including position i (fewer at the start).\n"
        "    >>> rolling_max([1, 3, 2, 5, 4], 2)\n"
        "    [1, 3, 3, 5, 5]\n"
        '    """\n'
    ),
    "chat": "Which planets of the solar system have rings, and what are the rings made of? Answer in a short "
            "paragraph.",
    "summarization": "Summarize what the following Python module does:\n\n" + _summary_document(),
}
# Without a tokenizer (a test pair), token ids of the same lengths' order stand for them.
UNTOKENIZED_LENGTHS = {"coding": 64, "chat": 24, "summarization": 400}


def lone_prompt_ids(engine: Engine, tokenizer: Any | None) -> dict[str, list[int]]:
    """LONE_PROMPTS as served chat turns (the model's template), by class; without a tokenizer, token ids of
    UNTOKENIZED_LENGTHS (at most the engine's context less the tokens to generate)."""
    if tokenizer is None:
        vocab = engine.target.vocab_size
        room = max(1, engine.max_context - LONE_TOKENS)
        return {c: [i % vocab for i in range(2, 2 + min(n, room))] for c, n in UNTOKENIZED_LENGTHS.items()}
    if has_chat_template(tokenizer):
        return {c: list(tokenizer.encode(chat_text(tokenizer, [{"role": "user", "content": text}]),
                                         add_special_tokens=False)) for c, text in LONE_PROMPTS.items()}
    return {c: list(tokenizer.encode(text, add_special_tokens=True)) for c, text in LONE_PROMPTS.items()}


def serve_alone(engine: Engine, req: Request, what: str) -> list[StepMetrics] | None:
    """Serve ``req`` with nothing else running; the iterations it took (the engine's history is left empty),
    or None, logged as "not <what>", if the engine refuses it."""
    try:
        engine.check_request(req)
    except ValueError as e:
        log.warning("not %s: %s", what, e)
        return None
    engine.run([(0.0, req)])
    steps = list(engine.history)
    engine.history.clear()
    return steps


# One iteration, with what the decoding request of a known class gained in it: request id -> (its class, draft
# tokens it had accepted), the form ``Measurements.on_step`` takes.
Attributed = tuple[StepMetrics, dict[str, tuple[str, int]]]


@dataclass(frozen=True)
class Lone:
    """Each kind's TPOT served alone (ms), and every iteration they took, each with its class's gain (they seed
    the measured curve: its first per-class figures are these requests')."""

    by_class: dict[str, float] = field(default_factory=dict)
    steps: list[Attributed] = field(default_factory=list)

    @property
    def median_ms(self) -> float | None:
        return statistics.median(self.by_class.values()) if self.by_class else None


def measure_lone(engine: Engine, prompts: Mapping[str, list[int]]) -> Lone:
    """Serve each class's prompt alone, as a client's request would be served. A prompt the engine refuses
    (too long for it) is left out."""
    by_class: dict[str, float] = {}
    steps: list[Attributed] = []
    for name, ids in prompts.items():
        req = Request(f"lone-{name}", ids, SamplingParams(max_tokens=LONE_TOKENS, ignore_eos=True))
        gains: list[dict[str, tuple[str, int]]] = []

        def gained(m: StepMetrics, req: Request = req, name: str = name, gains: list = gains) -> None:
            # as the runtime's own listener: the draft tokens accepted in this iteration, if it verified any
            verified = req.request_id in m.per_request_verified and req.metrics.accepted_per_step
            gains.append({req.request_id: (name, req.metrics.accepted_per_step[-1])} if verified else {})

        engine.step_listeners.append(gained)
        try:
            served = serve_alone(engine, req, "measuring a lone request")
        finally:
            engine.step_listeners.remove(gained)
        if served is None:
            continue
        steps += list(zip(served, gains, strict=True))
        if req.metrics.tpot_ms is not None:
            by_class[name] = req.metrics.tpot_ms
    return Lone(by_class, steps)
