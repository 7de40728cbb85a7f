"""state.py and redis_state.py: MemoryStore and RedisStore (a real Redis) must behave the same.

Each Redis case uses its own random key prefix and deletes its keys afterwards (helpers.open_store).
"""

from __future__ import annotations

import asyncio

import pytest

from adaserve.gateway.redis_state import RedisStore, connect
from adaserve.gateway.state import flatten, refill
from tests.gateway.unit.helpers import STORES, open_store, run
from tests.redis_prefix import isolated_aredis, require_redis

RATE, BURST = 20.0, 3  # one token every 50 ms


@pytest.fixture(params=STORES)
def kind(request: pytest.FixtureRequest) -> str:
    if request.param == "redis":
        require_redis()
    return request.param


# ---- the pure helpers --------------------------------------------------------------------------------------

def test_flatten_writes_what_a_redis_hash_holds() -> None:
    assert flatten({"a": None, "b": True, "c": False, "d": 1.5, "e": 0, "f": "x"}) == {
        "a": "", "b": "1", "c": "0", "d": "1.5", "e": "0", "f": "x"}


def test_refill() -> None:
    assert refill(0.5, 10.0, 10.1, rate_per_s=20, burst=3) == pytest.approx(2.5)
    assert refill(0.5, 10.0, 11.0, rate_per_s=20, burst=3) == 3  # capped at the burst
    assert refill(0.5, 10.0, 9.0, rate_per_s=20, burst=3) == 0.5  # a clock that stepped back adds nothing


# ---- both stores -------------------------------------------------------------------------------------------

def test_record_merges_fields(kind: str) -> None:
    async def main() -> tuple[dict[str, str] | None, dict[str, str] | None]:
        async with open_store(kind) as store:
            await store.record("r1", {"id": "r1", "status": "queued", "worker": None, "slo_met": True, "tokens": 3},
                               ttl_s=60)
            await store.record("r1", {"status": "done", "tokens": 7, "slo_met": False}, ttl_s=60)
            return await store.get_record("r1"), await store.get_record("r2")

    merged, unknown = run(main())
    assert merged == {"id": "r1", "status": "done", "worker": "", "slo_met": "0", "tokens": "7"}
    assert unknown is None


def test_record_expires_after_its_ttl_and_each_write_resets_it(kind: str) -> None:
    async def main() -> list[dict[str, str] | None]:
        seen = []
        async with open_store(kind) as store:
            await store.record("r", {"status": "queued"}, ttl_s=1)
            await asyncio.sleep(0.5)
            await store.record("r", {"status": "running"}, ttl_s=1)
            await asyncio.sleep(0.7)  # 1.2 s after the first write, 0.7 s after the second
            seen.append(await store.get_record("r"))
            await asyncio.sleep(0.6)  # 1.3 s after the second
            seen.append(await store.get_record("r"))
        return seen

    alive, gone = run(main())
    assert alive == {"status": "running"}
    assert gone is None


def test_counters_add_up_per_class(kind: str) -> None:
    async def main() -> tuple[dict[str, int], dict[str, int], dict[str, int]]:
        async with open_store(kind) as store:
            await store.count("chat", {"requests": 1, "tokens": 5})
            await store.count("chat", {"requests": 1, "finished": 1, "tokens": 7})
            await store.count("coding", {"shed": 1})
            return await store.counters("chat"), await store.counters("coding"), await store.counters("none")

    chat, coding, none = run(main())
    assert chat == {"requests": 2, "tokens": 12, "finished": 1}
    assert coding == {"shed": 1}
    assert none == {}


def test_record_adds_the_class_counters_in_the_same_call(kind: str) -> None:
    async def main() -> tuple[dict[str, str] | None, dict[str, int], dict[str, int]]:
        async with open_store(kind) as store:
            await store.record("r1", {"status": "running"}, ttl_s=60, slo_class="chat", counters={"requests": 1})
            await store.record("r1", {"status": "done"}, ttl_s=60, slo_class="chat",
                               counters={"finished": 1, "tokens": 7})
            await store.record("r2", {"status": "queued"}, ttl_s=60, slo_class="coding", counters={})
            await store.record("r3", {"status": "queued"}, ttl_s=60)  # no class: the record alone
            return await store.get_record("r1"), await store.counters("chat"), await store.counters("coding")

    rec, chat, coding = run(main())
    assert rec == {"status": "done"}
    assert chat == {"requests": 1, "finished": 1, "tokens": 7}
    assert coding == {}


