"""Loading Hugging Face checkpoints from a local directory: config, safetensors weights, tokenizer."""

from __future__ import annotations

import contextlib
import ctypes
import gc
import json
import logging
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from torch import nn
from tqdm import tqdm

from adaserve.engine.loading.tokenizer import Tokenizer
from adaserve.engine.model.config import ModelConfig, UnsupportedModelError
from adaserve.engine.model.layers import CausalLM
from adaserve.engine.model.parallel import TensorParallel, install_all_reduce, local_config, read_tensor
from adaserve.engine.model.quant import (
    KINDS,
    QuantLinear,
    check_weights,
    dequantize_stored,
    from_stored,
    quantizable_linears,
    quantize_head,
    quantize_linear,
    stored_kind,
    stored_prefixes,
    swap_module,
)

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
               progress: bool = False, weights: str = "auto", tp: TensorParallel | None = None) -> CausalLM:
    """The model in ``path`` on ``device``; ``weights`` says how its decoder linear layers are served:

    - ``float``: in ``dtype`` (a stored quantized layer is dequantized, one layer at a time);
    - ``int8`` / ``int4``: weight-only quantized (quant.py), each layer quantized as it is read (never a
      float copy of the whole model), or re-quantized from a stored layer of the other kind;
    - ``auto`` (the default): as stored on a CPU: a quantized layer stays as it is (a GGUF model converted for
      ``int8``, ``int4`` or ``auto``, see gguf.py), float stays float; on a GPU a stored quantized layer is
      dequantized to ``dtype``.

    When the decoder layers are served quantized, the LM head and the embedding are int8 (one table for a tied
    pair) and each block's q/k/v and gate/up products are joined into one where the device allows (quant.py
    says why); the norms are always float.

    ``tp``: load rank ``tp.rank``'s shard of a tensor-parallel model (parallel.py), reading only its slices.
    """
    path = Path(path)
    if not path.is_dir():
        raise FileNotFoundError(f"model directory {path} does not exist")
    check_weights(weights)
    full_cfg = read_config(path)
    tp = tp or TensorParallel()
    cfg = local_config(full_cfg, tp)
    dtype = dtype or default_dtype(device)
    with torch.device("meta"):
        model = CausalLM(cfg)
    expected = set(model.state_dict().keys())
    if cfg.tie_word_embeddings:
        expected.discard("lm_head.weight")
    linears = set(quantizable_linears(model))
    state: dict[str, torch.Tensor] = {}
    found: dict[str, torch.Tensor] = {}  # tensors the model does not name directly (see the tied pair below)
    stored: dict[str, torch.Tensor] = {}  # quantized layers' tensors, by name (quant.py's stored form)
    swapped: dict[str, QuantLinear] = {}
    files = weight_files(path)
    for f in tqdm(files, desc=f"loading {path.name}", disable=not progress, unit="shard"):
        with safe_open(str(f), framework="pt", device="cpu") as fh:
            names = set(fh.keys())
            prefixes = stored_prefixes(names)
            if prefixes and tp.enabled:
                raise UnsupportedModelError(f"{path}: tensor parallelism over a checkpoint stored quantized is "
                                            "not supported yet; convert it to float (or serve it on one rank)")
            for name in sorted(names):
                prefix = name.rpartition(".")[0]
                if prefix in prefixes and not name.endswith(".bias"):
                    stored[name] = fh.get_tensor(name)
                elif name in expected:
                    t = read_tensor(fh, name, full_cfg, tp)  # the whole tensor without tensor parallelism
                    if weights in KINDS and prefix in linears and name.endswith(".weight"):
                        layer = quantize_linear(t.to(device), None, weights, dtype=dtype)
                        if layer is not None:  # a shape the kind cannot take stays float
                            swapped[prefix] = layer
                            continue
                    state[name] = t.to(device=device, dtype=dtype)
                elif name == "lm_head.weight":
                    found[name] = fh.get_tensor(name).to(device=device, dtype=dtype)
    for prefix in stored_prefixes(set(stored)):
        kind = stored_kind(stored, prefix)
        want = served_kind(kind, weights, device.type)
        if want == kind:
            swapped[prefix] = from_stored(stored, prefix, None, dtype=dtype, device=device)
            continue
        w = dequantize_stored(stored, prefix).to(device)
        layer = None if want == "float" else quantize_linear(w, None, want, dtype=dtype)
        if layer is None:
            state[f"{prefix}.weight"] = w.to(dtype)
        else:
            swapped[prefix] = layer
    for prefix, layer in swapped.items():
        swap_module(model, prefix, layer)
        expected.discard(f"{prefix}.weight")
        if f"{prefix}.bias" in state:
            layer.bias = nn.Parameter(state.pop(f"{prefix}.bias"), requires_grad=False)
            expected.discard(f"{prefix}.bias")
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
    if swapped:  # served quantized: the head and embedding in int8 too, q/k/v and gate/up joined (quant.py)
        quantize_head(model)
        model.fuse_projections()
        model.use_native_kernels()
        own_memory(model)
    elif device.type == "cuda":  # float on a GPU: q/k/v and gate/up joined, fewer kernels a forward (issue 30)
        model.fuse_projections()
    else:  # float on a CPU: not joined (its weights stay views of the file's map: own_memory), but float32 norms on
        # the CPU kernels where they build, as its attention is (CausalLM.use_native_kernels)
        model.use_native_kernels()
    install_all_reduce(model, tp)
    model.tune_kernels()  # CPU: the fastest product per layer shape for a few rows (few_rows.py)
    return model.eval()


