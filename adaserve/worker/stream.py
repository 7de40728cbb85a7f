"""A request's events as response chunks: token ids plus text deltas, then one final chunk.

Chunk: ``{"id", "token_ids", "text"}``, and ``logprobs`` when the request asked for them (one entry per token id:
``{"id", "token", "bytes", "logprob", "top_logprobs": [{"id", "token", "bytes", "logprob"}]}``, OpenAI's chat
shape plus the ids); the final chunk adds ``finish_reason``, ``slo_class``,
``tpot_slo_ms``, ``ttft_slo_ms``, ``slo_met``, ``prompt_tokens`` and ``metrics`` (the engine's per-request
metrics).
``text`` is None when the model has no tokenizer.

A continuation (``resume_token_ids``) streams only its new tokens, and its text goes on from the text the
earlier worker had shown (``resume_text``): decoding starts from the earlier tokens, so a character or a stop
string split across the seam comes out as in an unbroken run. ``prompt_tokens`` is the client's prompt.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

from adaserve.engine.speculation.logprobs import TokenLogprob
from adaserve.worker.detok import IncrementalText
from adaserve.worker.runtime import InFlight, Runtime


async def chunks(runtime: Runtime, flight: InFlight) -> AsyncIterator[dict[str, Any]]:
    text = IncrementalText(runtime.decode, flight.req.params.stop) if runtime.tokenizer is not None else None
    if text is not None and flight.resumed:
        text.resume(flight.req.prompt_ids[-flight.resumed:], flight.resume_text)
    rid = flight.request_id
    while True:
        ev = await flight.events.get()
        delta = text.push(ev.new_tokens, finished=ev.finished) if text is not None else None
        lps = {} if ev.logprobs is None else {"logprobs": [logprob_entry(runtime, x) for x in ev.logprobs]}
        if not ev.finished:
            if ev.new_tokens:
                yield {"id": rid, "token_ids": ev.new_tokens, "text": delta, **lps}
            continue
        stopped = text is not None and text.stopped
        yield {
            "id": rid,
            "token_ids": ev.new_tokens,
            "text": delta,
            **lps,
            "finish_reason": "stop" if stopped else ev.finish_reason,
            "slo_class": flight.slo_class,
            "tpot_slo_ms": flight.tpot_slo_ms,
            # the engine's own request's target (only when the request gives one: ADASERVE_SLO_CLASSES holds
            # TPOT targets only), so a client sees what the SLO prefill rule works to
            "ttft_slo_ms": flight.req.ttft_slo_ms,
            "slo_met": flight.met_slo,
            "prompt_tokens": flight.prompt_tokens,
            "metrics": flight.req.metrics.to_dict(),
        }
        return


def logprob_entry(runtime: Runtime, x: TokenLogprob) -> dict[str, Any]:
    def one(token: int, logprob: float) -> dict[str, Any]:
        text = runtime.token_text(token)
        return {"id": token, "token": text, "bytes": None if text is None else list(text.encode()),
                "logprob": logprob}

    return {**one(x.token, x.logprob), "top_logprobs": [one(t, v) for t, v in x.top]}


async def collect(runtime: Runtime, flight: InFlight) -> dict[str, Any]:
    """The whole answer as one body: every token id, the full text, and the final chunk's fields."""
    ids: list[int] = []
    parts: list[str] = []
    lps: list[dict[str, Any]] = []
    async for c in chunks(runtime, flight):
        ids.extend(c["token_ids"])
        lps.extend(c.get("logprobs") or [])
        if c["text"] is not None:
            parts.append(c["text"])
        if "finish_reason" in c:
            whole = {**c, "token_ids": ids, "text": "".join(parts) if runtime.tokenizer is not None else None}
            if flight.req.params.logprobs is not None:
                whole["logprobs"] = lps
            return whole
    raise RuntimeError("event stream ended without a final event")
