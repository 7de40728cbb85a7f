"""Few-row linear kernels compute the linear layer's product, whichever the measurement picks."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from adaserve.engine.model import few_rows
from adaserve.engine.model.few_rows import BUCKETS, KERNELS, FewRowLinear, bucket, plain_linear, product, tune


@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("bias", [False, True])
def test_every_kernel_is_the_same_product(kernel: str, bias: bool) -> None:
    torch.manual_seed(0)
    w, b = torch.randn(40, 24), torch.randn(40) if bias else None
    for m in (1, 2, 3, 5, 16):
        x = torch.randn(m, 24)
        y = product(kernel, x, w, w.t().contiguous(), b)
        assert y.shape == (m, 40) and y.is_contiguous()
        assert torch.allclose(y, F.linear(x, w, b), atol=1e-5)


def test_buckets_and_tuned_plan() -> None:
    assert [bucket(m) for m in (1, 2, 3, 4, 5, 8, 9, 16)] == [0, 1, 2, 3, 4, 4, 5, 5]
    plan = tune(48, 32, torch.float32)
    assert len(plan) == len(BUCKETS) and set(plan) <= set(KERNELS)
    assert tune(48, 32, torch.float32) is plan  # measured once per shape


def test_layer_follows_its_plan_and_falls_back() -> None:
    torch.manual_seed(1)
    lin = FewRowLinear(32, 48, bias=True)
    x_few, x_many = torch.randn(3, 32), torch.randn(40, 32)
    ref_few, ref_many = F.linear(x_few, lin.weight, lin.bias), F.linear(x_many, lin.weight, lin.bias)
    lin.tune_kernels()
    assert lin.kernels is not None
    with torch.no_grad():
        assert torch.allclose(lin(x_few), ref_few, atol=1e-5) and torch.allclose(lin(x_many), ref_many, atol=1e-5)
        lin.kernels = ("xwt",) * len(BUCKETS)
        lin.weight_t = lin.weight.detach().t().contiguous()
        lin.weight.mul_(2.0)  # changed in place: the transposed copy is stale, F.linear takes over
        assert torch.allclose(lin(x_few), 2 * ref_few - lin.bias, atol=1e-4)
    with plain_linear(lin):
        assert lin.kernels is None
    assert lin.kernels is not None


def test_switched_off_by_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(few_rows.ENV, "off")
    lin = FewRowLinear(8, 8)
    lin.tune_kernels()
    assert lin.kernels is None and lin.weight_t is None


def test_a_measured_plan_is_reused_by_later_processes(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Every process on a machine rounds alike: the plan measured first is read back, not measured again."""
    monkeypatch.setenv("ADASERVE_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(few_rows, "_plans", {})
    first = tune(24, 40, torch.float32)
    assert few_rows.plan_file().is_file()
    monkeypatch.setattr(few_rows, "_plans", {})  # a new process: nothing in memory

    def no_timing(fn: object) -> float:
        raise AssertionError("measured again")

    monkeypatch.setattr(few_rows, "_cpu_s", no_timing)
    assert tune(24, 40, torch.float32) == first
    few_rows.plan_file().write_text("{not json")  # a corrupt file costs a measurement, not a crash
    monkeypatch.setattr(few_rows, "_plans", {})
    monkeypatch.setattr(few_rows, "_cpu_s", lambda fn: 1.0)
    assert len(tune(24, 40, torch.float32)) == len(BUCKETS)
