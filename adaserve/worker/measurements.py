"""What a worker measures while it serves, published in its registration (``measured``) for the gateway to
predict each class's TPOT from (docs/gateway.md "Routing and admission"):

- its iteration-time curve: for each number of requests an iteration held (decoding + prefilling), the mean
  wall time of its last ``steps_per_point`` such iterations in which some request decoded (an iteration that
  only prefills is in nobody's TPOT: a lone request's prefill is its TTFT, so counting it would price a lone
  request's tokens at its prompt's cost), the tree tokens they verified and the tokens a
  decoding request gained per iteration (accepted draft tokens + the bonus token); and per SLO class, over its
  last ``decodes_per_class`` decoding requests in iterations of that size, the same tokens (classes accept
  very differently: a summary of code far less than a chat answer) and the wall time of those iterations (a
  class's context is part of what its iterations cost: a lone summary's ~600 tokens more than a lone question's);
- per SLO class, over its last ``finished_per_class`` finished requests: TPOT, TTFT (mean and least),
  attainment, and draft tokens accepted per verification.

Fed on the engine thread (``on_step`` is an ``Engine.step_listeners`` entry; ``on_finished`` runs when a
request ends), read on the event loop (``measured``): windows are copied under a lock, summarised outside it.
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from adaserve.contract.registration import ClassRecent, ClassTokens, IterationPoint, Measured
from adaserve.engine.engine import StepMetrics


@dataclass(frozen=True)
class Step:
    """One iteration as the curve keeps it."""

    ms: float
    verified: int
    gained: int  # tokens decoding requests gained: accepted draft tokens + one bonus token each
    decoding: int


@dataclass(frozen=True)
class Finished:
    """One finished request as its class's window keeps it."""

    met: bool
    tpot_ms: float | None
    ttft_ms: float | None
    accepted: tuple[int, ...]  # draft tokens accepted per verification


def _mean(xs: Sequence[float]) -> float | None:
    return sum(xs) / len(xs) if xs else None


def point(requests: int, steps: Sequence[Step], gained: Mapping[str, Sequence[tuple[int, float]]]) -> IterationPoint:
    """The curve's point at ``requests`` from its recent iterations (at least one) and, per class, the tokens its
    recent decoding requests gained in iterations of that size and those iterations' wall time, one (tokens, ms)
    pair per decode (each class its own window, so that one class's burst does not erase another's figure)."""
    decoding = sum(s.decoding for s in steps)
    return IterationPoint(requests=requests, steps=len(steps),
                          iteration_ms=sum(s.ms for s in steps) / len(steps),
                          tokens_verified=sum(s.verified for s in steps) / len(steps),
                          tokens_per_request=sum(s.gained for s in steps) / decoding if decoding else None,
                          tokens_by_class={c: ClassTokens(tokens=sum(k for k, _ in g) / len(g), decodes=len(g),
                                                          iteration_ms=sum(ms for _, ms in g) / len(g))
                                           for c, g in sorted(gained.items()) if g})


def class_recent(done: Sequence[Finished]) -> ClassRecent:
    """A class's recent figures from its last finished requests (at least one)."""
    met = sum(f.met for f in done)
    accepted = [a for f in done for a in f.accepted]
    return ClassRecent(finished=len(done), met=met, attainment=met / len(done),
                       tpot_ms=_mean([f.tpot_ms for f in done if f.tpot_ms is not None]),
                       ttft_ms=_mean([f.ttft_ms for f in done if f.ttft_ms is not None]),
                       min_ttft_ms=min((f.ttft_ms for f in done if f.ttft_ms is not None), default=None),
                       accepted_per_verification=_mean(accepted))


class Measurements:
    def __init__(self, *, steps_per_point: int = 32, finished_per_class: int = 32, decodes_per_class: int = 64) -> None:
        if steps_per_point < 1 or finished_per_class < 1 or decodes_per_class < 1:
            raise ValueError("measurement windows must hold at least one entry")
        self.steps_per_point, self.finished_per_class = steps_per_point, finished_per_class
        self.decodes_per_class = decodes_per_class
        self._lock = threading.Lock()
        self._steps: dict[int, deque[Step]] = {}
        # requests per iteration -> class -> (tokens gained, the iteration's ms) per decode
        self._gained: dict[int, dict[str, deque[tuple[int, float]]]] = {}
        self._classes: dict[str, deque[Finished]] = {}

    def on_step(self, m: StepMetrics, accepted: Mapping[str, tuple[str, int]] | None = None) -> None:
        """One iteration; ``accepted``: request id -> (its SLO class, draft tokens it had accepted) for the
        decoding requests whose class is known."""
        n = m.n_decode + m.n_prefill
        if m.n_decode <= 0 or not m.t_step_s > 0:  # prefill only (or nothing): in no request's TPOT
            return
        step = Step(1e3 * m.t_step_s, m.tokens_verified, m.tokens_accepted + m.n_decode, m.n_decode)
        with self._lock:
            self._steps.setdefault(n, deque(maxlen=self.steps_per_point)).append(step)
            by_class = self._gained.setdefault(n, {})
            for name, k in (accepted or {}).values():
                by_class.setdefault(name, deque(maxlen=self.decodes_per_class)).append((k + 1, step.ms))

    def on_finished(self, slo_class: str, *, met: bool, tpot_ms: float | None, ttft_ms: float | None,
                    accepted: Sequence[int]) -> None:
        done = Finished(met, tpot_ms, ttft_ms, tuple(accepted))
        with self._lock:
            self._classes.setdefault(slo_class, deque(maxlen=self.finished_per_class)).append(done)

    def measured(self) -> Measured:
        with self._lock:
            steps = {n: list(q) for n, q in self._steps.items()}
            gained = {n: {c: list(q) for c, q in by.items()} for n, by in self._gained.items()}
            classes = {c: list(q) for c, q in self._classes.items()}
        return Measured(iterations=[point(n, steps[n], gained.get(n, {})) for n in sorted(steps)],
                        classes={c: class_recent(done) for c, done in sorted(classes.items())})
