"""The AdaServe artifact's workload format, read as the paper ran it (``adaserve bench --trace-json``).

The artifact (github.com/zikun-li/AdaServe-Artifact-Evaluation, ``exps/*/emission_*.json``) gives each
figure's workload as one JSON list, a request per object::

    {"emission_time_ms": 7799.03, "input_length": 810, "output_length": 256,
     "prompt": "Please generate a summarization ...", "slo_ratio": -150.0}

- Arrivals: ``emission_time_ms`` as given (ms from the run's start), not rescaled: the trace is the
  schedule. Its rate is ``n / window`` with the window ``[0, last emission]``.
- SLOs: a positive ``slo_ratio`` is relative, ``tpot = slo_ratio * baseline_tpot_ms`` (the artifact's
  ``BASELINE_LATENCY_PER_TOKEN_MS``, 30 ms for Llama-3.1-70B); a negative one is absolute,
  ``tpot = -slo_ratio`` ms. Either way times ``slo_scale`` (1 unless a sweep sets it).
- Classes: one per distinct ``slo_ratio``, named from its value: the paper's Table 2 class with that SLO
  when there is one (1.2x baseline = coding, 50 ms = chat, 150 ms = summarization; ``PAPER_CLASSES``),
  else ``"<r>x-baseline"`` or ``"<ms>ms"``.
- Output lengths: ``output_length`` tokens exactly, end-of-sequence ignored (``ignore_eos``), as the
  artifact runs them (its ``MAX_OUTPUT_LENGTH`` equals the traces' length). Ignoring EOS only removes
  a stop: every token up to the length is the one the model would have emitted anyway.
- Prompts: the text, tokenised by the served model's tokenizer (the bench cuts it from the left to the
  models' context; ``input_length``, the artifact's own count, is checked but not used).

Reading is pure and checks everything: any fault is a ``ValueError`` naming the file and the request.
"""

from __future__ import annotations

import hashlib
import json
import math
import numbers
from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from adaserve.bench.workload import PAPER_CLASSES, SLOClass, WorkloadRequest

FIELDS = ("emission_time_ms", "input_length", "output_length", "prompt", "slo_ratio")
# BASELINE_LATENCY_PER_TOKEN_MS of the artifact's Llama-3.1-70B runs (exps/test.sh, exps/fig8,9/run_llama_rps.sh)
ARTIFACT_BASELINE_TPOT_MS = 30.0


@dataclass(frozen=True)
class TraceRequest:
    """One request of the trace: when it arrives, its prompt, its fixed output length and its SLO."""

    emission_s: float
    input_length: int  # the artifact's own token count of the prompt (its tokenizer); not used
    output_length: int
    prompt: str
    slo_ratio: float  # > 0: x baseline TPOT; < 0: -TPOT in ms


@dataclass(frozen=True)
class EmissionTrace:
    """A trace file's requests, sorted by emission time, and what identifies the file."""

    name: str
    sha256: str
    requests: tuple[TraceRequest, ...]

    @property
    def window_s(self) -> float:
        """``[0, last emission]``: the span the requests arrive over."""
        return self.requests[-1].emission_s

    @property
    def rate_rps(self) -> float:
        """``n / window``; a trace whose requests all arrive at 0 counts as arriving within one second."""
        return len(self.requests) / (self.window_s if self.window_s > 0 else 1.0)


def _where(path: Path, i: int | None = None) -> str:
    return f"trace-json {path}" + ("" if i is None else f": request {i}")


def _number(x: Any) -> bool:
    return isinstance(x, numbers.Real) and not isinstance(x, bool) and math.isfinite(x)


def _integer(x: Any) -> bool:
    return isinstance(x, numbers.Integral) and not isinstance(x, bool)


def parse_request(obj: Any, where: str) -> TraceRequest:
    """One trace object, checked field by field (extra fields are ignored)."""
    if not isinstance(obj, Mapping):
        raise ValueError(f"{where}: expected a JSON object, got {type(obj).__name__}")
    missing = [f for f in FIELDS if f not in obj]
    if missing:
        raise ValueError(f"{where}: missing field(s) {missing}")
    t, n_in, n_out, prompt, r = (obj[f] for f in FIELDS)
    if not (_number(t) and t >= 0):
        raise ValueError(f"{where}: emission_time_ms must be a number >= 0, got {t!r}")
    if not (_integer(n_in) and n_in >= 0):
        raise ValueError(f"{where}: input_length must be an integer >= 0, got {n_in!r}")
    if not (_integer(n_out) and n_out >= 1):
        raise ValueError(f"{where}: output_length must be an integer >= 1, got {n_out!r}")
    if not (isinstance(prompt, str) and prompt):
        raise ValueError(f"{where}: prompt must be a non-empty string")
    if not (_number(r) and r != 0):
        raise ValueError(f"{where}: slo_ratio must be a non-zero number (> 0: x baseline, < 0: -ms), got {r!r}")
    return TraceRequest(float(t) / 1e3, int(n_in), int(n_out), prompt, float(r))


