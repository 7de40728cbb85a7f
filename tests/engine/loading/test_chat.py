"""chat.py: tool calls and tool results reach the chat template (or the transcript of a model without one), and a
template that cannot render tool calls refuses them instead of dropping them."""

from __future__ import annotations

import json
from typing import Any

import pytest

from adaserve.engine.loading.chat import ChatTemplateError, chat_text

CALL = {"id": "call_1", "type": "function", "function": {"name": "weather", "arguments": '{"city": "Oslo"}'}}
TURNS = [{"role": "user", "content": "weather?"},
         {"role": "assistant", "content": "", "tool_calls": [CALL]},
         {"role": "tool", "content": "rain", "tool_call_id": "call_1"}]


class Templated:
    """A tokenizer with a chat template: records what the template was given."""

    def __init__(self, template: str) -> None:
        self.chat_template = template
        self.given: list[dict[str, Any]] = []

    def apply_chat_template(self, turns: list[dict[str, Any]], **_: Any) -> str:
        self.given = turns
        return "rendered"


class Plain:
    chat_template = None


def test_the_transcript_shows_tool_calls_and_results() -> None:
    text = chat_text(Plain(), TURNS)
    call = json.dumps({"id": "call_1", "name": "weather", "arguments": '{"city": "Oslo"}'})
    assert text == (f"user: weather?\nassistant:  <tool_call>{call}</tool_call>\ntool (call_1): rain\nassistant:")
    assert chat_text(Plain(), [{"role": "user", "content": "hi"}]) == "user: hi\nassistant:"  # unchanged


def test_a_template_gets_the_tool_calls_with_their_arguments_parsed() -> None:
    tok = Templated("{% for m in messages %}{{ m.tool_calls }}{% endfor %}")
    assert chat_text(tok, TURNS) == "rendered"
    assert tok.given[1]["tool_calls"][0]["function"] == {"name": "weather", "arguments": {"city": "Oslo"}}
    assert tok.given[2] == {"role": "tool", "content": "rain", "tool_call_id": "call_1"}
    assert TURNS[1]["tool_calls"][0]["function"]["arguments"] == '{"city": "Oslo"}'  # the caller's turns untouched


def test_a_template_that_never_reads_tool_calls_refuses_them() -> None:
    tok = Templated("{% for m in messages %}{{ m.role }}: {{ m.content }}{% endfor %}")
    with pytest.raises(ChatTemplateError, match="tool_calls"):
        chat_text(tok, TURNS)
    assert chat_text(tok, [TURNS[0], TURNS[2]]) == "rendered"  # a tool result alone is the template's to render
