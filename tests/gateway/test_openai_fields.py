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

from tests import openai_choices
from tests.gateway.test_hardening import classes, gateway, gateway_for, rds, worker  # noqa: F401  (fixtures)
from tests.servers import GatewayProcess, Service, metric, scrape, wait_for

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


def assert_completion_400(gw: GatewayProcess, fields: dict[str, Any], needle: str, code: str | None) -> None:
    """A completion with ``fields`` is a 400 whose message names ``needle`` (and whose code is ``code``)."""
    r = httpx.post(f"{gw.url}/v1/completions", timeout=30,
                   json={"model": "demo", "prompt": "x", "max_tokens": 4, **fields})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert needle in err["message"], err
    if code:
        assert err["code"] == code

@pytest.mark.parametrize(("fields", "needle", "code"), [
    ({"presence_penalty": 2.5}, "presence_penalty", None),
    ({"logit_bias": {"1": 250}}, "logit_bias", None),
    ({"logit_bias": {"999999": 1}}, "logit_bias", "rejected_by_worker"),  # past the vocabulary: the engine's say
    ({"min_tokens": 20, "max_tokens": 4}, "min_tokens", "rejected_by_worker"),
    ({"repetition_penalty": -1}, "repetition_penalty", None),
])
def test_bad_processor_values_are_400_naming_the_field(gateway: GatewayProcess, fields: dict[str, Any],  # noqa: F811
                                                       needle: str, code: str | None) -> None:
    assert_completion_400(gateway, fields, needle, code)



# ---- structured output ----------------------------------------------------------------------------------------

# bounded, so the demo pair's JSON ends well within max_tokens; compact whitespace (llguidance's x-guidance option,
# a client may send it) because the demo pair, trained on Python, otherwise indents forever
SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 10},
                                           "kind": {"enum": ["list", "dict", "set"]},
                                           "size": {"type": "integer", "minimum": 0, "maximum": 99}},
          "required": ["name", "kind", "size"], "additionalProperties": False,
          "x-guidance": {"whitespace_flexible": False}}
RESPONSE_FORMAT = {"type": "json_schema", "json_schema": {"name": "thing", "schema": SCHEMA, "strict": True}}


def test_response_format_json_schema_gives_schema_valid_json(gateway: GatewayProcess,  # noqa: F811
                                                             worker: Service) -> None:  # noqa: F811
    """The official client, through the gateway and directly against the worker: the same JSON, which the schema
    validates."""
    import json

    import jsonschema

    messages = [{"role": "user", "content": "def reverse(items):"}]
    answers = []
    for base in (gateway.url, worker.url):
        with openai.OpenAI(base_url=f"{base}/v1", api_key="none", max_retries=0, timeout=120) as c:
            out = c.chat.completions.create(model="demo", messages=messages, max_tokens=64, temperature=0,
                                            response_format=RESPONSE_FORMAT)  # type: ignore[arg-type]
        assert out.choices[0].finish_reason == "stop"
        answers.append(out.choices[0].message.content)
    assert answers[0] == answers[1]
    jsonschema.validate(json.loads(answers[0] or ""), {k: v for k, v in SCHEMA.items() if k != "x-guidance"})
    # completions take it too, and a sampled answer follows the schema as well
    with client(gateway) as c:
        for seed in range(3):
            text = c.completions.create(model="demo", prompt=PROMPT, max_tokens=64, temperature=1.0, seed=seed,
                                        extra_body={"response_format": RESPONSE_FORMAT}).choices[0].text
            jsonschema.validate(json.loads(text), {k: v for k, v in SCHEMA.items() if k != "x-guidance"})


