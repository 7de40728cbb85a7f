"""The Llama-family transformer, written for ragged batches over a paged KV cache.

Module names mirror Hugging Face checkpoints (``model.layers.N.self_attn.q_proj`` ...), so a
safetensors state dict loads without renaming. Every forward takes a flat token batch ``[T]`` with
explicit positions; attention goes through the backend, which owns the KV layout.

Under tensor parallelism (parallel.py) a rank builds this same model from its *local* configuration
(its share of the heads, KV heads and MLP columns); the only difference is ``reduce`` after ``o_proj`` and
``down_proj``, an all-reduce that sums the ranks' partial outputs.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from adaserve.engine.model import native_kernels
from adaserve.engine.model.attention.base import AttentionBackend
from adaserve.engine.model.config import ModelConfig
from adaserve.engine.model.device_timer import DeviceTimer
from adaserve.engine.model.few_rows import FewRowLinear
from adaserve.engine.model.kv_cache import PagedKVCache
from adaserve.engine.model.native_kernels import NativeKernels
from adaserve.engine.model.quant import QuantLinear, concat_linears
from adaserve.engine.model.rope import Rotary, apply_rotary


def _whole(x: torch.Tensor) -> torch.Tensor:
    """One process holds every head and every MLP column: its output is already the whole sum."""
    return x


def join_linears(layers: list[nn.Module]) -> nn.Module | None:
    """One layer computing ``layers``' outputs side by side: quantized ones by quant.concat_linears (bitwise
    the same outputs), float ones by stacking their weights (one product instead of several: on a GPU, where
    a small model's forward is bound by its kernel count, two and one kernels fewer a block). None where they
    cannot be joined (different inputs, bias presence, device or dtype)."""
    joined = concat_linears(layers)
    if joined is not None or not all(type(m) is FewRowLinear for m in layers):
        return joined
    parts = [m for m in layers if isinstance(m, FewRowLinear)]
    if len({(m.in_features, m.bias is None, m.weight.device, m.weight.dtype) for m in parts}) != 1:
        return None
    with torch.device("meta"):
        out = FewRowLinear(parts[0].in_features, sum(m.out_features for m in parts), bias=parts[0].bias is not None)
    out.weight = nn.Parameter(torch.cat([m.weight.detach() for m in parts]), requires_grad=False)
    if parts[0].bias is not None:
        out.bias = nn.Parameter(torch.cat([m.bias.detach() for m in parts if m.bias is not None]),
                                requires_grad=False)
    return out


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps
        # a model served on the integer kernels normalises with them too (CausalLM.use_native_kernels): one call,
        # not torch's ~9-op composite, on every row alike
        self.native: NativeKernels | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x / rms(x) computed in fp32, then scaled: Hugging Face's order of operations
        dtype = x.dtype
        if self.native is not None and dtype == torch.float32 and x.device.type == "cpu":
            dim = self.weight.shape[0]
            return self.native.rms_norm(x.reshape(-1, dim).contiguous(), self.weight, self.eps).view(x.shape)
        if dtype == torch.float32:  # the same operations in one call, without the no-op casts (bitwise equal)
            return torch.rms_norm(x, self.weight.shape, self.weight, self.eps)
        # half precision: x / rms(x) in fp32 by one call (a fused kernel on a GPU: 4 kernels, not 8), rounded,
        # then scaled
        return self.weight * torch.rms_norm(x.float(), self.weight.shape, None, self.eps).to(dtype)


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int) -> None:
        super().__init__()
        self.layer, self.h, self.hkv, self.d = layer, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.q_proj = FewRowLinear(cfg.hidden_size, self.h * self.d, bias=cfg.qkv_bias)
        self.k_proj = FewRowLinear(cfg.hidden_size, self.hkv * self.d, bias=cfg.qkv_bias)
        self.v_proj = FewRowLinear(cfg.hidden_size, self.hkv * self.d, bias=cfg.qkv_bias)
        self.o_proj = FewRowLinear(self.h * self.d, cfg.hidden_size, bias=cfg.o_bias)
        self.reduce: Callable[[torch.Tensor], torch.Tensor] = _whole  # tensor parallel: the sum over ranks
        self.qkv_proj: nn.Module | None = None  # q, k and v in one product (CausalLM.fuse_projections)
        if cfg.qk_norm:  # Qwen3: each head's query and key normalised over head_dim, before RoPE
            self.q_norm = RMSNorm(self.d, cfg.rms_norm_eps)
            self.k_norm = RMSNorm(self.d, cfg.rms_norm_eps)
        self.qk_norm = cfg.qk_norm

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, backend: AttentionBackend,
                cache: PagedKVCache) -> torch.Tensor:
        t = x.shape[0]
        if self.qkv_proj is not None and not self.qk_norm:
            qkv = self.qkv_proj(x).view(t, self.h + 2 * self.hkv, self.d)
            qk = apply_rotary(qkv[:, : self.h + self.hkv], cos, sin)  # q's and k's heads in one rotation
            out = backend.forward(self.layer, qk[:, : self.h], qk[:, self.h :], qkv[:, self.h + self.hkv :], cache)
            return self.reduce(self.o_proj(out.reshape(t, self.h * self.d)))
        q = self.q_proj(x).view(t, self.h, self.d)
        k = self.k_proj(x).view(t, self.hkv, self.d)
        if self.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        q = apply_rotary(q, cos, sin)  # [T, H, D]
        k = apply_rotary(k, cos, sin)  # [T, Hkv, D]
        v = self.v_proj(x).view(t, self.hkv, self.d)
        out = backend.forward(self.layer, q, k, v, cache)
        return self.reduce(self.o_proj(out.reshape(t, self.h * self.d)))


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.gate_proj = FewRowLinear(cfg.hidden_size, cfg.intermediate_size, bias=cfg.mlp_bias)
        self.up_proj = FewRowLinear(cfg.hidden_size, cfg.intermediate_size, bias=cfg.mlp_bias)
        self.down_proj = FewRowLinear(cfg.intermediate_size, cfg.hidden_size, bias=cfg.mlp_bias)
        self.reduce: Callable[[torch.Tensor], torch.Tensor] = _whole  # tensor parallel: the sum over ranks
        self.gate_up_proj: nn.Module | None = None  # gate and up in one product (CausalLM.fuse_projections)
        self.intermediate = cfg.intermediate_size

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.gate_up_proj is not None:
            gate, up = self.gate_up_proj(x).split(self.intermediate, dim=-1)
            return self.reduce(self.down_proj(F.silu(gate) * up))
        return self.reduce(self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x)))  # SwiGLU


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg, layer)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, backend: AttentionBackend,
                cache: PagedKVCache) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, backend, cache)
        return x + self.mlp(self.post_attention_layernorm(x))


class Body(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        # Built on the meta device only (the loader, bench/random_arch.py), its weights assigned after: so no
        # init. The default one (normal_) on meta runs a Python decomposition that imports torch._dynamo, and
        # with it sympy, fx and torch.distributed.tensor: ~60 MB resident in a worker that never uses them.
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size,
                                         _weight=torch.empty(cfg.vocab_size, cfg.hidden_size))
        self.layers = nn.ModuleList(DecoderLayer(cfg, i) for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class CausalLM(nn.Module):
    """Llama / Qwen2 / Qwen3 / Mistral. ``forward`` returns logits only for the rows in ``logits_rows``."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.model = Body(cfg)
        self.lm_head = FewRowLinear(cfg.hidden_size, cfg.vocab_size, bias=False)
        self.rotary = Rotary(cfg)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        # the integer kernels the model is served on (use_native_kernels), or None: its attention backends read it
        self.native: NativeKernels | None = None
        # seconds spent in ``forward``, summed: the engine's time outside forwards is the rest of an
        # iteration (StepMetrics.t_forward_s). CUDA forwards are timed by events, never synchronised.
        self.timer = DeviceTimer()

    @property
    def forward_seconds(self) -> float:
        return self.timer.seconds

    def tune_kernels(self) -> None:
        """Pick each linear layer's fastest kernels for few rows on this CPU (few_rows.py); after loading."""
        for module in self.modules():
            if isinstance(module, FewRowLinear):
                module.tune_kernels()

    def fuse_projections(self) -> None:
        """Join each block's q/k/v and gate/up layers into one product each where ``join_linears`` can (a
        quantized model on a CPU; float layers anywhere): fewer calls per forward. The parts are dropped."""
        for layer in self.model.layers:
            assert isinstance(layer, DecoderLayer)
            attn, mlp = layer.self_attn, layer.mlp
            if attn.qkv_proj is None and not attn.qk_norm:
                attn.qkv_proj = join_linears([attn.q_proj, attn.k_proj, attn.v_proj])
                if attn.qkv_proj is not None:
                    attn.q_proj = attn.k_proj = attn.v_proj = None
            if mlp.gate_up_proj is None:
                mlp.gate_up_proj = join_linears([mlp.gate_proj, mlp.up_proj])
                if mlp.gate_up_proj is not None:
                    mlp.gate_proj = mlp.up_proj = None

    def use_native_kernels(self) -> None:
        """Served on the integer kernels (quant.py, native_kernels.py): the norms use them too, and so does
        attention (``self.native``, read by the CPU attention backends: native/attend.c). A float32 model on a CPU
        whose kernels build takes their norms as it takes their attention (``attention_kernels``): one call a norm,
        not torch's composite, and a row's result one function of that row. A model on torch's kernels, or another
        float dtype, is left as it is."""
        native = next((m.native for m in self.modules() if isinstance(m, QuantLinear) and m.native is not None),
                      None)
        if native is not None:
            self.native = native
        elif not isinstance(self.lm_head, QuantLinear):  # float (a quantized model's head is int8: quant.py)
            native = self.attention_kernels()
        if native is not None:
            for m in self.modules():
                if isinstance(m, RMSNorm):
                    m.native = native

    def attention_kernels(self) -> NativeKernels | None:
        """The native attention (native/attend.c) for this model, asked when a backend or a static grid is made:
        on a CPU, in float32, with a head size ``attend`` takes, on the integer kernels the model is served on, or
        for a float model wherever they build (``native_kernels.chosen``: ``ADASERVE_NATIVE_KERNELS=off`` keeps
        SDPA); else None (SDPA). A float model attends with them because SDPA is row-invariant only by summing in
        float64, over keys gathered into a padded grid: at 32 requests of a few hundred tokens that was most of a
        forward on a CPU, and it followed the longest request's keys, not the batch's. attend.c reads each row's
        keys from the cache by slot and is row-invariant by construction (docs/benchmarks.md, "Twenty-fifth
        round")."""
        weight = self.lm_head.weight
        if not NativeKernels.attends(weight.dtype, weight.device, self.cfg.head_dim):
            return None
        if self.native is not None or isinstance(self.lm_head, QuantLinear):  # quantized: the kernels it is on, or
            return self.native  # SDPA on torch's (a quantized model's head is int8: quant.py)
        return native_kernels.chosen()

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, *, backend: AttentionBackend,
                cache: PagedKVCache, logits_rows: torch.Tensor | None = None) -> torch.Tensor:
        with self.timer.region(input_ids.device):
            return self._logits(input_ids, positions, backend, cache, logits_rows)

    @torch.inference_mode()
    def _logits(self, input_ids: torch.Tensor, positions: torch.Tensor, backend: AttentionBackend,
                cache: PagedKVCache, logits_rows: torch.Tensor | None) -> torch.Tensor:
        x = self.model.embed_tokens(input_ids)  # [T, hidden]
        cos, sin = self.rotary.cos_sin(positions, x.dtype)
        for layer in self.model.layers:
            x = layer(x, cos, sin, backend, cache)
        if logits_rows is not None:
            x = x[logits_rows]  # only the rows someone reads: prefill chunks need one
        return self.lm_head(self.model.norm(x)).float()  # [R, vocab]
