"""Checks of ``n``, ``best_of`` and ``echo`` (issue 33) through the official openai client, run against a gateway
(tests/gateway/test_openai_fields.py) and against a worker alone (tests/worker/test_openai.py): the same answers
either way. ``generate`` posts a body to the worker's ``/v1/generate``: each choice must be that plain run for its
own seed (seed + index), which is what makes the choices lossless."""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable
from typing import Any

import openai
import pytest

PROMPT = "def fibonacci(n):"
SEED = 1234
Generate = Callable[..., dict[str, Any]]


def n_seeded_sampled(client: openai.OpenAI, model: str, generate: Generate) -> None:
    """n=3 seeded sampled completions: reproducible, different across choices, choice i the plain run with
    seed + i; usage sums the choices."""
    fields: dict[str, Any] = {"model": model, "prompt": PROMPT, "max_tokens": 12, "temperature": 1.0, "seed": SEED,
                              "extra_body": {"ignore_eos": True}}
    out = client.completions.create(n=3, **fields)
    assert [c.index for c in out.choices] == [0, 1, 2]
    texts = [c.text for c in out.choices]
    assert len(set(texts)) == 3, texts
    assert [c.text for c in client.completions.create(n=3, **fields).choices] == texts  # reproducible
    for i, text in enumerate(texts):
        plain = generate(prompt=PROMPT, max_tokens=12, temperature=1.0, seed=SEED + i, ignore_eos=True)
        assert plain["text"] == text, i
    assert out.usage is not None and out.usage.completion_tokens == 36


def n_greedy_and_streamed(client: openai.OpenAI, model: str) -> None:
    """Greedy: every choice is the n=1 answer. Streamed: each chunk carries its choice index, each choice ends with
    its own finish_reason, the texts are the non-streamed ones, and the usage chunk sums the choices."""
    messages = [{"role": "user", "content": PROMPT}]
    one = client.chat.completions.create(model=model, messages=messages, max_tokens=10, temperature=0,
                                         extra_body={"ignore_eos": True})
    two = client.chat.completions.create(model=model, messages=messages, max_tokens=10, temperature=0, n=2,
                                         extra_body={"ignore_eos": True})
    assert [c.index for c in two.choices] == [0, 1]
    assert [c.message.content for c in two.choices] == [one.choices[0].message.content] * 2
    assert two.usage is not None and two.usage.completion_tokens == 20

    sampled = {"model": model, "messages": messages, "max_tokens": 10, "temperature": 1.0, "seed": SEED, "n": 2,
               "extra_body": {"ignore_eos": True}}
    whole = client.chat.completions.create(**sampled)
    text: dict[int, str] = defaultdict(str)
    finishes: dict[int, list[str]] = defaultdict(list)
    roles = []
    chunks = list(client.chat.completions.create(**sampled, stream=True, stream_options={"include_usage": True}))
    for chunk in chunks:
        for c in chunk.choices:
            text[c.index] += c.delta.content or ""
            if c.delta.role:
                roles.append(c.index)
            if c.finish_reason:
                finishes[c.index].append(c.finish_reason)
    assert sorted(roles) == [0, 1] and dict(finishes) == {0: ["length"], 1: ["length"]}
    assert [text[0], text[1]] == [c.message.content for c in whole.choices]
    assert text[0] != text[1]
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 20


def best_of_picks_by_logprob(client: openai.OpenAI, model: str) -> None:
    """best_of=3, n=2: the two of the three seeded runs (seeds SEED..SEED+2) with the highest cumulative logprob,
    best first; no logprobs unless asked; usage counts every sequence generated."""
    fields: dict[str, Any] = {"model": model, "prompt": PROMPT, "max_tokens": 8, "temperature": 1.0,
                              "extra_body": {"ignore_eos": True}}
    runs = [client.completions.create(**fields, seed=SEED + i, logprobs=0).choices[0] for i in range(3)]
    scores = [sum(r.logprobs.token_logprobs or []) for r in runs]  # type: ignore[union-attr]
    best = sorted(range(3), key=lambda i: (-scores[i], i))[:2]
    out = client.completions.create(**fields, seed=SEED, n=2, best_of=3)
    assert [c.text for c in out.choices] == [runs[i].text for i in best], (scores, best)
    assert [c.index for c in out.choices] == [0, 1] and out.choices[0].logprobs is None
    assert out.usage is not None and out.usage.completion_tokens == 24
    # asked for, the logprobs are the chosen sequences' own
    asked = client.completions.create(**fields, seed=SEED, n=1, best_of=3, logprobs=1)
    assert asked.choices[0].logprobs.token_logprobs == pytest.approx(  # type: ignore[union-attr]
        runs[best[0]].logprobs.token_logprobs, abs=1e-4)  # type: ignore[union-attr]


def echo_prepends_the_prompt(client: openai.OpenAI, model: str) -> None:
    fields: dict[str, Any] = {"model": model, "prompt": PROMPT, "max_tokens": 6, "temperature": 0}
    plain = client.completions.create(**fields).choices[0].text
    echoed = client.completions.create(**fields, echo=True, n=2)
    assert [c.text for c in echoed.choices] == [PROMPT + plain] * 2
    streamed = list(client.completions.create(**fields, echo=True, stream=True))
    assert streamed[0].choices[0].text == PROMPT
    assert "".join(c.choices[0].text for c in streamed if c.choices) == PROMPT + plain


BAD = [
    ({"n": 9}, "n"),
    ({"n": 3, "best_of": 2}, "best_of: must be at least n"),
    ({"best_of": 2, "stream": True}, "best_of: cannot be streamed"),
    ({"echo": True, "logprobs": 1}, "echo: not with logprobs"),
    ({"echo": True, "prompt": [1, 2, 3]}, "echo: needs a text prompt"),
]


def bad_combinations_are_400(client: openai.OpenAI, model: str) -> None:
    for fields, needle in BAD:
        body = {"model": model, "prompt": PROMPT, "max_tokens": 2, **fields}
        with pytest.raises(openai.BadRequestError) as e:
            client.completions.create(**body)
        assert e.value.status_code == 400 and needle in e.value.message, (fields, e.value.message)
