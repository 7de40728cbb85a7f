"""What a worker process serves with: the engine on its thread, the requests in flight, the worker's state.

    loading --models, profile, warm-up--> ready --SIGTERM--> draining --idle or grace--> stopped
       \\--build error--> failed                  (engine crash: failed)

The engine thread reports each request's tokens through a callback; the callback records metrics on
that thread and hands the event to the request's asyncio queue with ``call_soon_threadsafe``, so the
event loop never waits on the engine and the engine never waits on a slow client.
"""

from __future__ import annotations

import asyncio
import enum
import logging
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from adaserve.contract.generate import GenerateRequest
from adaserve.contract.registration import Profile, Registration
from adaserve.contract.slo import NORMAL_END
from adaserve.engine.build import BuiltEngine, EngineBuildError, build_engine
from adaserve.engine.engine import Engine, StepMetrics, TokenEvent
from adaserve.engine.loading.catalog import ModelNotFoundError, resolve_drafts
from adaserve.engine.loading.chat import ChatTemplateError, chat_text, has_chat_template
from adaserve.engine.loading.loader import freeze_long_lived, load_tokenizer, thaw, trim_heap
from adaserve.engine.loading.tokenizer import Tokenizer
from adaserve.engine.loop import EngineLoop
from adaserve.engine.model.quant import served_description
from adaserve.engine.request import Request
from adaserve.engine.speculation.grammar import GrammarSpec
from adaserve.engine.speculation.sampling import SamplingParams, skip_draws
from adaserve.engine.stop_strings import StopStringMatcher
from adaserve.redis_client import check_credentials
from adaserve.worker import published
from adaserve.worker.lone import Lone, lone_prompt_ids, measure_lone, serve_alone
from adaserve.worker.measurements import Measurements
from adaserve.worker.metrics import WorkerMetrics
from adaserve.worker.settings import WorkerSettings

if TYPE_CHECKING:
    from adaserve.worker.registry import Registry

log = logging.getLogger(__name__)


class State(enum.Enum):
    LOADING = "loading"
    READY = "ready"
    DRAINING = "draining"
    STOPPED = "stopped"
    FAILED = "failed"


