"""Building engines over test checkpoints."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from adaserve.engine.config import EngineConfig
from adaserve.engine.engine import Engine
from adaserve.engine.loading.loader import load_model
from adaserve.engine.model.kv_cache import KVCacheConfig
from adaserve.engine.model.runner import ModelRunner
from adaserve.engine.model.static import StaticForward
from adaserve.engine.request import Request
from adaserve.engine.speculation.policies import make_policy

CPU = torch.device("cpu")


def captures_run_out_of_memory(static: StaticForward, monkeypatch: pytest.MonkeyPatch) -> list[object]:
    """``static`` as a GPU's (graphs on) on which every capture runs out of memory: CUDA's ``capture``, the one part
    mocked (no GPU here), stood in by one that raises what the allocator raises. Returns the pool each try asked
    for, in order (None: the buckets' shared pool)."""
    tries: list[object] = []

    def capture(fn: object, pool: object = None) -> None:
        tries.append(pool)
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")

    monkeypatch.setattr(static, "graphs", True)
    monkeypatch.setattr(static, "capture", capture)
    return tries


def runner(path: Path, *, page_size: int = 4, num_pages: int = 4000, static_shapes: bool = False) -> ModelRunner:
    cfg = EngineConfig(attention="torch", kv=KVCacheConfig(page_size=page_size, num_pages=num_pages),
                       static_shapes=static_shapes)
    return ModelRunner(load_model(path, device=CPU), cfg)


def engine(target: Path, draft: Path | None, policy: str, **cfg: int | str | bool) -> Engine:
    """``static_shapes=True`` runs both models' decode-sized forwards on the static path (model/static.py)."""
    config = EngineConfig(policy=policy, **cfg)
    st = config.static_shapes
    drf = runner(draft, static_shapes=st) if draft and make_policy(policy, config).max_shape is not None else None
    return Engine(runner(target, static_shapes=st), drf, config)


def hf_greedy(path: Path, prompt: list[int], max_new: int, *, eos: int | None = None) -> list[int]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    out = model.generate(torch.tensor([prompt]), max_new_tokens=max_new, do_sample=False, eos_token_id=eos,
                         pad_token_id=0)
    return out[0, len(prompt):].tolist()


def outputs(eng: Engine, reqs: list[Request]) -> list[list[int]]:
    """Add every request, step until the engine is idle, and return the requests' output ids in order."""
    for r in reqs:
        eng.add_request(r)
    while eng.has_work:
        eng.step()
    return [r.output_ids for r in reqs]


def integer_kernels() -> Any:
    """The integer kernels (native_kernels.kernels()); fails the test where they should build and do not, skips it
    where the CPU cannot take them."""
    import pytest

    from adaserve.engine.model import native_kernels

    lib = native_kernels.kernels()
    if lib is None:
        if native_kernels.supported_cpu():
            pytest.fail("the integer kernels did not build on a CPU that takes them (is a C compiler installed?)")
        pytest.skip("the integer kernels need x86-64 Linux with AVX2 and FMA")
    return lib


def use_cpu_kernels(kind: str, monkeypatch: Any) -> None:
    """Serve quantized layers on one CPU kernel family for the rest of the test: torch's (``"torch"``) or the
    integer ones (``"native"``, ``integer_kernels``)."""
    from adaserve.engine.model import native_kernels

    if kind == "native":
        integer_kernels()
    monkeypatch.setenv(native_kernels.ENV, "on" if kind == "native" else "off")
