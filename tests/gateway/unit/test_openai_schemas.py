"""openai_schemas.py: what the completions and chat bodies accept, refuse by name, and pass to the worker."""

from __future__ import annotations

from typing import Any

import h11
import jsonschema
import pytest
from pydantic import ValidationError

from adaserve.contract.generate import ChatMessage, GenerateRequest
from adaserve.contract.openai import ChatRequest, CompletionRequest, ignored_fields, ignored_header
from adaserve.gateway.slo import SloClass

USER = [{"role": "user", "content": "hi"}]


def completion(**kw: Any) -> CompletionRequest:
    return CompletionRequest.model_validate({"model": "m", "prompt": "hello", **kw})


def chat(**kw: Any) -> ChatRequest:
    return ChatRequest.model_validate({"model": "m", "messages": USER, **kw})


@pytest.mark.parametrize("make", [completion, chat])
@pytest.mark.parametrize(("fields", "message"), [
    ({"n": 9}, "n"),
    ({"n": 0}, "n"),
    ({"presence_penalty": 2.5}, "presence_penalty"),
    ({"frequency_penalty": -3.0}, "frequency_penalty"),
    ({"repetition_penalty": 0}, "repetition_penalty"),
    ({"logit_bias": {"12": 101}}, "logit_bias"),
    ({"logit_bias": {"token": 1}}, "logit_bias"),
    ({"logit_bias": {"007": 1}}, "logit_bias"),
    ({"min_tokens": -1}, "min_tokens"),
    ({"stop_token_ids": [-1]}, "stop_token_ids"),
    ({"logprobs": 21}, "logprobs"),
    ({"logprobs": [1]}, "logprobs"),
    ({"temperature": 2.5}, "temperature"),
    ({"top_p": 0}, "top_p"),
    ({"max_tokens": 0}, "max_tokens"),
    ({"max_tokens": "5"}, "max_tokens"),  # no coercion from strings
    ({"stop": [""]}, "stop strings must be non-empty"),
    ({"stop": [f"s{i}" for i in range(17)]}, "at most 16 stop strings"),
    ({"stop": 5}, "stop"),
    ({"slo_class": "two words"}, "slo_class"),
])
def test_unsupported_parameters_are_refused_by_name(make: Any, fields: dict[str, Any], message: str) -> None:
    with pytest.raises(ValidationError, match=message):
        make(**fields)


@pytest.mark.parametrize("make", [completion, chat])
def test_harmless_values_of_unsupported_parameters_pass(make: Any) -> None:
    req = make(n=1, logprobs=False, presence_penalty=0.0, frequency_penalty=0)
    assert req.n == 1


@pytest.mark.parametrize("make", [completion, chat])
def test_unknown_fields_are_accepted_and_named(make: Any) -> None:
    req = make(store=True, metadata={"a": "b"}, parallel_tool_calls=False, stream_options={"include_usage": True,
                                                                                          "continuous": 1})
    assert ignored_fields(req) == ["store", "metadata", "parallel_tool_calls", "stream_options.continuous"]
    sent = req.generate_request(64, CODING, "cmpl-1").model_dump(mode="json", exclude_none=True)
    assert not {"store", "metadata", "parallel_tool_calls"} & set(sent)  # nothing unknown reaches a worker
    assert ignored_fields(make()) == []


def test_odd_unknown_field_names_are_quoted_so_that_a_header_can_carry_them() -> None:
    req = completion(**{"": 1, "0": 2, " a": 3, "é": 4, "x\ny": 5, 'q"': 6})
    fields = ignored_fields(req)
    assert fields == ['""', "0", '" a"', '"\\u00e9"', '"x\\ny"', '"q\\""']
    h11.Response(status_code=200, headers=[("X-Ignored-Fields", ignored_header(fields))])  # a legal header
    assert ignored_header(["f" * 600, "g" * 600]).endswith("...") and len(ignored_header(["f" * 2000])) == 1024