def served_kind(stored: str, weights: str, device_type: str) -> str:
    """How a layer stored as ``stored`` (int4, int8) is served under ``weights``: ``auto`` keeps it as stored on
    a CPU, where the packed kernels are the fast path, and serves it as float on a GPU, where a dequantized
    bf16 product in a CUDA graph is (the stored values exactly: dequantize_stored); anything else as asked."""
    if weights != "auto":
        return weights
    return stored if device_type == "cpu" else "float"


def own_memory(model: nn.Module) -> None:
    """Copy the tensors a quantized model keeps out of the checkpoint's memory map, and give back the heap.

    A float model's CPU tensors stay views of safetensors' map on purpose (page-cache pages, shared between
    processes). A quantized model keeps only a few of its file's tensors (norms, biases, stored int8 codes),
    but any one view keeps the whole map, and every page loading read stays resident: the float32
    embedding that became int8, for instance (171 MB of the default model's int4 file). Copies cost what
    the model keeps; ``malloc_trim`` then returns what loading freed (unpacked codes, float tables) to the
    system, where glibc would keep it in the heap (200 MB on the default pair)."""
    originals: list[torch.Tensor] = []  # kept until the end, so that no id below is reused
    params: dict[int, nn.Parameter] = {}  # one copy per tensor: a tied pair stays one table
    buffers: dict[int, torch.Tensor] = {}

    def fresh(t: torch.Tensor) -> torch.Tensor:
        originals.append(t)
        return t.detach().clone() if t.device.type == "cpu" and t.numel() else t.detach()

    # new tensor objects rather than ``t.data = ...``: a view keeps its base, and the base keeps the map
    for module in model.modules():
        for name, p in module._parameters.items():
            if p is not None:
                if id(p) not in params:
                    params[id(p)] = nn.Parameter(fresh(p), requires_grad=p.requires_grad)
                module._parameters[name] = params[id(p)]
        for name, b in module._buffers.items():
            if b is not None:
                if id(b) not in buffers:
                    buffers[id(b)] = fresh(b)
                module._buffers[name] = buffers[id(b)]
    originals.clear()
    trim_heap()


def trim_heap() -> None:
    """Give the heap's free pages back to the system: glibc's ``malloc_trim``, and TCMalloc's
    ``MallocExtension_ReleaseFreeMemory`` where the process runs on it (adaserve/allocator.py); elsewhere a no-op.

    Loading frees far more than it keeps (unpacked codes, float tables, a tokenizer's parsed JSON), but either
    allocator keeps freed memory in the process, resident, for its next allocations; a server process that loads
    once and then serves would hold it for ever (tens of MB on the default pair). Costs a few ms; outputs are
    unchanged (only free memory moves)."""
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    with contextlib.suppress(OSError, AttributeError):  # the symbol is there only where TCMalloc is loaded
        ctypes.CDLL(None).MallocExtension_ReleaseFreeMemory()


def freeze_long_lived() -> int:
    """Keep every object alive now out of the garbage collector's full collections (``gc.freeze``), after one full
    collection (what is garbage already is freed, not frozen); returns the objects frozen.

    A serving process loads once (the models' modules, the tokenizer's tables, the web framework) and keeps all of
    it: ~435k objects in a worker serving the demo pair, which each of Python's full collections walks, 190-215 ms on
    a CPU (docs/benchmarks.md, "Thirty-second round"): an iteration stalled by several TPOT SLOs. Frozen, they are left
    out (vLLM's engine freezes after start-up the same way); objects made later are collected as before. Frozen ones
    that become garbage stay until ``thaw``: call it once what the process holds is what it will keep (the worker
    after its warm-up, a tensor-parallel rank after loading its shard)."""
    gc.collect()
    gc.freeze()
    return gc.get_freeze_count()


def thaw() -> None:
    """Hand every frozen object back to the collector (its oldest generation): a stopping server's."""
    gc.unfreeze()


