"""How long a forward takes on a device we may not have: the cost side of the simulated clock.

A device profile prices the two kinds of forward the engine runs, ``seconds(n_new, n_context)`` for
the target and the draft, plus the scheduler's own time per iteration. Two kinds of forward cost
(docs/architecture.md §13):

- ``Roofline``, analytic, from public specifications. A forward streams the weights and the KV it
  reads from memory and does ``2 * params`` FLOPs per new token; whichever takes longer bounds it:

      t_mem     = (W + kv_bytes_per_token * n_context) / tp / (HBM bandwidth * mem_efficiency)
      t_compute = n_new * 2 * params / tp / (FLOP/s * compute_efficiency)
      t_comm    = 2 * layers * (latency + 2 (tp-1)/tp * n_new * hidden * 2 bytes / link bandwidth)   (tp > 1)
      t         = fixed + max(t_mem, t_compute) + t_comm

  Attention FLOPs over the context are left out: for decoding and small trees they are a few percent of
  the matmuls; the KV read they need is in ``t_mem``.
- ``Table``, measured: the latency of ``n`` new tokens interpolated in ``n``, plus a cost ``alpha``
  per context token beyond a reference context. Either this machine's own start-up profile
  (``adaserve profile``: its reference context and fitted alpha), or a table measured elsewhere and
  shipped as a profile file (``"kind": "table"``, e.g. ``artifact/llama-3.1-70b``, the AdaServe
  artifact's batch-to-latency table; alpha as the file states it, 0 when the table has no context cost).

Pure: no model, no torch. ``device_profiles/`` holds the shipped profiles as data, each with its
derivation or source next to it.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Any, Protocol

MEASURED = "measured"  # the name of this machine's own profile
HOST_MEASURED = "measured"  # a scheduler time taken from the host's clock, step by step


class ForwardCost(Protocol):
    def seconds(self, n_new: int, n_context: int) -> float:
        """Seconds for one forward computing ``n_new`` tokens over ``n_context`` cached ones."""


@dataclass(frozen=True)
class Hardware:
    """One accelerator's public figures and how much of them a serving engine gets."""

    name: str
    hbm_bytes_per_s: float
    flops_per_s: float  # dense bf16
    mem_efficiency: float
    compute_efficiency: float
    fixed_s: float  # per forward: kernel launches, sampling, host work the device waits on
    link_bytes_per_s: float = 0.0  # per direction, between tensor-parallel peers
    allreduce_latency_s: float = 0.0


@dataclass(frozen=True)
class ModelShape:
    """What a forward's cost depends on: parameter count, layers, hidden size and the KV per token."""

    name: str
    params: float
    layers: int
    hidden: int
    kv_heads: int
    head_dim: int
    bytes_per_param: int = 2  # bf16

    @property
    def weight_bytes(self) -> float:
        return self.params * self.bytes_per_param

    @property
    def kv_bytes_per_token(self) -> float:
        return 2 * self.layers * self.kv_heads * self.head_dim * self.bytes_per_param  # K and V


@dataclass(frozen=True)
class Roofline:
    hw: Hardware
    model: ModelShape
    tp: int = 1

    def seconds(self, n_new: int, n_context: int) -> float:
        hw, m = self.hw, self.model
        t_mem = (m.weight_bytes + m.kv_bytes_per_token * n_context) / self.tp / (hw.hbm_bytes_per_s
                                                                                 * hw.mem_efficiency)
        t_compute = n_new * 2 * m.params / self.tp / (hw.flops_per_s * hw.compute_efficiency)
        t_comm = 0.0
        if self.tp > 1:  # two ring all-reduces of the activations per layer
            ring_bytes = 2 * (self.tp - 1) / self.tp * n_new * m.hidden * m.bytes_per_param
            t_comm = 2 * m.layers * (hw.allreduce_latency_s + ring_bytes / hw.link_bytes_per_s)
        return hw.fixed_s + max(t_mem, t_compute) + t_comm


@dataclass(frozen=True)
class Table:
    """A measured latency table ``n -> seconds`` at ``reference_context(n)`` cached tokens, plus alpha
    seconds per further context token (the profiler's fit)."""

    n_tokens: tuple[int, ...]
    latency_s: tuple[float, ...]
    context_per_sequence: int
    alpha: float

    def __post_init__(self) -> None:
        if len(self.n_tokens) < 2 or len(self.n_tokens) != len(self.latency_s):
            raise ValueError("a measured table needs at least two (n, latency) points")
        if list(self.n_tokens) != sorted(set(self.n_tokens)):
            raise ValueError("table sizes must be strictly increasing")

    def reference_context(self, n_new: int) -> int:
        # the profiler spreads n tokens over min(n, 8) sequences of ``context_per_sequence`` each
        return min(max(n_new, 1), 8) * self.context_per_sequence

    def seconds(self, n_new: int, n_context: int) -> float:
        base = _interpolate(self.n_tokens, self.latency_s, max(n_new, 1))
        return max(0.0, base + self.alpha * (n_context - self.reference_context(n_new)))


