"""GGUF files made into plain Hugging Face model directories, once, in the model cache.

The engine loads only ``config.json`` + safetensors (``loader.py``). A ``.gguf`` file (llama.cpp's
format, often quantised) is converted the first time it is used: transformers reads and dequantises
it (needs the ``gguf`` and ``accelerate`` packages), and we write the state dict, the config, the
generation config and the tokenizer files (with the chat template from the GGUF metadata) into
``<model cache>/<stem>-<sha256[:16]>``. transformers refuses ``save_pretrained`` on a GGUF-loaded
model, so the files are written here directly. The directory appears atomically (written beside it,
then renamed), so an interrupted conversion is redone rather than half-used, and later starts find it.

With ``weights="float"`` (the default) the weights are stored in float32: the dequantised values are exact
in float32, and the loader casts to whatever dtype the engine runs in. With ``int8``, ``int4`` or ``auto``
the decoder's linear layers are written in quant.py's stored form instead, read block by block from the
file with the ``gguf`` package (one tensor at a time: no float32 copy of the model), into
``<stem>-<sha256[:16]>-<weights>``; the cache holds what is served:

- ``auto`` keeps the file's precision: Q4_0 / Q4_1 become int4 with their own 32-wide block scales and
  minimums (exact: ``d q + m``); Q8_0 becomes int8 with one scale per row (the int8 kernel takes no
  blocks: each row is re-scaled from its exact values, one rounding); any other type (float, K-quants)
  is dequantised to float;
- ``int4`` / ``int8``: every decoder linear layer in that kind (Q4 blocks kept as they are for int4;
  anything else dequantised, one tensor at a time, and quantised);
- the embedding, the norms and the LM head are dequantised to float32 in every case (quant.py says why).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

MODEL_CACHE_ENV = "ADASERVE_MODEL_CACHE"
_DONE = ".adaserve-converted"  # written last: a directory without it is not trusted
WEIGHTS = ("float", "int8", "int4", "auto")  # quant.WEIGHTS, spelled here so that this module needs no torch


class GGUFError(ValueError):
    """A GGUF file that cannot be converted; the message is meant for the user."""


def model_cache_dir() -> Path:
    """``$ADASERVE_MODEL_CACHE``, else ``$ADASERVE_CACHE_DIR/models``, else ``~/.cache/adaserve/models``."""
    if os.environ.get(MODEL_CACHE_ENV):
        return Path(os.environ[MODEL_CACHE_ENV]).expanduser()
    if os.environ.get("ADASERVE_CACHE_DIR"):
        return Path(os.environ["ADASERVE_CACHE_DIR"]).expanduser() / "models"
    return Path.home() / ".cache" / "adaserve" / "models"


def file_digest(path: Path, *, chunk: int = 1 << 22) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


def is_converted(directory: Path) -> bool:
    return (directory / _DONE).is_file() and (directory / "config.json").is_file()


def ensure_converted(gguf: Path, *, cache: Path | None = None, progress: bool = True,
                     weights: str = "float") -> Path:
    """The Hugging Face directory for ``gguf`` (keyed by the file's content and ``weights``), converting it
    on first use."""
    gguf = Path(gguf)
    if weights not in WEIGHTS:
        raise GGUFError(f"unknown weights {weights!r}: use {', '.join(WEIGHTS)}")
    if not gguf.is_file():
        raise GGUFError(f"GGUF file {gguf} does not exist")
    digest = file_digest(gguf)
    out = (cache or model_cache_dir()) / (f"{gguf.stem}-{digest[:16]}" + ("" if weights == "float" else f"-{weights}"))
    if is_converted(out):
        return out
    if progress:
        print(f"adaserve: converting {gguf.name} to a Hugging Face directory (once, weights {weights}) -> {out}",
              file=sys.stderr)

    def write(tmp: Path) -> None:
        if weights == "float":
            write_hf_dir(gguf, tmp, progress=progress)
        else:
            write_quantized_dir(gguf, tmp, weights=weights, progress=progress)
        (tmp / _DONE).write_text(json.dumps({"source": str(gguf.resolve()), "sha256": digest, "weights": weights}))

    return publish_dir(out, write, done=_DONE)


def publish_dir(out: Path, write: Callable[[Path], None], *, done: str) -> Path:
    """Make ``out`` by ``write``-ing a temporary sibling and renaming it, so no reader ever sees half of it.

    ``done`` is the file ``write`` creates last. If another process published ``out`` meanwhile, its copy
    is kept and ours dropped (never remove a directory someone may be loading); an unfinished ``out``
    (no ``done`` file: an interrupted run) is replaced. The directory is world-readable, like any cache.
    """
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}-", dir=out.parent))
    try:
        write(tmp)
        for f in [tmp, *tmp.rglob("*")]:
            f.chmod(0o755 if f.is_dir() else 0o644)
        if (out / done).is_file():
            shutil.rmtree(tmp)
            return out
        if out.exists():
            shutil.rmtree(out)
        tmp.rename(out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out


def write_hf_dir(gguf: Path, out: Path, *, progress: bool = True) -> None:
    """Dequantise ``gguf`` with transformers and write config, weights and tokenizer into ``out``."""
    try:
        import torch
        from safetensors.torch import save_model
        from transformers import AutoModelForCausalLM, AutoTokenizer
        from transformers.utils import logging as hf_logging
    except ImportError as e:  # pragma: no cover - the package's dependencies
        raise GGUFError(f"reading GGUF needs transformers, gguf and accelerate: {e}") from None
    if not progress:
        hf_logging.disable_progress_bar()
    try:
        model = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32)
        tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    except ImportError as e:
        raise GGUFError(f"reading GGUF needs the 'gguf' and 'accelerate' packages: {e}") from None
    except (ValueError, OSError, KeyError, RuntimeError) as e:
        raise GGUFError(f"cannot read GGUF file {gguf}: {e}") from None
    finally:
        if not progress:
            hf_logging.enable_progress_bar()
    config = model.config.to_dict()
    config.pop("quantization_config", None)  # the written weights are plain float32
    config.pop("_name_or_path", None)
    config["architectures"] = [type(model).__name__]
    (out / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True))
    model.generation_config.to_json_file(str(out / "generation_config.json"))
    # save_model writes one tensor of a tied pair (the loader accepts either name).
    save_model(model, str(out / "model.safetensors"))
    tokenizer.save_pretrained(str(out))
    log.info("converted %s -> %s", gguf, out)


# ---- quantized tensors kept as they are ------------------------------------------------------------------
_LAYER_NAMES = {"attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
                "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
                "attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
                "ffn_down": "mlp.down_proj"}
_TOP_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
_SKIPPED = ("rope_freqs",)  # recomputed from the config
_ARCHITECTURES = ("llama", "qwen2")  # GGUF names; llama.cpp stores Mistral as llama


def hf_name(name: str) -> str | None:
    """The Hugging Face name of a GGUF tensor (``blk.3.attn_q.weight`` -> ``model.layers.3.self_attn.q_proj.weight``);
    None for tensors we recompute."""
    base, _, suffix = name.rpartition(".")
    if base in _SKIPPED:
        return None
    if base in _TOP_NAMES:
        return f"{_TOP_NAMES[base]}.{suffix}"
    parts = base.split(".")
    if len(parts) == 3 and parts[0] == "blk" and parts[2] in _LAYER_NAMES:
        return f"model.layers.{parts[1]}.{_LAYER_NAMES[parts[2]]}.{suffix}"
    raise GGUFError(f"GGUF tensor {name} has no place in a Llama-family model")


def _row_order(name: str, rows: int, heads: int, kv_heads: int, arch: str) -> Any:
    """llama.cpp stores a Llama's q/k rows permuted for its rotary layout; the row order that undoes it
    (as transformers' GGUF loader does), or None."""
    import numpy as np

    if arch != "llama" or not (".attn_q." in name or ".attn_k." in name):
        return None
    n = heads if ".attn_q." in name else kv_heads
    return np.arange(rows).reshape(n, rows // n // 2, 2).swapaxes(2, 1).reshape(rows)


def q4_blocks(data: Any, qtype: Any) -> tuple[Any, Any, Any]:
    """Codes [N, K] (0..15) and float16 (d, m) [N, K/32] of a Q4_0 / Q4_1 tensor's raw blocks, ``w = d q + m``.

    A block is d (float16), for Q4_1 m (float16), then 16 bytes: byte j holds element j in its low nibble
    and element j + 16 in its high one. Q4_0 is ``d (q - 8)``: m = -8 d (exact in float16)."""
    import numpy as np
    from gguf import GGMLQuantizationType as Q

    rows = data.shape[0]
    head = 4 if qtype == Q.Q4_1 else 2
    blocks = np.ascontiguousarray(data).reshape(rows, -1, head + 16)
    d = blocks[..., 0:2].copy().view(np.float16)[..., 0]
    m = blocks[..., 2:4].copy().view(np.float16)[..., 0] if qtype == Q.Q4_1 else (-8 * d).astype(np.float16)
    qs = blocks[..., head:]
    codes = np.concatenate([qs & 0x0F, qs >> 4], axis=-1).reshape(rows, -1)
    return codes, d, m


def write_quantized_dir(gguf: Path, out: Path, *, weights: str, progress: bool = True) -> None:
    """Config, tokenizer and weights of ``gguf`` into ``out``, the decoder's linear layers in quant.py's
    stored form as ``weights`` says (module docstring); one tensor in float at a time."""
    try:
        import gguf as gg
        import numpy as np
        import torch
        from safetensors.torch import save_file
        from transformers import AutoConfig, AutoTokenizer, GenerationConfig
        from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES
    except ImportError as e:  # pragma: no cover - the package's dependencies
        raise GGUFError(f"reading GGUF needs transformers and gguf: {e}") from None
    from adaserve.engine.model.quant import pack_nibbles, quantize_linear

    try:
        reader = gg.GGUFReader(str(gguf))
        config = AutoConfig.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
        tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    except (ValueError, OSError, KeyError, RuntimeError) as e:
        raise GGUFError(f"cannot read GGUF file {gguf}: {e}") from None
    field = reader.fields.get("general.architecture")
    arch = bytes(field.parts[field.data[0]]).decode() if field is not None else ""
    if arch not in _ARCHITECTURES:
        raise GGUFError(f"GGUF architecture {arch!r} cannot be served quantized (only {', '.join(_ARCHITECTURES)}); "
                        "use --weights float")
    heads, kv_heads = int(config.num_attention_heads), int(config.num_key_value_heads or config.num_attention_heads)
    Q = gg.GGMLQuantizationType
    tensors: dict[str, torch.Tensor] = {}
    for t in reader.tensors:
        name = hf_name(t.name)
        if name is None:
            continue
        prefix = name.removesuffix(".weight")
        linear = name.startswith("model.layers.") and ".weight" in name and "layernorm" not in name
        order = _row_order(t.name, int(t.shape[-1]) if len(t.shape) > 1 else 0, heads, kv_heads, arch)
        if linear and t.tensor_type in (Q.Q4_0, Q.Q4_1) and weights in ("auto", "int4"):
            codes, d, m = q4_blocks(t.data, t.tensor_type)
            if order is not None:
                codes, d, m = codes[order], d[order], m[order]
            tensors[f"{prefix}.qweight"] = pack_nibbles(torch.from_numpy(np.ascontiguousarray(codes)))
            tensors[f"{prefix}.d"] = torch.from_numpy(np.ascontiguousarray(d))
            tensors[f"{prefix}.m"] = torch.from_numpy(np.ascontiguousarray(m))
            continue
        w = gg.quants.dequantize(t.data, t.tensor_type).astype(np.float32)
        if order is not None:
            w = w[order]
        w32 = torch.from_numpy(np.ascontiguousarray(w))
        want = weights if weights != "auto" else ("int8" if t.tensor_type == Q.Q8_0 else "float")
        layer = quantize_linear(w32, None, want, keep_source=True) if linear and want != "float" else None
        if layer is None:
            tensors[name] = w32
        else:
            tensors.update(layer.stored_tensors(prefix))
    if "lm_head.weight" not in tensors and not config.tie_word_embeddings:
        raise GGUFError(f"GGUF file {gguf} has no output tensor and does not tie it to the embedding")
    cfg = config.to_dict()
    for key in ("quantization_config", "_name_or_path", "_model_name_or_path"):
        cfg.pop(key, None)
    cfg["architectures"] = [MODEL_FOR_CAUSAL_LM_MAPPING_NAMES[config.model_type]]
    cfg["adaserve_weights"] = weights  # for people: the loader reads each layer's stored form
    (out / "config.json").write_text(json.dumps(cfg, indent=2, sort_keys=True, default=str))
    GenerationConfig.from_model_config(config).to_json_file(str(out / "generation_config.json"))
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(out / "model.safetensors"))
    tokenizer.save_pretrained(str(out))
    log.info("converted %s -> %s (weights %s)", gguf, out, weights)
