"""A conversation as prompt text: the model's own chat template, or a plain transcript for base models."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any


class ChatTemplateError(ValueError):
    """The model's chat template refused the conversation (say, a system turn it does not allow)."""


def has_chat_template(tokenizer: Any) -> bool:
    return bool(getattr(tokenizer, "chat_template", None))


def chat_text(tokenizer: Any, turns: Sequence[dict[str, str]]) -> str:
    """``turns`` ({"role", "content"} dicts) rendered for generation: the model's chat template with the
    assistant's turn opened, else a ``role: text`` transcript ending with ``assistant:`` (base models such
    as the demo pair have no template)."""
    if has_chat_template(tokenizer):
        try:
            return str(tokenizer.apply_chat_template(list(turns), tokenize=False, add_generation_prompt=True))
        except Exception as e:  # jinja raises TemplateError, templates raise their own exceptions too
            raise ChatTemplateError(f"the model's chat template refused the messages: {e}") from None
    return "".join(f"{t['role']}: {t['content']}\n" for t in turns) + "assistant:"


def instruction_ids(tokenizer: Any, text: str) -> list[int]:
    """Token ids of ``text`` as a single user instruction: through the chat template when the model has
    one (an instruction-tuned model answers it), else the raw text (a base model continues it)."""
    if has_chat_template(tokenizer):
        text = chat_text(tokenizer, [{"role": "user", "content": text}])
    return list(tokenizer.encode(text, add_special_tokens=not has_chat_template(tokenizer)))
