"""Weight-only int8 / int4 layers (quant.py): the kernels against the dequantized weight, rows independent of
the batch, the loader's ``weights`` option, and losslessness with the quantized model as the target."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from adaserve.engine.config import EngineConfig
from adaserve.engine.engine import Engine
from adaserve.engine.loading.loader import load_model
from adaserve.engine.model.kv_cache import KVCacheConfig
from adaserve.engine.model.quant import (
    KERNEL_DTYPE,
    Int4Linear,
    Int8Embedding,
    Int8Linear,
    QuantLinear,
    concat_linears,
    dequantize_stored,
    pack_nibbles,
    pack_nibbles_for_cuda,
    quantize_head,
    quantize_linear,
    weight_bytes,
)
from adaserve.engine.model.runner import ModelRunner
from adaserve.engine.request import Request
from adaserve.engine.speculation.sampling import SamplingParams
from tests.engine.helpers import use_cpu_kernels

CPU = torch.device("cpu")
# The kernels take bfloat16 activations and (int4) a bfloat16 scale/zero table, and return bfloat16: against
# x @ W_deq^T in float32 a layer is off by bfloat16's rounding of its input, table and output, about 2^-8 of
# the output's size. Stated bound: 1% of the largest |output|.
# The integer kernels (native_kernels.py) quantize the activations to int8 per 32: about 2^-8 of a block's
# largest |x| per input, well inside the same bound.
REL_TOL = 1e-2


@pytest.fixture(autouse=True, params=["torch", "native"])
def cpu_kernels(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Every test here on both CPU kernel families: torch's bfloat16 kernels and the integer ones."""
    use_cpu_kernels(str(request.param), monkeypatch)
    return str(request.param)


def within_tolerance(layer: QuantLinear, x: torch.Tensor) -> tuple[float, float]:
    ref = x @ layer.dequantized().t()
    return (layer(x) - ref).abs().max().item(), REL_TOL * ref.abs().max().item()


# CUDA runs torch's kernels only (run with --with-gpu; scripts/gpu-checklist.sh): not twice, under both CPU families
DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]


def on_device(device: str, cpu_kernels: str) -> torch.device:
    if device == "cuda" and cpu_kernels == "native":
        pytest.skip("one kernel family on CUDA: torch's")
    return torch.device(device)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("shape", [(64, 64), (96, 128), (1536, 576), (576, 1536)])
@pytest.mark.parametrize("kind", ["int8", "int4"])
def test_layer_matches_dequantized_reference(shape: tuple[int, int], kind: str, device: str, cpu_kernels: str) -> None:
    dev = on_device(device, cpu_kernels)
    torch.manual_seed(0)
    w = (torch.randn(*shape) * 0.2).to(dev)
    layer = quantize_linear(w, torch.randn(shape[0]).to(dev), kind, keep_source=True)
    assert isinstance(layer, Int8Linear if kind == "int8" else Int4Linear)
    assert next(layer.buffers()).device.type == dev.type
    x = torch.randn(7, shape[1]).to(dev)
    ref = x @ layer.dequantized().t() + layer.bias
    err, tol = (layer(x) - ref).abs().max().item(), REL_TOL * ref.abs().max().item()
    assert err <= tol, (kind, shape, err, tol)
    # and the dequantized weight is the float weight within one quantisation step
    step = w.abs().max().item() / 127 if kind == "int8" else (w.max() - w.min()).item() / 15
    assert (layer.dequantized() - w).abs().max().item() <= step


