"""Attention backends, chosen automatically (flashinfer on CUDA when installed, else torch)."""

from __future__ import annotations

import importlib.util

import torch

from adaserve.engine.model.attention.base import AttentionBackend
from adaserve.engine.model.attention.torch_sdpa import TorchAttention
from adaserve.engine.model.config import ModelConfig
from adaserve.engine.model.native_kernels import NativeKernels

ATTENTION_BACKENDS = ("auto", "torch", "flashinfer")  # auto: flashinfer on CUDA when installed, else torch
BACKENDS = ATTENTION_BACKENDS


def flashinfer_available() -> bool:
    return importlib.util.find_spec("flashinfer") is not None


def resolve_backend_name(name: str, device: torch.device) -> str:
    if name not in BACKENDS:
        raise ValueError(f"unknown attention backend {name!r}; choose one of {', '.join(BACKENDS)}")
    if name == "auto":
        return "flashinfer" if device.type == "cuda" and flashinfer_available() else "torch"
    if name == "flashinfer" and (device.type != "cuda" or not flashinfer_available()):
        raise ValueError("the flashinfer backend needs a CUDA device and the flashinfer package (extra 'gpu')")
    return name


def make_backend(name: str, cfg: ModelConfig, device: torch.device, *,
                 native: NativeKernels | None = None) -> AttentionBackend:
    """``native``: the integer kernels a CPU model is served on; the torch backend then attends with them."""
    resolved = resolve_backend_name(name, device)
    if resolved == "flashinfer":
        from adaserve.engine.model.attention.flashinfer_paged import FlashInferAttention

        return FlashInferAttention(cfg, device=device)
    return TorchAttention(head_dim=cfg.head_dim, sliding_window=cfg.sliding_window, native=native)
