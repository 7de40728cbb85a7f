"""``POST /v1/completions``, ``POST /v1/chat/completions`` and ``GET /v1/models`` on a worker, without a gateway.

The bodies and answers are the gateway's (adaserve/contract/openai.py, openai_format.py), so any OpenAI client,
the Gateway API Inference Extension or llm-d can front a worker directly; the gateway stays the SLO-aware router.

The SLO class is the gateway's header ``X-SLO-Class``, else the body's ``slo_class``, else the worker's default
class; its TPOT target is the worker's own (``ADASERVE_SLO_CLASSES``) unless the request gives one, as
``tpot_slo_ms`` / ``ttft_slo_ms`` in the body or the ``X-TPOT-SLO-Ms`` / ``X-TTFT-SLO-Ms`` headers (header wins).
A field the worker does not know is ignored and named in ``X-Ignored-Fields``, as at the gateway. Errors are
OpenAI's ``{"error": {...}}``, and a malformed body is a 400 (app.py), not ``/v1/generate``'s 422.

``n`` > 1 and ``best_of`` submit one engine request per sequence (adaserve/contract/choices.py), ``<id>-<i>``.
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections.abc import AsyncIterator, Sequence
from contextlib import aclosing
from dataclasses import dataclass
from typing import Annotated, Any

from fastapi import APIRouter, Header, Request
from fastapi.responses import JSONResponse, StreamingResponse
from starlette.background import BackgroundTask

from adaserve.contract import choices
from adaserve.contract.generate import GenerateRequest
from adaserve.contract.openai import (
    IGNORED_HEADER,
    WorkerChatRequest,
    WorkerCompletionRequest,
    ignored_fields,
    ignored_header,
)
from adaserve.contract.openai_format import (
    Kind,
    answer_choice,
    choice_logprobs,
    error_body,
    full_response,
    logprobs_text,
    stream_chunk,
    usage_chunk,
)
from adaserve.contract.slo import FAILED_END
from adaserve.worker import stream
from adaserve.worker.routes.deps import RuntimeDep
from adaserve.worker.routes.generate import SloClassHeader, abort_unfinished, wait_whole
from adaserve.worker.runtime import InFlight, RequestRefused, Runtime

router = APIRouter(tags=["openai"])

# the paths whose errors are OpenAI's shape (app.py)
OPENAI_PATHS = frozenset({"/v1/completions", "/v1/chat/completions", "/v1/models"})

TargetHeader = Annotated[float | None, Header(gt=0, allow_inf_nan=False)]


@dataclass(frozen=True)
class Targets:
    """The SLO a request is served under here (``SloTargets``); a None TPOT: the class's, from the settings."""

    name: str
    tpot_ms: float | None
    ttft_ms: float | None


TpotHeader = Annotated[TargetHeader, Header(alias="X-TPOT-SLO-Ms")]
TtftHeader = Annotated[TargetHeader, Header(alias="X-TTFT-SLO-Ms")]


@router.post("/v1/completions")
async def completions(body: WorkerCompletionRequest, runtime: RuntimeDep, request: Request,
                      x_slo_class: SloClassHeader = None,
                      x_tpot_slo_ms: TpotHeader = None, x_ttft_slo_ms: TtftHeader = None) -> Any:
    targets = _targets(runtime, body, x_slo_class, x_tpot_slo_ms, x_ttft_slo_ms)
    return await _serve(runtime, "completion", body, request, targets)


@router.post("/v1/chat/completions")
async def chat_completions(body: WorkerChatRequest, runtime: RuntimeDep, request: Request,
                           x_slo_class: SloClassHeader = None,
                           x_tpot_slo_ms: TpotHeader = None, x_ttft_slo_ms: TtftHeader = None) -> Any:
    targets = _targets(runtime, body, x_slo_class, x_tpot_slo_ms, x_ttft_slo_ms)
    return await _serve(runtime, "chat", body, request, targets)


@router.get("/v1/models")
async def models(runtime: RuntimeDep) -> dict[str, Any]:
    """The one model this worker serves, under the name the gateway knows it by."""
    card: dict[str, Any] = {"id": runtime.settings.served_model_name, "object": "model",
                            "created": int(runtime.started_at), "owned_by": "adaserve"}
    if runtime.built is not None:
        card["max_model_len"] = runtime.built.engine.max_context
    return {"object": "list", "data": [card]}


def _targets(runtime: Runtime, body: WorkerCompletionRequest | WorkerChatRequest, header_class: str | None,
             tpot_header: float | None, ttft_header: float | None) -> Targets:
    name = header_class or body.slo_class or runtime.settings.default_slo_class  # the gateway's order
    tpot = tpot_header if tpot_header is not None else body.tpot_slo_ms
    ttft = ttft_header if ttft_header is not None else body.ttft_slo_ms
    return Targets(name, tpot, ttft)