def _interpolate(xs: Sequence[int], ys: Sequence[float], x: int) -> float:
    """Piecewise-linear in x; below the first point the first latency, past the last the last slope."""
    if x <= xs[0]:
        return ys[0]
    for i in range(1, len(xs)):
        if x <= xs[i] or i == len(xs) - 1:
            slope = (ys[i] - ys[i - 1]) / (xs[i] - xs[i - 1])
            return ys[i - 1] + slope * (x - xs[i - 1])
    raise AssertionError("unreachable")


@dataclass(frozen=True)
class DeviceProfile:
    name: str
    target: ForwardCost
    draft: ForwardCost
    sched_s: float  # the scheduler's own time per iteration, charged between forwards
    description: str = ""
    source: dict[str, Any] | None = None  # the data it was built from, copied into results

    def unloaded_tpot_s(self, context: int) -> float:
        """Per-token latency of the target alone, one request, no speculation."""
        return self.target.seconds(1, context) + self.sched_s


# ---- loading -----------------------------------------------------------------------------------
def _hardware(d: Mapping[str, Any]) -> Hardware:
    return Hardware(
        name=str(d["name"]), hbm_bytes_per_s=float(d["hbm_tb_per_s"]) * 1e12,
        flops_per_s=float(d["bf16_dense_tflops"]) * 1e12, mem_efficiency=float(d["mem_efficiency"]),
        compute_efficiency=float(d["compute_efficiency"]), fixed_s=float(d["fixed_ms"]) / 1e3,
        link_bytes_per_s=float(d.get("link_gb_per_s", 0.0)) * 1e9,
        allreduce_latency_s=float(d.get("allreduce_latency_us", 0.0)) / 1e6)


def _roofline(d: Mapping[str, Any], hw_by_name: Mapping[str, Mapping[str, Any]]) -> Roofline:
    m = d["model"]
    shape = ModelShape(name=str(m["name"]), params=float(m["params_b"]) * 1e9, layers=int(m["layers"]),
                       hidden=int(m["hidden"]), kv_heads=int(m["kv_heads"]), head_dim=int(m["head_dim"]),
                       bytes_per_param=int(m.get("bytes_per_param", 2)))
    hw = dict(hw_by_name[d["hardware"]])
    if "fixed_ms" in d:  # a small model's forward has less host work to wait on
        hw["fixed_ms"] = d["fixed_ms"]
    tp = int(d.get("tp", 1))
    if tp > 1 and not float(hw.get("link_gb_per_s", 0)) > 0:
        raise ValueError(f"{d['hardware']}: tensor parallelism needs link_gb_per_s")
    return Roofline(_hardware(hw), shape, tp)


def _table(d: Mapping[str, Any]) -> Table:
    """A forward priced by a published table: ``latency_ms`` as ``[n_tokens, ms]`` rows, interpolated in n,
    plus ``context_ms_per_token`` for every cached token (absent: the table carries no context cost)."""
    rows = d["latency_ms"]
    return Table(tuple(int(n) for n, _ in rows), tuple(float(ms) / 1e3 for _, ms in rows),
                 context_per_sequence=0, alpha=float(d.get("context_ms_per_token", 0.0)) / 1e3)


def _measured(part: Mapping[str, Any]) -> Table:
    """A model's part of what the profiler measured (``adaserve profile --json``, bench/random_arch.py): its
    table at ``context`` cached tokens per sequence, and the cost model's alpha per further context token."""
    rows = part["table"]
    return Table(tuple(int(r["n_tokens"]) for r in rows), tuple(float(r["latency_ms"]) / 1e3 for r in rows),
                 context_per_sequence=int(part["context"]), alpha=float(part["cost_model"]["alpha"]))


def _forward_cost(d: Mapping[str, Any], hw_by_name: Mapping[str, Mapping[str, Any]]) -> ForwardCost:
    """One model's price from its JSON part: ``"kind": "table"`` (a published table), ``"measured"`` (the
    profiler's own output, measured on the named hardware) or, by default, a roofline."""
    kind = d.get("kind", "roofline")
    if kind == "table":
        return _table(d)
    if kind == "measured":
        return _measured(d)
    if kind != "roofline":
        raise ValueError(f"kind {kind!r}: expected 'roofline', 'table' or 'measured'")
    return _roofline(d, hw_by_name)


