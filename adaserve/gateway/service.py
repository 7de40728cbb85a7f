"""The gateway's parts in one object, built once from settings: SLO classes, keys, state, workers, routing.

``open`` is the request path up to the first token: admit, pick a worker, open its stream, and on a
failure before any token try another worker (``max_attempts`` in all). With prefix affinity on
(prefix_index.py), the request's block keys go to admission and are recorded on the worker it is sent to;
``answered`` records its prompt and answer there when it ends.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Coroutine, Sequence
from typing import Any

import httpx
from redis.exceptions import RedisError

from adaserve.contract.generate import GenerateRequest
from adaserve.contract.redis_settings import redacted
from adaserve.gateway import dispatch, redis_state
from adaserve.gateway.admission import Admission, Refused
from adaserve.gateway.directory import Directory, RedisSource, Source, StaticSource
from adaserve.gateway.errors import ApiError
from adaserve.gateway.keys import ApiKey, load_keys
from adaserve.gateway.metrics import GatewayMetrics
from adaserve.gateway.prefix_index import PrefixIndex, answered_text, block_keys, request_text
from adaserve.gateway.routing import Choice, Router
from adaserve.gateway.settings import GatewaySettings
from adaserve.gateway.slo import SloClass, load_catalog
from adaserve.gateway.state import MemoryStore, StateStore
from adaserve.gateway.tracker import Tracker

log = logging.getLogger(__name__)


class Gateway:
    def __init__(self, settings: GatewaySettings) -> None:
        """Reads the class and key files (ValueError with a message when they are wrong); connects nothing."""
        self.settings = s = settings
        self.catalog = load_catalog(file=s.slo_classes_file, inline=s.slo_classes, default=s.default_slo_class)
        self.keys = load_keys(s.api_keys_file, classes=list(self.catalog.classes))
        self.metrics = GatewayMetrics()
        self.metrics.declare(list(self.catalog.classes))
        self.router = Router(s.routing)
        # the read limit is only a backstop: dispatch enforces first_token_timeout_s on the first token and
        # token_timeout_s on each chunk after it, whatever the socket does
        timeout = httpx.Timeout(connect=s.connect_timeout_s, read=max(s.first_token_timeout_s, s.token_timeout_s),
                                write=10.0, pool=s.connect_timeout_s)
        # every call to a worker (generate, abort, status) carries the workers' token when they require one
        headers = {"Authorization": f"Bearer {s.worker_token.get_secret_value()}"} if s.worker_token else None
        self.http = httpx.AsyncClient(timeout=timeout, limits=httpx.Limits(max_connections=1024), headers=headers)
        self.store: StateStore
        source: Source
        if s.redis_url:
            client = redis_state.connect(s.redis_url, s.redis_auth)
            self.store = redis_state.RedisStore(client, s.redis_prefix)
            source = RedisSource(client, s.redis_prefix) if not s.workers else StaticSource(s.workers, self.http)
        else:
            if not s.workers:
                raise ValueError("give redis_url (workers register there) or workers (their URLs)")
            self.store = MemoryStore()
            source = StaticSource(s.workers, self.http)
        self.directory = Directory(source, refresh_s=s.refresh_s, suspect_s=s.suspect_s)
        # read at each scrape: what /readyz counts, whatever one request excludes
        self.metrics.workers.set_function(lambda: len(self.directory.usable()))
        # prefix affinity: in this process's memory (several replicas each keep their own: prefix_index.py)
        self.prefixes = PrefixIndex(s.prefix_index_blocks) if s.prefix_index_blocks > 0 else None
        self.admission = Admission(self.directory, self.router, self.catalog, s, self.metrics, self.prefixes)
        self._tasks: set[asyncio.Task[None]] = set()

    async def start(self) -> None:
        where = redacted(self.settings.redis_url) if self.settings.redis_url else "in-process state"
        log.info("gateway: %d SLO classes, API keys %s, %s, routing %s, admission %s", len(self.catalog.classes),
                 "on" if self.keys.enabled else "off", where, self.settings.routing, self.settings.admission)
        await self.directory.start()
        self.name_infeasible()

    def name_infeasible(self) -> list[str]:
        """Log, and return, the classes no usable worker can meet even for a lone request."""
        workers = self.directory.usable()
        bad = [c for c in self.catalog.classes.values() if self.admission.infeasible(c, workers)]
        treat = "refused" if self.settings.on_infeasible == "refuse" else "served best effort"
        for c in bad:
            log.warning("SLO class %r (%g ms per token) cannot be met by any worker even for a lone request: "
                        "its requests are %s", c.name, c.tpot_ms, treat)
        return [c.name for c in bad]

    def spawn(self, work: Coroutine[Any, Any, None]) -> None:
        """Run clean-up that must finish even when the request that started it was cancelled."""
        task = asyncio.create_task(work)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def stop(self, *, step_timeout_s: float = 5.0) -> None:
        """Finish the clean-ups, then close the worker list, the HTTP client and the store, each within
        ``step_timeout_s``: a close that hangs (a Redis connection stuck mid-command) must not hold SIGTERM's
        exit until the pod is killed; it is logged and left."""
        if self._tasks:
            await asyncio.wait(self._tasks, timeout=step_timeout_s)
        for name, close in (("worker list", self.directory.stop), ("HTTP client", self.http.aclose),
                            ("state store", self.store.close)):
            try:
                await asyncio.wait_for(close(), step_timeout_s)
            except TimeoutError:
                log.warning("closing the %s took over %.0f s at shutdown: left open", name, step_timeout_s)

    # ---- the request path -------------------------------------------------------------------------
    def check_model(self, model: str) -> str:
        """404 for a model no worker serves; 503 ``no_workers`` at once when no worker is registered at all (none
        ever was, or the last one's registration expired): nothing to wait for, and the model may well be right."""
        pinned = self.settings.model_name
        if pinned is not None and model != pinned:
            raise ApiError(404, f"model {model!r} not found; available: {pinned}", code="model_not_found",
                           param="model")
        if not self.directory.all():
            why = f" (the worker registry is unreachable: {self.directory.last_error})" \
                if self.directory.last_error else ""
            raise ApiError(503, f"no worker is registered to serve any model{why}; retry later", code="no_workers",
                           retry_after=self.settings.retry_after_s)
        known = [pinned] if pinned is not None else self.directory.models()
        if model not in known:
            raise ApiError(404, f"model {model!r} not found; available: {', '.join(known)}",
                           code="model_not_found", param="model")
        return model

    async def rate_limit(self, key: ApiKey | None) -> None:
        if key is None or key.rate_per_s is None:
            return
        try:
            wait = await self.store.take_token(key.name, rate_per_s=key.rate_per_s, burst=key.bucket_size)
        except (RedisError, OSError) as e:
            # fail closed by default: a limit nobody can check is not a limit (rate_limit_fail_open serves anyway)
            if self.settings.rate_limit_fail_open:
                log.warning("rate limit of %s not checked, state store unreachable: %s", key.name, e)
                return
            log.warning("rate-limited key %s refused, state store unreachable: %s", key.name, e)
            raise ApiError(503, f"the rate limit of API key {key.name!r} cannot be checked: the state store is "
                           "unreachable; retry later", code="state_store_unavailable",
                           retry_after=self.settings.retry_after_s) from None
        if wait > 0:
            self.metrics.rate_limited.labels(key.name).inc()
            raise ApiError(429, f"rate limit of API key {key.name!r} exceeded ({key.rate_per_s:g} requests/s, "
                           f"burst {key.bucket_size:g}); retry in {wait:.2f}s", code="rate_limit_exceeded",
                           retry_after=max(1, int(wait + 0.999)))

    def tracker(self, request_id: str, slo: SloClass, key: ApiKey | None, model: str) -> Tracker:
        return Tracker(self.store, self.metrics, self.settings.record_ttl_s, request_id, slo,
                       api_key=key.name if key else None, model=model)

    # ---- prefix affinity (prefix_index.py) -------------------------------------------------------
    def prefix_keys(self, request: GenerateRequest) -> list[int]:
        """The request's block keys; none without prefix affinity. Forgets the workers gone from the list."""
        if self.prefixes is None:
            return []
        self.prefixes.retain({w.id for w in self.directory.all()})
        text = request_text(request)
        return block_keys(text, block_chars=self.settings.prefix_block_chars) if text else []

    def routed(self, worker_id: str, choice: Choice, keys: Sequence[int]) -> None:
        """The request with ``keys`` was sent to the worker: it holds them now; count what the prefix did."""
        if self.prefixes is None or not keys:
            return
        self.prefixes.record(worker_id, keys)
        p, m = choice.prefix, self.metrics
        m.prefix_blocks.labels("sent").inc(len(keys))
        if p is None:
            return
        m.prefix_blocks.labels("matched").inc(p.matched)
        m.prefix_requests.labels("no_headroom" if p.passed_over else "hit" if p.matched else "miss").inc()
        if p.moved:
            m.prefix_moved.inc()

    def answered(self, worker_id: str, request: GenerateRequest, answer: str) -> None:
        """The request ended on the worker with ``answer``: its cache holds the prompt and the answer now."""
        if self.prefixes is None:
            return
        text = answered_text(request, answer)
        if text:
            self.prefixes.record(worker_id, block_keys(text, block_chars=self.settings.prefix_block_chars))

    async def open(self, request: GenerateRequest, slo: SloClass, track: Tracker) -> dispatch.Upstream:
        """Admit and start the request on a worker; another worker if one fails before its first token."""
        tried: set[str] = set()
        failures: list[str] = []
        model = track.model if self.settings.model_name is None else None
        code = "workers_failed"
        keys = self.prefix_keys(request)
        for _ in range(self.settings.max_attempts):
            try:
                admitted = await self.admission.admit(slo, model=model, exclude=tried, keys=keys)
            except Refused as e:
                if not failures:
                    await track.refused("shed" if e.reason != "no_workers" else "unavailable", e.reason)
                    raise
                break
            except asyncio.CancelledError:  # the client left while the request waited
                self.spawn(track.finished("aborted", None))
                raise
            w = admitted.choice.worker
            self.directory.acquire(w.id, slo.name)  # before any await: waiters woken now must see this load
            self.routed(w.id, admitted.choice, keys)  # before any await too: the next request sees where it went
            self.metrics.routed.labels(w.id, slo.name, self.router.policy).inc()
            self.metrics.admitted.labels(slo.name, "after_wait" if admitted.queued else "at_once",
                                         admitted.mode).inc()
            self.metrics.queue_wait.labels(slo.name).observe(admitted.waited_s)
            try:
                await track.routed(w.id, admitted)
                up = await dispatch.open_stream(self.http, w, request,
                                                first_token_timeout_s=self.settings.first_token_timeout_s,
                                                token_timeout_s=self.settings.token_timeout_s)
                track.decoding_since = self.directory.mark(w.id)  # the load it decodes under is measured from here
                return up
            except dispatch.WorkerFailed as e:
                self.worker_failed(w.id, slo.name, e)
                log.warning("request %s: %s; trying another worker", track.request_id, e)
                tried.add(w.id)
                failures.append(str(e))
                if not e.busy and all(x.id in tried for x in self.directory.usable(model)):
                    # the last live worker is gone (its registration outlives it by up to a TTL): say so now,
                    # 503 no_workers + Retry-After, rather than hold a request nothing was sent for worker_wait_s
                    code = "no_workers"
                    break
            except ApiError as e:  # the worker refused the request itself (its 4xx): the caller's to fix
                self.directory.release(w.id, slo.name)
                await track.finished("rejected", None, reason=e.message)
                raise
            except BaseException as e:  # cancelled (the client left), or a bug: the request still ends once
                self.directory.release(w.id, slo.name)
                self.spawn(track.finished("aborted" if isinstance(e, asyncio.CancelledError) else "failed", None))
                raise
        await track.finished("failed", None)
        raise ApiError(503, f"no worker could start the request: {'; '.join(failures)}", code=code,
                       retry_after=self.settings.retry_after_s)

    def worker_failed(self, worker_id: str, slo_class: str, e: dispatch.WorkerFailed) -> None:
        """A worker failed a request before its answer started: free its slot, and unless it was only busy
        (a refusal, a drain), keep requests away from it for a while."""
        self.directory.release(worker_id, slo_class)
        if not e.busy:
            self.directory.mark_failed(worker_id)

    def done(self, up: dispatch.Upstream, track: Tracker, outcome: str) -> None:
        """The request has left its worker: learn from its TPOT (if it finished normally), then release the slot."""
        wid = up.worker.id
        if outcome == "done" and track.decoding_since is not None:
            track.lesson = self.directory.learn(wid, track.slo.name, track.decoding_since,
                                                observed_ms=track.tpot_ms, tokens=track.tokens)
            self.metrics.correction.labels(wid).set(track.lesson.after)
        if track.ttft_ms is not None and track.waited_s is not None:
            self.directory.calibration.observe_ttft(track.slo.name, track.ttft_ms - 1e3 * track.waited_s)
        self.directory.release(wid, track.slo.name)
