"""SLO classes as every service names them, and the one rule for whether a request met its SLO."""

from __future__ import annotations

import re
from typing import Annotated

from pydantic import AfterValidator, WithJsonSchema

# What a request may name (body or X-SLO-Class header), a worker's ADASERVE_SLO_CLASSES key, a gateway
# class and the CRD's sloClasses[].name (the CRD's schema repeats the pattern: crds/).
CLASS_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$")


def _class_name(v: str) -> str:
    if not CLASS_NAME.match(v):
        raise ValueError(f"must match {CLASS_NAME.pattern}")
    return v


SloClassName = Annotated[str, AfterValidator(_class_name),
                         WithJsonSchema({"type": "string", "pattern": CLASS_NAME.pattern})]

# How a request can end (the engine's words, passed on by the worker's final chunk and the gateway's record).
NORMAL_END = ("stop", "length")
FAILED_END = ("abort", "error")


def ttft_ms(arrival_s: float, first_token_s: float | None) -> float | None:
    """Time to first token in ms; None before the first token."""
    return None if first_token_s is None else 1e3 * (first_token_s - arrival_s)


def mean_tpot_ms(first_token_s: float | None, last_token_s: float | None, tokens: int) -> float | None:
    """Mean time per output token after the first, ``(t_last - t_first) / (n - 1)`` in ms; None below two
    tokens (one token has no per-token time). Times in seconds on any one clock."""
    if first_token_s is None or last_token_s is None or tokens < 2:
        return None
    return 1e3 * (last_token_s - first_token_s) / (tokens - 1)


def slo_met(finish: str | None, *, tpot_ms: float | None, ttft_ms: float | None,
            tpot_target_ms: float | None, ttft_target_ms: float | None = None) -> bool:
    """A request meets its SLO when it ended normally (``stop`` or ``length``), its mean TPOT (time per
    output token after the first) is within the TPOT target and, if there is a TTFT target, its time to
    first token is within that too.

    A missing target constrains nothing, and a missing measurement misses nothing: a one-token answer has
    no TPOT. The worker and the gateway both judge by this; each measures from where it stands (the
    gateway's TTFT includes its own queue and the network), so their verdicts can differ near a target.
    """
    if finish not in NORMAL_END:
        return False
    return _within(tpot_ms, tpot_target_ms) and _within(ttft_ms, ttft_target_ms)


def _within(value: float | None, target: float | None) -> bool:
    return target is None or value is None or value <= target