# tokenizer classes whose tokenizer_config.json names them for any model type (transformers >= 5)
_GENERIC_TOKENIZERS = ("TokenizersBackend",)
# tokenizer_config.json classes that transformers 5 loads as its generic TokenizersBackend, which tokenizer.py
# reproduces (PreTrainedTokenizerFast is another name of that class, and the demo pair's)
_NATIVE_CLASSES = ("TokenizersBackend", "PreTrainedTokenizerFast")
# model types (config.json) for which AutoTokenizer loads either class as it is, from transformers 5.24's tables
# (transformers.models.auto.tokenization_auto): ``llama`` has no tokenizer class of its own there; ``qwen3`` has
# one (Qwen2Tokenizer) but is not among the types whose declared class transformers replaces, so the declared
# generic class stands. Not here: ``qwen2`` (declared classes replaced by Qwen2Tokenizer, which rebuilds the
# pre-tokenizer), ``mistral`` (MistralCommonBackend where mistral-common is installed, and a pre-tokenizer patch
# for some checkpoints). tests/engine/loading/test_tokenizer.py checks each type against AutoTokenizer.
NATIVE_MODEL_TYPES = ("llama", "qwen3")


def load_tokenizer(path: str | Path) -> Any:
    """The checkpoint's tokenizer (local files only, never a hub).

    Where transformers would load its generic ``TokenizersBackend`` from tokenizer.json (``_native_tokenizer``
    says when), tokenizer.py's ``Tokenizer`` loads the same tokenizer without importing transformers (~30 MB
    of resident memory a process, issue 35), and one copy serves every thread. Anything else goes through
    transformers: ``TokenizersBackend`` directly where ``AutoTokenizer`` would pick it whatever the config
    says (``_generic_tokenizer``: it skips the model's config class, whose import pulls in much of the
    modelling stack, ~50 MB), else ``AutoTokenizer``. tests/engine/loading/ compares each with
    ``AutoTokenizer``."""
    path = Path(path)
    return Tokenizer.from_dir(path) if _native_tokenizer(path) else _transformers_tokenizer(path)


def _transformers_tokenizer(path: Path) -> Any:
    """``path``'s tokenizer through transformers (load_tokenizer says how)."""
    if _generic_tokenizer(path):
        from transformers import TokenizersBackend

        return TokenizersBackend.from_pretrained(str(path), local_files_only=True)
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(path), local_files_only=True)


def _native_tokenizer(path: Path) -> bool:
    """Whether transformers' ``AutoTokenizer`` would load ``path``'s tokenizer.json as its generic
    ``TokenizersBackend``, which tokenizer.py reproduces, decided from the files alone (no transformers import):
    tokenizer_config.json names that class (``_NATIVE_CLASSES``) and no remote code (``auto_map``) nor another
    tokenizer file (``fast_tokenizer_files``); there is no legacy added_tokens.json (which tokenizer.py does
    not read); and config.json, without remote code, has a model type (and model name, if any) in
    ``NATIVE_MODEL_TYPES``, the types for which transformers keeps the declared class."""
    if not (path / "tokenizer.json").is_file() or (path / "added_tokens.json").exists():
        return False
    configs = _tokenizer_configs(path, config_required=True)
    if configs is None:
        return False
    tok_cfg, cfg = configs
    if tok_cfg.get("tokenizer_class") not in _NATIVE_CLASSES or {"auto_map", "fast_tokenizer_files"} & tok_cfg.keys():
        return False
    names = [cfg.get("model_type"), *([cfg["model_name"]] if "model_name" in cfg else [])]
    return "auto_map" not in cfg and all(n in NATIVE_MODEL_TYPES for n in names)


def _tokenizer_configs(path: Path, *, config_required: bool) -> tuple[dict[str, Any], dict[str, Any]] | None:
    """(tokenizer_config.json, config.json) as objects, the second {} when absent unless ``config_required``;
    None where either cannot be read or is not a JSON object (the tokenizer rules then decline)."""
    try:
        tok_cfg = json.loads((path / "tokenizer_config.json").read_text())
        has_cfg = config_required or (path / "config.json").is_file()
        cfg = json.loads((path / "config.json").read_text()) if has_cfg else {}
    except (OSError, ValueError):
        return None
    return (tok_cfg, cfg) if isinstance(tok_cfg, dict) and isinstance(cfg, dict) else None


def _generic_tokenizer(path: Path) -> bool:
    """Whether ``AutoTokenizer`` resolves ``path``'s tokenizer to ``TokenizersBackend`` without needing the
    model's config class: tokenizer_config.json names it and has no ``auto_map``, and the model type (plain
    config.json) neither has a tokenizer class of its own in transformers' table nor is one whose declared
    class transformers replaces (transformers.models.auto.tokenization_auto's two tables)."""
    configs = _tokenizer_configs(path, config_required=False)
    if configs is None:
        return False
    tok_cfg, cfg = configs
    if tok_cfg.get("tokenizer_class") not in _GENERIC_TOKENIZERS or "auto_map" in tok_cfg:
        return False
    from transformers.models.auto import tokenization_auto as auto

    overridden = getattr(auto, "MODELS_WITH_INCORRECT_HUB_TOKENIZER_CLASS", None)
    if overridden is None:  # another transformers than the one this was checked against
        return False
    names = [n for n in (cfg.get("model_type"), cfg.get("model_name")) if n is not None]
    if not all(isinstance(n, str) for n in names):
        return False
    return all(auto.TOKENIZER_MAPPING_NAMES.get(n) is None and n not in overridden for n in names)