def test_unknown_fields_inside_messages_are_named_by_path() -> None:
    messages = [{"role": "user", "content": [{"type": "text", "text": "hi", "cache_control": {}}], "x": 1},
                {"role": "assistant", "content": None, "tool_calls": [
                    {"id": "c1", "type": "function", "index": 0, "function": {"name": "f", "arguments": "{}",
                                                                                "strict": True}}]}]
    assert ignored_fields(chat(messages=messages)) == [
        "messages[0].x", "messages[0].content[0].cache_control", "messages[1].tool_calls[0].index",
        "messages[1].tool_calls[0].function.strict"]


def test_logits_processor_fields_reach_the_worker() -> None:
    req = completion(presence_penalty=0.5, frequency_penalty=-1.0, repetition_penalty=1.2, min_tokens=3,
                     stop_token_ids=[7], logit_bias={"12": -100, "0": 2.5})
    sampling = req.sampling(64)
    assert {k: sampling[k] for k in ("presence_penalty", "frequency_penalty", "repetition_penalty", "min_tokens",
                                     "stop_token_ids", "logit_bias")} == {
        "presence_penalty": 0.5, "frequency_penalty": -1.0, "repetition_penalty": 1.2, "min_tokens": 3,
        "stop_token_ids": [7], "logit_bias": {"12": -100.0, "0": 2.5}}


@pytest.mark.parametrize("prompt", [["one", "two"], ["a", "b", "c"]])
def test_several_prompts_are_refused(prompt: list[str]) -> None:
    with pytest.raises(ValidationError, match="one prompt per request"):
        completion(prompt=prompt)


@pytest.mark.parametrize("prompt", ["", [], [""]])
def test_empty_prompt_is_refused(prompt: str | list[Any]) -> None:
    with pytest.raises(ValidationError, match="prompt: must not be empty"):
        completion(prompt=prompt)


@pytest.mark.parametrize(("fields", "message"), [
    ({"suffix": "end"}, "suffix is not supported"),
    ({"n": 3, "best_of": 2}, r"best_of: must be at least n \(2 < 3\)"),
    ({"best_of": 2, "stream": True}, "best_of: cannot be streamed"),
    ({"best_of": 9}, "best_of"),
    ({"echo": True, "logprobs": 0}, "echo: not with logprobs"),
    ({"echo": True, "prompt": [1, 2]}, "echo: needs a text prompt"),
])
def test_bad_choice_combinations_are_refused(fields: dict[str, Any], message: str) -> None:
    with pytest.raises(ValidationError, match=message):
        completion(**fields)


def test_good_choice_combinations_pass() -> None:
    assert completion(best_of=1, stream=True).sequences == 1  # one: nothing to choose, streamable
    assert completion(n=2, best_of=2).sequences == 2 and completion(n=2, best_of=5).sequences == 5
    assert completion(n=3).sequences == 3
    assert chat(n=4).sequences == 4 and completion().sequences == 1
    assert completion(echo=True, prompt=["hi"]).echo_text() == "hi" and completion().echo_text() == ""
    assert completion(echo=True, logprobs=False).echo_text() == "hello"  # false: no logprobs


@pytest.mark.parametrize("doc", [CompletionRequest.model_json_schema()])
@pytest.mark.parametrize(("fields", "valid"), [
    ({"n": 3, "best_of": 2}, False), ({"n": 3, "best_of": 3}, True), ({"n": 2, "best_of": None}, True),
    ({"best_of": 2, "stream": True}, False), ({"best_of": 1, "stream": True}, True),
    ({"echo": True, "logprobs": 2}, False), ({"echo": True, "logprobs": False}, True),
    ({"echo": True, "prompt": [1, 2]}, False), ({"echo": True, "prompt": ["x"]}, True),
])
def test_the_schema_declares_the_rules_across_fields(doc: dict[str, Any], fields: dict[str, Any],
                                                     valid: bool) -> None:
    """The OpenAPI document says what the validator refuses (a fuzzer's valid data must pass)."""
    body = {"model": "m", "prompt": "hello", **fields}
    errors = list(jsonschema.Draft202012Validator(doc).iter_errors(body))
    assert (not errors) == valid, errors
    if valid:
        completion(**fields)
    else:
        with pytest.raises(ValidationError):
            completion(**fields)


