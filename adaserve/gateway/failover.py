"""Going on with a request on another worker after its worker failed mid-answer (killed, hung, drained past
its grace, engine error).

The client already has some tokens, so the answer cannot start again: it continues. The new worker gets the
same request as a continuation (adaserve/contract/generate.py, ``resume_*``): the prompt plus every token
already sent, as token ids (never re-tokenised text), ``max_tokens`` less those tokens, and the text already
shown, from which its stream goes on. What the client sees has no seam: one id, no text twice or missing,
usage over both workers, the last worker's finish reason.

Why the continuation is what an unbroken run gives:

- greedy: every token is the target's argmax given the prompt and the tokens before it, on any worker.
- sampled: the engine draws token i with the i-th uniform of the request's seeded generator, one uniform per
  emitted token whatever the speculation did (adaserve/engine/speculation/sampling.py). Every sampled request carries a
  seed (the client's, else one drawn here, ``with_seed``), and the new worker skips the uniforms of the tokens
  already sent, so it draws at every later position what the unbroken run would have drawn: the same tokens,
  and so the target's distribution. (Even without that, a fresh draw of the rest from the target given the
  prefix would be distribution-correct: p(prefix, rest) = p(prefix) p(rest | prefix).)
"""

from __future__ import annotations

import logging
import secrets
import time

from adaserve.contract.generate import GenerateRequest
from adaserve.gateway import dispatch
from adaserve.gateway.admission import Refused
from adaserve.gateway.errors import ApiError
from adaserve.gateway.service import Gateway
from adaserve.gateway.slo import SloClass
from adaserve.gateway.tracker import Tracker

log = logging.getLogger(__name__)

SEED_LIMIT = 2**63  # the contract's bound


def with_seed(request: GenerateRequest) -> GenerateRequest:
    """A sampled request without a seed gets one (an unseeded run is a run with a seed nobody chose), so a
    continuation can draw what the rest of the unbroken run would have."""
    if request.temperature == 0.0 or request.seed is not None:
        return request
    return request.model_copy(update={"seed": secrets.randbelow(SEED_LIMIT)})


def continuation(request: GenerateRequest, sent_ids: list[int], shown: str | None) -> GenerateRequest | None:
    """``request`` continued after ``sent_ids`` (of which ``shown`` was the text sent); None when nothing is
    left to generate. Always built from the original request: a second failover sends every token so far."""
    left = (request.max_tokens or 0) - len(sent_ids)
    if left <= 0:
        return None
    # min_tokens, like max_tokens, is what is left: the earlier tokens already count towards it
    return request.model_copy(update={"resume_token_ids": list(sent_ids), "resume_text": shown, "max_tokens": left,
                                      "min_tokens": max(0, (request.min_tokens or 0) - len(sent_ids))})


async def reopen(gw: Gateway, request: GenerateRequest, slo: SloClass, track: Tracker, *,
                 failed: str) -> dispatch.Upstream:
    """Start ``request`` (a continuation) on a worker other than ``failed``, waiting for one up to
    ``worker_wait_s`` if none is usable (admission's rule 6: a request a worker failed is patient). Like
    ``Gateway.open``, but a refusal is not a new request refused: the request has already been served in part,
    so it ends as failed (WorkerLost), never as shed."""
    deadline = time.monotonic() + gw.settings.worker_wait_s
    tried = {failed}
    model = track.model if gw.settings.model_name is None else None
    keys = gw.prefix_keys(request)  # its prompt's: the worker holding them is still the one to prefer
    while True:
        try:
            admitted = await gw.admission.admit(slo, model=model, exclude=tried, keys=keys)
        except Refused as e:
            if time.monotonic() >= deadline:
                raise dispatch.WorkerLost(f"no worker to continue on: {e}") from None
            tried = set()  # a failed worker stays suspect a while (suspect_s); one back since may serve
            await gw.directory.wait_change(gw.settings.refresh_s)  # a refusal at once must not spin
            continue
        w = admitted.choice.worker
        gw.directory.acquire(w.id, slo.name)  # before any await, as Gateway.open does
        gw.routed(w.id, admitted.choice, keys)
        gw.metrics.routed.labels(w.id, slo.name, gw.router.policy).inc()
        gw.metrics.admitted.labels(slo.name, "after_wait" if admitted.queued else "at_once", admitted.mode).inc()
        gw.metrics.queue_wait.labels(slo.name).observe(admitted.waited_s)
        try:
            await track.routed(w.id, admitted)
            return await dispatch.open_stream(gw.http, w, request,
                                              first_token_timeout_s=gw.settings.first_token_timeout_s,
                                              token_timeout_s=gw.settings.token_timeout_s)
        except dispatch.WorkerFailed as e:
            gw.worker_failed(w.id, slo.name, e)
            log.warning("request %s: continuing failed too: %s", track.request_id, e)
            tried.add(w.id)
            if time.monotonic() >= deadline:
                raise dispatch.WorkerLost(f"no worker could continue the request: {e}") from None
        except ApiError as e:  # the worker refused the continuation itself (a 4xx): no other will take it
            gw.directory.release(w.id, slo.name)
            raise dispatch.WorkerLost(f"worker {w.id} refused the continuation: {e.message}") from None
        except BaseException:
            gw.directory.release(w.id, slo.name)
            raise

