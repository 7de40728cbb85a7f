"""openai_format.py: every response shape, exactly as OpenAI's clients read it."""

from __future__ import annotations

from adaserve.contract.openai_format import answer_choice, full_response, slo_info, stream_chunk, usage, usage_chunk

META = {"rid": "cmpl-1", "model": "m", "created": 1700000000}


def test_usage() -> None:
    assert usage(5, 7) == {"prompt_tokens": 5, "completion_tokens": 7, "total_tokens": 12}


def test_completion_chunk() -> None:
    assert stream_chunk("completion", **META, text="Hel") == {
        "id": "cmpl-1", "object": "text_completion", "created": 1700000000, "model": "m",
        "choices": [{"index": 0, "text": "Hel", "logprobs": None, "finish_reason": None}]}
    assert stream_chunk("completion", **META, finish="length") == {
        "id": "cmpl-1", "object": "text_completion", "created": 1700000000, "model": "m",
        "choices": [{"index": 0, "text": "", "logprobs": None, "finish_reason": "length"}]}


def test_chat_chunks() -> None:
    base = {"id": "cmpl-1", "object": "chat.completion.chunk", "created": 1700000000, "model": "m"}
    assert stream_chunk("chat", **META, role=True, text="") == {
        **base, "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                             "finish_reason": None}]}
    assert stream_chunk("chat", **META, text="lo") == {
        **base, "choices": [{"index": 0, "delta": {"content": "lo"}, "logprobs": None, "finish_reason": None}]}
    assert stream_chunk("chat", **META, finish="stop") == {
        **base, "choices": [{"index": 0, "delta": {}, "logprobs": None, "finish_reason": "stop"}]}


def test_usage_chunks() -> None:
    expected_usage = {"prompt_tokens": 3, "completion_tokens": 4, "total_tokens": 7}
    assert usage_chunk("completion", **META, prompt_tokens=3, completion_tokens=4) == {
        "id": "cmpl-1", "object": "text_completion", "created": 1700000000, "model": "m", "choices": [],
        "usage": expected_usage}
    assert usage_chunk("chat", **META, prompt_tokens=3, completion_tokens=4) == {
        "id": "cmpl-1", "object": "chat.completion.chunk", "created": 1700000000, "model": "m", "choices": [],
        "usage": expected_usage}


def test_full_completion() -> None:
    extra = {"slo_class": "chat"}
    one = answer_choice("completion", index=0, text="Hello", finish="stop")
    assert full_response("completion", **META, choices=[one], prompt_tokens=2, completion_tokens=1,
                         extra=extra) == {
        "id": "cmpl-1", "object": "text_completion", "created": 1700000000, "model": "m",
        "choices": [{"index": 0, "text": "Hello", "logprobs": None, "finish_reason": "stop"}],
        "usage": {"prompt_tokens": 2, "completion_tokens": 1, "total_tokens": 3}, "adaserve": extra}


def test_full_chat() -> None:
    one = answer_choice("chat", index=0, text="Hi!", finish="length")
    assert full_response("chat", **META, choices=[one], prompt_tokens=10, completion_tokens=2, extra={}) == {
        "id": "cmpl-1", "object": "chat.completion", "created": 1700000000, "model": "m",
        "choices": [{"index": 0, "message": {"role": "assistant", "content": "Hi!"}, "logprobs": None,
                     "finish_reason": "length"}],
        "usage": {"prompt_tokens": 10, "completion_tokens": 2, "total_tokens": 12}, "adaserve": {}}


def test_slo_info() -> None:
    final = {"finish_reason": "stop", "tpot_slo_ms": 50.0, "metrics": {"tpot_ms": 31.0}, "token_ids": [1],
             "slo_met": False}
    assert slo_info(final, "chat", met=True) == {"slo_class": "chat", "tpot_slo_ms": 50.0, "slo_met": True,
                                                 "worker_slo_met": False, "metrics": {"tpot_ms": 31.0}}
    assert slo_info({}, "batch", met=None) == {"slo_class": "batch", "tpot_slo_ms": None, "slo_met": None,
                                               "worker_slo_met": None, "metrics": None}


def test_choices_carry_their_index() -> None:
    assert stream_chunk("completion", **META, text="a", index=2)["choices"][0]["index"] == 2
    assert stream_chunk("chat", **META, text="a", index=1)["choices"][0]["index"] == 1
    two = [answer_choice("chat", index=i, text=t, finish="stop") for i, t in enumerate(["x", "y"])]
    doc = full_response("chat", **META, choices=two, prompt_tokens=3, completion_tokens=4, extra={})
    assert [(c["index"], c["message"]["content"]) for c in doc["choices"]] == [(0, "x"), (1, "y")]
    assert doc["usage"]["completion_tokens"] == 4
