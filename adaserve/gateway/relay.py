"""One OpenAI request from arrival to its last byte: who is calling, which class, rate limit, a worker's
stream, and the answer as server-sent events or one JSON body. The two endpoints differ only in shape.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, StreamingResponse

from adaserve.contract import openai_format
from adaserve.contract.generate import GenerateRequest
from adaserve.contract.openai import (
    IGNORED_HEADER,
    ChatRequest,
    CompletionRequest,
    ignored_fields,
    ignored_header,
)
from adaserve.contract.openai_format import Kind
from adaserve.contract.slo import FAILED_END
from adaserve.gateway import dispatch, failover
from adaserve.gateway.errors import ApiError, error_body
from adaserve.gateway.keys import AuthError
from adaserve.gateway.service import Gateway
from adaserve.gateway.slo import UnknownClass
from adaserve.gateway.tracker import Tracker

log = logging.getLogger(__name__)

DISCONNECT_POLL_S = 0.25
class Call:
    """What the handler knows about one request once it is admitted to a worker."""

    def __init__(self, gw: Gateway, kind: Kind, body: CompletionRequest | ChatRequest, track: Tracker,
                 up: dispatch.Upstream, request: GenerateRequest) -> None:
        self.gw, self.kind, self.body, self.track, self.up = gw, kind, body, track, up
        self.request = request  # as the first worker got it (seed included): continuations are built from it
        self.created = int(time.time())
        self.text: list[str] = []  # every text delta passed on, from every worker
        self.sent_ids: list[int] = []  # every token id passed on, from every worker
        self.logprobs: list[dict[str, Any]] = []  # their logprobs entries, when the request asked for them
        self.offset = 0  # the text before the next streamed logprobs (completions' text_offset)
        self.has_text = True  # the workers send text (a model without a tokenizer sends None)
        self.held = True  # ``up``'s slot is counted on its worker (Directory.acquire)
        self.continued = 0  # times the request went on on another worker
        self.finish: str | None = None
        self.prompt_tokens = 0
        self.final: dict[str, Any] = {}
        self.outcome = "aborted"  # until the worker's final chunk says otherwise

    @property
    def rid(self) -> str:
        return self.track.request_id

    def chunk(self, **kw: Any) -> dict[str, Any]:
        return openai_format.stream_chunk(self.kind, rid=self.rid, model=self.body.model, created=self.created, **kw)

    async def chunks(self) -> AsyncIterator[dict[str, Any]]:
        """The answer's chunks, recorded as they pass; sets outcome and finish on the final one. A worker lost
        mid-answer is replaced (``_continue``): the chunks go on from another. WorkerLost when none can."""
        while True:
            try:
                async for c in self.up.chunks():
                    ids = c.get("token_ids") or []
                    if "finish_reason" in c and c["finish_reason"] in FAILED_END:
                        # its tokens were emitted and go on, not its text: a failed worker's last chunk flushes
                        # the tail it held back (a stop string's start, half a character), which the next one
                        # shows in its own time
                        self._passed(ids, None)
                        self.logprobs += c.get("logprobs") or []
                        raise dispatch.WorkerLost(f"worker {self.up.worker.id} ended the request: "
                                                  f"{c['finish_reason']}")
                    self._passed(ids, c.get("text"))
                    self.logprobs += c.get("logprobs") or []
                    yield c
                    if "finish_reason" in c:
                        self.final, self.prompt_tokens = c, int(c.get("prompt_tokens") or 0)
                        self.outcome, self.finish = "done", c["finish_reason"]  # stop | length: OpenAI's words
                        return
                raise dispatch.WorkerLost(f"worker {self.up.worker.id} ended the stream without a last chunk")
            except dispatch.WorkerLost as lost:
                if not await self._continue(lost):
                    return

    def _passed(self, ids: list[int], text: str | None) -> None:
        self.sent_ids.extend(ids)
        self.track.on_tokens(len(ids))
        if text is None and not self.text and ids:
            self.has_text = False
        if text:
            self.text.append(text)

    async def _continue(self, lost: dispatch.WorkerLost) -> bool:
        """Go on on another worker from the prompt plus the tokens sent (failover.py); False when nothing was
        left to generate (the answer is complete: ``length``). Re-raises ``lost`` when it cannot go on."""
        old = self.up
        self.gw.spawn(dispatch.abort(self.gw.http, old.worker, self.rid))  # it may be alive but silent
        await old.close()
        if self.held:
            self.held = False
            self.gw.directory.release(old.worker.id, self.track.slo.name)
        self.gw.directory.mark_failed(old.worker.id)
        if self.continued >= self.gw.settings.max_attempts:
            raise lost
        request = failover.continuation(self.request, self.sent_ids, "".join(self.text) if self.has_text else None)
        if request is None:
            self.outcome, self.finish = "done", "length"
            return False
        log.warning("request %s: %s; continuing on another worker after %d tokens", self.rid, lost,
                    len(self.sent_ids))
        self.continued += 1
        waited = self.track.waited_s  # admission's calibration learns from the first wait, not this one
        self.up = await failover.reopen(self.gw, request, self.track.slo, self.track, failed=old.worker.id)
        self.held = True
        self.track.waited_s = waited
        self.track.decoding_since = None  # its TPOT spans a failover: nothing to learn about either worker
        return True

    async def end(self) -> None:
        """Release the worker, abort there if unfinished, write the record. Runs once, whatever happened."""
        if self.outcome == "aborted":
            await dispatch.abort(self.gw.http, self.up.worker, self.rid)
        await self.up.close()
        if self.held:
            self.gw.done(self.up, self.track, self.outcome)
        met = await self.track.finished(self.outcome, self.finish)
        self.final["slo_met"] = met

    def extra(self) -> dict[str, Any]:
        return {**openai_format.slo_info(self.final, self.track.slo.name, met=self.final.get("slo_met")),
                "worker": self.up.worker.id, "continued": self.continued}


async def serve(gw: Gateway, kind: Kind, body: CompletionRequest | ChatRequest, request: Request, *,
                authorization: str | None, header_class: str | None) -> Any:
    ignored = ignored_fields(body)
    if ignored and gw.settings.strict_openai_fields:  # the schema's own 400, as before the fields were ignored
        raise ApiError(400, f"{', '.join(ignored)}: unknown field(s); this gateway refuses fields it does not know "
                       "(--strict-openai-fields)", code="unknown_field", param=ignored[0])
    try:
        key = gw.keys.authenticate(authorization)
    except AuthError as e:
        raise ApiError(401, str(e), code="invalid_api_key") from None
    try:
        slo = gw.catalog.resolve(header=header_class, body=body.slo_class,
                                 key_default=key.default_class if key else None)
    except UnknownClass as e:
        raise ApiError(400, str(e), code="unknown_slo_class", param="slo_class") from None
    model = gw.check_model(body.model)
    rid = f"{'cmpl' if kind == 'completion' else 'chatcmpl'}-{uuid.uuid4().hex}"
    track = gw.tracker(rid, slo, key, model)
    await track.received()
    try:
        await gw.rate_limit(key)
    except ApiError:
        await track.refused("rate_limited", "rate_limit")
        raise
    sent = failover.with_seed(body.generate_request(gw.settings.max_tokens_default, slo, rid))
    up = await gw.open(sent, slo, track)
    call = Call(gw, kind, body, track, up, sent)
    headers = {"X-Request-Id": rid, "X-SLO-Class": slo.name, "X-Adaserve-Worker": up.worker.id}
    if ignored:
        headers[IGNORED_HEADER] = ignored_header(ignored)
        log.warning("request %s: ignored unknown field(s): %s", rid, headers[IGNORED_HEADER])
    if body.stream:
        return StreamingResponse(_sse(call), media_type="text/event-stream",
                                 headers={**headers, "Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
    return JSONResponse(await _collect(call, request), headers=headers)


def _event(doc: dict[str, Any]) -> str:
    return f"data: {json.dumps(doc)}\n\n"


async def _sse(call: Call) -> AsyncIterator[str]:
    """Server-sent events. A worker lost mid-stream is replaced without a seam (Call.chunks); when no worker
    can go on, tokens already sent cannot be taken back, so the stream ends with an error event that says so
    (the official client raises it as an APIError)."""
    try:
        if call.kind == "chat":
            yield _event(call.chunk(role=True, text=""))
        try:
            async for c in call.chunks():
                lps = c.get("logprobs")
                if c.get("text") or lps:
                    yield _event(call.chunk(text=c.get("text") or "",
                                            logprobs=openai_format.choice_logprobs(call.kind, lps, call.offset)))
                    call.offset += openai_format.logprobs_text(lps)
        except dispatch.WorkerLost as e:
            call.outcome = "failed"
            yield _event(error_body(502, f"{e}; the output above is incomplete", code="worker_failed"))
        else:
            yield _event(call.chunk(finish=call.finish))
            if call.body.include_usage:
                yield _event(openai_format.usage_chunk(call.kind, rid=call.rid, model=call.body.model,
                                                       created=call.created, prompt_tokens=call.prompt_tokens,
                                                       completion_tokens=call.track.tokens))
        yield "data: [DONE]\n\n"
    finally:
        # a client that went away cancels this generator: clean up in a task of its own, not on the way out
        call.gw.spawn(call.end())


async def _collect(call: Call, request: Request) -> dict[str, Any]:
    async def gather() -> None:
        async for _ in call.chunks():  # Call.chunks keeps the text
            pass

    task = asyncio.ensure_future(gather())
    try:
        while not task.done():
            await asyncio.wait({task}, timeout=DISCONNECT_POLL_S)
            if not task.done() and await request.is_disconnected():
                task.cancel()
        try:
            task.result()
        except asyncio.CancelledError:
            raise ApiError(499, "client closed the request") from None
        except dispatch.WorkerLost as e:
            call.outcome = "failed"
            raise ApiError(502, str(e), code="worker_failed") from None
    finally:
        if not task.done():
            task.cancel()
        await call.end()
    return openai_format.full_response(call.kind, rid=call.rid, model=call.body.model, created=call.created,
                                       text="".join(call.text), finish=call.finish,
                                       prompt_tokens=call.prompt_tokens, completion_tokens=call.track.tokens,
                                       extra=call.extra(),
                                       logprobs=call.logprobs if call.request.logprobs is not None else None)