def test_json_object_and_vllm_structured_outputs(gateway: GatewayProcess) -> None:  # noqa: F811
    import re

    # both: vLLM's explicit field wins, and the answer names the JSON response_format it ignored
    r = httpx.post(f"{gateway.url}/v1/completions", timeout=60,
                   json={"model": "demo", "prompt": PROMPT, "max_tokens": 8, "temperature": 0,
                         "structured_outputs": {"choice": ["yes", "no"]}, "response_format": {"type": "json_object"}})
    assert r.status_code == 200 and r.json()["choices"][0]["text"] in ("yes", "no"), r.text
    assert r.headers["X-Ignored-Fields"] == "response_format"
    with client(gateway) as c:
        out = c.chat.completions.create(model="demo", messages=[{"role": "user", "content": PROMPT}], max_tokens=16,
                                        temperature=0, response_format={"type": "json_object"})
        text = out.choices[0].message.content or ""
        assert text.lstrip().startswith("{")  # a JSON object under way (16 tokens rarely close it on the demo pair)
        for body, check in [({"regex": r"[a-z]{2,6}\(\d\)"}, lambda t: re.fullmatch(r"[a-z]{2,6}\(\d\)", t)),
                            ({"choice": ["list", "dict"]}, lambda t: t in ("list", "dict")),
                            ({"grammar": 'start: "x = " /[0-9]{1,3}/'}, lambda t: re.fullmatch(r"x = [0-9]{1,3}", t))]:
            text = c.completions.create(model="demo", prompt=PROMPT, max_tokens=16, temperature=0,
                                        extra_body={"structured_outputs": body}).choices[0].text
            assert check(text), (body, text)


@pytest.mark.parametrize(("fields", "needle", "code"), [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nonsense"}}}},
     "nonsense", "rejected_by_worker"),
    ({"structured_outputs": {"regex": "a("}}, "unclosed group", "rejected_by_worker"),
    ({"structured_outputs": {"grammar": "start: nowhere"}}, "nowhere", "rejected_by_worker"),
    ({"response_format": {"type": "json_object"}, "min_tokens": 2}, "min_tokens", "rejected_by_worker"),
    ({"response_format": {"type": "json_schema"}}, "json_schema", None),
    ({"response_format": {"type": "xml"}}, "response_format", None),
    ({"structured_outputs": {"regex": "a", "choice": ["b"]}}, "exactly one", None),
])
def test_bad_structured_outputs_are_400_with_a_message(gateway: GatewayProcess, fields: dict[str, Any],  # noqa: F811
                                                       needle: str, code: str | None) -> None:
    assert_completion_400(gateway, fields, needle, code)


# ---- logprobs -------------------------------------------------------------------------------------------------


def test_logprobs_top1_is_the_greedy_token(gateway: GatewayProcess, worker: Service) -> None:  # noqa: F811
    """Chat's logprobs / top_logprobs and completions' logprobs through the official client: under greedy decoding
    the top-1 of every token's alternatives is the token itself, the worker's /v1/generate reports the same
    numbers, and streaming reports them too."""
    plain = direct(worker, prompt=PROMPT, max_tokens=12, temperature=0, ignore_eos=True, logprobs=3)
    assert len(plain["logprobs"]) == len(plain["token_ids"]) == 12
    with client(gateway) as c:
        out = c.completions.create(model="demo", prompt=PROMPT, max_tokens=12, temperature=0, logprobs=3,
                                   extra_body={"ignore_eos": True})
        lp = out.choices[0].logprobs
        assert lp is not None and "".join(lp.tokens or []) == out.choices[0].text
        assert lp.token_logprobs == pytest.approx([e["logprob"] for e in plain["logprobs"]], abs=1e-5)
        for tok, value, top in zip(lp.tokens or [], lp.token_logprobs or [], lp.top_logprobs or [], strict=True):
            assert max(top, key=top.get) == tok and top[tok] == value and len(top) == 3
        assert lp.text_offset == [sum(len(t) for t in (lp.tokens or [])[:i]) for i in range(12)]

        chat = c.chat.completions.create(model="demo", messages=[{"role": "user", "content": PROMPT}],
                                         max_tokens=10, temperature=0, logprobs=True, top_logprobs=2)
        content = chat.choices[0].logprobs.content  # type: ignore[union-attr]
        assert content is not None and len(content) == chat.usage.completion_tokens  # type: ignore[union-attr]
        for entry in content:
            assert entry.top_logprobs[0].token == entry.token and entry.top_logprobs[0].logprob == entry.logprob
            assert entry.logprob <= 0 and len(entry.top_logprobs) == 2
        streamed = c.chat.completions.create(model="demo", messages=[{"role": "user", "content": PROMPT}],
                                             max_tokens=10, temperature=0, logprobs=True, top_logprobs=2, stream=True)
        parts = [e for ch in streamed if ch.choices and ch.choices[0].logprobs
                 for e in ch.choices[0].logprobs.content or []]
        # the same tokens; the values up to float error (another batch, another summation order)
        assert [e.token for e in parts] == [e.token for e in content]
        assert [e.logprob for e in parts] == pytest.approx([e.logprob for e in content], abs=1e-4)
        assert c.chat.completions.create(model="demo", messages=[{"role": "user", "content": PROMPT}],
                                         max_tokens=4).choices[0].logprobs is None