@pytest.mark.parametrize(("fields", "seeds", "logprobs"), [
    ({"n": 3, "seed": 7}, [7, 8, 9], [None] * 3),
    ({"n": 2, "seed": 2**63 - 1}, [2**63 - 1, 0], [None] * 2),  # wraps within the contract's range
    ({"n": 2}, [None, None], [None] * 2),  # each draws its own (the gateway gives each a seed)
    ({"n": 1, "best_of": 3, "seed": 1}, [1, 2, 3], [0] * 3),  # best_of ranks by logprob: asked for
    ({"n": 2, "best_of": 2, "logprobs": 4}, [None, None], [4, 4]),
])
def test_one_engine_request_per_sequence(fields: dict[str, Any], seeds: list[int | None],
                                         logprobs: list[int | None]) -> None:
    sent = completion(**fields).generate_requests(64, CODING, "cmpl-1")
    assert [r.request_id for r in sent] == [f"cmpl-1-{i}" for i in range(len(seeds))]
    assert [r.seed for r in sent] == seeds and [r.logprobs for r in sent] == logprobs
    assert {r.prompt for r in sent} == {"hello"} and {r.slo_class for r in sent} == {CODING.name}
    # one sequence keeps the answer's id and the client's own fields
    one = completion(seed=5).generate_requests(64, CODING, "cmpl-1")
    assert [(r.request_id, r.seed, r.logprobs) for r in one] == [("cmpl-1", 5, None)]


@pytest.mark.parametrize(("prompt", "fields"), [
    ("hello", {"prompt": "hello"}),
    (["hello"], {"prompt": "hello"}),  # a list of one prompt
    ([1, 2, 3], {"prompt_token_ids": [1, 2, 3]}),
])
def test_prompt_fields(prompt: Any, fields: dict[str, Any]) -> None:
    assert completion(prompt=prompt).prompt_fields() == fields


def test_defaults_sample_like_openai() -> None:
    req = completion()
    assert req.temperature == 1.0 and req.top_p == 1.0 and not req.stream and req.slo_class is None
    assert req.sampling(64) == {"max_tokens": 64, "temperature": 1.0, "top_p": 1.0, "top_k": 0, "seed": None,
                                "stop": [], "stop_token_ids": [], "ignore_eos": False, "min_tokens": 0,
                                "logit_bias": {}, "presence_penalty": 0.0, "frequency_penalty": 0.0,
                                "repetition_penalty": 1.0, "structured_outputs": None, "logprobs": None}


def test_sampling_passes_the_request_fields() -> None:
    req = completion(max_tokens=9, temperature=0.0, top_p=0.9, top_k=40, seed=7, stop="###", ignore_eos=True)
    assert req.sampling(64) == {"max_tokens": 9, "temperature": 0.0, "top_p": 0.9, "top_k": 40, "seed": 7,
                                "stop": ["###"], "stop_token_ids": [], "ignore_eos": True, "min_tokens": 0,
                                "logit_bias": {}, "presence_penalty": 0.0, "frequency_penalty": 0.0,
                                "repetition_penalty": 1.0, "structured_outputs": None, "logprobs": None}


@pytest.mark.parametrize(("fields", "max_tokens"), [
    ({}, 64),
    ({"max_tokens": 3}, 3),
    ({"max_completion_tokens": 7}, 7),
    ({"max_tokens": 3, "max_completion_tokens": 7}, 7),  # the newer field wins
])
def test_max_completion_tokens_overrides(fields: dict[str, Any], max_tokens: int) -> None:
    assert chat(**fields).sampling(64)["max_tokens"] == max_tokens