def profile_from_dict(d: Mapping[str, Any]) -> DeviceProfile:
    """A shipped device profile from its JSON form (see device_profiles/*.json): each of target and draft
    an analytic roofline or a measured table."""
    try:
        hw = {h["name"]: h for h in d.get("hardware", [])}
        prof = DeviceProfile(name=str(d["name"]), target=_forward_cost(d["target"], hw),
                             draft=_forward_cost(d["draft"], hw),
                             sched_s=float(d["sched_ms"]) / 1e3, description=str(d.get("description", "")),
                             source=dict(d))
    except (KeyError, TypeError, ValueError) as e:
        raise ValueError(f"device profile {d.get('name', '?')!r}: bad or missing field {e}") from None
    for what, cost in (("target", prof.target), ("draft", prof.draft)):
        t = cost.seconds(1, 0)
        if not (math.isfinite(t) and t > 0):
            raise ValueError(f"device profile {prof.name!r}: {what} forward time {t!r} is not positive")
    return prof


def profile_from_measured(data: Mapping[str, Any], *, name: str = MEASURED, sched_s: float) -> DeviceProfile:
    """This machine's profile, from what ``adaserve profile`` measured (its JSON or the cache entry)."""

    table = _measured
    if "draft" not in data:
        raise ValueError("the measured profile has no draft table: profile the pair with its draft")
    return DeviceProfile(name=name, target=table(data["target"]), draft=table(data["draft"]), sched_s=sched_s,
                         description=f"measured on {data.get('device', 'this machine')}",
                         source={"device": data.get("device"), "target": data["target"], "draft": data["draft"]})


@dataclass(frozen=True)
class ScaledTable:
    """A measured table scaled by a constant (a draft of another size on the same machine)."""

    base: ForwardCost
    factor: float

    def seconds(self, n_new: int, n_context: int) -> float:
        return self.base.seconds(n_new, n_context) * self.factor


def scaled_draft(cost: ForwardCost, *, params_ratio: float, kv_ratio: float) -> ForwardCost:
    """The profile's draft priced as a draft of another size: a second draft has no profile of its own.

    Roofline: parameters (weights streamed, FLOPs per token) times ``params_ratio``, KV bytes per token
    times ``kv_ratio`` (through the layer count), the fixed per-forward time unchanged. The ratios are
    those of the real drafts the bench runs (the second against the first), so a draft half the size
    of ours is priced as half the profile's draft (device_profiles/README.md). A measured table is
    scaled by ``params_ratio`` as a whole."""
    if not (params_ratio > 0 and kv_ratio > 0):
        raise ValueError("draft size ratios must be positive")
    if isinstance(cost, Roofline):
        m = cost.model
        layers = max(1, round(m.layers * kv_ratio))
        model = ModelShape(name=f"{m.name} x{params_ratio:.3g}", params=m.params * params_ratio, layers=layers,
                           hidden=m.hidden, kv_heads=m.kv_heads, head_dim=m.head_dim,
                           bytes_per_param=m.bytes_per_param)
        return Roofline(cost.hw, model, cost.tp)
    return ScaledTable(cost, params_ratio)


def builtin_profiles() -> dict[str, Path]:
    """Name -> file of every profile shipped with adaserve (``<hardware or source>/<model>.json``)."""
    root = resources.files("adaserve.bench.sim") / "device_profiles"
    out = {}
    for hw_dir in sorted(root.iterdir(), key=lambda p: p.name):
        if hw_dir.is_dir():
            for f in sorted(hw_dir.iterdir(), key=lambda p: p.name):
                if f.name.endswith(".json"):
                    out[f"{hw_dir.name}/{f.name.removesuffix('.json')}"] = Path(str(f))
    return out


def load_profile_file(ref: str) -> DeviceProfile:
    """A shipped profile by name (e.g. ``a100-80g-tp4/llama-3.1-70b``) or a JSON file of that form."""
    shipped = builtin_profiles()
    path = shipped.get(ref) or Path(ref)
    if not path.is_file():
        raise ValueError(f"unknown device profile {ref!r}: give {MEASURED!r}, one of {', '.join(shipped)}, "
                         "or a JSON file")
    try:
        data = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise ValueError(f"device profile {path}: cannot read it as JSON ({e})") from None
    if not isinstance(data, dict):
        raise ValueError(f"device profile {path}: expected a JSON object")
    return profile_from_dict(data)
