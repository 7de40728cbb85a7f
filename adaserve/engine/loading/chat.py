"""A conversation as prompt text: the model's own chat template, or a plain transcript for base models."""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any


class ChatTemplateError(ValueError):
    """The model's chat template refused the conversation (say, a system turn it does not allow)."""


def has_chat_template(tokenizer: Any) -> bool:
    return bool(getattr(tokenizer, "chat_template", None))


def chat_text(tokenizer: Any, turns: Sequence[Mapping[str, Any]]) -> str:
    """``turns`` ({"role", "content"} dicts, with OpenAI's ``name``, ``tool_calls`` and ``tool_call_id`` where
    given) rendered for generation: the model's chat template with the assistant's turn opened, else a
    ``role: text`` transcript ending with ``assistant:`` (base models such as the demo pair have no template).

    Tool calls reach the template as Hugging Face templates read them, their ``arguments`` parsed from JSON (as
    vLLM does); a template that never mentions ``tool_calls`` would drop them without a word, so the turns are
    refused instead (ChatTemplateError)."""
    if has_chat_template(tokenizer):
        if any(t.get("tool_calls") for t in turns) and "tool_calls" not in str(tokenizer.chat_template):
            raise ChatTemplateError("the model's chat template cannot render an assistant turn's tool_calls")
        try:
            return str(tokenizer.apply_chat_template([_for_template(t) for t in turns], tokenize=False,
                                                     add_generation_prompt=True))
        except Exception as e:  # jinja raises TemplateError, templates raise their own exceptions too
            raise ChatTemplateError(f"the model's chat template refused the messages: {e}") from None
    return "".join(_transcript_line(t) for t in turns) + "assistant:"


def _for_template(turn: Mapping[str, Any]) -> dict[str, Any]:
    out = dict(turn)
    if turn.get("tool_calls"):
        out["tool_calls"] = [{**call, "function": {**call["function"], "arguments": _json(call["function"])}}
                             for call in turn["tool_calls"]]
    return out


def _json(function: Mapping[str, Any]) -> Any:
    try:
        return json.loads(function["arguments"])
    except (ValueError, TypeError):
        return function["arguments"]  # not JSON: the text as sent


def _transcript_line(turn: Mapping[str, Any]) -> str:
    """``role: text``; ``role (name): text`` for a named turn or a tool result (named by the call it answers);
    an assistant's tool calls follow its text, one ``<tool_call>{json}</tool_call>`` each."""
    who = turn.get("name") or turn.get("tool_call_id")
    head = f"{turn['role']} ({who})" if who else turn["role"]
    calls = "".join(" <tool_call>" + json.dumps({"id": c["id"], "name": c["function"]["name"],
                                                 "arguments": c["function"]["arguments"]}) + "</tool_call>"
                    for c in turn.get("tool_calls") or ())
    return f"{head}: {turn['content']}{calls}\n"


def instruction_ids(tokenizer: Any, text: str) -> list[int]:
    """Token ids of ``text`` as a single user instruction: through the chat template when the model has
    one (an instruction-tuned model answers it), else the raw text (a base model continues it)."""
    if has_chat_template(tokenizer):
        text = chat_text(tokenizer, [{"role": "user", "content": text}])
    return list(tokenizer.encode(text, add_special_tokens=not has_chat_template(tokenizer)))