@pytest.mark.parametrize(("options", "include"), [
    (None, False),
    ({}, False),
    ({"include_usage": False}, False),
    ({"include_usage": True}, True),
])
def test_include_usage(options: dict[str, Any] | None, include: bool) -> None:
    assert completion(stream=True, stream_options=options).include_usage is include
    assert chat(stream=True, stream_options=options).include_usage is include


def test_chat_messages_as_text() -> None:
    messages = [{"role": "system", "content": "be brief"},
                {"role": "user", "content": [{"type": "text", "text": "two "}, {"type": "text", "text": "parts"}]},
                {"role": "assistant", "content": None, "name": "bot"}]
    assert chat(messages=messages, slo_class="coding").prompt_fields() == {"messages": [
        ChatMessage(role="system", content="be brief"), ChatMessage(role="user", content="two parts"),
        ChatMessage(role="assistant", content="", name="bot")]}


def test_tool_messages_reach_the_worker() -> None:
    call = {"id": "call_1", "type": "function", "function": {"name": "weather", "arguments": '{"city": "Oslo"}'}}
    messages = [{"role": "user", "content": "weather?"},
                {"role": "assistant", "content": None, "tool_calls": [call]},
                {"role": "tool", "tool_call_id": "call_1", "content": "rain"}]
    sent = chat(messages=messages).generate_request(64, CODING, "c-1").model_dump(mode="json", exclude_none=True)
    assert sent["messages"] == [{"role": "user", "content": "weather?"},
                                {"role": "assistant", "content": "", "tool_calls": [call]},
                                {"role": "tool", "content": "rain", "tool_call_id": "call_1"}]
    assert GenerateRequest.model_validate(sent).model_dump(mode="json", exclude_none=True) == sent


@pytest.mark.parametrize("messages", [
    [],
    [{"role": "robot", "content": "x"}],
    [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "http://x"}}]}],
    [{"role": "assistant", "tool_calls": [{"id": "c", "function": {"name": "f", "arguments": {"a": 1}}}]}],
    [{"role": "assistant", "tool_calls": [{"id": "c", "type": "code", "function": {"name": "f", "arguments": ""}}]}],
])
def test_bad_messages_are_refused(messages: list[dict[str, Any]]) -> None:
    with pytest.raises(ValidationError):
        chat(messages=messages)


CODING = SloClass(name="coding", tpot_ms=40, ttft_ms=2000)


@pytest.mark.parametrize("body", [
    completion(prompt=[1, 2, 3], max_tokens=9, temperature=0.0, top_p=0.9, top_k=40, seed=7, stop="###",
               ignore_eos=True),
    completion(prompt=["hello"]),
    completion(prompt="x", presence_penalty=1, frequency_penalty=-2, repetition_penalty=1.5, min_tokens=2,
               stop_token_ids=[3], logit_bias={"5": 1, "6": -100}, store=True),
    chat(messages=[{"role": "system", "content": "be brief"},
                   {"role": "user", "content": [{"type": "text", "text": "two "}, {"type": "text", "text": "parts"}]}],
         max_completion_tokens=5),
])
def test_the_worker_request_is_one_the_worker_accepts(body: CompletionRequest | ChatRequest) -> None:
    # built without a second validation: it must still be exactly what the worker's schema makes of it
    sent = body.generate_request(64, CODING, "cmpl-1").model_dump(mode="json", exclude_none=True)
    assert GenerateRequest.model_validate(sent).model_dump(mode="json", exclude_none=True) == sent
    assert (sent["slo_class"], sent["tpot_slo_ms"], sent["ttft_slo_ms"], sent["request_id"], sent["stream"]) == (
        "coding", 40.0, 2000.0, "cmpl-1", True)


def test_negative_token_ids_are_refused_at_the_gateway() -> None:
    with pytest.raises(ValidationError, match="prompt"):
        completion(prompt=[1, -2])
