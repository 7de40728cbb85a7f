"""The model configuration the engine needs, read from a Hugging Face ``config.json``.

One typed object for the whole Llama family (Llama 2/3, Qwen2, Qwen3 dense, Mistral). Anything the project's
model code does not implement is refused here with a clear message, never silently mis-served.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3")
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")


class UnsupportedModelError(ValueError):
    """The checkpoint is readable but is not an architecture or option the engine implements."""


@dataclass(frozen=True)
class ModelConfig:
    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    qkv_bias: bool = False
    o_bias: bool = False
    mlp_bias: bool = False
    qk_norm: bool = False  # Qwen3: an RMSNorm over head_dim on every query and key head, before RoPE
    sliding_window: int | None = None
    rope_scaling: dict[str, Any] = field(default_factory=dict)
    eos_token_ids: tuple[int, ...] = ()
    bos_token_id: int | None = None

    def __post_init__(self) -> None:
        if self.num_heads % self.num_kv_heads != 0:
            raise UnsupportedModelError(
                f"num_attention_heads={self.num_heads} is not a multiple of num_key_value_heads={self.num_kv_heads}"
            )
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "head_dim"):
            if getattr(self, name) <= 0:
                raise UnsupportedModelError(f"config field {name} must be positive")

    @property
    def rope_type(self) -> str:
        return str(self.rope_scaling.get("rope_type", self.rope_scaling.get("type", "default")))

    @staticmethod
    def from_dict(cfg: dict[str, Any]) -> ModelConfig:
        model_type = cfg.get("model_type")
        if model_type not in SUPPORTED_MODEL_TYPES:
            archs = cfg.get("architectures")
            raise UnsupportedModelError(
                f"unsupported architecture model_type={model_type!r} (architectures={archs}); "
                f"supported: {', '.join(SUPPORTED_MODEL_TYPES)}"
            )
        act = cfg.get("hidden_act", "silu")
        if act != "silu":
            raise UnsupportedModelError(f"unsupported hidden_act={act!r}: only silu (SwiGLU) is implemented")
        num_heads = int(cfg["num_attention_heads"])
        hidden = int(cfg["hidden_size"])
        head_dim = cfg.get("head_dim") or hidden // num_heads

        # transformers >= 5 folds rope_theta into `rope_parameters`; older configs use `rope_scaling`.
        rope = dict(cfg.get("rope_parameters") or cfg.get("rope_scaling") or {})
        rope_theta = float(rope.pop("rope_theta", cfg.get("rope_theta", 10000.0)))
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        if rope_type not in SUPPORTED_ROPE_TYPES:
            raise UnsupportedModelError(
                f"unsupported rope scaling {rope_type!r}; supported: {', '.join(SUPPORTED_ROPE_TYPES)}"
            )

        sliding_window = None
        if model_type == "mistral":
            sliding_window = cfg.get("sliding_window")
        elif model_type in ("qwen2", "qwen3") and cfg.get("use_sliding_window"):
            raise UnsupportedModelError(f"{model_type} with use_sliding_window=true is not supported")

        eos = cfg.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (int(eos),))
        qkv_bias = model_type == "qwen2" or bool(cfg.get("attention_bias", False))
        return ModelConfig(
            model_type=model_type,
            vocab_size=int(cfg["vocab_size"]),
            hidden_size=hidden,
            intermediate_size=int(cfg["intermediate_size"]),
            num_layers=int(cfg["num_hidden_layers"]),
            num_heads=num_heads,
            num_kv_heads=int(cfg.get("num_key_value_heads") or num_heads),
            head_dim=int(head_dim),
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            rope_theta=rope_theta,
            max_position_embeddings=int(cfg.get("max_position_embeddings", 4096)),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            qkv_bias=qkv_bias,
            # Llama's attention_bias covers o_proj too; Qwen2 has bias on q/k/v only.
            o_bias=model_type != "qwen2" and bool(cfg.get("attention_bias", False)),
            mlp_bias=bool(cfg.get("mlp_bias", False)),
            qk_norm=model_type == "qwen3",
            sliding_window=int(sliding_window) if sliding_window else None,
            rope_scaling=rope,
            eos_token_ids=eos_ids,
            bos_token_id=cfg.get("bos_token_id"),
        )

    @staticmethod
    def from_dir(path: str | Path) -> ModelConfig:
        p = Path(path) / "config.json"
        if not p.is_file():
            raise FileNotFoundError(f"no config.json in model directory {path}")
        try:
            return ModelConfig.from_dict(json.loads(p.read_text()))
        except KeyError as e:
            raise UnsupportedModelError(f"{p}: missing required field {e.args[0]}") from None