def test_q4_1_block_maps_to_the_kernels_scale_and_zero() -> None:
    """GGUF Q4_1 keeps float16 (d, m) per 32 weights, w = d q + m; the kernel computes (q - 8) scale + zero
    with scale = d, zero = m + 8 d. Q4_0 (w = d (q - 8)) is m = -8 d."""
    torch.manual_seed(1)
    n, k = 48, 96
    codes = torch.randint(0, 16, (n, k), dtype=torch.uint8)
    d = (torch.rand(n, k // 32) * 0.05 + 0.001).half()
    for m in ((torch.randn(n, k // 32) * 0.2).half(), -8 * d):
        layer = Int4Linear(codes, d, m, keep_source=True)
        exact = d.float().repeat_interleave(32, 1) * codes.float() + m.float().repeat_interleave(32, 1)
        assert torch.equal(layer.dequantized(), exact)
        err, tol = within_tolerance(layer, torch.randn(5, k))
        assert err <= tol
    if layer.native is not None:  # the integer kernels read d and m as they are
        assert torch.equal(layer.d32, d.float()) and torch.equal(layer.m32, m.float())
        return
    # the (scale, zero) table torch's kernel reads: [K/32, N, 2]
    assert layer.scales_and_zeros.shape == (k // 32, n, 2) and layer.scales_and_zeros.dtype == KERNEL_DTYPE
    assert torch.equal(layer.scales_and_zeros[..., 1].float(), torch.zeros(k // 32, n))  # Q4_0: zero is 0


@pytest.mark.parametrize("kind", ["int8", "int4", "head"])
def test_rows_do_not_depend_on_the_batch_or_threads(kind: str) -> None:
    """Decode (1 row), prefill chunks and verification trees (many rows) must see one function. ``head``: the int8
    LM head, whose refined top rows once went through ``einsum`` (a batched matmul whose order follows the number
    of rows: a verified row's logits differed from the same row decoded alone by ~1e-5)."""
    from adaserve.engine.model.quant import Int8Head, quantize_int8

    torch.manual_seed(2)
    w = torch.randn(96, 128) * 0.2
    layer = Int8Head(*quantize_int8(w), refine=16) if kind == "head" else quantize_linear(w, None, kind)
    assert layer is not None
    x = torch.randn(33, 128)
    full = layer(x)
    threads = torch.get_num_threads()
    try:
        for t in (1, 2):
            torch.set_num_threads(t)
            for m in (1, 2, 3, 5, 8, 16, 17):
                assert torch.equal(layer(x[:m]), full[:m]), (kind, t, m)
            assert torch.equal(torch.cat([layer(x[i:i + 1]) for i in range(33)]), full)
    finally:
        torch.set_num_threads(threads)


def test_shapes_the_int4_kernel_cannot_take_stay_float() -> None:
    assert quantize_linear(torch.randn(97, 64), None, "int4") is None  # N not a multiple of 16
    assert quantize_linear(torch.randn(64, 48), None, "int4") is None  # K not a multiple of the group
    assert isinstance(quantize_linear(torch.randn(97, 48), None, "int8"), Int8Linear)


@pytest.mark.parametrize("weights", ["float", "auto", "int8", "int4"])
def test_loader_weights_option_on_a_float_checkpoint(target_dir: Path, weights: str, cpu_kernels: str) -> None:
    model = load_model(target_dir, device=CPU, weights=weights)
    blocks = {type(m).__name__ for n, m in model.named_modules() if isinstance(m, QuantLinear) and ".layers." in n}
    assert blocks == ({"Int8Linear"} if weights == "int8" else {"Int4Linear"} if weights == "int4" else set())
    if weights in ("int8", "int4"):  # the head and the embedding in int8, one table for the tied pair
        assert isinstance(model.lm_head, Int8Linear) and isinstance(model.model.embed_tokens, Int8Embedding)
        tied = model.lm_head.qweight is model.model.embed_tokens.qweight
        assert tied == model.cfg.tie_word_embeddings
        assert model.lm_head.weight.dtype == torch.float32  # what the runner reads for the model's dtype
        attn, mlp = model.model.layers[0].self_attn, model.model.layers[0].mlp
        assert mlp.gate_up_proj is not None and mlp.gate_proj is None
        assert (attn.qkv_proj is None) == (attn.q_proj is not None)  # joined, or (int4, k/v of 32 rows) apart
        assert weight_bytes(model) < weight_bytes(load_model(target_dir, device=CPU)) / 3
        # on the integer kernels the norms use them too (layers.CausalLM.use_native_kernels)
        assert (model.model.norm.native is not None) == (cpu_kernels == "native")
    else:  # float32 on a CPU: not on the integer kernels, yet its norms (and attention) on their library
        assert not isinstance(model.lm_head, QuantLinear) and model.native is None
        assert (model.model.norm.native is not None) == (cpu_kernels == "native")


@pytest.mark.parametrize("kind", ["int8", "int4"])
def test_joined_layers_give_their_parts_outputs_bitwise(kind: str, cpu_kernels: str) -> None:
    """q/k/v and gate/up joined into one product: the same function, only fewer calls."""
    torch.manual_seed(3)
    sizes = (128, 64, 32)  # int4: parts but the last fill the CPU packing's 64-row blocks
    parts = [quantize_linear(torch.randn(n, 128) * 0.2, torch.randn(n), kind, keep_source=True) for n in sizes]
    joined = concat_linears(parts)
    assert joined is not None and joined.out_features == 224 and type(joined) is type(parts[0])
    for m in (1, 3, 17):
        x = torch.randn(m, 128)
        assert torch.equal(joined(x), torch.cat([p(x) for p in parts], dim=-1)), (kind, m)
    assert torch.equal(joined.dequantized(), torch.cat([p.dequantized() for p in parts]))
    assert concat_linears([parts[0], quantize_linear(torch.randn(32, 64), None, kind)]) is None  # other K
    unaligned = concat_linears([parts[2], parts[1]])  # torch's int4: a 32-row part first would shift its blocks
    assert (unaligned is None) == (kind == "int4" and cpu_kernels == "torch")
    if unaligned is not None:  # the integer kernels keep every output row on its own: any order joins
        x = torch.randn(5, 128)
        assert torch.equal(unaligned(x), torch.cat([parts[2](x), parts[1](x)], dim=-1))


def test_int8_head_and_embedding_match_their_float_table() -> None:
    torch.manual_seed(4)
    table = torch.randn(97, 64) * 0.5
    model = torch.nn.Module()
    model.model = torch.nn.Module()
    model.model.embed_tokens = torch.nn.Embedding(97, 64, _weight=table.clone())
    model.lm_head = torch.nn.Linear(64, 97, bias=False)
    model.lm_head.weight = model.model.embed_tokens.weight  # tied
    quantize_head(model)
    step = table.abs().amax(dim=1, keepdim=True) / 127  # one quantisation step per row
    ids = torch.tensor([0, 5, 96, 5])
    assert ((model.model.embed_tokens(ids) - table[ids]).abs() <= step[ids] / 2 + 1e-6).all()
    x = torch.randn(4, 64)
    err, tol = within_tolerance(model.lm_head, x)
    assert err <= tol


def write_stored(src: Path, out: Path, kind: str) -> Path:
    """``src`` as a checkpoint that stores its decoder layers quantized (as the GGUF conversion writes them)."""
    import shutil

    model = load_model(src, device=CPU)
    tied = model.cfg.tie_word_embeddings
    tensors = {k: v for k, v in model.state_dict().items() if k != "lm_head.weight" or not tied}
    for name, mod in list(model.named_modules()):
        if ".layers." in name and isinstance(mod, torch.nn.Linear):
            layer = quantize_linear(mod.weight.detach(), None, kind, keep_source=True)
            assert layer is not None
            del tensors[f"{name}.weight"]
            tensors.update(layer.stored_tensors(name))
    out.mkdir()
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(out / "model.safetensors"))
    shutil.copy(src / "config.json", out / "config.json")
    return out


def test_stored_quantized_layers_load_as_stored_or_as_asked(target_dir: Path, tmp_path: Path) -> None:
    stored = write_stored(target_dir, tmp_path / "int4", "int4")
    auto = load_model(stored, device=CPU, weights="auto")
    at_load = load_model(target_dir, device=CPU, weights="int4")  # the same codes, quantized while loading
    for name in ("model.layers.0.mlp.gate_up_proj", "model.layers.1.mlp.down_proj"):
        a, b = auto.get_submodule(name), at_load.get_submodule(name)
        assert isinstance(a, Int4Linear) and isinstance(b, Int4Linear)
        y = torch.randn(3, a.in_features)
        assert torch.equal(a(y), b(y))
    floated = load_model(stored, device=CPU, weights="float")
    from safetensors import safe_open

    with safe_open(str(stored / "model.safetensors"), framework="pt") as fh:
        tensors = {k: fh.get_tensor(k) for k in fh.keys()}  # noqa: SIM118 - safe_open is not a mapping
    w = floated.get_submodule("model.layers.0.mlp.up_proj").weight
    assert torch.equal(w, dequantize_stored(tensors, "model.layers.0.mlp.up_proj"))
    int8 = load_model(stored, device=CPU, weights="int8")
    assert isinstance(int8.get_submodule("model.layers.0.mlp.gate_up_proj"), Int8Linear)
    # a quantized model owns its tensors: no view of the checkpoint's map (a view keeps the whole map resident)
    for model in (auto, int8, load_model(write_stored(target_dir, tmp_path / "int8", "int8"), device=CPU)):
        assert all(t._base is None for t in [*model.parameters(), *model.buffers()])


# ---- losslessness: the quantized model is the target ------------------------------------------------------

def quantized_runner(path: Path, weights: str, device: torch.device = CPU) -> ModelRunner:
    cfg = EngineConfig(attention="torch", kv=KVCacheConfig(page_size=4, num_pages=4000))
    # float32 activations around the kernels on a GPU too: greedy equality is exact there, not up to near-ties
    return ModelRunner(load_model(path, device=device, dtype=torch.float32, weights=weights), cfg)


def workload(n: int, seed: int) -> list[Request]:
    rng = random.Random(seed)
    return [Request(f"r{i}", [rng.randrange(2, 97) for _ in range(rng.randrange(1, 30))],
                    SamplingParams(max_tokens=rng.randrange(2, 30), ignore_eos=True)) for i in range(n)]


def own_greedy(target: Path, weights: str, reqs: list[Request], device: torch.device = CPU) -> dict[str, list[int]]:
    """The quantized target's greedy output without speculation, one request at a time, prefill unchunked."""
    out = {}
    for r in reqs:
        eng = Engine(quantized_runner(target, weights, device), None, EngineConfig(policy="incremental"))
        req = Request(r.request_id, list(r.prompt_ids), r.params)
        eng.add_request(req)
        while eng.has_work:
            eng.step()
        out[r.request_id] = req.output_ids
    return out


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("weights", ["int4", "int8"])
@pytest.mark.parametrize("policy", ["adaserve", "chain:4", "specinfer"])
@pytest.mark.parametrize("draft", ["random", "self"])
def test_speculation_is_lossless_against_the_quantized_target(target_dir: Path, draft_dir: Path, weights: str,
                                                               policy: str, draft: str, device: str,
                                                               cpu_kernels: str) -> None:
    dev = on_device(device, cpu_kernels)
    reqs = workload(8, 5)
    ref = own_greedy(target_dir, weights, reqs, dev)
    drf = quantized_runner(target_dir if draft == "self" else draft_dir, weights, dev)
    eng = Engine(quantized_runner(target_dir, weights, dev), drf,
                 EngineConfig(policy=policy, budget=20, prefill_chunk=12))
    queue = list(reqs)
    while queue or eng.has_work:  # arrivals while others are mid-generation
        if queue:
            eng.add_request(queue.pop(0))
        eng.step()
    for r in reqs:
        assert r.output_ids == ref[r.request_id], (weights, policy, draft, r.request_id)
    if draft == "self":  # the quantized target drafting for itself: every verification agrees with it
        assert sum(m.tokens_accepted for m in eng.history) > 0



@pytest.mark.parametrize("policy", ["adaserve", "incremental"])
def test_greedy_draws_take_the_int8_heads_own_maxima(target_dir: Path, draft_dir: Path, policy: str,
                                                    cpu_kernels: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """On the integer kernels the int8 head's refinement finds each row's first maximum (Int8Head.last_argmax, the
    runner's ``last_argmax``): the greedy walks take it and scan no logits, and emit what the scan emits (the head's
    maxima withheld). On torch's kernels there are none, and the walks scan. A greedy request whose logits a
    processor changes (a logit bias that makes token 7 win) draws from its own rows, never from the head's maxima."""
    from adaserve.engine.model.quant import Int8Head
    from adaserve.engine.speculation import verify

    scans = []
    scan = verify.first_argmax
    monkeypatch.setattr(verify, "first_argmax", lambda rows, **kw: scans.append(rows.shape[0]) or scan(rows, **kw))

    def outputs(biased: bool = False) -> dict[str, list[int]]:
        reqs = workload(6, 9)
        if biased:
            reqs.append(Request("biased", [5, 9, 11], SamplingParams(max_tokens=6, ignore_eos=True,
                                                                      logit_bias=((7, 1000.0),))))
        drf = quantized_runner(draft_dir, "int4") if policy != "incremental" else None
        eng = Engine(quantized_runner(target_dir, "int4"), drf, EngineConfig(policy=policy, budget=20))
        for r in reqs:
            eng.add_request(r)
        while eng.has_work:
            eng.step()
        return {r.request_id: r.output_ids for r in reqs}

    with_maxima = outputs()
    assert bool(scans) == (cpu_kernels == "torch")  # the walks scanned only where the head found no maxima
    assert outputs(biased=True)["biased"] == [7] * 6  # its processed rows, scanned
    forward = Int8Head.forward

    def without_maxima(self: Int8Head, x: torch.Tensor) -> torch.Tensor:
        y = forward(self, x)
        self.last_argmax = None
        return y

    monkeypatch.setattr(Int8Head, "forward", without_maxima)
    scans.clear()
    assert outputs() == with_maxima
    assert scans  # now every greedy draw scanned


def test_auto_serves_stored_layers_as_stored_on_a_cpu_and_as_float_on_a_gpu(target_dir: Path,
                                                                            tmp_path: Path) -> None:
    """``auto``: the packed kernels are a CPU's fast path, a bf16 product in a CUDA graph a GPU's (the loader's
    one device-dependent choice, loader.served_kind); on the CPU a stored int4 layer stays int4."""
    from adaserve.engine.loading.loader import served_kind

    assert served_kind("int4", "auto", "cpu") == "int4" and served_kind("int8", "auto", "cpu") == "int8"
    assert served_kind("int4", "auto", "cuda") == "float" and served_kind("int8", "auto", "cuda") == "float"
    assert served_kind("int4", "int8", "cuda") == "int8" and served_kind("int8", "float", "cpu") == "float"
    stored = write_stored(target_dir, tmp_path / "stored", "int4")
    kept = load_model(stored, device=torch.device("cpu"), weights="auto")
    assert isinstance(kept.model.layers[0].mlp.down_proj, QuantLinear)


def test_int8_head_resolves_a_near_tie_its_bfloat16_output_cannot(cpu_kernels: str) -> None:
    """Two rows whose float32 logits differ by 0.025 at ~25 (bfloat16's step there is 0.125): the kernel's
    output ties them, the refined head keeps them apart as the dequantized float32 product does."""
    from adaserve.engine.model.quant import Int8Head, quantize_int8

    gen = torch.Generator().manual_seed(0)
    w = torch.randn(64, 32, generator=gen) * 0.1
    w[0] = torch.randn(32, generator=gen)
    w[1] = w[0] * (1 + 1e-3)  # a near-copy of row 0, a hair larger: a tie would go to row 0, wrongly
    x = (w[0] * 25.0 / float(w[0] @ w[0])).expand(3, 32).clone()  # row 0's logit 25, the largest
    head = Int8Head(*quantize_int8(w), refine=4)
    ref = x @ head.dequantized().T  # the int8 weights' product in float32
    plain = Int8Linear(head.qweight, head.scales32)(x)
    got = head(x)
    assert float(ref[0, 1] - ref[0, 0]) > 0.01  # apart in float32 ...
    if cpu_kernels == "torch":
        assert float(plain[0, 0]) == float(plain[0, 1])  # ... tied in the kernel's bfloat16 output
        assert int(plain[0].argmax()) == 0  # what greedy took before
    else:  # the integer kernels return float32: apart already
        assert int(plain[0].argmax()) == 1
    assert int(got[0].argmax()) == int(ref[0].argmax()) == 1
    top = plain[0].float().topk(4).indices  # the rows the head recomputed: float32's values there
    torch.testing.assert_close(got[0, top], ref[0, top], rtol=1e-5, atol=1e-4)
    assert torch.equal(got[0], got[2])  # one function of the row: the batch does not change it


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_int8_quantization_in_row_blocks_is_the_whole_tables(dtype: torch.dtype) -> None:
    """quantize_int8 works ``rows`` rows at a time (a few MB of temporaries, not several tables): every step is
    per row, so blocks of any size give the codes and scales of one pass over the table, bit for bit."""
    from adaserve.engine.model.quant import quantize_int8

    gen = torch.Generator().manual_seed(0)
    w = (torch.randn(300, 48, generator=gen) * 3).to(dtype)
    w[7] = 0  # a zero row: the smallest scale
    whole = quantize_int8(w, rows=len(w))
    for rows in (1, 7, 64, 299):
        q, s = quantize_int8(w, rows=rows)
        assert q.dtype == torch.int8 and s.dtype == torch.float32
        assert torch.equal(q, whole[0]) and torch.equal(s, whole[1])
    ref = w.float()
    scales = (ref.abs().amax(dim=1) / 127).clamp(min=torch.finfo(torch.float32).tiny)
    assert torch.equal(whole[1], scales)
    assert torch.equal(whole[0], torch.round(ref / scales[:, None]).clamp(-127, 127).to(torch.int8))


# ---- CUDA: torch's int4 and int8 kernels there (run with --with-gpu; scripts/gpu-checklist.sh) ----------------

def test_cuda_int4_packing_puts_the_even_column_in_the_high_nibble() -> None:
    """``_convert_weight_to_int4pack`` on CUDA takes [N, K/2] uint8 with the even column high (torch's own tests
    pack so), the reverse of the stored form's ``pack_nibbles``."""
    codes = torch.tensor([[1, 2, 3, 4], [15, 0, 7, 8]], dtype=torch.uint8)
    assert pack_nibbles_for_cuda(codes).tolist() == [[0x12, 0x34], [0xF0, 0x78]]
    assert pack_nibbles(codes).tolist() == [[0x21, 0x43], [0x0F, 0x87]]
