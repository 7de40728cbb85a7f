"""service.py: the Gateway object as built from settings (no worker, no Redis: in-process state)."""

from __future__ import annotations

from adaserve.gateway.service import Gateway
from adaserve.gateway.settings import GatewaySettings
from adaserve.gateway.slo import DEFAULT_CLASSES
from tests.gateway.unit.fakes import FakeSource, registration
from tests.gateway.unit.helpers import run


def workers_gauge(gw: Gateway) -> float | None:
    return gw.metrics.registry.get_sample_value("adaserve_gateway_workers")


def test_workers_gauge_counts_the_usable_workers_not_one_requests_view() -> None:
    gw = Gateway(GatewaySettings(workers=["http://x"], queue_timeout_s=0.0))
    source = FakeSource([registration("a"), registration("b"), registration("c", status="loading")])
    gw.directory.source = source
    chat = DEFAULT_CLASSES[1]

    async def main() -> list[float | None]:
        seen = [workers_gauge(gw)]  # nothing read yet
        await gw.directory.refresh()
        seen.append(workers_gauge(gw))
        # a retry that excludes a worker sees one fewer; the fleet did not shrink
        admitted = await gw.admission.admit(chat, model=None, exclude={"a"})
        assert admitted.choice.worker.id == "b"
        seen.append(workers_gauge(gw))
        gw.directory.mark_failed("a")  # suspected: not routable until suspect_s has passed
        seen.append(workers_gauge(gw))
        source.docs = [registration("b"), registration("c"), registration("d")]  # c ready, d new
        await gw.directory.refresh()
        seen.append(workers_gauge(gw))
        await gw.http.aclose()
        return seen

    assert run(main()) == [0, 2, 2, 1, 3]


def test_rate_limit_fails_closed_when_the_state_store_is_unreachable() -> None:
    """Nothing listens at the Redis address: a rate-limited key gets 503 state_store_unavailable (a limit nobody
    can check is no limit) unless rate_limit_fail_open; a key without a limit never needs the store."""
    import pytest

    from adaserve.gateway.errors import ApiError
    from adaserve.gateway.keys import ApiKey

    limited = ApiKey(key="sk-limited-0123", name="limited", ratePerS=5)
    free = ApiKey(key="sk-free-012345", name="free")

    def gateway(**kw: object) -> Gateway:
        return Gateway(GatewaySettings(redis_url="redis://127.0.0.1:1/0", workers=["http://x"], **kw))

    async def check(gw: Gateway, key: ApiKey) -> None:
        try:
            await gw.rate_limit(key)
        finally:
            await gw.http.aclose()

    closed = gateway()
    with pytest.raises(ApiError) as refused:
        run(check(closed, limited))
    assert (refused.value.status, refused.value.code, refused.value.retry_after) == (503, "state_store_unavailable", 1)
    assert "limited" in refused.value.message
    run(check(gateway(), free))
    run(check(gateway(rate_limit_fail_open=True), limited))  # the documented switch: served unchecked


def test_stop_is_bounded_when_a_close_hangs() -> None:
    """A close that never returns (seen once as a gateway stuck at 'Waiting for application shutdown' until
    SIGKILL) is given up after its step timeout, and the other closes still run."""
    import asyncio
    import time

    gw = Gateway(GatewaySettings(workers=["http://x"]))
    closed: list[str] = []

    async def hang() -> None:
        await asyncio.sleep(3600)

    async def store_close() -> None:
        closed.append("store")

    gw.directory.source.close = hang  # type: ignore[method-assign]
    gw.store.close = store_close  # type: ignore[method-assign]

    async def main() -> float:
        t0 = time.perf_counter()
        await gw.stop(step_timeout_s=0.2)
        return time.perf_counter() - t0

    took = run(main())
    assert took < 2.0 and closed == ["store"]


def test_every_call_to_a_worker_carries_the_workers_token_when_it_has_one() -> None:
    """The one HTTP client the gateway calls workers with (generate, abort, /v1/status) sends the token set as
    ADASERVE_GATEWAY_WORKER_TOKEN; without it, no Authorization header at all."""
    with_token = Gateway(GatewaySettings(workers=["http://127.0.0.1:9"], worker_token="tok-1"))
    without = Gateway(GatewaySettings(workers=["http://127.0.0.1:9"]))
    try:
        assert with_token.http.headers["authorization"] == "Bearer tok-1"
        assert with_token.http.build_request("POST", "http://w/v1/generate").headers["authorization"] == "Bearer tok-1"
        assert "authorization" not in without.http.headers
        assert "tok-1" not in repr(with_token.settings)
    finally:
        run(with_token.http.aclose())
        run(without.http.aclose())


def test_redis_auth_settings_reach_the_state_store_client() -> None:
    g = Gateway(GatewaySettings(redis_url="redis://127.0.0.1:9/0", redis_password="pw-2", redis_username="svc"))
    try:
        kwargs = g.store.redis.connection_pool.connection_kwargs  # type: ignore[attr-defined]
        assert (kwargs["password"], kwargs["username"]) == ("pw-2", "svc")
    finally:
        run(g.http.aclose())
