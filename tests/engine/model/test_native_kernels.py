"""The integer kernels (native_kernels.py, native/q8dot.c): built once per machine, the maths their comment
states, and a row's result independent of the batch, the row blocking and the thread count."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from adaserve.engine.cache_dir import CACHE_DIR_ENV
from adaserve.engine.model import native_kernels as nk


@pytest.fixture
def kernels() -> nk.NativeKernels:
    lib = nk.kernels()
    if lib is None:
        if nk.supported_cpu():
            pytest.fail("the integer kernels did not build on a CPU that takes them (is a C compiler installed?)")
        pytest.skip("the integer kernels need x86-64 Linux with AVX2 and FMA")
    return lib


def q8_reference(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per 32-block: codes round(x * (127 / amax)) (half to even, in float32 as the kernel computes it), and
    the scale amax / 127."""
    m, k = x.shape
    blocks = x.reshape(m, k // 32, 32)
    amax = blocks.abs().amax(dim=-1)
    inv = torch.where(amax > 0, torch.tensor(127.0) / amax, torch.zeros(()))
    codes = torch.round(blocks * inv[..., None]).to(torch.int8)
    return codes.reshape(m, k), amax / torch.tensor(127.0)


def test_activations_are_quantized_per_block_of_32(kernels: nk.NativeKernels) -> None:
    torch.manual_seed(0)
    x = torch.randn(5, 96) * torch.tensor([0.01, 1.0, 30.0]).repeat_interleave(32)
    x[2, 32:64] = 0  # an all-zero block: scale 0, codes 0
    a, s, s_sum = kernels.quantize_rows(x)
    codes, scale = q8_reference(x)
    assert torch.equal(a, codes) and torch.equal(s, scale)
    assert a.abs().max() == 127 and s[2, 1] == 0
    torch.testing.assert_close(s_sum, scale * codes.reshape(5, 3, 32).sum(-1).float())


def test_int4_product_is_the_stated_integer_sum(kernels: nk.NativeKernels) -> None:
    """y = sum_g s d (q . a)_g + m (s sum a)_g, the block dots exact integers: against float64 of the same."""
    torch.manual_seed(1)
    n, k, g = 48, 128, 4
    codes = torch.randint(0, 16, (n, k))
    d, m = torch.rand(n, g) * 0.05, torch.randn(n, g) * 0.2
    x = torch.randn(7, k)
    a, s = q8_reference(x)
    dots = (codes.reshape(1, n, g, 32).long() * a.reshape(7, 1, g, 32).long()).sum(-1).double()  # [M, N, G]
    sums = a.reshape(7, 1, g, 32).long().sum(-1).double()
    ref = (s.double()[:, None] * (d.double() * dots + m.double() * sums)).sum(-1)
    got = kernels.mm_q4(x, nk.q4_blocks(codes), d, m)
    torch.testing.assert_close(got.double(), ref, rtol=1e-5, atol=1e-5)


def test_int8_product_takes_the_whole_code_range(kernels: nk.NativeKernels) -> None:
    """|w| up to 128 against |a| up to 127: maddubs's int16 pairs do not saturate."""
    torch.manual_seed(2)
    n, k = 32, 64
    w = torch.randint(-128, 128, (n, k), dtype=torch.int8)
    w[0], w[1] = -128, 127
    c = torch.rand(n) + 0.5
    x = torch.randn(3, k)
    x[0] = 5.0  # every code +127
    x[1] = -5.0
    a, s = q8_reference(x)
    dots = (w.reshape(1, n, 2, 32).long() * a.reshape(3, 1, 2, 32).long()).sum(-1).double()
    ref = c.double() * (s.double()[:, None] * dots).sum(-1)
    torch.testing.assert_close(kernels.mm_q8(x, w, c).double(), ref, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("kind", ["int4", "int8"])
def test_a_rows_result_is_bitwise_the_same_in_any_batch_and_thread_count(kernels: nk.NativeKernels,
                                                                        kind: str) -> None:
    torch.manual_seed(3)
    n, k = 80, 192
    x = torch.randn(11, k)
    if kind == "int4":
        args = (nk.q4_blocks(torch.randint(0, 16, (n, k))), torch.rand(n, k // 32), torch.randn(n, k // 32))

        def mm(rows: torch.Tensor) -> torch.Tensor:
            return kernels.mm_q4(rows, *args)
    else:
        w, c = torch.randint(-127, 128, (n, k), dtype=torch.int8), torch.rand(n)

        def mm(rows: torch.Tensor) -> torch.Tensor:
            return kernels.mm_q8(rows, w, c)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        alone = torch.cat([mm(x[i:i + 1].contiguous()) for i in range(11)])
        for t in (1, 2):
            torch.set_num_threads(t)
            for m in (1, 3, 4, 5, 8, 11):  # blocks of 4 rows and the tail
                assert torch.equal(mm(x[:m].contiguous()), alone[:m]), (kind, t, m)
            assert mm(x[:0].contiguous()).shape == (0, n)  # no rows: no scratch, no error
    finally:
        torch.set_num_threads(threads)


def test_rms_norm_is_torchs_within_rounding_and_one_function_of_the_row(kernels: nk.NativeKernels) -> None:
    torch.manual_seed(4)
    for k in (576, 100):  # whole 8-lane steps, and a tail
        x, w = torch.randn(9, k) * 3, torch.rand(k)
        y = kernels.rms_norm(x, w, 1e-5)
        torch.testing.assert_close(y, torch.rms_norm(x, (k,), w, 1e-5), rtol=1e-6, atol=1e-6)
        assert torch.equal(torch.cat([kernels.rms_norm(x[i:i + 1].contiguous(), w, 1e-5) for i in range(9)]), y)


def test_built_once_per_machine_into_the_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                               kernels: nk.NativeKernels) -> None:
    monkeypatch.setenv(CACHE_DIR_ENV, str(tmp_path))
    monkeypatch.setattr(nk, "_loaded", {})
    first = nk.kernels()
    assert first is not None and first.path.parent == tmp_path / "native" and first.path.exists()
    stamp = first.path.stat().st_mtime_ns
    monkeypatch.setattr(nk, "_loaded", {})  # another process: loads what is there, builds nothing
    again = nk.kernels()
    assert again is not None and again.path == first.path and first.path.stat().st_mtime_ns == stamp
    assert [p.name for p in (tmp_path / "native").iterdir()] == [first.path.name]  # no build leftovers


def test_the_mode_is_read_from_the_environment(monkeypatch: pytest.MonkeyPatch, kernels: nk.NativeKernels) -> None:
    monkeypatch.delenv(nk.ENV, raising=False)
    assert (nk.chosen() is None) == nk.has_avx512_bf16()  # auto by default: where torch's kernels are the slower
    monkeypatch.setenv(nk.ENV, "off")
    assert nk.chosen() is None
    monkeypatch.setenv(nk.ENV, "on")
    assert nk.chosen() is kernels
    monkeypatch.setenv(nk.ENV, "auto")
    assert (nk.chosen() is None) == nk.has_avx512_bf16()
    monkeypatch.setenv(nk.ENV, "fast")
    with pytest.raises(ValueError, match="ADASERVE_NATIVE_KERNELS='fast': use auto, on or off"):
        nk.chosen()
