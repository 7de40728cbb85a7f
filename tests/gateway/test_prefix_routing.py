"""Prefix affinity end to end (gateway/prefix_index.py): two real workers (the demo pair, each with its prefix
cache), a real Redis, a gateway with its default settings, the official ``openai`` client.

The first turns are sent three at a time, each while the ones before it still stream, so that they spread
over both workers of two slots each: the shared system prompt draws the first two to the worker holding it
until it is full, the third goes to the other, which from then on holds the system prompt too, and the policy
(fewer requests) spreads the next ones. The second turns are then sent one at a time, where the policy alone
would send them all to the same worker. With prefix affinity at least 80% of them (here: all) go back to their
first turn's worker. To see these tests fail without it: ``ADASERVE_GATEWAY_PREFIX_INDEX_BLOCKS=0``.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import pytest
import redis

from tests.gateway.test_gateway import LAX, client
from tests.redis_prefix import REDIS_URL, isolated_redis
from tests.servers import (
    GatewayProcess,
    Service,
    demo_pair,
    metric,
    ready_then_stopped,
    scrape,
    start_gateway,
    start_worker,
)

WORKER_IDS = ("w-a", "w-b")
SLOTS = 2  # each worker's max_active_requests: two long answers fill one
SYSTEM = ("You are the support assistant of a small bookshop. Answer in short sentences, name the shelf a book "
          "is on when you know it, and never invent a title. The shop opens at nine and closes at six; it is "
          "closed on Sundays. ")
GROUP = SLOTS + 1  # first turns started together: one more than a worker holds
CONVERSATIONS = 3 * GROUP
FIRST_TOKENS = 200  # a first answer's length: long enough that its group overlaps on a busy machine
Messages = list[dict[str, str]]


@pytest.fixture(scope="module")
def rds() -> Iterator[tuple[redis.Redis, str]]:
    yield from isolated_redis("prefix-routing")


@pytest.fixture(scope="module")
def workers(rds: tuple[redis.Redis, str], tmp_path_factory: pytest.TempPathFactory) -> Iterator[list[Service]]:
    tmp = tmp_path_factory.mktemp("prefix-workers")
    target, draft = demo_pair()
    procs = [start_worker(target, draft, tmp / f"{wid}.log", "--budget", "8", "--redis-url", REDIS_URL,
                          "--worker-id", wid,
                          env={"ADASERVE_REDIS_PREFIX": rds[1], "ADASERVE_MODEL_NAME": "demo",
                               "ADASERVE_MAX_ACTIVE_REQUESTS": str(SLOTS), "ADASERVE_HEARTBEAT_S": "0.5",
                               "ADASERVE_REGISTRATION_TTL_S": "3"})
             for wid in WORKER_IDS]
    yield from ready_then_stopped(procs)


def lax_gateway(tmp: Path, prefix: str, *args: str) -> GatewayProcess:
    """A gateway over the workers, with targets no busy machine misses: every worker with a free slot has
    headroom."""
    classes = tmp / "lax.json"
    classes.write_text(json.dumps([c.model_dump(by_alias=True, exclude_none=True) for c in LAX]))
    return start_gateway(tmp / "gateway.log", "--redis-url", REDIS_URL, "--redis-prefix", prefix,
                         "--slo-classes-file", str(classes), "--default-slo-class", "chat", "--queue-timeout-s", "10",
                         *args)


@pytest.fixture(scope="module")
def gateway(rds: tuple[redis.Redis, str], workers: list[Service],
            tmp_path_factory: pytest.TempPathFactory) -> Iterator[GatewayProcess]:
    gw = lax_gateway(tmp_path_factory.mktemp("prefix-gw"), rds[1])
    try:
        gw.wait_workers(2)
        yield gw
    finally:
        assert gw.stop() == 0, gw.logs()[-3000:]


def first_turn(i: int) -> Messages:
    return [{"role": "system", "content": SYSTEM},
            {"role": "user", "content": f"Customer {i} here. I am looking for book number {i * 37} of the series "
                                        f"you recommended last week; which shelf is it on, and is it in stock?"}]


def then(messages: Messages, answer: str, question: str) -> Messages:
    return [*messages, {"role": "assistant", "content": answer}, {"role": "user", "content": question}]


class Streaming:
    """A streamed chat answer whose first token has arrived (the gateway has placed it on a worker)."""

    def __init__(self, gw: GatewayProcess, messages: Messages, tokens: int) -> None:
        raw = client(gw).chat.completions.with_raw_response.create(
            model="demo", messages=messages, max_tokens=tokens, temperature=0, stream=True,
            extra_body={"ignore_eos": True})
        self.worker = raw.headers["x-adaserve-worker"]
        self.stream: openai.Stream[Any] = raw.parse()

    def answer(self) -> str:
        return "".join(ch.choices[0].delta.content or "" for ch in self.stream if ch.choices)


def answered(gw: GatewayProcess, messages: Messages, tokens: int = 8) -> tuple[str, str]:
    """(worker, answer) of one chat request, not streamed."""
    raw = client(gw).chat.completions.with_raw_response.create(model="demo", messages=messages,
                                                               max_tokens=tokens, temperature=0)
    return raw.headers["x-adaserve-worker"], raw.parse().choices[0].message.content or ""


def prefix_counts(gw: GatewayProcess) -> dict[str, float]:
    samples = scrape(gw.url)
    return {r: metric(samples, "adaserve_gateway_prefix_requests_total", result=r)
            for r in ("hit", "miss", "no_headroom")}


def cache_hits(workers: list[Service]) -> float:
    return sum(metric(scrape(w.url), "adaserve_prefix_cache_hits_total") for w in workers)


def test_second_turns_land_on_the_worker_holding_their_first(gateway: GatewayProcess,
                                                             workers: list[Service]) -> None:
    firsts: list[tuple[Messages, str, str]] = []  # (messages, worker, answer)
    for group in range(0, CONVERSATIONS, GROUP):
        streams = [(first_turn(i), Streaming(gateway, first_turn(i), FIRST_TOKENS))
                   for i in range(group, group + GROUP)]
        firsts += [(m, s.worker, s.answer()) for m, s in streams]
    placed = [w for _, w, _ in firsts]
    assert set(placed) == set(WORKER_IDS), placed  # the first turns are spread: affinity has something to do
    hits_before, counts_before = cache_hits(workers), prefix_counts(gateway)
    seconds = [answered(gateway, then(m, ans, "Thank you. Can you keep it for me until Saturday?"))[0]
               for m, _, ans in firsts]
    stayed = sum(w1 == w2 for w1, w2 in zip(placed, seconds, strict=True))
    assert stayed >= 0.8 * CONVERSATIONS, list(zip(placed, seconds, strict=True))
    counts = prefix_counts(gateway)
    assert counts["hit"] - counts_before["hit"] == CONVERSATIONS  # each matched blocks on the worker it went to
    assert cache_hits(workers) > hits_before  # and the workers' caches served the prefixes


def test_a_worker_without_a_free_slot_is_not_chosen_for_its_prefix(gateway: GatewayProcess) -> None:
    messages = first_turn(100)
    home, answer = answered(gateway, messages, 24)
    other = next(w for w in WORKER_IDS if w != home)
    # two long second turns fill the worker holding the conversation: affinity sends both there
    busy = [Streaming(gateway, then(messages, answer, f"And the next volume, number {j}?"), 400) for j in range(SLOTS)]
    try:
        assert [s.worker for s in busy] == [home] * SLOTS
        before = prefix_counts(gateway)
        went, _ = answered(gateway, then(messages, answer, "Is the shop open on Sunday?"))
        assert went == other  # its prefix is on a full worker: the other one takes it
        assert prefix_counts(gateway)["no_headroom"] - before["no_headroom"] == 1
    finally:
        for s in busy:
            s.stream.close()


def test_the_settings_turn_affinity_off(tmp_path: Path, rds: tuple[redis.Redis, str],
                                        workers: list[Service]) -> None:
    """With ``--prefix-index-blocks 0`` the gateway counts nothing for the prefix (and routes as before)."""
    gw = lax_gateway(tmp_path, rds[1], "--prefix-index-blocks", "0")
    try:
        gw.wait_workers(2)
        answered(gw, first_turn(200))
        assert sum(prefix_counts(gw).values()) == 0
    finally:
        assert gw.stop() == 0, gw.logs()[-3000:]
