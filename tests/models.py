"""Small random Hugging Face checkpoints for tests, built by transformers itself and saved to disk."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

BASE: dict[str, Any] = dict(
    vocab_size=97,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=512,
    rms_norm_eps=1e-6,
    eos_token_id=1,
    bos_token_id=0,
)


def make_checkpoint(path: Path, arch: str = "llama", *, seed: int = 0, **overrides: Any) -> Path:
    """Save a randomly initialised ``arch`` model (llama, qwen2, mistral) to ``path``."""
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(seed)
    cfg = AutoConfig.for_model(arch, **{**BASE, **overrides})
    model = AutoModelForCausalLM.from_config(cfg, torch_dtype=torch.float32)
    # default init is tiny (std 0.02): widen it so logits are peaked and tests see real argmax gaps
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() > 1:
                p.normal_(0, 0.2)
    model.save_pretrained(path)
    return path


def smollm2_pair(*, with_draft: bool = True) -> Any:
    """The default model's catalog pair (converted once, cached); a test fails, naming the fix, when the model
    package is missing (setup.sh installs it; a bare ``pip install -e .`` does not)."""
    import pytest

    from adaserve.engine.loading import catalog

    try:
        catalog.smollm2_gguf()
    except catalog.ModelNotFoundError as e:
        pytest.fail(str(e))
    return catalog.resolve(catalog.DEFAULT_MODEL, with_draft=with_draft, progress=False)
