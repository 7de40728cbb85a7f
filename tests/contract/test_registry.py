"""read_registrations against a real Redis: the live entries, whichever client reads them."""

from __future__ import annotations

import asyncio
import json
import time

import pytest

from adaserve.contract.registry import index_key, read_registrations, worker_key
from tests.redis_prefix import isolated_aredis, require_redis


def test_key_names() -> None:
    assert worker_key("p", "w1") == "p:workers:w1"
    assert index_key("p") == "p:workers"


@pytest.mark.parametrize("decode_responses", [True, False])  # the gateway's client decodes, the operator's not
def test_only_live_registrations_are_read(decode_responses: bool) -> None:
    require_redis()

    async def main() -> tuple[list[str], list[str]]:
        async with isolated_aredis("registry", decode_responses=decode_responses) as (r, prefix):
            empty = [reg.worker_id for reg in await read_registrations(r, prefix)]
            now_ms = int(time.time() * 1000)
            entries = {
                "w-1": (now_ms + 60_000, {"worker_id": "w-1", "address": "http://w-1:8000", "status": "ready"}),
                "gone": (now_ms - 1_000, {"worker_id": "gone", "address": "http://gone:8000", "status": "ready"}),
                "foreign": (now_ms + 60_000, {"worker_id": "foreign"}),  # not a registration: left out
            }
            for wid, (expires, body) in entries.items():
                await r.set(worker_key(prefix, wid), json.dumps(body), px=60_000)
                await r.zadd(index_key(prefix), {wid: expires})
            await r.set(worker_key(prefix, "broken"), "{not json", px=60_000)
            await r.zadd(index_key(prefix), {"broken": now_ms + 60_000, "crashed": now_ms + 60_000})  # no entry
            return empty, [reg.worker_id for reg in await read_registrations(r, prefix)]

    empty, live = asyncio.run(main())
    assert empty == [] and live == ["w-1"]
