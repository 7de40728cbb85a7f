"""One OpenAI request from arrival to its last byte: who is calling, which class, rate limit, a worker's
stream, and the answer as server-sent events or one JSON body. The two endpoints differ only in shape.

``n`` > 1 (and ``best_of``) is one ``Call`` per sequence (adaserve/contract/choices.py): each its own request to
admission, routing and a worker, with its own record (``<id>-<i>``) and SLO outcome, under the request's class;
the rate limit counts the HTTP request once.
"""

from __future__ import annotations

import asyncio
import functools
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator
from contextlib import aclosing
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, StreamingResponse

from adaserve.contract import choices, openai_format
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
                 up: dispatch.Upstream, request: GenerateRequest, *, answer_id: str, index: int = 0) -> None:
        self.gw, self.kind, self.body, self.track, self.up = gw, kind, body, track, up
        self.answer_id, self.index = answer_id, index  # the answer's id, and this sequence's place in it
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
        return openai_format.stream_chunk(self.kind, rid=self.answer_id, model=self.body.model, created=self.created,
                                          index=self.index, **kw)

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
                try:
                    going_on = await self._continue(lost)
                except dispatch.WorkerLost:
                    self.outcome = "failed"
                    raise
                if not going_on:
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
        if self.outcome == "done" and self.has_text:  # the worker's cache holds the prompt and this answer
            self.gw.answered(self.up.worker.id, self.request, "".join(self.text))
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
    sent = [failover.with_seed(r) for r in body.generate_requests(gw.settings.max_tokens_default, slo, rid)]
    tracks = [gw.tracker(r.request_id or rid, slo, key, model) for r in sent]
    for track in tracks:
        await track.received()
    try:
        await gw.rate_limit(key)
    except ApiError:
        for track in tracks:
            await track.refused("rate_limited", "rate_limit")
        raise
    calls = await _open_all(gw, kind, body, sent, tracks, answer_id=rid)
    workers = ",".join(dict.fromkeys(c.up.worker.id for c in calls))
    headers = {"X-Request-Id": rid, "X-SLO-Class": slo.name, "X-Adaserve-Worker": workers}
    if ignored:
        headers[IGNORED_HEADER] = ignored_header(ignored)
        log.warning("request %s: ignored unknown field(s): %s", rid, headers[IGNORED_HEADER])
    if body.stream:
        return StreamingResponse(_sse(calls), media_type="text/event-stream",
                                 headers={**headers, "Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
    return JSONResponse(await _collect(calls, request), headers=headers)


async def _open_all(gw: Gateway, kind: Kind, body: CompletionRequest | ChatRequest, sent: list[GenerateRequest],
                    tracks: list[Tracker], *, answer_id: str) -> list[Call]:
    """Every sequence started on a worker, each admitted on its own; when one cannot be, the others are ended
    (aborted on their workers) and its refusal is the answer."""
    def call(i: int, up: dispatch.Upstream) -> Call:
        return Call(gw, kind, body, tracks[i], up, sent[i], answer_id=answer_id, index=i)

    def end_if_opened(i: int, task: asyncio.Future[dispatch.Upstream]) -> None:
        if not task.cancelled() and task.exception() is None:
            gw.spawn(call(i, task.result()).end())

    tasks = [asyncio.ensure_future(gw.open(r, t.slo, t)) for r, t in zip(sent, tracks, strict=True)]
    try:
        await asyncio.wait(tasks)
    except BaseException:  # the client left while some waited for admission: end every one, now or once open
        for i, task in enumerate(tasks):
            task.cancel()
            task.add_done_callback(functools.partial(end_if_opened, i))
        raise
    failed = [t.exception() for t in tasks if t.exception() is not None]
    if failed:
        for i, task in enumerate(tasks):
            end_if_opened(i, task)
        raise failed[0]  # type: ignore[misc]
    return [call(i, t.result()) for i, t in enumerate(tasks)]


def _event(doc: dict[str, Any]) -> str:
    return f"data: {json.dumps(doc)}\n\n"


async def _sse(calls: list[Call]) -> AsyncIterator[str]:
    """Server-sent events, each choice's chunks with its index as they come. A worker lost mid-stream is
    replaced without a seam (Call.chunks); when no worker can go on, tokens already sent cannot be taken back,
    so the stream ends with an error event that says so (the official client raises it as an APIError), and the
    other choices are aborted."""
    first = calls[0]
    body = first.body
    try:
        for call in calls:
            if call.kind == "chat":
                yield _event(call.chunk(role=True, text=""))
            if body.echo_text():
                yield _event(call.chunk(text=body.echo_text()))
        try:
            async with aclosing(choices.merged([_then_none(call.chunks()) for call in calls])) as merged:
                async for i, c in merged:
                    call = calls[i]
                    if c is None:  # this choice is complete (its final chunk, or nothing left after a failover)
                        yield _event(call.chunk(finish=call.finish))
                        continue
                    lps = c.get("logprobs")
                    if c.get("text") or lps:
                        yield _event(call.chunk(text=c.get("text") or "", logprobs=openai_format.choice_logprobs(
                            call.kind, lps, call.offset)))
                        call.offset += openai_format.logprobs_text(lps)
        except dispatch.WorkerLost as e:
            yield _event(error_body(502, f"{e}; the output above is incomplete", code="worker_failed"))
        else:
            if body.include_usage:
                yield _event(openai_format.usage_chunk(first.kind, rid=first.answer_id, model=body.model,
                                                       created=first.created, prompt_tokens=first.prompt_tokens,
                                                       completion_tokens=sum(c.track.tokens for c in calls)))
        yield "data: [DONE]\n\n"
    finally:
        # a client that went away cancels this generator: clean up in a task of its own, not on the way out
        for call in calls:
            call.gw.spawn(call.end())


async def _then_none(chunks: AsyncIterator[dict[str, Any]]) -> AsyncIterator[dict[str, Any] | None]:
    async for c in chunks:
        yield c
    yield None


async def _collect(calls: list[Call], request: Request) -> dict[str, Any]:
    async def gather() -> None:
        async with aclosing(choices.merged([call.chunks() for call in calls])) as merged:
            async for _ in merged:  # Call.chunks keeps the text
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
            raise ApiError(502, str(e), code="worker_failed") from None
    finally:
        if not task.done():
            task.cancel()
        for call in calls:
            await call.end()
    return answer(calls)


def answer(calls: list[Call]) -> dict[str, Any]:
    """The non-streamed answer from finished calls: ``n`` choices (``best_of``: the most likely, best first),
    usage over every sequence generated."""
    first = calls[0]
    body = first.body
    order = range(len(calls))
    if len(calls) > body.n:
        order = choices.best_of_order([choices.cumulative_logprob(c.logprobs) for c in calls], body.n)
    wanted = body.top_logprobs_wanted() is not None
    picked = [calls[i] for i in order]
    out = [openai_format.answer_choice(c.kind, index=i, text=body.echo_text() + "".join(c.text), finish=c.finish,
                                       logprobs=c.logprobs if wanted else None) for i, c in enumerate(picked)]
    extra = picked[0].extra() if len(calls) == 1 else {"slo_class": first.track.slo.name,
                                                       "choices": [c.extra() for c in picked]}
    return openai_format.full_response(first.kind, rid=first.answer_id, model=body.model, created=first.created,
                                       choices=out, prompt_tokens=first.prompt_tokens,
                                       completion_tokens=sum(c.track.tokens for c in calls), extra=extra)