def read_emission_trace(path: Path) -> EmissionTrace:
    """Read and check a trace file; requests sorted by emission time (stable: ties keep the file's order)."""
    path = Path(path)
    try:
        blob = path.read_bytes()
    except OSError as e:
        raise ValueError(f"{_where(path)}: cannot read ({e.strerror or e})") from None
    try:
        data = json.loads(blob)
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"{_where(path)}: not JSON ({e})") from None
    if not isinstance(data, list) or not data:
        raise ValueError(f"{_where(path)}: expected a non-empty JSON list of requests with fields {', '.join(FIELDS)}")
    reqs = [parse_request(obj, _where(path, i)) for i, obj in enumerate(data)]
    reqs.sort(key=lambda r: r.emission_s)
    return EmissionTrace(path.name, hashlib.sha256(blob).hexdigest(), tuple(reqs))


# --- classes and the workload ---------------------------------------------------------------------------

def class_name(slo_ratio: float) -> str:
    """The class a ``slo_ratio`` stands for: the paper's Table 2 class with that SLO, else one named by it."""
    for c in PAPER_CLASSES:
        if (slo_ratio > 0 and c.tpot_multiplier == slo_ratio) or (slo_ratio < 0 and c.tpot_ms == -slo_ratio):
            return c.name
    return f"{slo_ratio:g}x-baseline" if slo_ratio > 0 else f"{-slo_ratio:g}ms"


def trace_classes(trace: EmissionTrace) -> dict[float, SLOClass]:
    """``slo_ratio`` -> its class, with its share of the trace's requests, in order of first appearance."""
    counts = Counter(r.slo_ratio for r in trace.requests)
    out: dict[float, SLOClass] = {}
    names: set[str] = set()
    for ratio, k in counts.items():
        name = class_name(ratio)
        if name in names:  # two values that print alike: keep them apart
            name = f"{name}({ratio!r})"
        names.add(name)
        out[ratio] = SLOClass(name, tpot_multiplier=ratio if ratio > 0 else None,
                              tpot_ms=-ratio if ratio < 0 else None, share=k / len(trace.requests))
    return out


@dataclass(frozen=True)
class TraceWorkload:
    """A trace as one point of ``adaserve bench``: the fields a sweep point reports, and its requests."""

    trace: EmissionTrace
    baseline_tpot_ms: float
    slo_scale: float = 1.0
    max_tokens_cap: int | None = None  # None: every output_length as given

    @property
    def rate(self) -> float:
        return self.trace.rate_rps

    @property
    def duration_s(self) -> float:
        return self.trace.window_s

    @property
    def mix(self) -> dict[str, float]:
        return {c.name: c.share for c in trace_classes(self.trace).values()}

    def build(self) -> list[WorkloadRequest]:
        """The trace's requests, in arrival order: fixed output lengths (capped by ``max_tokens_cap``), EOS ignored."""
        classes = trace_classes(self.trace)
        cap = self.max_tokens_cap
        return [WorkloadRequest(
            request_id=f"req-{i:05d}", arrival_s=r.emission_s, slo_class=classes[r.slo_ratio].name, prompt=r.prompt,
            max_tokens=r.output_length if cap is None else min(r.output_length, cap),
            tpot_slo_ms=classes[r.slo_ratio].tpot_slo_ms(self.baseline_tpot_ms, slo_scale=self.slo_scale),
            ignore_eos=True) for i, r in enumerate(self.trace.requests)]

    def describe(self) -> dict[str, Any]:
        """What the report records about the trace: the file, its size and rate, and each class's SLO."""
        cap = self.max_tokens_cap
        counts = Counter(r.slo_ratio for r in self.trace.requests)
        return {
            "file": self.trace.name, "sha256": self.trace.sha256, "requests": len(self.trace.requests),
            "window_s": self.trace.window_s, "rate_rps": self.trace.rate_rps,
            "baseline_tpot_ms": self.baseline_tpot_ms, "output_tokens": "fixed, end-of-sequence ignored",
            "max_tokens_cap": cap,
            "outputs_capped": 0 if cap is None else sum(r.output_length > cap for r in self.trace.requests),
            "classes": {c.name: {"slo_ratio": ratio, "requests": counts[ratio],
                                 "tpot_slo_ms": c.tpot_slo_ms(self.baseline_tpot_ms)}  # before any slo_scale
                        for ratio, c in trace_classes(self.trace).items()},
        }
