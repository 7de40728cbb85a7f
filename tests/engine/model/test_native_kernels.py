"""The integer kernels (native_kernels.py, native/q8dot.c): built once per machine, the maths their comment
states, and a row's result independent of the batch, the row blocking and the thread count."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from adaserve.engine.cache_dir import CACHE_DIR_ENV
from adaserve.engine.model import native_kernels as nk
from tests.engine.helpers import integer_kernels


@pytest.fixture
def kernels() -> nk.NativeKernels:
    return integer_kernels()


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
    """y = sum_g s d (q . a)_g + m (s sum a)_g, the block dots exact integers: against float64 of the same. An odd
    number of outputs: the kernel's tiles of two columns and the last column alone."""
    torch.manual_seed(1)
    n, k, g = 49, 128, 4
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
    n, k = 33, 64  # odd, as above
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
    n, k = 81, 192  # tiles of two columns and the last one alone
    x = torch.randn(17, k)
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
        alone = torch.cat([mm(x[i:i + 1].contiguous()) for i in range(17)])
        for t in (1, 2):
            torch.set_num_threads(t)
            # tiles of 4 rows and every tail (3, 2 or 1 rows); two-column tiles up to 7 rows (int8) or 15 (int4 on
            # AVX2), one column a tile above
            for m in (1, 2, 3, 4, 5, 6, 7, 8, 11, 15, 16, 17):
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
    assert nk.chosen() is kernels  # auto by default: wherever they build
    monkeypatch.setenv(nk.ENV, "off")
    assert nk.chosen() is None
    monkeypatch.setenv(nk.ENV, "on")
    assert nk.chosen() is kernels
    monkeypatch.setenv(nk.ENV, "auto")
    assert nk.chosen() is kernels
    monkeypatch.setenv(nk.ENV, "fast")
    with pytest.raises(ValueError, match="ADASERVE_NATIVE_KERNELS='fast': use auto, on or off"):
        nk.chosen()