async def _serve(runtime: Runtime, kind: Kind, body: WorkerCompletionRequest | WorkerChatRequest,
                 request: Request, targets: Targets) -> Any:
    served = runtime.settings.served_model_name
    if body.model != served:
        raise RequestRefused(404, f"model {body.model!r} not found; available: {served}", code="model_not_found",
                             param="model")
    if runtime.built is not None and runtime.tokenizer is None:
        raise RequestRefused(400, "this model has no tokenizer: the OpenAI routes answer text; use /v1/generate "
                             "with prompt_token_ids", code="no_tokenizer")
    rid = f"{'cmpl' if kind == 'completion' else 'chatcmpl'}-{uuid.uuid4().hex}"
    flights = await _submit_all(runtime, body.generate_requests(runtime.settings.default_max_tokens, targets, rid))
    headers = {"X-Request-Id": rid, "X-SLO-Class": flights[0].slo_class}
    ignored = ignored_fields(body)
    if ignored:
        headers[IGNORED_HEADER] = ignored_header(ignored)
    answer = _Answer(runtime, kind, body, flights, rid)
    if body.stream:
        return StreamingResponse(answer.events(), media_type="text/event-stream",
                                 headers={**headers, "Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
                                 background=BackgroundTask(_abort_all, runtime, flights))
    wholes = await asyncio.gather(*(wait_whole(runtime, f, request) for f in flights))
    failed = [w["finish_reason"] for w in wholes if w["finish_reason"] in FAILED_END]
    if failed:
        return JSONResponse(error_body(500, f"the request ended with {failed[0]!r}; see the worker log",
                                       code="generation_failed"), status_code=500, headers=headers)
    return JSONResponse(answer.whole(wholes), headers=headers)


async def _submit_all(runtime: Runtime, requests: list[GenerateRequest]) -> list[InFlight]:
    """Every sequence submitted; when one is refused, those already in are aborted and its refusal is the answer."""
    flights: list[InFlight] = []
    try:
        for r in requests:
            flights.append(await runtime.submit(r))
    except BaseException:
        _abort_all(runtime, flights)
        raise
    return flights


def _abort_all(runtime: Runtime, flights: list[InFlight]) -> None:
    for flight in flights:
        abort_unfinished(runtime, flight)


class _Answer:
    def __init__(self, runtime: Runtime, kind: Kind, body: WorkerCompletionRequest | WorkerChatRequest,
                 flights: list[InFlight], rid: str) -> None:
        self.runtime, self.kind, self.body, self.flights, self.rid = runtime, kind, body, flights, rid
        self.created = int(time.time())
        self.offsets = [0] * len(flights)  # the text before each choice's next streamed logprobs (text_offset)

    def chunk(self, index: int = 0, **kw: Any) -> str:
        doc = stream_chunk(self.kind, rid=self.rid, model=self.body.model, created=self.created, index=index, **kw)
        return _event(doc)

    def extra(self, final: dict[str, Any]) -> dict[str, Any]:
        """The worker's own SLO verdict, as the gateway's ``adaserve`` field carries its own."""
        return {"slo_class": final["slo_class"], "tpot_slo_ms": final["tpot_slo_ms"],
                "ttft_slo_ms": final["ttft_slo_ms"], "slo_met": final["slo_met"], "metrics": final["metrics"],
                "worker": self.runtime.settings.worker_id}

    def whole(self, wholes: list[dict[str, Any]]) -> dict[str, Any]:
        """The non-streamed answer from every sequence's whole (``best_of``: the n most likely, best first)."""
        body = self.body
        order: Sequence[int] = range(len(wholes))
        if len(wholes) > body.n:
            order = choices.best_of_order([choices.cumulative_logprob(w.get("logprobs")) for w in wholes], body.n)
        wanted = body.top_logprobs_wanted() is not None
        picked = [wholes[i] for i in order]
        out = [answer_choice(self.kind, index=i, text=body.echo_text() + (w["text"] or ""), finish=w["finish_reason"],
                             logprobs=w.get("logprobs") if wanted else None) for i, w in enumerate(picked)]
        extra = self.extra(picked[0]) if len(wholes) == 1 else {"slo_class": picked[0]["slo_class"],
                                                                "choices": [self.extra(w) for w in picked]}
        return full_response(self.kind, rid=self.rid, model=body.model, created=self.created, choices=out,
                             prompt_tokens=wholes[0]["prompt_tokens"],
                             completion_tokens=sum(len(w["token_ids"]) for w in wholes), extra=extra)

    async def events(self) -> AsyncIterator[str]:
        """OpenAI's server-sent events, each choice's chunks with its index as they come. A request the engine
        ends with an error cannot take back what was sent: the stream ends with an error event (the official
        client raises it as an APIError), and the other choices are aborted."""
        tokens = 0
        prompt_tokens = 0
        echo = self.body.echo_text()
        try:
            for i in range(len(self.flights)):
                if self.kind == "chat":
                    yield self.chunk(i, role=True, text="")
                if echo:
                    yield self.chunk(i, text=echo)
            async with aclosing(choices.merged([stream.chunks(self.runtime, f) for f in self.flights])) as merged:
                async for i, c in merged:
                    tokens += len(c["token_ids"])
                    lps = c.get("logprobs")
                    if c.get("text") or lps:
                        yield self.chunk(i, text=c.get("text") or "",
                                         logprobs=choice_logprobs(self.kind, lps, self.offsets[i]))
                        self.offsets[i] += logprobs_text(lps)
                    if "finish_reason" not in c:
                        continue
                    if c["finish_reason"] in FAILED_END:
                        yield _event(error_body(500, f"the request ended with {c['finish_reason']!r}; the output above "
                                                     "is incomplete", code="generation_failed"))
                        break
                    yield self.chunk(i, finish=c["finish_reason"])
                    prompt_tokens = c["prompt_tokens"]
                else:
                    if self.body.include_usage:
                        yield _event(usage_chunk(self.kind, rid=self.rid, model=self.body.model, created=self.created,
                                                 prompt_tokens=prompt_tokens, completion_tokens=tokens))
            yield "data: [DONE]\n\n"
        finally:
            _abort_all(self.runtime, self.flights)


def _event(doc: dict[str, Any]) -> str:
    return f"data: {json.dumps(doc)}\n\n"
