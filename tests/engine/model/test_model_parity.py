"""The project's model reproduces Hugging Face transformers' logits for the same checkpoint."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from adaserve.engine.loading.loader import load_model, weight_files
from adaserve.engine.model.batch import Segment
from adaserve.engine.model.config import ModelConfig, UnsupportedModelError
from adaserve.engine.model.kv_cache import SequenceKV
from adaserve.engine.model.tree import TokenTree
from tests.engine.helpers import CPU, runner
from tests.models import make_checkpoint

LLAMA3_ROPE = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 64}

CASES = {
    "llama-gqa-untied": ("llama", {}),
    "llama-tied-llama3-rope": ("llama", {"tie_word_embeddings": True, "rope_scaling": LLAMA3_ROPE}),
    "llama-mha-bias": ("llama", {"num_key_value_heads": 4, "attention_bias": True, "mlp_bias": True}),
    "qwen2-qkv-bias": ("qwen2", {"tie_word_embeddings": False}),
    # Qwen3: q/k norms, and a head_dim (32) that is not hidden_size / heads (16): q is 128 wide, hidden 64
    "qwen3-qk-norm-wide-heads": ("qwen3", {"head_dim": 32, "tie_word_embeddings": True}),
    "mistral-sliding-window": ("mistral", {"sliding_window": 16}),
    "llama-linear-rope": ("llama", {"rope_scaling": {"rope_type": "linear", "factor": 2.0}}),
}


def hf_logits(path: Path, ids: torch.Tensor) -> torch.Tensor:
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    with torch.no_grad():
        return hf(ids[None]).logits[0]


def our_logits(path: Path, ids: torch.Tensor, chunk: int) -> torch.Tensor:
    """Prefill in chunks (the serving path) and collect every position's logits."""
    r = runner(path)
    seq = SequenceKV()
    out = []
    for start in range(0, len(ids), chunk):
        part = ids[start : start + chunk].tolist()
        out.append(r.forward([Segment(seq, start, TokenTree.chain(part))], all_logits=[True])[0])
        r.cache.truncate(seq, start + len(part))
    return torch.cat(out)


@pytest.mark.parametrize("case", sorted(CASES))
def test_logits_match_transformers(case: str, tmp_path: Path) -> None:
    arch, overrides = CASES[case]
    path = make_checkpoint(tmp_path / case, arch, seed=3, **overrides)
    ids = torch.randint(0, 97, (40,), generator=torch.Generator().manual_seed(0))
    ref = hf_logits(path, ids)
    ours = our_logits(path, ids, chunk=13)
    assert ours.shape == ref.shape
    assert (ours - ref).abs().max().item() <= 1e-4


def test_checkpoint_options_are_read(tmp_path: Path) -> None:
    path = make_checkpoint(tmp_path / "m", "mistral", sliding_window=16)
    assert ModelConfig.from_dir(path).sliding_window == 16
    path = make_checkpoint(tmp_path / "q", "qwen2")
    assert ModelConfig.from_dir(path).qkv_bias
    path = make_checkpoint(tmp_path / "l", "llama", rope_scaling=LLAMA3_ROPE)
    assert ModelConfig.from_dir(path).rope_type == "llama3"


def test_sliding_window_changes_logits_beyond_the_window(tmp_path: Path) -> None:
    """Guards the mistral case above from passing vacuously: the window really is applied."""
    ids = torch.randint(0, 97, (40,), generator=torch.Generator().manual_seed(1))
    windowed = our_logits(make_checkpoint(tmp_path / "w", "mistral", seed=3, sliding_window=8), ids, 40)
    full = our_logits(make_checkpoint(tmp_path / "f", "mistral", seed=3, sliding_window=None), ids, 40)
    assert torch.allclose(windowed[:8], full[:8], atol=1e-5)
    assert (windowed[20:] - full[20:]).abs().max() > 1e-3


def test_sharded_checkpoint_loads(tmp_path: Path) -> None:
    from transformers import AutoModelForCausalLM

    single = make_checkpoint(tmp_path / "single", "llama", seed=4)
    model = AutoModelForCausalLM.from_pretrained(single, dtype=torch.float32)
    sharded = tmp_path / "sharded"
    model.save_pretrained(sharded, max_shard_size="50KB")
    assert len(weight_files(sharded)) > 1
    ids = torch.arange(2, 30)
    assert torch.equal(our_logits(sharded, ids, 28), our_logits(single, ids, 28))


def test_unsupported_architecture_is_refused(tmp_path: Path) -> None:
    path = make_checkpoint(tmp_path / "ok", "llama")
    cfg = json.loads((path / "config.json").read_text())
    cfg["model_type"] = "gpt2"
    (path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(UnsupportedModelError, match="gpt2"):
        load_model(path, device=CPU)


def test_missing_directory_is_a_clear_error(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="does not exist"):
        load_model(tmp_path / "nope", device=CPU)
