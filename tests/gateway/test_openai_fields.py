"""Issue 33's fields, through the gateway with the official openai client on loopback (a real worker on the demo
pair, a real Redis under a prefix of its own):

- unknown fields (``store``, ``metadata``, ...) are accepted and ignored, named in ``X-Ignored-Fields`` and the
  gateway's log; a gateway run with ``--strict-openai-fields`` refuses them with 400;
- tool calls and tool results reach the worker's chat template (the demo pair's transcript);
- ``logit_bias``, ``min_tokens``, ``stop_token_ids`` and the penalties reach the engine: the answer is the
  worker's own for the same fields, and each changes the output as it says.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest
import redis

from tests.gateway.test_hardening import classes, gateway, gateway_for, rds, worker  # noqa: F401  (fixtures)
from tests.servers import GatewayProcess, Service

PROMPT = "def fibonacci(n):"
CALL = {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}}
TOOL_TURNS = [{"role": "user", "content": "What is the weather in Oslo?"},
              {"role": "assistant", "content": None, "tool_calls": [CALL]},
              {"role": "tool", "tool_call_id": "call_1", "content": "rain, 4 degrees"}]


def client(gw: GatewayProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{gw.url}/v1", api_key="none", max_retries=0, timeout=120)


def direct(worker: Service, **body: Any) -> dict[str, Any]:  # noqa: F811
    r = httpx.post(f"{worker.url}/v1/generate", json=body, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()


@pytest.fixture(scope="module")
def strict(rds: tuple[redis.Redis, str], worker: Service, classes: list[str],  # noqa: F811
           tmp_path_factory: pytest.TempPathFactory) -> Iterator[GatewayProcess]:
    gw = gateway_for(rds[1], tmp_path_factory.mktemp("strict-gw") / "gateway.log", *classes,
                     "--strict-openai-fields")
    try:
        yield gw
    finally:
        assert gw.stop() == 0, gw.logs()[-3000:]


# ---- unknown fields ---------------------------------------------------------------------------------------


def test_unknown_fields_are_ignored_and_named(gateway: GatewayProcess) -> None:  # noqa: F811
    raw = client(gateway).chat.completions.with_raw_response.create(
        model="demo", messages=[{"role": "user", "content": "hi"}], max_tokens=4, temperature=0, store=True,
        metadata={"team": "a"}, parallel_tool_calls=False, extra_body={"guided_choice": ["a"]})
    assert raw.http_response.status_code == 200
    ignored = raw.headers["X-Ignored-Fields"]
    assert sorted(ignored.split(", ")) == ["guided_choice", "metadata", "parallel_tool_calls", "store"], ignored
    assert raw.parse().choices[0].finish_reason == "length"
    rid = raw.headers["X-Request-Id"]
    assert f"request {rid}: ignored unknown field(s): {ignored}" in gateway.logs()
    # a request with none has no such header
    plain = client(gateway).completions.with_raw_response.create(model="demo", prompt="x", max_tokens=1)
    assert "X-Ignored-Fields" not in plain.headers


def test_strict_mode_refuses_unknown_fields_with_400(strict: GatewayProcess) -> None:
    with pytest.raises(openai.BadRequestError) as e:
        client(strict).chat.completions.create(model="demo", messages=[{"role": "user", "content": "hi"}],
                                               max_tokens=4, store=True)
    assert e.value.status_code == 400 and "store" in e.value.message and "--strict-openai-fields" in e.value.message
    assert e.value.code == "unknown_field" and e.value.param == "store"
    # known fields still pass, and the document says no other property is allowed
    ok = client(strict).completions.create(model="demo", prompt="x", max_tokens=2, presence_penalty=0.5)
    assert ok.usage is not None and ok.usage.completion_tokens == 2
    doc = httpx.get(f"{strict.url}/openapi.json", timeout=30).json()
    assert doc["components"]["schemas"]["ChatRequest"]["additionalProperties"] is False


# ---- tool messages ----------------------------------------------------------------------------------------


def test_tool_messages_reach_the_chat_template(gateway: GatewayProcess, worker: Service) -> None:  # noqa: F811
    got = client(gateway).chat.completions.create(model="demo", messages=TOOL_TURNS, max_tokens=8, temperature=0)
    want = direct(worker, messages=[{**t, "content": t["content"] or ""} for t in TOOL_TURNS], max_tokens=8,
                  temperature=0)
    assert got.choices[0].message.content == want["text"]
    assert got.usage is not None and got.usage.prompt_tokens == want["prompt_tokens"]
    # the call and the result are in the prompt: without them it is shorter
    bare = direct(worker, messages=[TOOL_TURNS[0]], max_tokens=1, temperature=0)
    tool_text = 'assistant:  <tool_call>{"id": "call_1", "name": "get_weather", "arguments": "{\\"city\\": ' \
                '\\"Oslo\\"}"}</tool_call>\ntool (call_1): rain, 4 degrees\n'
    assert want["prompt_tokens"] > bare["prompt_tokens"] + len(tool_text) // 8


def test_malformed_tool_calls_are_400_naming_the_field(gateway: GatewayProcess) -> None:  # noqa: F811
    bad = {"role": "assistant", "tool_calls": [{"id": "c", "type": "function", "function": {"name": "f"}}]}
    r = httpx.post(f"{gateway.url}/v1/chat/completions", timeout=30,
                   json={"model": "demo", "messages": [{"role": "user", "content": "x"}, bad]})
    assert r.status_code == 400 and "arguments" in r.json()["error"]["message"], r.text


# ---- logits processors ------------------------------------------------------------------------------------


def completion(gw: GatewayProcess, **fields: Any) -> tuple[str, int]:
    got = client(gw).completions.create(model="demo", prompt=PROMPT, max_tokens=16, temperature=0, **fields)
    assert got.usage is not None
    return got.choices[0].text, got.usage.completion_tokens


def test_logits_processors_reach_the_engine(gateway: GatewayProcess, worker: Service) -> None:  # noqa: F811
    plain = direct(worker, prompt=PROMPT, max_tokens=16, temperature=0, ignore_eos=True)
    ids = plain["token_ids"]
    cases: list[tuple[dict[str, Any], dict[str, Any]]] = [
        # OpenAI's own fields go as themselves; vLLM's as extra_body, as vLLM's clients send them
        ({"logit_bias": {str(ids[0]): -100}}, {}),
        ({"presence_penalty": 1.5, "frequency_penalty": 1.0}, {}),
        ({}, {"repetition_penalty": 1.8}),
        ({}, {"stop_token_ids": [ids[3]], "ignore_eos": True}),
        ({}, {"min_tokens": 8, "stop_token_ids": [ids[3]], "ignore_eos": True}),
    ]
    for openai_fields, vllm_fields in cases:
        text, n = completion(gateway, **openai_fields, extra_body={"ignore_eos": True, **vllm_fields})
        worker_body = {"ignore_eos": True, **openai_fields, **vllm_fields}
        want = direct(worker, prompt=PROMPT, max_tokens=16, temperature=0, **worker_body)
        assert (text, n) == (want["text"], len(want["token_ids"])), worker_body
        assert want["token_ids"] != ids, f"{worker_body} changed nothing"
        if "min_tokens" in vllm_fields:
            assert ids[3] not in want["token_ids"][:7] and len(want["token_ids"]) >= 8
        elif "stop_token_ids" in vllm_fields:
            assert want["token_ids"] == ids[: ids.index(ids[3]) + 1] and want["finish_reason"] == "stop"
        if "logit_bias" in openai_fields:
            assert want["token_ids"][0] != ids[0]


@pytest.mark.parametrize(("fields", "needle", "code"), [
    ({"presence_penalty": 2.5}, "presence_penalty", None),
    ({"logit_bias": {"1": 250}}, "logit_bias", None),
    ({"logit_bias": {"999999": 1}}, "logit_bias", "rejected_by_worker"),  # past the vocabulary: the engine's say
    ({"min_tokens": 20, "max_tokens": 4}, "min_tokens", "rejected_by_worker"),
    ({"repetition_penalty": -1}, "repetition_penalty", None),
])
def test_bad_processor_values_are_400_naming_the_field(gateway: GatewayProcess, fields: dict[str, Any],  # noqa: F811
                                                       needle: str, code: str | None) -> None:
    r = httpx.post(f"{gateway.url}/v1/completions", timeout=30,
                   json={"model": "demo", "prompt": "x", "max_tokens": 4, **fields})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert needle in err["message"], err
    if code:
        assert err["code"] == code