class RequestRefused(Exception):
    """A request the worker will not take; ``status`` is the HTTP answer."""

    def __init__(self, status: int, message: str, *, retry_after: int | None = None, code: str | None = None,
                 param: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.retry_after = status, message, retry_after
        self.code, self.param = code, param  # OpenAI's error fields, for the OpenAI routes (routes/openai.py)


@dataclass
class InFlight:
    """One request between submission and its final event, as the event loop sees it."""

    req: Request
    slo_class: str
    tpot_slo_ms: float | None
    events: asyncio.Queue[TokenEvent] = field(default_factory=asyncio.Queue)
    met_slo: bool | None = None  # set on the engine thread just before the final event is queued
    done: bool = False
    resumed: int = 0  # the prompt's last tokens that an earlier worker sent as output (a continuation)
    resume_text: str | None = None  # the text already shown from them

    @property
    def prompt_tokens(self) -> int:
        """The client's prompt: a continuation's earlier output is not prompt."""
        return len(self.req.prompt_ids) - self.resumed

    @property
    def request_id(self) -> str:
        return self.req.request_id


def warm_up(engine: Engine) -> None:
    """One short speculative request end to end, so the first client does not pay for lazy set-up."""
    vocab = engine.target.vocab_size
    req = Request("warmup", [i % vocab for i in range(2, 18)], SamplingParams(max_tokens=8, ignore_eos=True))
    serve_alone(engine, req, "warming up")



MIN_TEMPERATURE = 1e-300  # smaller positive temperatures are served greedy (Runtime._params)


def longest_token(tokenizer: Any | None) -> int:
    """The most characters of text one token can stand for: its vocabulary string's length, which for byte-level
    and SentencePiece vocabularies is at least the characters it covers (0 when it cannot be read)."""
    if tokenizer is None:
        return 0
    try:
        return max((len(t) for t in tokenizer.get_vocab()), default=0)
    except Exception:  # a tokenizer without a readable vocabulary: no early check, the exact count still holds
        return 0


def _close_target(built: BuiltEngine) -> None:
    try:
        built.engine.target.close()
    except Exception as e:  # a rank already gone (the engine failed on it): nothing left to tell it
        log.warning("stopping the tensor-parallel ranks: %s", e)


class Runtime:
    def __init__(self, settings: WorkerSettings, *, metrics: WorkerMetrics | None = None) -> None:
        self.settings = settings
        self.metrics = metrics or WorkerMetrics(model_name=settings.served_model_name)
        self.measurements = Measurements()
        self.lone = Lone()  # each kind of request served alone at warm-up (measure_lone)
        self.state = State.LOADING
        self.failure: str | None = None
        self.built: BuiltEngine | None = None
        self.loop: EngineLoop | None = None
        self.tokenizer: Any | None = None  # the event loop's (the engine's too, unless transformers': _prepare)
        self.max_token_chars = 0  # the most characters one token spans (0: unknown, no early length check)
        self.active: dict[str, InFlight] = {}
        self.registry: Registry | None = None
        self.started_at = time.time()
        self._aloop: asyncio.AbstractEventLoop | None = None
        self._idle = asyncio.Event()
        self._idle.set()
        self._fatal: list[Callable[[], None]] = []
        self._watch: asyncio.Task[None] | None = None

    # ---- life cycle -----------------------------------------------------------------------------
    def on_fatal(self, callback: Callable[[], None]) -> None:
        """``callback`` runs (on the event loop) when the worker cannot go on: build failure, engine crash."""
        self._fatal.append(callback)

    async def startup(self) -> None:
        """Load, profile, warm up (in a thread), then start the engine loop and the registration."""
        self._aloop = asyncio.get_running_loop()
        if self.settings.redis_url:  # before minutes of loading: wrong credentials are a setting, not an outage
            refused = await check_credentials(self.settings.redis_url, self.settings.redis_auth)
            if refused:
                self._fail(f"{refused} (ADASERVE_REDIS_PASSWORD, ADASERVE_REDIS_USERNAME, ADASERVE_REDIS_TLS_CA_FILE)")
                return
        try:
            built, tokenizer, lone = await asyncio.to_thread(self._prepare)
        except (EngineBuildError, OSError, ValueError) as e:
            self._fail(f"cannot start the engine: {e}")
            return
        except Exception as e:  # anything else (a device error, a bug): still end the process, not hang
            log.exception("engine start-up crashed")
            self._fail(f"cannot start the engine: {type(e).__name__}: {e}")
            return
        if self.state is not State.LOADING:  # told to stop while loading
            return
        self.built, self.tokenizer = built, tokenizer
        self.max_token_chars = longest_token(tokenizer)
        self.lone = lone
        self.metrics.bind_engine(built.engine)
        for step, gained in lone.steps:  # the curve starts from the lone requests' iterations
            self.measurements.on_step(step, gained)
        built.engine.step_listeners.append(self._measure_step)
        self.metrics.declare_classes([self.settings.default_slo_class, *self.settings.slo_classes])
        self.metrics.declare_drafts(published.model_names(self.settings, built).drafts)
        frozen = freeze_long_lived()  # what loading and the warm-up left stays: no full collection walks it again
        self.loop = EngineLoop(built.engine).start()
        self.state = State.READY
        self.metrics.ready.set(1)
        self._watch = asyncio.create_task(self._watch_engine())
        if self.settings.redis_url:
            from adaserve.worker.registry import Registry  # redis-py only where there is a Redis (redis_client.py)

            self.registry = Registry(self.settings, self.registration)
            await self.registry.start()
        else:
            log.info("no Redis configured (ADASERVE_REDIS_URL / --redis-url): local mode, not registering")
        log.info("worker %s ready at %s (budget %d; weights %s; %d objects kept out of the garbage collector's "
                 "full collections)", self.settings.worker_id, self.settings.address, built.engine.cfg.budget,
                 served_description(built.engine.target.model), frozen)

    def _measure_step(self, m: StepMetrics) -> None:
        """Engine thread, after each iteration: the curve, with what each decoding request of a known class gained
        (its flight is still here: a finished request leaves ``active`` only later, on the event loop)."""
        accepted = {}
        for rid in m.per_request_verified:
            flight = self.active.get(rid)
            if flight is not None and flight.req.metrics.accepted_per_step:
                accepted[rid] = (flight.slo_class, flight.req.metrics.accepted_per_step[-1])
        self.measurements.on_step(m, accepted)

    def _prepare(self) -> tuple[BuiltEngine, Any | None, Lone]:
        s = self.settings
        if s.torch_threads:
            import torch

            torch.set_num_threads(s.torch_threads)
        try:
            # a GGUF file: converted once, here, to the weights it will be served in
            pair, extra = resolve_drafts(s.target, s.draft_refs, progress=False, weights=s.weights)
        except ModelNotFoundError as e:
            raise EngineBuildError(str(e)) from None
        built = build_engine(target=pair.target, draft=pair.draft, extra_drafts=extra, device=s.device,
                             policy=s.policy, budget=s.budget, attention=s.attention, kv_memory_mb=s.kv_memory_mb,
                             kv_memory_fraction=s.kv_memory_fraction,
                             force_profile=s.reprofile,
                             dtype=s.dtype, weights=s.weights, max_depth=s.max_depth, max_width=s.max_width,
                             progress=False, tensor_parallel_size=s.tensor_parallel_size,
                             prefix_caching=s.enable_prefix_caching, static_shapes=s.static_shapes)
        lone = Lone()
        if s.warmup:
            warm_up(built.engine)
            lone = measure_lone(built.engine, lone_prompt_ids(built.engine, built.tokenizer))
        # The event loop encodes and decodes while the engine thread decodes. adaserve's own tokenizer never
        # changes after loading (loading/tokenizer.py), so both share it. A transformers tokenizer may reset its
        # Rust tokenizer's truncation, padding or special-token splitting inside a call, and a call on another
        # thread at that moment fails ("Already borrowed"): the loop gets its own copy of one.
        tokenizer = built.tokenizer
        if tokenizer is not None and not isinstance(tokenizer, Tokenizer):
            tokenizer = load_tokenizer(pair.target)
        trim_heap()  # what the warm-up and any second tokenizer's loading freed (build_engine gave back the rest)
        return built, tokenizer, lone

    def _fail(self, message: str) -> None:
        log.error("%s", message)
        self.failure, self.state = message, State.FAILED
        self.metrics.ready.set(0)
        for cb in self._fatal:
            cb()

    async def _watch_engine(self) -> None:
        while self.loop is not None and self.state in (State.READY, State.DRAINING):
            if not self.loop.alive:
                self._fail(f"engine loop stopped: {self.loop.error!r}")
                return
            await asyncio.sleep(0.5)

    async def drain(self, grace_s: float) -> None:
        """Stop admitting, tell the gateway, let in-flight requests finish (up to ``grace_s``), abort the rest."""
        if self.state in (State.LOADING, State.READY):
            self.state = State.DRAINING
        self.metrics.ready.set(0)
        self.metrics.draining.set(1)
        log.warning("draining: %d request(s) in flight, grace %.0fs", len(self.active), grace_s)
        if self.registry is not None:
            await self.registry.publish()
        try:
            await asyncio.wait_for(self._idle.wait(), grace_s)
        except TimeoutError:
            log.warning("grace period over: aborting %d request(s)", len(self.active))
            for rid in list(self.active):
                self.abort(rid)
            try:
                await asyncio.wait_for(self._idle.wait(), 5.0)
            except TimeoutError:
                log.error("%d request(s) did not end after abort", len(self.active))

    async def shutdown(self) -> None:
        if self.state is not State.FAILED:
            self.state = State.STOPPED
        self.metrics.ready.set(0)
        if self._watch is not None:
            self._watch.cancel()
        if self.registry is not None:
            await self.registry.stop()
        if self.loop is not None:
            for rid in list(self.active):  # EngineLoop.stop finishes what it holds: make that quick
                self.loop.abort(rid)
            await asyncio.to_thread(self.loop.stop)
        if self.built is not None:  # a tensor-parallel target stops its other ranks (after the loop's last forward)
            await asyncio.to_thread(_close_target, self.built)
        thaw()  # startup's freeze: what it kept may be garbage now

    def registration(self) -> Registration:
        """What this worker publishes about itself now (Redis and ``GET /v1/status``)."""
        return published.registration(self.settings, status=self.state.value, built=self.built,
                                      active_classes=[f.slo_class for f in list(self.active.values())],
                                      metrics=self.metrics, measurements=self.measurements,
                                      lone=self.lone, started_at=self.started_at)

    def profile(self) -> Profile:
        """``GET /v1/profile``: budget, cost model, device and the lone request's measured TPOT."""
        if self.built is None:
            raise RuntimeError("no engine yet")
        return published.profile_info(self.built, self.settings, lone=self.lone)

    # ---- health -----------------------------------------------------------------------------------
    @property
    def live(self) -> bool:
        return self.state is not State.FAILED and (self.loop is None or self.loop.alive)

    @property
    def ready(self) -> bool:
        return self.state is State.READY and self.loop is not None and self.loop.alive

    # ---- requests -----------------------------------------------------------------------------------
    async def submit(self, body: GenerateRequest, *, header_class: str | None = None) -> InFlight:
        """Queue ``body``; raises RequestRefused with the HTTP status to answer.

        Each thing is checked once, where it is known: the body's shape by its schema at the HTTP edge (the
        route), this worker's settings and state here, and what only the engine knows (context, vocabulary,
        KV) by the engine itself when the request is submitted to it.
        """
        self._check_admitting()
        slo_class, tpot = self._slo(body, header_class)
        params = self._params(body)
        ids = await self._prompt_ids(body, params)
        resumed = list(body.resume_token_ids or ())
        rid = body.request_id or uuid.uuid4().hex
        req = Request(rid, ids + resumed, params, tpot_slo_ms=tpot, resumed=len(resumed), ttft_slo_ms=body.ttft_slo_ms)
        if resumed:  # checked first: the stop matcher decodes them, and an id past the vocabulary is a 400 then
            self._check_servable(req)
            self._resume(req, resumed)
        if params.grammar is not None:
            await self._start_grammar(req)
        self._check_admitting()  # again: the state may have changed while tokenizing
        if rid in self.active:
            raise RequestRefused(409, f"request_id {rid!r} is already in flight")
        if len(self.active) >= self.settings.max_active_requests:
            self.metrics.rejected.labels("overloaded").inc()
            raise RequestRefused(503, f"overloaded: {len(self.active)} requests in flight",
                                 retry_after=self.settings.retry_after_s)
        flight = InFlight(req, slo_class, tpot, resumed=len(resumed), resume_text=body.resume_text)
        self.active[rid] = flight
        self._idle.clear()
        self.metrics.active.labels(slo_class).inc()
        self.metrics.track(rid, slo_class)
        try:
            self._engine_loop().submit(req, lambda ev: self._on_event(flight, ev))
        except ValueError as e:  # Engine.check_request: this engine could never serve it
            self.metrics.forget(rid)
            self._forget(flight)
            self.metrics.rejected.labels("invalid").inc()
            raise RequestRefused(400, str(e)) from None
        except RuntimeError as e:  # the loop is stopping
            self.metrics.forget(rid)
            self._forget(flight)
            raise RequestRefused(503, str(e), retry_after=self.settings.retry_after_s) from None
        return flight

    def abort(self, request_id: str) -> bool:
        flight = self.active.get(request_id)
        if flight is None or self.loop is None:
            return False
        self.loop.abort(request_id)
        return True

    def _check_servable(self, req: Request) -> None:
        """Engine.check_request ahead of the submission (it runs again there): 400 naming what this engine
        could never serve."""
        engine = self.built.engine if self.built is not None else None
        if engine is None:
            return
        try:
            engine.check_request(req)
        except ValueError as e:
            self.metrics.rejected.labels("invalid").inc()
            raise RequestRefused(400, str(e)) from None

    def _resume(self, req: Request, earlier: list[int]) -> None:
        """Make ``req`` go on as if it had emitted ``earlier`` itself (they end its prompt): its random stream
        starts past them, and a stop string that began in them is still found when a new token completes it.
        The stop matcher is primed here with this loop's tokenizer, then handed the engine thread's."""
        skip_draws(req.generator, len(earlier))
        engine = self.built.engine if self.built is not None else None
        if req.params.stop and self.tokenizer is not None and engine is not None and engine.detokenize is not None:
            matcher = StopStringMatcher(req.params.stop, self.decode)
            matcher.first_stop(earlier)
            matcher.decode = engine.detokenize
            req.stop_matcher = matcher

    async def _start_grammar(self, req: Request) -> None:
        """Compile the request's grammar off the event loop (a large schema takes a while); 400 when it is invalid
        or this model has no tokenizer (Engine.start_grammar)."""
        engine = self.built.engine if self.built is not None else None
        if engine is None:
            raise RequestRefused(503, "the engine is not ready", retry_after=self.settings.retry_after_s)
        try:
            await asyncio.to_thread(engine.start_grammar, req)
        except ValueError as e:
            self.metrics.rejected.labels("invalid").inc()
            raise RequestRefused(400, str(e), param="response_format") from None

    def token_text(self, token: int) -> str | None:
        """One token's text, special tokens included (a logprobs entry's ``token``); None without a tokenizer."""
        return self.tokenizer.decode([token]) if self.tokenizer is not None else None

    def decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True) if self.tokenizer is not None else ""

    def _engine_loop(self) -> EngineLoop:
        if self.loop is None:
            raise RuntimeError("the engine loop is not running")
        return self.loop

    def _check_admitting(self) -> None:
        if self.state is not State.READY or self.loop is None or not self.loop.alive:
            reason = "draining" if self.state is State.DRAINING else "not_ready"
            self.metrics.rejected.labels(reason).inc()
            raise RequestRefused(503, f"worker is {self.state.value}, not taking requests",
                                 retry_after=self.settings.retry_after_s)

    def _slo(self, body: GenerateRequest, header_class: str | None) -> tuple[str, float | None]:
        classes = self.settings.slo_classes
        name = body.slo_class or header_class or self.settings.default_slo_class
        if classes and name not in classes and name != self.settings.default_slo_class:
            raise RequestRefused(422, f"slo_class: unknown class {name!r}; known: {sorted(classes)}")
        tpot = body.tpot_slo_ms if body.tpot_slo_ms is not None else classes.get(name)
        return name, tpot

    def _params(self, body: GenerateRequest) -> SamplingParams:
        max_tokens = body.max_tokens if body.max_tokens is not None else self.settings.default_max_tokens
        if max_tokens > self.settings.max_tokens_limit:
            raise RequestRefused(422, f"max_tokens: must be <= {self.settings.max_tokens_limit}, got {max_tokens}")
        if body.stops and self.tokenizer is None:
            raise RequestRefused(400, "stop: stop strings need a tokenizer, and this model has none")
        if body.min_tokens > max_tokens:
            raise RequestRefused(400, f"min_tokens: must be <= max_tokens ({max_tokens}), got {body.min_tokens}")
        # the schema already holds every other field to SamplingParams' own ranges: nothing else can be refused.
        # Below MIN_TEMPERATURE, logits / temperature overflows float64 and the probabilities turn NaN (5e-324 gave
        # the last token of the vocabulary every time); the distribution there is the argmax anyway: greedy.
        temperature = body.temperature if body.temperature >= MIN_TEMPERATURE else 0.0
        grammar = None if body.structured_outputs is None else GrammarSpec(*body.structured_outputs.spec())
        if grammar is not None and body.min_tokens:
            raise RequestRefused(400, "min_tokens: cannot be combined with structured output")
        return SamplingParams(max_tokens=max_tokens, temperature=temperature, top_p=body.top_p, top_k=body.top_k,
                              seed=body.seed, stop=body.stops, stop_token_ids=tuple(body.stop_token_ids),
                              ignore_eos=body.ignore_eos, min_tokens=body.min_tokens,
                              logit_bias=tuple((int(t), b) for t, b in body.logit_bias.items()),
                              presence_penalty=body.presence_penalty, frequency_penalty=body.frequency_penalty,
                              repetition_penalty=body.repetition_penalty, grammar=grammar, logprobs=body.logprobs)

    async def _prompt_ids(self, body: GenerateRequest, params: SamplingParams) -> list[int]:
        if body.prompt_token_ids is not None:
            return list(body.prompt_token_ids)
        field = "messages" if body.messages is not None else "prompt"
        if self.tokenizer is None:
            raise RequestRefused(400, f"{field}: this model has no tokenizer; send prompt_token_ids")
        if body.messages is None:
            text, special = body.prompt or "", True
        else:
            try:
                text = chat_text(self.tokenizer, [m.model_dump(exclude_none=True) for m in body.messages])
            except ChatTemplateError as e:  # a template that rejects these turns (say, no system role)
                raise RequestRefused(400, f"messages: {e}") from None
            special = not has_chat_template(self.tokenizer)  # a template writes its own special tokens
        self._check_length(field, text, params)
        ids = await asyncio.to_thread(self.tokenizer.encode, text, add_special_tokens=special)
        return list(ids)

    def _check_length(self, field: str, text: str, params: SamplingParams) -> None:
        """Refuse, without tokenising it, a text too long to fit the context whatever its tokens: no token spans
        more than ``max_token_chars`` characters, so a text longer than that many per free position cannot fit.
        What passes is tokenised (a bounded amount of work) and the engine checks the exact count."""
        if self.built is None or not self.max_token_chars:
            return
        engine = self.built.engine
        depth = 0 if engine.policy.max_shape is None else engine.policy.max_shape.depth
        room = engine.max_context - params.max_tokens - depth - 1  # prompt tokens that can fit
        if len(text) > max(room, 0) * self.max_token_chars:
            self.metrics.rejected.labels("invalid").inc()
            raise RequestRefused(400, f"{field}: {len(text)} characters cannot fit the model context of "
                                 f"{engine.max_context} tokens with max_tokens {params.max_tokens} (at most "
                                 f"{max(room, 0)} prompt tokens, a token covers at most {self.max_token_chars} "
                                 "characters)")

    # ---- events (engine thread -> event loop) -------------------------------------------------------
    def _on_event(self, flight: InFlight, ev: TokenEvent) -> None:
        self.metrics.on_tokens(flight.request_id, len(ev.new_tokens))
        if ev.finished:  # the engine is done with the request: its metrics are final
            flight.met_slo = self.metrics.on_finished(flight.req, slo_class=flight.slo_class,
                                                      tpot_slo_ms=flight.tpot_slo_ms,
                                                      ttft_slo_ms=flight.req.ttft_slo_ms, reason=ev.finish_reason)
            if ev.finish_reason in NORMAL_END:  # an abort says nothing about how fast requests are served
                m = flight.req.metrics
                self.measurements.on_finished(flight.slo_class, met=flight.met_slo, tpot_ms=m.tpot_ms,
                                              ttft_ms=m.ttft_ms, accepted=m.accepted_per_step)
        try:
            if self._aloop is not None:
                self._aloop.call_soon_threadsafe(self._deliver, flight, ev)
        except RuntimeError:  # the event loop has closed: nobody is listening any more
            pass

    def _deliver(self, flight: InFlight, ev: TokenEvent) -> None:
        flight.events.put_nowait(ev)
        if ev.finished:
            self._forget(flight)

    def _forget(self, flight: InFlight) -> None:
        flight.done = True
        if self.active.get(flight.request_id) is flight:
            del self.active[flight.request_id]
            self.metrics.active.labels(flight.slo_class).dec()
        if not self.active:
            self._idle.set()
