"""The pure parts of failover: the continuation request, the seed, the worker's detokenizer resumed, the
engine's random stream skipped, and admission waiting for a worker through a drain (rule 6)."""

from __future__ import annotations

import asyncio
import time

import torch

from adaserve.contract.generate import GenerateRequest
from adaserve.engine.speculation.sampling import make_generator, skip_draws
from adaserve.gateway.admission import Admitted, Refused
from adaserve.gateway.failover import continuation, with_seed
from adaserve.worker.detok import IncrementalText
from tests.gateway.unit.fakes import registration
from tests.gateway.unit.helpers import run
from tests.gateway.unit.test_admission import CHAT, admission, full_worker

REQ = GenerateRequest.model_construct(prompt="p", max_tokens=10, temperature=0.0, seed=None, request_id="r")


def test_a_continuation_sends_the_tokens_as_ids_and_counts_them_against_max_tokens() -> None:
    got = continuation(REQ, [5, 6, 7], "abc")
    assert got is not None
    assert (got.resume_token_ids, got.resume_text, got.max_tokens) == ([5, 6, 7], "abc", 7)
    assert (got.prompt, got.request_id) == ("p", "r")
    GenerateRequest.model_validate(got.model_dump(exclude_none=True))  # what the worker will accept
    assert continuation(REQ, list(range(10)), "x") is None  # nothing left: the answer is whole
    assert REQ.max_tokens == 10 and getattr(REQ, "resume_token_ids", None) is None  # the original is untouched


def test_a_continuation_counts_the_tokens_sent_against_min_tokens() -> None:
    req = REQ.model_copy(update={"min_tokens": 5})
    assert continuation(req, [5, 6, 7], "abc").min_tokens == 2  # type: ignore[union-attr]
    assert continuation(req, list(range(8)), "abc").min_tokens == 0  # type: ignore[union-attr]


def test_sampled_requests_get_a_seed_greedy_and_seeded_ones_are_left_alone() -> None:
    assert with_seed(REQ) is REQ
    seeded = REQ.model_copy(update={"temperature": 0.7, "seed": 3})
    assert with_seed(seeded) is seeded
    drawn = {with_seed(REQ.model_copy(update={"temperature": 0.7})).seed for _ in range(8)}
    assert None not in drawn and len(drawn) > 1 and all(0 <= s < 2**63 for s in drawn)


def test_skipping_draws_puts_the_stream_where_the_unbroken_run_is() -> None:
    whole = torch.rand(40, generator=make_generator(9), dtype=torch.float64)
    g = make_generator(9)
    skip_draws(g, 17)
    assert torch.equal(torch.rand(23, generator=g, dtype=torch.float64), whole[17:])


def decode(ids: list[int]) -> str:
    return "".join(chr(ord("a") + i) if i < 26 else "\ufffd" for i in ids)


def test_the_resumed_detokenizer_goes_on_from_the_text_shown() -> None:
    t = IncrementalText(decode, ("cd",))
    t.resume([0, 1, 2], "ab")  # 'c' was held back: it may start the stop string
    assert t.push([4], finished=False) == "ce"
    t = IncrementalText(decode, ("cd",))
    t.resume([0, 1, 2], None)  # what it would have shown itself: the same
    assert t.sent == "ab"
    assert t.push([3], finished=True) == "" and t.stopped  # 'c' + 'd' across the seam is the stop string


def test_a_queued_request_waits_through_a_drain_for_the_next_worker() -> None:
    """Queued behind a full worker, which then drains: no 503 at the queue timeout; the next worker takes it."""
    async def main() -> tuple[Admitted | Refused, float]:
        adm, directory, _ = await full_worker(queue_timeout_s=0.2, refresh_s=0.05, worker_wait_s=5.0)
        start = time.monotonic()
        task = asyncio.ensure_future(adm.admit(CHAT, model=None, exclude=set()))
        await asyncio.sleep(0.1)
        directory.source.docs = [registration("a", status="draining")]  # type: ignore[attr-defined]
        await directory.refresh()
        await asyncio.sleep(0.6)  # three queue timeouts, no usable worker
        assert not task.done()
        directory.source.docs = [registration("b")]  # type: ignore[attr-defined]
        await directory.refresh()
        try:
            out: Admitted | Refused = await task
        except Refused as e:
            out = e
        return out, time.monotonic() - start

    out, elapsed = run(main())
    assert isinstance(out, Admitted) and out.choice.worker.id == "b" and out.queued and elapsed < 5.0


def test_a_waiter_gives_up_after_worker_wait_s_and_one_that_saw_none_at_its_budget() -> None:
    async def main() -> tuple[float, str, float, str]:
        adm, directory, _ = await full_worker(queue_timeout_s=0.1, refresh_s=0.05, worker_wait_s=0.5)
        task = asyncio.ensure_future(adm.admit(CHAT, model=None, exclude=set()))
        start = time.monotonic()
        await asyncio.sleep(0.05)
        directory.source.docs = []  # type: ignore[attr-defined]
        await directory.refresh()
        try:
            await task
        except Refused as e:
            patient = (time.monotonic() - start, e.reason)
        fresh, _, _ = admission([], queue_timeout_s=0.1, worker_wait_s=5.0)
        start = time.monotonic()
        try:
            await fresh.admit(CHAT, model=None, exclude=set())
        except Refused as e:
            return (*patient, time.monotonic() - start, e.reason)
        raise AssertionError("admitted with no worker")

    waited, reason, fresh_waited, fresh_reason = run(main())
    assert 0.45 <= waited < 2.0 and reason == "no_workers"
    assert fresh_waited < 0.45 and fresh_reason == "no_workers"
