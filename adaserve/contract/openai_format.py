"""Worker chunks as OpenAI responses, and OpenAI's error body: pure functions, one per shape, used by the
gateway (gateway/relay.py) and by a worker's own OpenAI routes (worker/routes/openai.py) alike.

A worker chunk is ``{"id", "token_ids", "text"}``; the last one adds ``finish_reason``,
``prompt_tokens`` and the SLO outcome (adaserve/worker/stream.py).
"""

from __future__ import annotations

from typing import Any, Literal

Kind = Literal["completion", "chat"]


def usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def slo_info(final: dict[str, Any], slo_class: str, *, met: bool | None) -> dict[str, Any]:
    """An extra top-level field; OpenAI clients ignore it, curl users see which class served them. ``slo_met``
    is the gateway's verdict (TTFT from the client's arrival), ``worker_slo_met`` the worker's (from its own)."""
    return {"slo_class": slo_class, "tpot_slo_ms": final.get("tpot_slo_ms"), "slo_met": met,
            "worker_slo_met": final.get("slo_met"), "metrics": final.get("metrics")}


def choice_logprobs(kind: Kind, entries: list[dict[str, Any]] | None, offset: int = 0) -> dict[str, Any] | None:
    """A choice's ``logprobs`` from a worker's entries (``{"id", "token", "bytes", "logprob", "top_logprobs"}``,
    adaserve/worker/stream.py): chat's ``{"content": [...]}``, or completions' ``tokens`` / ``token_logprobs`` /
    ``top_logprobs`` / ``text_offset`` (offsets from ``offset``, the text before these tokens). None: not asked."""
    if entries is None:
        return None
    if kind == "chat":
        def oai(e: dict[str, Any]) -> dict[str, Any]:
            return {"token": e["token"] or "", "logprob": e["logprob"], "bytes": e["bytes"]}

        return {"content": [{**oai(e), "top_logprobs": [oai(t) for t in e["top_logprobs"]]} for e in entries]}
    tokens = [e["token"] or "" for e in entries]
    offsets = []
    for t in tokens:
        offsets.append(offset)
        offset += len(t)
    # as vLLM: the top k, and the emitted token beside them when it is not among them
    tops = [{**{t["token"] or "": t["logprob"] for t in e["top_logprobs"]}, tok: e["logprob"]}
            for e, tok in zip(entries, tokens, strict=True)]
    return {"tokens": tokens, "token_logprobs": [e["logprob"] for e in entries], "top_logprobs": tops,
            "text_offset": offsets}


def logprobs_text(entries: list[dict[str, Any]] | None) -> int:
    """How many characters of text ``entries``' tokens stand for (the next text_offset)."""
    return sum(len(e["token"] or "") for e in entries or ())


def stream_chunk(kind: Kind, *, rid: str, model: str, created: int, text: str | None = None,
                 finish: str | None = None, role: bool = False, logprobs: dict[str, Any] | None = None,
                 index: int = 0) -> dict[str, Any]:
    """One streamed chunk of choice ``index``; ``logprobs``: ``choice_logprobs`` of the tokens it carries."""
    if kind == "completion":
        choice: dict[str, Any] = {"index": index, "text": text or "", "logprobs": logprobs,
                                  "finish_reason": finish}
        return {"id": rid, "object": "text_completion", "created": created, "model": model, "choices": [choice]}
    delta: dict[str, Any] = {}
    if role:
        delta["role"] = "assistant"
    if text is not None:
        delta["content"] = text
    return {"id": rid, "object": "chat.completion.chunk", "created": created, "model": model,
            "choices": [{"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish}]}


def usage_chunk(kind: Kind, *, rid: str, model: str, created: int, prompt_tokens: int,
                completion_tokens: int) -> dict[str, Any]:
    obj = "text_completion" if kind == "completion" else "chat.completion.chunk"
    return {"id": rid, "object": obj, "created": created, "model": model, "choices": [],
            "usage": usage(prompt_tokens, completion_tokens)}


def answer_choice(kind: Kind, *, index: int, text: str, finish: str | None,
                  logprobs: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    """One choice of a non-streamed answer; ``logprobs``: the worker's entries for its tokens (None: not asked)."""
    lp = choice_logprobs(kind, logprobs)
    if kind == "completion":
        return {"index": index, "text": text, "logprobs": lp, "finish_reason": finish}
    return {"index": index, "message": {"role": "assistant", "content": text}, "logprobs": lp,
            "finish_reason": finish}


def full_response(kind: Kind, *, rid: str, model: str, created: int, choices: list[dict[str, Any]],
                  prompt_tokens: int, completion_tokens: int, extra: dict[str, Any]) -> dict[str, Any]:
    """The non-streamed answer: ``choices`` (``answer_choice``, by index), ``usage`` over all of them."""
    obj = "text_completion" if kind == "completion" else "chat.completion"
    return {"id": rid, "object": obj, "created": created, "model": model, "choices": choices,
            "usage": usage(prompt_tokens, completion_tokens), "adaserve": extra}


# OpenAI's error ``type`` per status: the official client turns these into typed exceptions (BadRequestError, ...)
ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error",
               405: "invalid_request_error", 409: "invalid_request_error", 413: "invalid_request_error",
               422: "invalid_request_error", 429: "rate_limit_error", 503: "service_unavailable",
               502: "server_error", 504: "server_error"}


def error_body(status: int, message: str, *, code: str | None = None, param: str | None = None) -> dict[str, Any]:
    """``{"error": {"message", "type", "param", "code"}}``, as OpenAI's API shapes every error."""
    return {"error": {"message": message, "type": ERROR_TYPES.get(status, "server_error"), "param": param,
                      "code": code}}
