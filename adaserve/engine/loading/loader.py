"""Loading Hugging Face checkpoints from a local directory: config, safetensors weights, tokenizer."""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from tqdm import tqdm

from adaserve.engine.model.config import ModelConfig
from adaserve.engine.model.layers import CausalLM

log = logging.getLogger(__name__)


def default_dtype(device: torch.device) -> torch.dtype:
    """fp32 on CPU (exact reference numerics); bf16 on CUDA where supported, else fp16."""
    if device.type == "cuda":
        return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
    return torch.float32


def weight_files(path: Path) -> list[Path]:
    single = path / "model.safetensors"
    if single.is_file():
        return [single]
    index = path / "model.safetensors.index.json"
    if index.is_file():
        shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        return [path / s for s in shards]
    raise FileNotFoundError(f"no model.safetensors or model.safetensors.index.json in {path}")


def read_config(path: Path) -> ModelConfig:
    cfg = ModelConfig.from_dir(path)
    gen = path / "generation_config.json"
    if gen.is_file() and not cfg.eos_token_ids:
        eos = json.loads(gen.read_text()).get("eos_token_id")
        ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (int(eos),))
        cfg = ModelConfig(**{**cfg.__dict__, "eos_token_ids": ids})
    return cfg


def load_model(path: str | Path, *, device: torch.device, dtype: torch.dtype | None = None,
               progress: bool = False) -> CausalLM:
    path = Path(path)
    if not path.is_dir():
        raise FileNotFoundError(f"model directory {path} does not exist")
    cfg = read_config(path)
    dtype = dtype or default_dtype(device)
    with torch.device("meta"):
        model = CausalLM(cfg)
    expected = set(model.state_dict().keys())
    if cfg.tie_word_embeddings:
        expected.discard("lm_head.weight")
    state: dict[str, torch.Tensor] = {}
    found: dict[str, torch.Tensor] = {}  # tensors the model does not name directly (see the tied pair below)
    files = weight_files(path)
    for f in tqdm(files, desc=f"loading {path.name}", disable=not progress, unit="shard"):
        with safe_open(str(f), framework="pt", device="cpu") as fh:
            for name in fh.keys():  # noqa: SIM118 - safe_open is not a mapping
                if name in expected:
                    state[name] = fh.get_tensor(name).to(device=device, dtype=dtype)
                elif name == "lm_head.weight":
                    found[name] = fh.get_tensor(name).to(device=device, dtype=dtype)
    # A tied pair may be saved under either name (safetensors' save_model keeps only lm_head.weight).
    if cfg.tie_word_embeddings and "model.embed_tokens.weight" not in state and "lm_head.weight" in found:
        state["model.embed_tokens.weight"] = found["lm_head.weight"]
    missing = expected - state.keys()
    if missing:
        raise ValueError(f"{path}: checkpoint lacks weights {sorted(missing)[:5]}")
    model.load_state_dict(state, strict=False, assign=True)
    if cfg.tie_word_embeddings:
        model.lm_head.weight = model.model.embed_tokens.weight
    model.rotary = model.rotary.__class__(cfg).to(device)  # buffers are not in checkpoints
    model.tune_kernels()  # CPU: the fastest product per layer shape for a few rows (few_rows.py)
    return model.eval()


def load_tokenizer(path: str | Path) -> Any:
    """The checkpoint's tokenizer through transformers (local files only, never a hub)."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(path), local_files_only=True)
