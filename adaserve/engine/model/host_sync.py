"""Counting, or forbidding, the places where the host waits for the device: the CPU-side check that a
GPU iteration can be captured in a CUDA graph and runs without host round trips (issue 30).

On a GPU the host queues work and runs ahead; it stops and waits wherever it needs a value back, or hands
the device data that is not there yet. This module names those places by what the code calls, so the same
check runs on a CPU, where nothing waits at all:

    kind           calls                                                  on CUDA
    h2d            torch.tensor / as_tensor / asarray of host data        a blocking copy to the device
                   with an explicit ``device=`` (the engine's convention:
                   a tensor meant for the device names it; host scratch
                   does not)
    d2h            Tensor.tolist / item / cpu, bool() / int() /            a blocking copy back, after a sync
                   float() of a tensor
    data_shape     nonzero, masked_select, unique, repeat_interleave       the output's size is on the device:
                   without ``output_size``, boolean-mask indexing           a hidden d2h
    sync           ``synchronize(device)`` below                          the host waits for every kernel
    async_copy     Tensor.copy_ / to with ``non_blocking=True``           a copy that does not wait (allowed)

``HostSync`` is a ``TorchFunctionMode``: inside ``with HostSync() as s:`` every such call is counted in
``s.counts``; with ``forbid=True`` any kind but ``h2d`` and ``async_copy`` raises ``HostSyncError`` naming
the call, which is what a region to be graph-captured must satisfy (inputs reach a captured graph by
copies into its static buffers made before the replay, so ``h2d`` is counted there but not forbidden).
What it cannot see: work outside torch (numpy, Python), which costs host time but no round trip.

May import: torch only.
"""

from __future__ import annotations

import sys
from collections import Counter
from collections.abc import Callable, Mapping
from typing import Any, ClassVar

import torch
from torch.overrides import TorchFunctionMode

KINDS = ("h2d", "d2h", "data_shape", "sync", "async_copy")
BLOCKING = ("h2d", "d2h", "data_shape", "sync")  # every kind the host waits on
FORBIDDEN_IN_CAPTURE = ("d2h", "data_shape", "sync")

_FROM_HOST = {torch.tensor, torch.as_tensor, torch.asarray}
# not Tensor.numpy: a device tensor refuses it, so it always follows the copy (.cpu()) that is counted
_TO_HOST = {torch.Tensor.tolist, torch.Tensor.item, torch.Tensor.cpu,
            torch.Tensor.__bool__, torch.Tensor.__int__, torch.Tensor.__float__, torch.Tensor.__index__}
_DATA_SHAPE = {torch.nonzero, torch.Tensor.nonzero, torch.masked_select, torch.Tensor.masked_select,
               torch.unique, torch.Tensor.unique, torch.argwhere, torch.Tensor.argwhere}
_REPEAT = {torch.repeat_interleave, torch.Tensor.repeat_interleave}
_COPY = {torch.Tensor.copy_, torch.Tensor.to}


class HostSyncError(RuntimeError):
    """A call that makes the host wait for the device, inside a region that must not."""


def _name(func: Callable[..., Any]) -> str:
    """``torch.tensor``, ``Tensor.tolist``: the call as the code spells it."""
    name = getattr(func, "__name__", repr(func))
    method = getattr(func, "__qualname__", "").startswith(("TensorBase.", "Tensor."))
    return f"Tensor.{name}" if method else f"torch.{name}"


def _caller() -> str:
    """``file:line`` of the innermost adaserve frame outside this module: where to look in the code."""
    frame = sys._getframe(2)
    while frame is not None:
        path = frame.f_code.co_filename
        if "adaserve" in path and not path.endswith("host_sync.py"):
            return f"{path.split('adaserve/')[-1]}:{frame.f_lineno}"
        frame = frame.f_back
    return "?"


def _is_host_data(x: object) -> bool:
    return not isinstance(x, torch.Tensor)


def _bool_mask_index(args: tuple[Any, ...]) -> bool:
    """``t[mask]`` with a boolean tensor anywhere in the index: its result's length is the mask's count."""
    if len(args) < 2:
        return False
    idx = args[1] if isinstance(args[1], tuple) else (args[1],)
    return any(isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in idx)


def classify(func: Callable[..., Any], args: tuple[Any, ...], kwargs: Mapping[str, Any]) -> str | None:
    """Which kind of host-device crossing a torch call is (see the module docstring), or None."""
    if func in _FROM_HOST:
        return "h2d" if kwargs.get("device") is not None and args and _is_host_data(args[0]) else None
    if func in _TO_HOST:
        return "d2h"
    if func in _DATA_SHAPE:
        return "data_shape"
    if func in _REPEAT:
        repeats = args[1] if len(args) > 1 else kwargs.get("repeats")
        return "data_shape" if isinstance(repeats, torch.Tensor) and kwargs.get("output_size") is None else None
    if func is torch.Tensor.__getitem__:
        return "data_shape" if _bool_mask_index(args) else None
    if func in _COPY and kwargs.get("non_blocking"):
        return "async_copy"
    return None


class HostSync(TorchFunctionMode):
    """Counts the calls of each kind inside the ``with`` block; with ``forbid`` raises on the capture-unsafe."""

    active: ClassVar[list[HostSync]] = []  # the innermost open counter last (``synchronize`` reports to it)

    def __init__(self, *, forbid: bool = False) -> None:
        super().__init__()
        self.forbid = forbid
        self.counts: Counter[str] = Counter()
        self.where: Counter[str] = Counter()  # "kind call at file:line" -> count, to find each in the code

    def note(self, kind: str, what: str) -> None:
        if self.forbid and kind in FORBIDDEN_IN_CAPTURE:
            raise HostSyncError(f"{what} makes the host wait for the device ({kind}) inside a region that "
                                "must not (docs/architecture.md §10, host syncs)")
        self.counts[kind] += 1
        self.where[f"{kind} {what} at {_caller()}"] += 1

    def __torch_function__(self, func: Callable[..., Any], types: Any, args: tuple[Any, ...] = (),
                           kwargs: Mapping[str, Any] | None = None) -> Any:
        kwargs = kwargs or {}
        kind = classify(func, args, kwargs)
        if kind is not None:
            self.note(kind, _name(func))
        return func(*args, **kwargs)

    def __enter__(self) -> HostSync:
        HostSync.active.append(self)
        super().__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        super().__exit__(*exc)
        HostSync.active.remove(self)

    @property
    def blocking(self) -> int:
        """Calls the host waits on: every kind but ``async_copy``."""
        return sum(self.counts[k] for k in BLOCKING)


def synchronize(device: torch.device) -> None:
    """Wait for ``device`` (a no-op on a CPU), counted as ``sync`` by every open ``HostSync`` on any device,
    so a CPU run shows where a GPU run would wait. Every wait of the engine goes through here."""
    for counter in HostSync.active:
        counter.note("sync", "synchronize")
    if device.type == "cuda":
        torch.cuda.synchronize(device)
