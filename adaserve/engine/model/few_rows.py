"""Linear layers over a few rows on a CPU: the fastest of three equal matrix products, chosen by measurement.

y = x W^T + b, x [M, K], W [N, K]. Decoding (M = 1 per request), the draft's beams and small verification
trees multiply a handful of rows by every weight; the forward is then bound by streaming the weights
from memory, and the kernel PyTorch's CPU BLAS picks for ``F.linear`` is often far from that bound, by
an amount that depends on the shape and on M. On the development CPU (fp32, one thread; SmolLM2's
lm_head, N = 49152, K = 576) ``F.linear`` takes 9.8 ms at M = 1 and 34 ms at M = 3, ``x @ W_t`` (W stored
transposed) 5.0 ms at M = 1, and ``(W @ x^T)^T`` 8.1 ms at M = 3. Which product wins depends on the CPU,
the BLAS build and the thread count, so each weight shape is timed once per process (CPU time, the
minimum of a few rounds over enough copies of the weight that they come from memory, as in a forward)
and every M bucket keeps its fastest kernel:

    linear   F.linear(x, W, b)
    xwt      x @ W_t + b       W_t = W^T kept contiguous: a second copy of W, made only when it wins
    wxt      (W @ x^T)^T + b

The three compute the same product; only the rounding of the sums differs, as it already does between
BLAS kernels for different M. So that every process on a machine rounds alike (a run repeats to the
byte), a measured plan is kept under the cache directory (``$ADASERVE_CACHE_DIR``, cache_dir.py) per
shape, dtype, thread count, torch version and CPU, and later processes use it instead of measuring.
Above ``MAX_ROWS`` rows (prefill chunks, large batches) ``F.linear`` is used unchanged.
``ADASERVE_FEW_ROW_KERNELS=off`` keeps ``F.linear`` everywhere.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import platform
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from adaserve.engine.cache_dir import default_cache_dir

KERNELS = ("linear", "xwt", "wxt")
BUCKETS = (1, 2, 3, 4, 8, 16)  # a product of M rows uses the first bucket >= M
MAX_ROWS = BUCKETS[-1]
TUNE_BYTES = 32 * 2**20  # weight copies per timing round: enough to leave the caches, as a forward does
MAX_COPIES = 64
ROUNDS = 3
ENV = "ADASERVE_FEW_ROW_KERNELS"

_plans: dict[tuple[int, int, torch.dtype, int], tuple[str, ...]] = {}


def enabled() -> bool:
    return os.environ.get(ENV, "on").lower() not in ("off", "0", "false", "no")


def bucket(m: int) -> int:
    """Index of the bucket for M rows (M <= MAX_ROWS)."""
    return next(i for i, b in enumerate(BUCKETS) if m <= b)


def product(kernel: str, x: torch.Tensor, w: torch.Tensor, w_t: torch.Tensor | None,
            bias: torch.Tensor | None) -> torch.Tensor:
    """x [M, K] times W^T, by ``kernel``; contiguous [M, N]."""
    if kernel == "xwt":
        assert w_t is not None
        y = x @ w_t
    elif kernel == "wxt":
        y = (w @ x.t()).t().contiguous()
    else:
        return F.linear(x, w, bias)
    return y if bias is None else y + bias


def _cpu_s(fn: Callable[[], object]) -> float:
    best = math.inf
    for _ in range(ROUNDS):
        t0 = time.process_time()
        fn()
        best = min(best, time.process_time() - t0)
    return best


def _cpu_name() -> str:
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return platform.processor() or platform.machine()
    return next((ln.split(":", 1)[1].strip() for ln in lines if ln.startswith("model name")), platform.machine())


def plan_file() -> Path:
    """Beside the profiles, in a folder of its own (the profile cache's folder holds only profiles)."""
    return default_cache_dir() / "kernels" / "few-row-kernels.json"


def _stored_key(n: int, k: int, dtype: torch.dtype, threads: int) -> str:
    return f"{n}x{k} {str(dtype).removeprefix('torch.')} threads={threads} torch={torch.__version__} cpu={_cpu_name()}"


def _read_plans() -> dict[str, list[str]]:
    try:
        data = json.loads(plan_file().read_text())
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def _store_plan(key: str, plan: tuple[str, ...]) -> None:
    """Add one plan to the file (written beside, then renamed); a read-only cache only costs a re-measure."""
    path = plan_file()
    data = {**_read_plans(), key: list(plan)}
    with contextlib.suppress(OSError):
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
        tmp.write_text(json.dumps(data, indent=1, sort_keys=True))
        os.replace(tmp, path)


def tune(n: int, k: int, dtype: torch.dtype) -> tuple[str, ...]:
    """The fastest kernel per bucket for W [n, k] on this CPU: measured once, then read from the cache."""
    key = (n, k, dtype, torch.get_num_threads())
    stored_key = _stored_key(*key)
    if key not in _plans:
        stored = _read_plans().get(stored_key)
        if isinstance(stored, list) and len(stored) == len(BUCKETS) and set(stored) <= set(KERNELS):
            _plans[key] = tuple(stored)
    if key not in _plans:
        copies = max(1, min(MAX_COPIES, TUNE_BYTES // (n * k * dtype.itemsize)))
        ws = [torch.randn(n, k).to(dtype) for _ in range(copies)]
        wts = [w.t().contiguous() for w in ws]
        plan = []
        for m in BUCKETS:
            x = torch.randn(m, k).to(dtype)

            def every_copy(kern: str, x: torch.Tensor = x) -> None:
                for w, wt in zip(ws, wts, strict=True):
                    product(kern, x, w, wt, None)

            times = {kern: _cpu_s(lambda kern=kern: every_copy(kern)) for kern in KERNELS}  # type: ignore[misc]
            plan.append(min(KERNELS, key=lambda kern: times[kern]))
        _plans[key] = tuple(plan)
        _store_plan(stored_key, _plans[key])
    return _plans[key]


class FewRowLinear(nn.Linear):
    """``nn.Linear`` (same parameters, same state dict) whose products over few rows use measured kernels."""

    kernels: tuple[str, ...] | None = None  # per bucket; None until ``tune_kernels`` (then F.linear is used)
    weight_t: torch.Tensor | None = None
    _tuned_for: tuple[torch.Tensor, int] | None = None  # the weight (and its version) W^T was copied from

    def tune_kernels(self) -> None:
        """Measure (or reuse the measurement for this shape) and keep W^T if a bucket wants it. CPU only."""
        if self.weight.device.type != "cpu" or not enabled():
            return
        plan = tune(self.out_features, self.in_features, self.weight.dtype)
        self.weight_t = self.weight.detach().t().contiguous() if "xwt" in plan else None
        self.kernels, self._tuned_for = plan, (self.weight, self.weight._version)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        m = x.shape[0] if x.dim() == 2 else 0
        if self.kernels is None or not 0 < m <= MAX_ROWS or not self._current():
            return F.linear(x, self.weight, self.bias)
        return product(self.kernels[bucket(m)], x, self.weight, self.weight_t, self.bias)

    def _current(self) -> bool:
        """False once the weight was replaced or changed in place: W^T would be stale."""
        assert self._tuned_for is not None
        w, version = self._tuned_for
        return self.weight is w and self.weight._version == version


@contextmanager
def plain_linear(model: nn.Module) -> Iterator[None]:
    """Inside, every FewRowLinear of ``model`` uses F.linear (to measure what the kernels save)."""
    saved = [(m, m.kernels) for m in model.modules() if isinstance(m, FewRowLinear)]
    for m, _ in saved:
        m.kernels = None
    try:
        yield
    finally:
        for m, kernels in saved:
            m.kernels = kernels
