"""Weight-only quantized linear layers on torch's packed kernels: int8 per output row, int4 group-wise.

y = x W^T + b with W kept in integers and expanded inside the kernel (the activations stay in the model's
float dtype). The kernels are torch's own (the layout gpt-fast uses), so there is no new runtime:

    int8   W = s[n] * q[n, k],             q int8,  one scale per output row
           torch.ops.aten._weight_int8pack_mm(x, q, s)                       CPU and CUDA
    int4   W = d[n, g] * q[n, k] + m[n, g],  q in 0..15, g = k // group    (GGUF Q4_1's block form)
           CPU:  _convert_weight_to_int4pack_for_cpu / _weight_int4pack_mm_for_cpu
           CUDA: _convert_weight_to_int4pack / _weight_int4pack_mm (bfloat16 activations)

By default on any x86-64 CPU where they build (``ADASERVE_NATIVE_KERNELS=auto``; ``native_kernels.chosen``),
both kinds run instead on integer kernels built from ``native/q8dot.c``: the activations are quantized to int8
per block of 32, as llama.cpp does, and the products are exact integer sums (native_kernels.py). They are ~2.2x
faster than torch's at one row on an AVX2-only EPYC (SmolLM2's 1536x576 product: 0.067 against 0.147 ms, one
thread, timed under load), and a lone int4 step is ~1.5x faster on them on an AVX512-BF16 EPYC
(docs/benchmarks.md). Their rows are independent too, bitwise, so the same holds as below; the served model is
then the one with int8 activations. ``ADASERVE_NATIVE_KERNELS=off`` keeps torch's kernels, described next.

Torch's kernels run on bfloat16 activations, on CPU as on CUDA: layer inputs are rounded to bfloat16,
outputs come back in bfloat16 and are widened to the model's dtype. On the development CPU (AVX512-BF16,
one thread, SmolLM2's 1536x576 MLP product at one row) float32 ``x @ W^T`` takes ~0.4-0.7 ms, int4 on
bfloat16 0.14 ms and int8 0.21 ms, while the same kernels on float32 activations take 3.8 and 1.4 ms
(an unvectorised fallback). The kernels' rows are independent: a row's result is bitwise the same
whatever the number of rows M and the thread count (checked in the tests), so decode, prefill chunks
and verification trees see one function, as losslessness needs.

The int4 kernels compute ``(q - 8) * scale + zero`` per group, from a ``[K/group, N, 2]`` table of
(scale, zero). A block ``d * q + m`` is that with ``scale = d`` and ``zero = m + 8 d`` (GGUF Q4_0,
``d * (q - 8)``, is ``m = -8 d``, zero 0); ``tests/engine/model/test_quant.py`` checks the identity
against the dequantized weight. The table is held in bfloat16 (the kernel takes x's dtype), so a
quantized layer equals its dequantized float twin only within bfloat16's tolerance (about 1% of the
largest output, stated in the test), never bitwise: losslessness is stated against the *quantized*
target, which serves every path (decode, prefill, verification) with the same modules.

Stored form (what the conversion cache writes for a GGUF model, and ``stored_tensors`` returns):

    int8   ``P.qweight`` int8 [N, K], ``P.scales`` float32 [N]
    int4   ``P.qweight`` uint8 [N, K/2] (two codes a byte, the even column in the low nibble),
           ``P.d`` and ``P.m`` [N, K/group] (float16 straight from a GGUF Q4 block, float32 otherwise)

It is portable: the kernels' packed layouts depend on the device (and the CPU one on its ISA), so
packing happens at load. Which layers: every linear layer of the decoder blocks (attention q/k/v/o and
the MLP) in the kind asked for; and, whenever those are quantized, the LM head and the token embedding in
int8 (``quantize_head``). The head is the widest product of a small model (SmolLM2: 49152 x 576, 113 MB in
float32, a fifth of a lone request's decode step at one thread, and as much memory as all 30 blocks in
int4); int8 per row keeps it at 8 bits, as the GGUF file does (its table is Q8_0), where int4 would halve
its precision. A tied pair shares one int8 table: the embedding is a row lookup of it, ``q[id] * s[id]``.
The norms stay float.

Fused products (``concat_linears``): on CPU a decoder block's q/k/v and gate/up layers of one kind are
joined into one layer each (``CausalLM.fuse_projections``), 4 kernel calls a block instead of 7. The CPU
packing works in blocks of 64 rows (int8: row by row) and each output column is computed on its own, so a
layer joined from parts that fill whole blocks gives bitwise its parts' outputs side by side (tested):
fusing changes the speed, never the served function. Parts that do not fill their blocks stay apart.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from adaserve.engine.model import native_kernels
from adaserve.engine.model.native_kernels import NativeKernels

WEIGHTS = ("float", "int8", "int4", "auto")  # "auto": the precision the file holds
KINDS = ("int8", "int4")
INT4_GROUP = 32  # GGUF's block size; the int4 kernels take 32, 64, 128 or 256
_INT4_GROUPS = (32, 64, 128, 256)
_CUDA_INNER_K_TILES = (8, 4, 2)
_CPU_PACK_ROWS = 64  # the CPU int4 packing interleaves rows in blocks of 64 (concat_linears)
KERNEL_DTYPE = torch.bfloat16  # the activations' dtype inside both kernels (see the module docstring)


def check_weights(weights: str) -> str:
    if weights not in WEIGHTS:
        raise ValueError(f"unknown weights {weights!r}: use {', '.join(WEIGHTS)}")
    return weights


def quantizable_linears(model: nn.Module) -> list[str]:
    """Names of the linear layers a quantized model keeps in integers: every ``nn.Linear`` of the decoder
    blocks (not the LM head, see the module docstring)."""
    return [name for name, m in model.named_modules() if isinstance(m, nn.Linear) and ".layers." in f".{name}"]


def swap_module(model: nn.Module, name: str, new: nn.Module) -> None:
    parent, _, leaf = name.rpartition(".")
    setattr(model.get_submodule(parent) if parent else model, leaf, new)


class QuantLinear(nn.Module):
    """A weight-only quantized ``nn.Linear``: ``in_features``, ``out_features``, an optional float ``bias``."""

    kind = ""

    def __init__(self, in_features: int, out_features: int, bias: torch.Tensor | None, *,
                 dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu") -> None:
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.bias = nn.Parameter(bias, requires_grad=False) if bias is not None else None
        # zero-size, in the float dtype and on the device the layer computes for: code that reads a linear
        # layer's ``weight.dtype`` / ``weight.device`` (the runner reads the LM head's) keeps working
        self.register_buffer("weight", torch.empty(0, dtype=dtype, device=device), persistent=False)

    def product(self, x: torch.Tensor) -> torch.Tensor:  # x [M, K] contiguous
        raise NotImplementedError

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dim() == 2 and x.is_contiguous():  # the usual case: [T, K], one call fewer per op
            y = self.product(x)
            return y if self.bias is None else y + self.bias
        lead = x.shape[:-1]
        y = self.product(x.reshape(-1, self.in_features).contiguous())
        if self.bias is not None:
            y = y + self.bias
        return y.reshape(*lead, self.out_features)

    def dequantized(self) -> torch.Tensor:
        """W as float32 [N, K]: the reference the kernel is checked against."""
        raise NotImplementedError

    def stored_tensors(self, prefix: str) -> dict[str, torch.Tensor]:
        raise NotImplementedError

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}"


class Int8Linear(QuantLinear):
    """int8 weights, one scale per output row (``_weight_int8pack_mm``)."""

    kind = "int8"

    def __init__(self, qweight: torch.Tensor, scales: torch.Tensor, bias: torch.Tensor | None = None, *,
                 dtype: torch.dtype = torch.float32) -> None:
        n, k = qweight.shape
        super().__init__(k, n, None if bias is None else bias.to(dtype), dtype=dtype, device=qweight.device)
        if qweight.dtype != torch.int8 or scales.shape != (n,):
            raise ValueError(f"int8 layer needs int8 [N, K] codes and [N] scales, got {qweight.dtype} "
                             f"{tuple(qweight.shape)} and {tuple(scales.shape)}")
        self.register_buffer("qweight", qweight.contiguous())
        self.register_buffer("scales", scales.to(KERNEL_DTYPE).contiguous())  # the kernel wants x's dtype
        self.register_buffer("scales32", scales.float().clone(), persistent=False)  # embedding, dequantized()
        self.native = native_for(qweight.device, k)

    def product(self, x: torch.Tensor) -> torch.Tensor:
        if self.native is not None:
            return self.native.mm_q8(x.float().contiguous(), self.qweight, self.scales32).to(x.dtype)
        return torch.ops.aten._weight_int8pack_mm(x.to(KERNEL_DTYPE), self.qweight, self.scales).to(x.dtype)

    def dequantized(self) -> torch.Tensor:
        return self.qweight.float() * self.scales32.to(self.qweight.device)[:, None]

    def stored_tensors(self, prefix: str) -> dict[str, torch.Tensor]:
        return {f"{prefix}.qweight": self.qweight.cpu(), f"{prefix}.scales": self.scales32.cpu()}


class Int4Linear(QuantLinear):
    """int4 weights in groups of ``group`` along K, ``W = d * q + m`` per group (q in 0..15)."""

    kind = "int4"

    def __init__(self, codes: torch.Tensor, d: torch.Tensor, m: torch.Tensor, bias: torch.Tensor | None = None, *,
                 dtype: torch.dtype = torch.float32, keep_source: bool = False) -> None:
        """``keep_source``: also keep the codes and (d, m) as given, for ``dequantized`` and
        ``stored_tensors`` (tests, writing); a served layer holds only the kernel's packed form."""
        n, k = codes.shape
        if k % d.shape[1] or d.shape != m.shape or d.shape[0] != n:
            raise ValueError(f"int4 layer: codes {tuple(codes.shape)} do not match d {tuple(d.shape)} "
                             f"and m {tuple(m.shape)}")
        group = k // d.shape[1]
        if group not in _INT4_GROUPS:
            raise ValueError(f"int4 group size {group} is not one the kernels take ({_INT4_GROUPS})")
        super().__init__(k, n, None if bias is None else bias.to(dtype), dtype=dtype, device=codes.device)
        self.group = group
        self.source = (pack_nibbles(codes), d, m) if keep_source else None
        dev = codes.device
        self.cuda = dev.type == "cuda"
        self.native = native_for(dev, k) if group == native_kernels.BLOCK else None
        if self.native is not None:  # the integer kernels' own form: codes in blocks, float32 d and m
            self.register_buffer("blocks", native_kernels.q4_blocks(codes))
            self.register_buffer("d32", d.float().contiguous())
            self.register_buffer("m32", m.float().contiguous())
            return
        # (scale, zero) per group for ``(q - 8) * scale + zero``: zero = m + 8 d, computed in float32
        sz = torch.stack([d.float(), m.float() + 8 * d.float()], dim=-1)  # [N, G, 2]
        self.register_buffer("scales_and_zeros", sz.transpose(0, 1).contiguous().to(KERNEL_DTYPE))
        if self.cuda:
            tiles = next((t for t in _CUDA_INNER_K_TILES if k % (t * 16) == 0), None)
            if tiles is None or n % 8:
                raise ValueError(f"int4 on CUDA needs K a multiple of 32 and N of 8, got K={k}, N={n}")
            packed = torch.ops.aten._convert_weight_to_int4pack(pack_nibbles_for_cuda(codes), tiles)
        else:
            if n % 16:
                raise ValueError(f"int4 on CPU needs N a multiple of 16, got N={n}")
            packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes.to(torch.int32).contiguous(), 2)
        self.register_buffer("packed", packed)

    @classmethod
    def joined(cls, packed: torch.Tensor, scales_and_zeros: torch.Tensor, *, in_features: int, group: int,
               bias: torch.Tensor | None, dtype: torch.dtype,
               source: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None) -> Int4Linear:
        """A layer from CPU-packed codes and their (scale, zero) table as they are (``concat_linears``)."""
        layer = cls.__new__(cls)
        QuantLinear.__init__(layer, in_features, packed.shape[0], bias, dtype=dtype, device=packed.device)
        layer.group, layer.source, layer.cuda, layer.native = group, source, False, None
        layer.register_buffer("scales_and_zeros", scales_and_zeros)
        layer.register_buffer("packed", packed)
        return layer

    @classmethod
    def joined_native(cls, parts: Sequence[Int4Linear], *, bias: torch.Tensor | None, dtype: torch.dtype,
                      source: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None) -> Int4Linear:
        """A layer from parts on the integer kernels: their blocks, d and m stacked (every output row is its own)."""
        layer = cls.__new__(cls)
        blocks = torch.cat([p.blocks for p in parts])
        QuantLinear.__init__(layer, parts[0].in_features, blocks.shape[0], bias, dtype=dtype, device=blocks.device)
        layer.group, layer.source, layer.cuda, layer.native = parts[0].group, source, False, parts[0].native
        layer.register_buffer("blocks", blocks)
        layer.register_buffer("d32", torch.cat([p.d32 for p in parts]))
        layer.register_buffer("m32", torch.cat([p.m32 for p in parts]))
        return layer

    def product(self, x: torch.Tensor) -> torch.Tensor:
        if self.native is not None:
            return self.native.mm_q4(x.float().contiguous(), self.blocks, self.d32, self.m32).to(x.dtype)
        mm = torch.ops.aten._weight_int4pack_mm if self.cuda else torch.ops.aten._weight_int4pack_mm_for_cpu
        return mm(x.to(KERNEL_DTYPE), self.packed, self.group, self.scales_and_zeros).to(x.dtype)

    def _source(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        if self.source is None:
            raise ValueError("this int4 layer kept only its packed form (build it with keep_source=True)")
        return self.source

    def dequantized(self) -> torch.Tensor:
        packed, d, m = self._source()
        return dequantize_int4(unpack_nibbles(packed), d, m)

    def stored_tensors(self, prefix: str) -> dict[str, torch.Tensor]:
        packed, d, m = self._source()
        return {f"{prefix}.qweight": packed.cpu(), f"{prefix}.d": d.cpu(), f"{prefix}.m": m.cpu()}


def native_for(device: torch.device, in_features: int) -> NativeKernels | None:
    """The integer kernels (native_kernels.py) for a new layer on ``device``, or None for torch's: CPU layers
    whose K is whole blocks of 32, where ``native_kernels.chosen`` picks them."""
    if device.type != "cpu" or in_features % native_kernels.BLOCK:
        return None
    return native_kernels.chosen()


def pack_nibbles(codes: torch.Tensor) -> torch.Tensor:
    """int4 codes [N, K] (0..15) two a byte, the even column in the low nibble: [N, K/2] uint8."""
    return (codes[:, 0::2] | (codes[:, 1::2] << 4)).to(torch.uint8).contiguous()


def pack_nibbles_for_cuda(codes: torch.Tensor) -> torch.Tensor:
    """int4 codes [N, K] (0..15) two a byte as CUDA's ``_convert_weight_to_int4pack`` takes them: [N, K/2] uint8,
    the even column in the high nibble (the order of torch's own tests, the reverse of ``pack_nibbles``)."""
    return ((codes[:, 0::2] << 4) | codes[:, 1::2]).to(torch.uint8).contiguous()


def unpack_nibbles(packed: torch.Tensor) -> torch.Tensor:
    return torch.stack([packed & 0xF, packed >> 4], dim=-1).reshape(packed.shape[0], 2 * packed.shape[1])


def dequantize_int4(codes: torch.Tensor, d: torch.Tensor, m: torch.Tensor) -> torch.Tensor:
    """``d * q + m`` per group, in float32 [N, K]."""
    group = codes.shape[1] // d.shape[1]
    return d.float().repeat_interleave(group, dim=1) * codes.float() + m.float().repeat_interleave(group, dim=1)


def quantize_int8(w: torch.Tensor, *, rows: int = 4096) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric per-row int8: codes and float32 scales (``amax / 127``) for a float W [N, K].

    ``rows`` rows at a time: every step is per row, so the result is the same, and the float32 temporaries
    stay a few MB where the whole table's were several times its size (SmolLM2's 113 MB head: ~300 MB at
    the load's peak)."""
    q = torch.empty(w.shape, dtype=torch.int8, device=w.device)
    scales = torch.empty(w.shape[0], dtype=torch.float32, device=w.device)
    for i in range(0, w.shape[0], rows):
        part = w[i:i + rows].float()
        s = (part.abs().amax(dim=1) / 127).clamp(min=torch.finfo(torch.float32).tiny)
        q[i:i + rows] = torch.round(part / s[:, None]).clamp(-127, 127)
        scales[i:i + rows] = s
    return q, scales


def quantize_int4(w: torch.Tensor, group: int = INT4_GROUP) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Asymmetric group-wise int4 (Q4_1's form): codes 0..15 [N, K] and float32 d, m [N, K/group],
    ``d = (max - min) / 15``, ``m = min`` per group."""
    n, k = w.shape
    g = w.float().reshape(n, k // group, group)
    lo, hi = g.amin(dim=-1), g.amax(dim=-1)
    d = ((hi - lo) / 15).clamp(min=torch.finfo(torch.float32).tiny)
    q = torch.round((g - lo[..., None]) / d[..., None]).clamp(0, 15).to(torch.uint8)
    return q.reshape(n, k), d, lo


def can_int4(n: int, k: int, group: int = INT4_GROUP) -> bool:
    return n % 16 == 0 and k % group == 0  # the CPU packing takes N in 16s (CUDA in 8s)


def quantize_linear(w: torch.Tensor, bias: torch.Tensor | None, kind: str, *, dtype: torch.dtype = torch.float32,
                    keep_source: bool = False) -> QuantLinear | None:
    """A quantized layer for a float weight, or None where ``kind`` cannot take its shape (it stays float)."""
    if kind == "int8":
        return Int8Linear(*quantize_int8(w), bias, dtype=dtype)
    if kind == "int4" and can_int4(*w.shape):
        return Int4Linear(*quantize_int4(w), bias, dtype=dtype, keep_source=keep_source)
    return None


def from_stored(tensors: dict[str, torch.Tensor], prefix: str, bias: torch.Tensor | None, *,
                dtype: torch.dtype, device: torch.device) -> QuantLinear:
    """The layer for ``prefix``'s stored tensors (see the module docstring)."""
    q = tensors[f"{prefix}.qweight"].to(device)
    if q.dtype == torch.int8:
        return Int8Linear(q, tensors[f"{prefix}.scales"].to(device), bias, dtype=dtype)
    return Int4Linear(unpack_nibbles(q), tensors[f"{prefix}.d"].to(device), tensors[f"{prefix}.m"].to(device), bias,
                      dtype=dtype)


def stored_kind(tensors: dict[str, torch.Tensor], prefix: str) -> str:
    return "int8" if tensors[f"{prefix}.qweight"].dtype == torch.int8 else "int4"


def dequantize_stored(tensors: dict[str, torch.Tensor], prefix: str) -> torch.Tensor:
    """A stored quantized layer's weight in float32 [N, K]."""
    q = tensors[f"{prefix}.qweight"]
    if q.dtype == torch.int8:
        return q.float() * tensors[f"{prefix}.scales"].float()[:, None]
    return dequantize_int4(unpack_nibbles(q), tensors[f"{prefix}.d"], tensors[f"{prefix}.m"])


def stored_prefixes(names: set[str]) -> set[str]:
    """Layers stored quantized among a checkpoint's tensor names."""
    return {n.removesuffix(".qweight") for n in names if n.endswith(".qweight")}


def quantize_model(model: nn.Module, kind: str) -> nn.Module:
    """Replace every decoder linear layer of a loaded float model by its ``kind`` twin (post-load swap)."""
    for name in quantizable_linears(model):
        lin = model.get_submodule(name)
        assert isinstance(lin, nn.Linear)
        new = quantize_linear(lin.weight.detach(), None if lin.bias is None else lin.bias.detach(), kind,
                              dtype=lin.weight.dtype)
        if new is not None:
            swap_module(model, name, new)
    return model


def concat_linears(layers: Sequence[nn.Module]) -> QuantLinear | None:
    """One layer computing ``layers``' outputs side by side (their output rows joined), or None where they
    cannot be joined: different kinds, inputs, groups or bias presence, int4 parts (but the last) whose rows
    do not fill the CPU packing's 64-row blocks, or not on a CPU (the CUDA packing is tiled; its join is not
    checked). Bitwise the same outputs: see the module docstring."""
    first = layers[0]
    if not all(isinstance(m, QuantLinear) for m in layers) or len({type(m) for m in layers}) != 1:
        return None
    parts = [m for m in layers if isinstance(m, QuantLinear)]
    if (len({m.in_features for m in parts}) != 1 or len({m.bias is None for m in parts}) != 1
            or any(m.weight.device.type != "cpu" for m in parts)):
        return None
    bias = None if first.bias is None else torch.cat([m.bias for m in parts if m.bias is not None])
    dtype = first.weight.dtype
    if isinstance(first, Int8Linear):
        joined8 = [m for m in parts if isinstance(m, Int8Linear)]
        return Int8Linear(torch.cat([m.qweight for m in joined8]), torch.cat([m.scales32 for m in joined8]), bias,
                          dtype=dtype)
    joined4 = [m for m in parts if isinstance(m, Int4Linear)]
    native = {m.native is not None for m in joined4}
    if len({m.group for m in joined4}) != 1 or len(native) != 1:
        return None
    sources = [m.source for m in joined4 if m.source is not None]
    source = None
    if len(sources) == len(joined4):  # every part kept its codes: so does the joined layer
        source = (torch.cat([p for p, _, _ in sources]), torch.cat([d for _, d, _ in sources]),
                  torch.cat([m for _, _, m in sources]))
    if native == {True}:
        return Int4Linear.joined_native(joined4, bias=bias, dtype=dtype, source=source)
    if any(m.out_features % _CPU_PACK_ROWS for m in joined4[:-1]):
        return None
    return Int4Linear.joined(torch.cat([m.packed for m in joined4]),
                             torch.cat([m.scales_and_zeros for m in joined4], dim=1), in_features=first.in_features,
                             group=joined4[0].group, bias=bias, dtype=dtype, source=source)


class Int8Embedding(nn.Module):
    """A token embedding kept as int8 rows with one scale each (``quantize_int8``): ``E[id] = q[id] * s[id]``,
    in the model's float dtype. Tied to an int8 LM head, both read one table."""

    def __init__(self, qweight: torch.Tensor, scales: torch.Tensor, *, dtype: torch.dtype = torch.float32) -> None:
        super().__init__()
        self.num_embeddings, self.embedding_dim = qweight.shape
        self.register_buffer("qweight", qweight)
        self.register_buffer("scales32", scales.to(dtype))
        self.register_buffer("weight", torch.empty(0, dtype=dtype, device=qweight.device), persistent=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.qweight[ids].to(self.scales32.dtype) * self.scales32[ids, None]

    def dequantized(self) -> torch.Tensor:
        return self.qweight.float() * self.scales32.float()[:, None]

    def extra_repr(self) -> str:
        return f"{self.num_embeddings}, {self.embedding_dim}, int8"


class Int8Head(Int8Linear):
    """The int8 LM head, its ``refine`` largest logits of each row recomputed in float32.

    Torch's kernel's output is bfloat16 (the integer kernels' carries the activations' int8 rounding, which
    moves logits by as much): at a logit of 25 its resolution is 0.125, so a float32 near-tie becomes
    an exact one and greedy takes the lower token id (the shipped SmolLM2 served as int4 answered "What is the
    capital of France?" with "L'..." instead of "The capital ... Paris": 25.243 against 25.325 in float32, 25.25
    both in bfloat16). Recomputing the top rows from the int8 codes and float32 scales against the float32
    hidden state costs ``refine`` x K multiply-adds a row and gives them float32 resolution. A row's result
    depends on that row alone, so the head stays one function of its input whatever the batch: speculation
    verifies against the same values it would decode with (lossless).
    """

    def __init__(self, qweight: torch.Tensor, scales: torch.Tensor, *, dtype: torch.dtype = torch.float32,
                 refine: int = 16) -> None:
        super().__init__(qweight, scales, dtype=dtype)
        # on the integer kernels too: their float32 output carries the head input's int8 rounding; the top rows
        # come back to float32's product with the row's hidden state (a hidden state that the decoder's own int8
        # activations have moved is not undone: docs/models.md, "Two kernel families on a CPU")
        self.refine = min(refine, qweight.shape[0])

    # the first maximum of each row the last call returned, from the integer kernels' refinement (``head_refine``), or
    # None: what a greedy draw at those rows takes (ModelRunner.last_argmax), without a second scan of the vocabulary
    last_argmax: torch.Tensor | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.last_argmax = None
        y = super().forward(x)
        if self.refine < 1 or x.shape[0] == 0:
            return y
        flat = y.reshape(-1, self.out_features)
        if (self.native is not None and flat.dtype == x.dtype == torch.float32 and flat.is_contiguous()
                and self.refine < self.out_features):
            # one pass a row on the integer kernels: its top k by a vectorised threshold scan (torch's topk walks a
            # row in a scalar loop), the refinement as ``refined`` states it, and the row's first maximum while the
            # row is in the cache (with the draw, 1.5 ms against 7.8 at 32 rows of 49,152 logits on an AVX2 EPYC:
            # docs/benchmarks.md, thirty-seventh round)
            self.last_argmax = self.native.head_refine(flat, x.reshape(-1, self.in_features).contiguous(),
                                                       self.qweight, self.scales32, self.refine)
            return y
        return self.refined(flat, x).reshape(y.shape)

    def refined(self, flat: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """The head's output rows ``flat`` [R, V] with each row's ``refine`` largest logits recomputed in float32 from
        the int8 rows and the row's input ``x`` (R rows of K), on torch's ops: a new tensor."""
        top = flat.float().topk(self.refine, dim=-1).indices  # [R, k]
        rows = self.qweight[top].float() * self.scales32[top][..., None]  # [R, k, K]
        # each row's dot products as a product and a sum over K, not ``einsum``: its batched matmul sums in an order
        # that depends on the number of rows, so a verification's row would differ from the same row decoded
        # alone (by ~1e-5 here: a greedy near-tie could flip, and losslessness needs every row to be one function)
        exact = (rows * x.reshape(-1, 1, self.in_features).float()).sum(-1)
        return flat.scatter(1, top, exact.to(flat.dtype))


def quantize_head(model: nn.Module) -> None:
    """The LM head (``model.lm_head``) and the token embedding (``model.model.embed_tokens``) in int8 per row,
    one table for a tied pair (module docstring). In place; a head already quantized is left as it is."""
    head, embed = model.lm_head, model.model.embed_tokens  # type: ignore[union-attr]
    if isinstance(head, QuantLinear) or not isinstance(head, nn.Linear):
        return
    tied = isinstance(embed, nn.Embedding) and head.weight is embed.weight
    dtype = head.weight.dtype
    q, scales = quantize_int8(head.weight.detach())
    model.lm_head = Int8Head(q, scales, dtype=dtype)  # type: ignore[union-attr]
    if tied:
        model.model.embed_tokens = Int8Embedding(q, scales, dtype=dtype)  # type: ignore[union-attr]
    elif isinstance(embed, nn.Embedding):
        model.model.embed_tokens = Int8Embedding(*quantize_int8(embed.weight.detach()), dtype=dtype)  # type: ignore[union-attr]


def served_weights(model: nn.Module) -> str:
    """How a model's linear layers are served: ``float``, ``int8``, ``int4``, or a mix (``int4+int8``)."""
    kinds = sorted({m.kind for m in model.modules() if isinstance(m, QuantLinear)})
    return "+".join(kinds) if kinds else "float"


def served_kernels(model: nn.Module) -> str:
    """The CPU kernels a quantized model runs on: ``torch``, or the integer kernels' build (its library's name,
    which hashes their sources, flags and compiler: native_kernels.py). ``CausalLM.native`` says which."""
    native = getattr(model, "native", None)
    return "torch" if native is None else native.path.stem


def served_attention(model: nn.Module) -> str:
    """The attention a CPU model's backends run: ``sdpa`` (torch's), or the native kernels' build (native/attend.c,
    their library's name as in ``served_kernels``); ``CausalLM.attention_kernels`` decides. A model with no such
    choice (not a CausalLM): ``sdpa``."""
    pick = getattr(model, "attention_kernels", None)
    native = pick() if callable(pick) else None
    return "sdpa" if native is None else native.path.stem


def served_description(model: nn.Module) -> str:
    """``float``, or the quantized kinds and the kernels they run on (a quantized model's answers depend on them:
    docs/models.md), e.g. ``int4+int8 on the integer kernels (cpu-kernels-...)``."""
    weights, kernels = served_weights(model), served_kernels(model)
    if weights == "float":
        return weights
    return f"{weights} on " + ("torch's kernels" if kernels == "torch" else f"the integer kernels ({kernels})")


def weight_bytes(model: nn.Module) -> int:
    """Bytes the model's parameters and buffers hold (quantized layers included), tied tensors once."""
    seen: set[int] = set()
    total = 0
    for t in [*model.parameters(), *model.buffers()]:
        if t.data_ptr() not in seen and t.device.type != "meta":
            seen.add(t.data_ptr())
            total += t.numel() * t.element_size()
    return total