def test_token_bucket_allows_a_burst_then_waits_one_token(kind: str) -> None:
    async def main() -> tuple[list[float], float, float, float]:
        async with open_store(kind) as store:
            burst = [await store.take_token("team-a", rate_per_s=RATE, burst=BURST) for _ in range(BURST)]
            wait = await store.take_token("team-a", rate_per_s=RATE, burst=BURST)
            other = await store.take_token("team-b", rate_per_s=RATE, burst=BURST)  # buckets are separate
            await asyncio.sleep(wait + 0.03)
            again = await store.take_token("team-a", rate_per_s=RATE, burst=BURST)
            return burst, wait, other, again

    burst, wait, other, again = run(main())
    assert burst == [0.0] * BURST
    assert 0.02 < wait <= 1 / RATE + 0.002  # ≈ 1/rate = 50 ms, less whatever trickled in meanwhile
    assert other == 0.0
    assert again == 0.0


def test_token_bucket_refills_only_up_to_the_burst(kind: str) -> None:
    async def main() -> list[float]:
        async with open_store(kind) as store:
            for _ in range(BURST):
                await store.take_token("k", rate_per_s=RATE, burst=BURST)
            await asyncio.sleep(0.4)  # 8 tokens' worth of time, but the bucket holds 3
            return [await store.take_token("k", rate_per_s=RATE, burst=BURST) for _ in range(BURST + 1)]

    got = run(main())
    assert got[:BURST] == [0.0] * BURST
    assert got[BURST] > 0


def test_ping(kind: str) -> None:
    async def main() -> bool:
        async with open_store(kind) as store:
            return await store.ping()

    assert run(main()) is True


# ---- Redis only: the key schema and its TTLs ---------------------------------------------------------------

def test_redis_keys_and_ttls() -> None:
    require_redis()

    async def main() -> dict[str, object]:
        async with isolated_aredis("gw") as (client, prefix):
            store = RedisStore(client, prefix)
            await store.record("r1", {"status": "queued"}, ttl_s=100)
            first = await client.ttl(f"{prefix}:requests:r1")
            await store.record("r1", {"status": "done"}, ttl_s=5000)
            second = await client.ttl(f"{prefix}:requests:r1")
            await store.count("chat", {"requests": 2})
            await store.take_token("team-a", rate_per_s=RATE, burst=BURST)
            bucket_ttl = await client.pttl(f"{prefix}:ratelimit:team-a")
            return {"first": first, "second": second, "hash": await client.hgetall(f"{prefix}:requests:r1"),
                    "counters": await client.hgetall(f"{prefix}:classes:chat"), "bucket_ttl": bucket_ttl,
                    "keys": sorted([k async for k in client.scan_iter(match=f"{prefix}:*")]), "prefix": prefix}

    got = run(main())
    prefix = got["prefix"]
    assert 95 <= got["first"] <= 100  # type: ignore[operator]
    assert 4995 <= got["second"] <= 5000  # type: ignore[operator]
    assert got["hash"] == {"status": "done"}
    assert got["counters"] == {"requests": "2"}
    # the bucket lives until it would be full again (one token at 20/s = 50 ms) plus a second
    assert 0 < got["bucket_ttl"] <= 1050  # type: ignore[operator]
    assert got["keys"] == [f"{prefix}:classes:chat", f"{prefix}:ratelimit:team-a", f"{prefix}:requests:r1"]


def test_redis_store_ping_is_false_when_unreachable() -> None:
    async def main() -> bool:
        store = RedisStore(connect("redis://127.0.0.1:1/0"), "adaserve-test-unreachable")
        try:
            return await store.ping()
        finally:
            await store.close()

    assert run(main()) is False
