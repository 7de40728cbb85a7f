"""SLO classes: what a request's class promises, and how a request finds its class.

A class is ``{name, tpotMs, ttftMs?, priority, sheddable?}`` (the AdaServeDeployment's ``sloClasses``;
snake_case keys work too). Priority below 0 means sheddable (the llm-d convention): under overload
those requests are refused first.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, TypeAdapter, ValidationError

from adaserve.contract.slo import SloClassName
from adaserve.gateway.prediction import lone_tpot_ms
from adaserve.gateway.view import WorkerView


class SloClass(BaseModel):
    model_config = ConfigDict(extra="forbid", populate_by_name=True, frozen=True)

    name: SloClassName
    tpot_ms: float = Field(alias="tpotMs", gt=0, allow_inf_nan=False)
    ttft_ms: float | None = Field(None, alias="ttftMs", gt=0, allow_inf_nan=False)
    priority: int = 0
    sheddable_flag: bool | None = Field(None, alias="sheddable")

    @property
    def sheddable(self) -> bool:
        return self.sheddable_flag if self.sheddable_flag is not None else self.priority < 0

    def public(self) -> dict[str, Any]:
        return {"name": self.name, "tpot_ms": self.tpot_ms, "ttft_ms": self.ttft_ms, "priority": self.priority,
                "sheddable": self.sheddable}


# The README's three applications at a GPU's absolute targets: a gateway given no classes serves these.
DEFAULT_CLASSES = (
    SloClass(name="coding", tpot_ms=40, ttft_ms=2000, priority=10),
    SloClass(name="chat", tpot_ms=50, priority=0),
    SloClass(name="summarization", tpot_ms=150, priority=-1),
)

# `adaserve up` with no classes scales the same three to the machine it runs on: multiples of the per-token
# latency a lone request gets there at warm-up (AdaServe Table 2 sets coding at ~1.2x on a GPU). On the 2-core
# CPU a lone HumanEval request later took 1.32x and 1.43x the warm-up's coding figure (loadtest runs 4 and 5,
# docs/results/loadtest-cpu-smollm2-admission-{4,5}.json, `sequential`): at 1.5x coding sat at the edge of its
# own feasibility (0.4 attained alone in run 5), so coding gets 2x; still the tightest class.
LOCAL_MULTIPLIERS = {"coding": 2.0, "chat": 2.5, "summarization": 6.0}


def local_classes(lone_tpot_ms: float, by_class: Mapping[str, float] | None = None) -> list[SloClass]:
    """DEFAULT_CLASSES with TPOT targets at ``LOCAL_MULTIPLIERS`` x the per-token latency a lone request of that
    class gets here (``by_class``, measured on a prompt shaped like the class's traffic), else x ``lone_tpot_ms``."""
    figures = {c.name: (by_class or {}).get(c.name, lone_tpot_ms) for c in DEFAULT_CLASSES}
    bad = {name: v for name, v in figures.items() if not v > 0}
    if bad:
        raise ValueError(f"per-token latency must be positive, got {bad}")
    return [c.model_copy(update={"tpot_ms": float(round(LOCAL_MULTIPLIERS[c.name] * figures[c.name]))})
            for c in DEFAULT_CLASSES]


def feasibility(tpot_ms: float, *, unloaded_tpot_ms: float | None, max_depth: int | None,
                lone_tpot_ms: float | None = None) -> str | None:
    """How a lone request of this class fares on a worker (None: the worker has not said):

    - ``"infeasible"``: the TPOT a lone request gets there, as measured (``lone_tpot_ms``), is above the
      target; or, without a measurement, ``tpot < t1 / (D + 1)``, beyond even a fully accepted tree;
    - ``"plain"``: plain decoding meets it (``tpot >= t1``, t1 the unloaded per-token latency);
    - ``"speculation"``: only speculation can: each iteration costs at least t1 and yields at most D + 1
      tokens, so ``t1 / (D + 1) <= tpot < t1`` needs about ``t1 / tpot - 1`` accepted tokens per step.
    """
    if lone_tpot_ms is not None and tpot_ms < lone_tpot_ms:
        return "infeasible"
    if unloaded_tpot_ms is None:
        return None if lone_tpot_ms is None else ("plain" if tpot_ms >= lone_tpot_ms else "infeasible")
    if tpot_ms >= unloaded_tpot_ms:
        return "plain"
    if (max_depth and tpot_ms >= unloaded_tpot_ms / (max_depth + 1)) or lone_tpot_ms is not None:
        return "speculation"
    return "infeasible"


_RANK = {"plain": 0, "speculation": 1, "infeasible": 2}


def class_feasibility(c: SloClass, workers: list[WorkerView], *, margin: float = 0.0) -> dict[str, Any]:
    """``feasibility`` of the class on its best worker, and the TPOT a lone request of it gets there (as this
    gateway predicts it: routing.lone_tpot_ms); nulls until a worker reports. ``margin``: admission's, so that
    a lone TPOT within the target but not within the margin counts as infeasible, as admission judges it."""
    found = []
    for w in workers:
        lone = lone_tpot_ms(w, c.name)
        judged = None if lone is None else lone / (1.0 - margin)
        f = feasibility(c.tpot_ms, unloaded_tpot_ms=w.unloaded_tpot_ms, max_depth=w.draft_steps, lone_tpot_ms=judged)
        if f is not None:
            found.append((_RANK[f], lone if lone is not None else math.inf, f))
    if not found:
        return {"feasibility": None, "lone_tpot_ms": None}
    _, lone, f = min(found)
    return {"feasibility": f, "lone_tpot_ms": None if math.isinf(lone) else round(lone, 1)}


class UnknownClass(Exception):
    def __init__(self, name: str, known: list[str]) -> None:
        super().__init__(f"unknown SLO class {name!r}; valid classes: {', '.join(known)}")
        self.name, self.known = name, known


@dataclass(frozen=True)
class SloCatalog:
    classes: dict[str, SloClass]
    default: str

    def __post_init__(self) -> None:
        if not self.classes:
            raise ValueError("at least one SLO class is needed")
        if self.default not in self.classes:
            raise ValueError(f"default SLO class {self.default!r} is not one of {', '.join(self.classes)}")

    @classmethod
    def of(cls, classes: list[SloClass], default: str | None = None) -> SloCatalog:
        names = [c.name for c in classes]
        dupes = sorted({n for n in names if names.count(n) > 1})
        if dupes:
            raise ValueError(f"SLO class names must be unique; repeated: {', '.join(dupes)}")
        return cls({c.name: c for c in classes}, default or (names[0] if names else ""))

    def resolve(self, *, header: str | None, body: str | None, key_default: str | None) -> SloClass:
        """Header, then body field, then the API key's default, then the configured default."""
        name = header or body or key_default or self.default
        if name not in self.classes:
            raise UnknownClass(name, list(self.classes))
        return self.classes[name]

    def tpot_of(self, name: str) -> float | None:
        c = self.classes.get(name)
        return c.tpot_ms if c else None


_CLASS_LIST = TypeAdapter(list[SloClass])


def parse_classes(text: str, *, source: str) -> list[SloClass]:
    """A JSON list of classes; ValueError naming the source and the bad field."""
    try:
        raw = json.loads(text)
    except json.JSONDecodeError as e:
        raise ValueError(f"{source}: not JSON: {e}") from None
    if isinstance(raw, dict) and "sloClasses" in raw:  # a whole spec fragment pasted in
        raw = raw["sloClasses"]
    try:
        return _CLASS_LIST.validate_python(raw)
    except ValidationError as e:
        first = e.errors()[0]
        where = ".".join(str(p) for p in first["loc"])
        raise ValueError(f"{source}: [{where}] {first['msg']}") from None


def load_catalog(*, file: Path | None, inline: str | None, default: str | None) -> SloCatalog:
    if file is not None:
        try:
            text = file.read_text()
        except OSError as e:
            raise ValueError(f"cannot read SLO classes file {file}: {e.strerror}") from None
        classes = parse_classes(text, source=str(file))
    elif inline is not None:
        classes = parse_classes(inline, source="slo_classes")
    else:
        classes = list(DEFAULT_CLASSES)
    return SloCatalog.of(classes, default or ("chat" if classes == list(DEFAULT_CLASSES) else None))