def test_a_vnni_build_gives_bitwise_the_avx2_builds_results(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                            kernels: nk.NativeKernels) -> None:
    """VNNI forms each block's eight lanes of four exact products in one instruction: the same integers, so the
    same floats after. Both builds run here only where the CPU has VNNI."""
    vnni = nk.build_flags()
    if vnni == nk.FLAGS:
        pytest.skip("this CPU has no VNNI: only the AVX2 build can run")
    monkeypatch.setenv(CACHE_DIR_ENV, str(tmp_path))
    cc = nk.shutil.which("cc") or nk.shutil.which("gcc")
    assert cc is not None
    builds = [nk._built(cc, "test", flags)[0] for flags in (nk.FLAGS, vnni)]
    assert all(b is not None for b in builds) and builds[0] != builds[1]
    avx2, fast = (nk.load(b) for b in builds if b is not None)
    torch.manual_seed(5)
    n, k = 64, 256
    x = torch.randn(16, k)
    x[0] = 5.0  # every activation code +127, against the largest weight codes
    codes = torch.randint(0, 16, (n, k))
    codes[0] = 15
    q4 = (nk.q4_blocks(codes), torch.rand(n, k // 32), torch.randn(n, k // 32))
    w8, c8 = torch.randint(-128, 128, (n, k), dtype=torch.int8), torch.rand(n)
    w8[0] = -128
    for m in (1, 4, 9, 16):  # 16: the AVX2 build's int4 products one column a tile, the VNNI build's two
        assert torch.equal(fast.mm_q4(x[:m].contiguous(), *q4), avx2.mm_q4(x[:m].contiguous(), *q4))
        assert torch.equal(fast.mm_q8(x[:m].contiguous(), w8, c8), avx2.mm_q8(x[:m].contiguous(), w8, c8))


def test_a_failed_vnni_build_falls_back_to_avx2(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                capsys: pytest.CaptureFixture[str], kernels: nk.NativeKernels) -> None:
    monkeypatch.setenv(CACHE_DIR_ENV, str(tmp_path))
    monkeypatch.setattr(nk, "_loaded", {})
    monkeypatch.setattr(nk, "build_flags", lambda: (*nk.FLAGS, "-mno-such-option"))  # an older compiler's refusal
    lib = nk.kernels()
    assert lib is not None and lib.path.parent == tmp_path / "native"
    assert [p.name for p in (tmp_path / "native").iterdir()] == [lib.path.name]
    assert "did not build" not in capsys.readouterr().err
    x, w, c = torch.randn(2, 64), torch.randint(-127, 128, (8, 64), dtype=torch.int8), torch.rand(8)
    assert torch.equal(lib.mm_q8(x, w, c), kernels.mm_q8(x, w, c))


def paged_reference(q: torch.Tensor, kc: torch.Tensor, vc: torch.Tensor, key_slots: torch.Tensor,
                    mask: torch.Tensor | None, scale: float) -> torch.Tensor:
    """The attention ``attend`` states, in float64 by SDPA: q [G, Q, H, D] -> [G * Q, H, D]."""
    g, rows, h, d = q.shape
    k, v = (c[key_slots].double() for c in (kc, vc))  # [G, K, Hkv, D]
    m = torch.ones(g, rows, key_slots.shape[1], dtype=torch.bool) if mask is None else mask
    out = torch.nn.functional.scaled_dot_product_attention(
        q.double().transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), attn_mask=m[:, None], scale=scale,
        enable_gqa=True)
    return out.transpose(1, 2).reshape(g * rows, h, d).float()


def test_attention_is_softmax_over_the_visible_keys(kernels: nk.NativeKernels) -> None:
    torch.manual_seed(6)
    g, rows, h, hkv, d, k, slots = 3, 5, 6, 2, 64, 40, 200
    kc, vc = torch.randn(slots, hkv, d), torch.randn(slots, hkv, d)
    key_slots = torch.randperm(slots)[: g * k].reshape(g, k)
    mask = torch.rand(g, rows, k) < 0.6
    mask[:, :, 0] = True
    q = torch.randn(g, rows, h, d) * 2
    for m in (mask, None):
        torch.testing.assert_close(kernels.attend(q, kc, vc, key_slots, m, 0.125),
                                   paged_reference(q, kc, vc, key_slots, m, 0.125), rtol=2e-5, atol=2e-6)
    # a row that sees nothing: zeros (no NaN into the layers after)
    mask[1, 2] = False
    assert kernels.attend(q, kc, vc, key_slots, mask, 0.125).reshape(g, rows, h, d)[1, 2].eq(0).all()
    # rows strided as a fused q/k/v product leaves them: q is a slice of a wider row
    wide = torch.randn(g * rows, h + 2 * hkv, d)
    qs = wide[:, :h].view(g, rows, h, d)
    torch.testing.assert_close(kernels.attend(qs, kc, vc, key_slots, mask, 0.125),
                               kernels.attend(qs.contiguous(), kc, vc, key_slots, mask, 0.125), rtol=0, atol=0)


def test_a_rows_attention_depends_only_on_the_keys_it_sees(kernels: nk.NativeKernels) -> None:
    """The same token decoded alone (its keys, no mask) and verified in a wider grid (the same keys among masked
    ones, padded rows, other rows, two threads): bitwise the same output."""
    torch.manual_seed(7)
    h, hkv, d, slots = 9, 3, 64, 300
    kc, vc = torch.randn(slots, hkv, d), torch.randn(slots, hkv, d)
    visible = torch.tensor(sorted(torch.randperm(slots)[:57].tolist()))
    q = torch.randn(1, 1, h, d)
    alone = kernels.attend(q, kc, vc, visible[None], None, 0.125)
    k = 90
    key_slots = torch.randint(0, slots, (4, k))
    cols = torch.tensor(sorted(torch.randperm(k)[:57].tolist()))
    key_slots[2, cols] = visible
    mask = torch.rand(4, 6, k) < 0.5
    mask[2, 3] = False
    mask[2, 3, cols] = True
    grid_q = torch.randn(4, 6, h, d)
    grid_q[2, 3] = q[0, 0]
    threads = torch.get_num_threads()
    try:
        for t in (1, 2):
            torch.set_num_threads(t)
            got = kernels.attend(grid_q, kc, vc, key_slots, mask, 0.125).reshape(4, 6, h, d)[2, 3]
            assert torch.equal(got, alone[0]), t
    finally:
        torch.set_num_threads(threads)


@pytest.mark.parametrize("static_shapes", [False, True])
def test_a_bfloat16_model_on_the_integer_kernels_attends_with_sdpa(target_dir: Path, kernels: nk.NativeKernels,
                                                                   monkeypatch: pytest.MonkeyPatch,
                                                                   static_shapes: bool) -> None:
    """attend.c is float32: a model served in bfloat16 (its KV cache bfloat16) keeps SDPA, on both paths, and its
    logits are what SDPA gives them (the kernel would have read the bfloat16 cache as float32)."""
    from adaserve.engine.config import EngineConfig, KVCacheConfig
    from adaserve.engine.loading.loader import load_model
    from adaserve.engine.model.batch import Segment
    from adaserve.engine.model.kv_cache import SequenceKV
    from adaserve.engine.model.runner import ModelRunner
    from adaserve.engine.model.tree import TokenTree

    monkeypatch.setenv(nk.ENV, "on")
    cfg = EngineConfig(attention="torch", kv=KVCacheConfig(page_size=4, num_pages=200), static_shapes=static_shapes)

    def logits(native: bool) -> torch.Tensor:
        model = load_model(target_dir, device=torch.device("cpu"), dtype=torch.bfloat16, weights="int4")
        assert model.native is kernels and model.attention_kernels() is None  # its layers on them, attention not
        r = ModelRunner(model, cfg)
        if not native:
            r.backend.native = None
            if r.static is not None:
                model.native = None  # the static grids read it when they are made
        seq, prompt = SequenceKV(), list(range(2, 14))
        r.forward([Segment(seq, 0, TokenTree.chain(prompt))], all_logits=[True])
        return r.forward([Segment(seq, len(prompt), TokenTree.chain([7, 9, 4]))], all_logits=[True])[0]

    assert torch.equal(logits(native=True), logits(native=False))


@pytest.mark.parametrize("static_shapes", [False, True])
def test_a_float32_model_on_a_cpu_attends_with_the_kernels_wherever_they_serve(
        target_dir: Path, kernels: nk.NativeKernels, monkeypatch: pytest.MonkeyPatch, static_shapes: bool) -> None:
    """A float model is not on the integer kernels, yet in float32 on a CPU it attends with attend.c (and normalises
    with their norm) where they serve (``ADASERVE_NATIVE_KERNELS`` auto or on), on both paths, and with SDPA where they
    are off, the model is bfloat16, or it is quantized on torch's kernels. Its logits stay SDPA's within float32
    rounding: the same softmax over the same keys, summed in another order."""
    from adaserve.engine.config import EngineConfig, KVCacheConfig
    from adaserve.engine.loading.loader import load_model
    from adaserve.engine.model.batch import Segment
    from adaserve.engine.model.kv_cache import SequenceKV
    from adaserve.engine.model.quant import served_attention, served_weights
    from adaserve.engine.model.runner import ModelRunner
    from adaserve.engine.model.tree import TokenTree

    cfg = EngineConfig(attention="torch", kv=KVCacheConfig(page_size=4, num_pages=200), static_shapes=static_shapes)

    def logits(mode: str, dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, ModelRunner]:
        monkeypatch.setenv(nk.ENV, mode)
        model = load_model(target_dir, device=torch.device("cpu"), dtype=dtype, weights="float")
        assert served_weights(model) == "float" and model.native is None  # no integer layers
        r = ModelRunner(model, cfg)
        seq, prompt = SequenceKV(), list(range(2, 14))
        r.forward([Segment(seq, 0, TokenTree.chain(prompt))], all_logits=[True])
        return r.forward([Segment(seq, len(prompt), TokenTree.chain([7, 9, 4]))], all_logits=[True])[0], r

    native, r = logits("auto")
    assert r.model.attention_kernels() is kernels and r.backend.native is kernels
    assert r.model.model.norm.native is kernels  # its norms too (CausalLM.use_native_kernels)
    assert served_attention(r.model) == kernels.path.stem
    sdpa, r = logits("off")
    assert r.model.attention_kernels() is None and r.backend.native is None and served_attention(r.model) == "sdpa"
    assert r.model.model.norm.native is None
    torch.testing.assert_close(native, sdpa, rtol=1e-4, atol=1e-4)  # the same attention, summed in another order
    _, r = logits("on", torch.bfloat16)
    assert r.model.attention_kernels() is None  # attend.c is float32 only
    monkeypatch.setenv(nk.ENV, "off")
    on_torch = load_model(target_dir, device=torch.device("cpu"), weights="int4")  # quantized, on torch's kernels
    monkeypatch.setenv(nk.ENV, "on")
    assert on_torch.native is None and on_torch.attention_kernels() is None  # its attention stays with its layers


def test_the_picks_refuse_what_their_pointers_would_misread(kernels: nk.NativeKernels) -> None:
    """beam_picks and first_argmax read raw pointers: another dtype, a strided view or a row count that does not
    match the bases is a clear error, not a misread buffer."""
    x, base = torch.randn(4, 64), torch.zeros(2, 2, dtype=torch.float64)
    assert kernels.beam_picks(x, base, k=2, width=2, frontier=0) is not None
    bad = [
        (x.double(), base, 2),  # float64 logits
        (x, base.float(), 2),  # float32 bases
        (torch.randn(64, 4).t(), base, 2),  # strided logits
        (x[:3], base, 2),  # 3 rows for 2 x 2 frontier nodes
        (x, base, 0),  # no pick
        (x, base, 65),  # more picks than the vocabulary
    ]
    for logits, bases, k in bad:
        with pytest.raises(ValueError, match="beam_picks"):
            kernels.beam_picks(logits, bases, k=k, width=2, frontier=0)
    assert kernels.first_argmax(x).tolist() == x.argmax(-1).tolist()
    for rows in (x.double(), torch.randn(64, 4).t()):
        with pytest.raises(ValueError, match="first_argmax"):
            kernels.first_argmax(rows)


def test_first_argmax_is_argmax_at_every_width(kernels: nk.NativeKernels) -> None:
    """The scan's steps (32 logits at a time, then 8, then one; the first index's search the same way) give
    torch's argmax at every width from 1 to 200: ties (its first maximum), -inf rows, +inf and NaN (the first NaN)
    wherever they fall, a tail included."""
    gen = torch.Generator().manual_seed(7)
    for v in range(1, 201):
        x = torch.randint(-3, 3, (6, v), generator=gen).float()  # small ints: ties in every step
        x[1] = float("-inf")
        x[2, int(torch.randint(0, v, (), generator=gen))] = float("inf")
        x[3, int(torch.randint(0, v, (), generator=gen))] = float("nan")
        x[4, v - 1] = 10.0  # the maximum in the last place: past every vector step when v % 8
        assert kernels.first_argmax(x).tolist() == x.argmax(-1).tolist(), v


def test_beam_picks_refuse_a_logit_that_is_not_finite_wherever_it_is(kernels: nk.NativeKernels) -> None:
    """The picks' one scan checks every logit: the first k, the few it takes one by one to align the rest to 8
    lanes, and the rest, 8 at a time. NaN, +inf or -inf anywhere in any row: no picks."""
    base = torch.zeros(1, 2, dtype=torch.float64)
    for v in (5, 13, 37, 64):
        for where in range(v):
            for bad in (float("nan"), float("inf"), float("-inf")):
                x = torch.randn(2, v)
                x[1, where] = bad
                assert kernels.beam_picks(x, base, k=2, width=2, frontier=0) is None, (v, where, bad)
        assert kernels.beam_picks(torch.randn(2, v), base, k=2, width=2, frontier=0) is not None


def test_one_pick_a_row_is_its_first_maximum(kernels: nk.NativeKernels) -> None:
    """k = 1: the row's first maximum (argmax's), its log-softmax the maximum's, at widths that are and are not a
    multiple of 8 lanes, with ties everywhere."""
    gen = torch.Generator().manual_seed(3)
    for v in (1, 7, 8, 9, 31, 64, 100):
        x = torch.randint(-2, 2, (6, v), generator=gen).float()
        got = kernels.beam_picks(x, torch.zeros(6, 1, dtype=torch.float64), k=1, width=1, frontier=0)
        assert got is not None
        tok, _, value = got
        assert tok[:, 0].tolist() == x.argmax(-1).tolist(), v
        want = torch.log_softmax(x.double(), -1).max(-1).values
        assert torch.allclose(value[:, 0], want, rtol=0, atol=1e-6), v


def test_search_picks_are_each_levels_picks_with_their_rows_grown(kernels: nk.NativeKernels) -> None:
    """SearchPicks writes every level into the trees' [n, K] arrays, reading the previous level's columns as its
    base, and grows the ancestor rows in the same call: the same tokens, parents and float64 log path
    probabilities, bit for bit, as ``beam_picks`` level by level on packed bases, and the same rows as
    ``grow_ancestors`` (beam_ops.py), for beams and static trees."""
    from adaserve.engine.speculation.beam_ops import ancestor_rows, grow_ancestors

    rng = np.random.default_rng(5)
    for case in range(40):
        n, v, depth = int(rng.integers(1, 6)), int(rng.integers(9, 200)), int(rng.integers(1, 5))
        static = case % 3 == 0
        ks = [int(rng.integers(1, 4)) for _ in range(depth)] if static else [int(rng.integers(1, 5))] * depth
        width = None if static else ks[0]
        sizes = [1]
        for k in ks:
            sizes.append(sizes[-1] * k if width is None else min(width, sizes[-1] * k))
        side = sum(sizes)
        anc = ancestor_rows(n, side, torch.device("cpu"), first_level=sizes[1])
        ref_anc = anc.clone()
        # every other case names its levels' sizes: a lone request's level ids are then views made up front
        picks = nk.SearchPicks(kernels, n, side - 1, anc, sizes[1:] if case % 2 else ())
        base, frontier, column = torch.zeros((n, 1), dtype=torch.float64), 0, 0
        for step, k in enumerate(ks):
            x = torch.from_numpy(rng.standard_normal((n * sizes[step], v)).astype(np.float32))
            x[0, 3] = x[0, 5]  # a tie: to the lower token id
            grow = 0 < step < depth - 1
            tok = picks.level(x, k=k, width=width, frontier=frontier, grow=grow)
            ref = kernels.beam_picks(x, base, k=k, width=width, frontier=frontier)
            assert ref is not None
            end = column + sizes[step + 1]
            assert torch.equal(tok, ref[0].reshape(-1))
            if n == 1:  # the level's columns themselves, not a copy
                assert tok.data_ptr() == picks.tokens[0, column:end].ctypes.data
            assert np.array_equal(picks.tokens[:, column:end], ref[0].numpy())
            assert np.array_equal(picks.parents[:, column:end], ref[1].numpy())
            assert np.array_equal(picks.log_probs[:, column:end], ref[2].numpy())
            frontier += sizes[step]
            if grow:
                grow_ancestors(ref_anc, frontier, ref[1])
            assert torch.equal(anc, ref_anc), (case, step)
            base, column = ref[2], end
        assert picks.finite and column == side - 1


def test_search_picks_zero_a_level_whose_logits_are_not_finite(kernels: nk.NativeKernels) -> None:
    picks = nk.SearchPicks(kernels, 2, 4, None)
    picks.level(torch.randn(2, 50), k=2, width=2, frontier=0, grow=False)
    x = torch.randn(4, 50)
    x[3, 7] = float("nan")
    picks.level(x, k=1, width=2, frontier=1, grow=False)
    assert not picks.finite
    assert (picks.tokens[:, 2:] == 0).all() and (picks.parents[:, 2:] == 1).all()
    assert (picks.log_probs[:, 2:] == 0).all()
    assert (picks.parents[:, :2] == 0).all() and np.isfinite(picks.log_probs[:, :2]).all()  # level 1 as picked


def test_search_picks_refuse_what_their_pointers_would_misread(kernels: nk.NativeKernels) -> None:
    """Every pointer SearchPicks hands the C code is one of its own arrays': a level that does not fit them, or
    rows the kernel would misread, is a clear error."""
    with pytest.raises(ValueError, match="SearchPicks"):
        nk.SearchPicks(kernels, 2, 4, torch.zeros((2, 5, 5), dtype=torch.int64))  # not bool rows
    with pytest.raises(ValueError, match="SearchPicks"):
        nk.SearchPicks(kernels, 2, 4, torch.zeros((3, 5, 5), dtype=torch.bool))  # another request count
    picks = nk.SearchPicks(kernels, 2, 4, torch.zeros((2, 5, 5), dtype=torch.bool))
    bad = [
        dict(x=torch.randn(3, 50), k=2, width=2),  # 3 rows for 2 requests' 1 frontier node
        dict(x=torch.randn(2, 1, 50), k=2, width=2),  # not [n * F, V] rows
        dict(x=torch.randn(2, 50), k=0, width=2),  # no pick
        dict(x=torch.randn(2, 50), k=65, width=None),  # past the kernel's 64 picks a row
        dict(x=torch.randn(2, 50), k=5, width=None),  # 5 nodes where 4 are left
    ]
    for kw in bad:
        with pytest.raises(ValueError, match="SearchPicks"):
            picks.level(frontier=0, grow=False, **kw)
    picks.level(torch.randn(2, 50), k=2, width=2, frontier=0, grow=False)
    with pytest.raises(ValueError, match="SearchPicks"):  # a frontier that puts the level's rows past the 5
        picks.level(torch.randn(4, 50), k=1, width=2, frontier=2, grow=True)
    nogrow = nk.SearchPicks(kernels, 2, 4, None)
    nogrow.level(torch.randn(2, 50), k=1, width=1, frontier=0, grow=False)
    with pytest.raises(ValueError, match="SearchPicks"):  # growing rows it was not given
        nogrow.level(torch.randn(2, 50), k=1, width=1, frontier=0, grow=True)


def refine_reference(y: torch.Tensor, x: torch.Tensor, q: torch.Tensor, c: torch.Tensor, k: int) -> torch.Tensor:
    """head_refine's rows by its statement: each row's k greatest logits (ties to the lower id: a stable sort) from
    the int8 weights in float64, the rest as they were; a row holding a NaN as it was."""
    out = y.clone()
    for r in range(y.shape[0]):
        if torch.isnan(y[r]).any():
            continue
        top = torch.sort(y[r], descending=True, stable=True).indices[:k]
        out[r, top] = ((q[top].double() * c[top, None].double()) @ x[r].double()).float()
    return out


def test_head_refine_recomputes_each_rows_top_k_and_draws_its_first_maximum(kernels: nk.NativeKernels) -> None:
    """The refined values are the int8 weights' float32 product (float64's within rounding) at the row's k greatest
    logits, every other logit untouched; the draw is the refined row's first maximum (``first_argmax``) at widths
    that are and are not a multiple of 8: when the greatest refined value stands above the rest, when it falls
    below the (k+1)-th logit and when it equals it (the scan decides), with refined values tied among themselves,
    with ties at the k-th place, -inf and NaN logits, and an input whose refinement gives NaN."""
    gen = torch.Generator().manual_seed(11)
    for v in (6, 12, 40, 67, 256):
        k = 4
        dim = 20  # not a multiple of 8 lanes: the dot's tail too
        q = torch.randint(-127, 128, (v, dim), generator=gen, dtype=torch.int8)
        c = torch.rand(v, generator=gen) * 0.01
        x = torch.randn(9, dim, generator=gen)
        y = torch.randn(9, v, generator=gen) * 5
        y[1] = torch.randint(-2, 2, (v,), generator=gen).float()  # ties everywhere, at the k-th place too
        y[2, : v // 2] = float("-inf")
        y[3, v // 3] = float("nan")
        x[4, 0] = float("nan")  # its refined values are NaN: the first of them is the row's first maximum
        # row 5: a top k with one weight row between them (refined values tied) and a small scale (refined ~0),
        # below the (k+1)-th logit (90, at the lowest id of the five): the draw is that logit's, by the scan
        five = torch.randperm(v, generator=gen)[: k + 1].sort().values
        y[5, five[1:]] = 100 + torch.arange(k).float()
        y[5, five[0]] = 90.0
        q[five[1:]] = q[five[1]].clone()
        c[five[1:]] = 1e-6
        y[7, -1] = 100.0  # the maximum in the last place (the tail, when v % 8)
        # row 6: the (k+1)-th logit made equal to the greatest refined value, at a lower id than any of the top k
        six = torch.randperm(v, generator=gen)[: k + 1].sort().values
        y[6] = -1000.0  # below any refined value
        y[6, six[1:]] = 100 + torch.arange(k).float()
        y[6, six[0]] = 0.0
        probe = y[6:7].clone()
        kernels.head_refine(probe, x[6:7].clone(), q, c, k)
        y[6, six[0]] = probe[0, six[1:]].max()
        assert (y[6, six[1:]] > y[6, six[0]]).all()  # still the (k+1)-th
        want = refine_reference(y, x, q, c, k)
        got = y.clone()
        drawn = kernels.head_refine(got, x, q, c, k)
        finite = ~torch.isnan(want)
        torch.testing.assert_close(got[finite], want[finite], rtol=1e-5, atol=1e-5)
        assert torch.equal(torch.isnan(got), torch.isnan(want)), v
        assert int((got[0] != y[0]).sum()) <= k and torch.equal(got[3].nan_to_num(), y[3].nan_to_num()), v
        assert drawn.tolist() == got.argmax(-1).tolist() == kernels.first_argmax(got).tolist(), v
        assert int(drawn[5]) == int(five[0]) and int(drawn[6]) == int(six[0]), v


def test_head_refine_is_one_function_of_the_row(kernels: nk.NativeKernels) -> None:
    """Each row's refined logits and draw are bitwise the same alone, in any batch and at any thread count: 17 rows of
    4096 logits are past PARALLEL_MIN (65,536), so at two threads the batch runs on OpenMP's threads, a row alone
    on the caller's."""
    gen = torch.Generator().manual_seed(5)
    v, rows = 4096, 17
    q = torch.randint(-127, 128, (v, 64), generator=gen, dtype=torch.int8)
    c = torch.rand(v, generator=gen) * 0.02
    x, y = torch.randn(rows, 64, generator=gen), torch.randn(rows, v, generator=gen)
    threads = torch.get_num_threads()
    try:
        for t in (1, 2):
            torch.set_num_threads(t)
            whole = y.clone()
            drawn = kernels.head_refine(whole, x, q, c, 16)
            for r in range(rows):
                alone = y[r : r + 1].clone()
                assert kernels.head_refine(alone, x[r : r + 1].clone(), q, c, 16).tolist() == [int(drawn[r])]
                assert torch.equal(alone[0], whole[r]), (t, r)
                assert int(drawn[r]) == int(whole[r].argmax())
    finally:
        torch.set_num_threads(threads)


def test_head_refine_refuses_what_its_pointers_would_misread(kernels: nk.NativeKernels) -> None:
    q, c = torch.zeros(10, 32, dtype=torch.int8), torch.ones(10)
    y, x = torch.zeros(2, 10), torch.zeros(2, 32)
    bad = [
        (y.double(), x, q, c, 2),
        (y, x[:1], q, c, 2),  # rows that do not match
        (y, x, q.float(), c, 2),
        (torch.zeros(10, 2).t(), x, q, c, 2),  # strided
        (y, x, q, c, 0),
        (y, x, q, c, 10),  # k = V: nothing outside the top k to compare with
    ]
    for args in bad:
        with pytest.raises(ValueError, match="head_refine"):
            kernels.head_refine(*args)
