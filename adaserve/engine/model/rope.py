"""Rotary position embeddings, including Llama 3's frequency scaling.

Positions are explicit per token (``prefix_len + depth`` for tree nodes), never derived from a
token's index in the batch: that is what keeps tree verification exact.
"""

from __future__ import annotations

import math

import torch

from adaserve.engine.model.config import ModelConfig


def inverse_frequencies(cfg: ModelConfig) -> torch.Tensor:
    """[head_dim/2] float32 inverse frequencies, after the configured scaling; always computed on the CPU.

    Even while a model is built on the meta device (the loader, which replaces the module once loaded):
    there ``arange`` runs a Python decomposition that imports torch._dynamo, sympy and fx, ~60 MB resident
    in a worker that never uses them."""
    dim = cfg.head_dim
    steps = torch.arange(0, dim, 2, dtype=torch.int64, device="cpu")
    inv_freq = 1.0 / (cfg.rope_theta ** (steps.float() / dim))
    kind = cfg.rope_type
    if kind == "linear":
        return inv_freq / float(cfg.rope_scaling["factor"])
    if kind == "llama3":
        return _llama3_scale(inv_freq, cfg.rope_scaling)
    return inv_freq


def _llama3_scale(inv_freq: torch.Tensor, s: dict) -> torch.Tensor:
    # Long wavelengths are divided by `factor`, short ones kept, the band between interpolated.
    factor = float(s["factor"])
    low, high = float(s.get("low_freq_factor", 1.0)), float(s.get("high_freq_factor", 4.0))
    old_ctx = float(s.get("original_max_position_embeddings", 8192))
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > old_ctx / low, inv_freq / factor, inv_freq)
    smooth = (old_ctx / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelen >= old_ctx / high) & (wavelen <= old_ctx / low)
    return torch.where(medium, smoothed, scaled)


class Rotary(torch.nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.register_buffer("inv_freq", inverse_frequencies(cfg), persistent=False)

    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """positions [T] -> cos, signed sin [T, 1, head_dim] (broadcast over heads), once per forward.

        The sin's first half carries the minus sign of the rotation (``apply_rotary``), so that no layer
        negates anything: x * (-s) is exactly -(x * s), the values are the Hugging Face layout's bit for bit.
        """
        freqs = positions.float()[:, None] * self.inv_freq.float()[None, :]
        sin = freqs.sin()
        return (torch.cat((freqs, freqs), dim=-1).cos().to(dtype)[:, None, :],
                torch.cat((-sin, sin), dim=-1).to(dtype)[:, None, :])


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [T, H, D]: rotate the two halves of the head dimension (the Hugging Face layout), with the signed
    sin of ``Rotary.cos_sin``: x * cos + (x2, x1) * (-s, s) = x * cos + (-x2, x1) * s. Four kernels on a
    GPU (swap, two products, sum), not five; the swap is one ``roll`` by half the head (the same copy as
    concatenating the two slices, one op instead of three)."""
    return x * cos + x.roll(x.shape[-1] // 2, dims=-1) * sin