@pytest.mark.parametrize(("fields", "needle"), [({"logprobs": 21}, "logprobs"), ({"logprobs": -1}, "logprobs")])
def test_bad_logprobs_are_400(gateway: GatewayProcess, fields: dict[str, Any], needle: str) -> None:  # noqa: F811
    r = httpx.post(f"{gateway.url}/v1/completions", timeout=30,
                   json={"model": "demo", "prompt": "x", "max_tokens": 4, **fields})
    assert r.status_code == 400 and needle in r.json()["error"]["message"], r.text
    # top_logprobs without logprobs asks for nothing, and the answer says it ignored it
    r = httpx.post(f"{gateway.url}/v1/chat/completions", timeout=60,
                   json={"model": "demo", "messages": [{"role": "user", "content": "x"}], "top_logprobs": 2,
                         "max_tokens": 2})
    assert r.status_code == 200 and r.json()["choices"][0]["logprobs"] is None, r.text
    assert r.headers["X-Ignored-Fields"] == "top_logprobs"


# ---- n, best_of, echo (tests/openai_choices.py, also run against a worker alone) --------------------------------


def test_n_seeded_sampled_choices_are_the_plain_runs(gateway: GatewayProcess, worker: Service) -> None:  # noqa: F811
    with client(gateway) as c:
        openai_choices.n_seeded_sampled(c, "demo", lambda **body: direct(worker, **body))


def test_n_greedy_choices_are_equal_and_streamed_with_indices(gateway: GatewayProcess) -> None:  # noqa: F811
    with client(gateway) as c:
        openai_choices.n_greedy_and_streamed(c, "demo")


def test_each_choice_is_its_own_request(gateway: GatewayProcess) -> None:  # noqa: F811
    """Each sequence is admitted, routed and recorded on its own (<id>-<i>), under the request's class."""
    raw = client(gateway).completions.with_raw_response.create(
        model="demo", prompt=PROMPT, max_tokens=3, n=2, temperature=0, extra_body={"slo_class": "summarization"})
    rid, doc = raw.headers["X-Request-Id"], raw.parse().model_dump()
    assert doc["id"] == rid and [c["index"] for c in doc["choices"]] == [0, 1]
    assert [c["slo_class"] for c in doc["adaserve"]["choices"]] == ["summarization"] * 2
    records = [httpx.get(f"{gateway.url}/v1/requests/{rid}-{i}", timeout=30) for i in range(2)]
    assert [r.status_code for r in records] == [200, 200], [r.text for r in records]
    assert [int(r.json()["tokens"]) for r in records] == [3, 3]
    assert {r.json()["slo_class"] for r in records} == {"summarization"}


def test_best_of_picks_by_cumulative_logprob(gateway: GatewayProcess) -> None:  # noqa: F811
    with client(gateway) as c:
        openai_choices.best_of_picks_by_logprob(c, "demo")


def test_echo_prepends_the_prompt(gateway: GatewayProcess) -> None:  # noqa: F811
    with client(gateway) as c:
        openai_choices.echo_prepends_the_prompt(c, "demo")


def test_bad_choice_combinations_are_400(gateway: GatewayProcess) -> None:  # noqa: F811
    with client(gateway) as c:
        openai_choices.bad_combinations_are_400(c, "demo")


def test_a_client_that_leaves_aborts_every_choice(gateway: GatewayProcess, worker: Service) -> None:  # noqa: F811
    with httpx.stream("POST", f"{gateway.url}/v1/completions", timeout=60,
                      json={"model": "demo", "prompt": "class A:", "max_tokens": 1500, "ignore_eos": True, "n": 2,
                            "temperature": 0, "stream": True}) as r:
        rid = r.headers["X-Request-Id"]
        next(r.iter_lines())  # one event, then hang up

    def statuses() -> list[str] | None:
        got = [httpx.get(f"{gateway.url}/v1/requests/{rid}-{i}", timeout=30).json().get("status") for i in range(2)]
        return got if "running" not in got else None

    assert wait_for(statuses, timeout=20) == ["aborted", "aborted"]
    assert wait_for(lambda: metric(scrape(worker.url), "adaserve_active_requests", slo_class="chat") == 0,
                    timeout=20)
