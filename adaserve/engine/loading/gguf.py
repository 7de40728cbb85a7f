"""GGUF files made into plain Hugging Face model directories, once, in the model cache.

The engine loads only ``config.json`` + safetensors (``loader.py``). A ``.gguf`` file (llama.cpp's
format, often quantised) is converted the first time it is used: transformers reads and dequantises
it (needs the ``gguf`` and ``accelerate`` packages), and we write the state dict, the config, the
generation config and the tokenizer files (with the chat template from the GGUF metadata) into
``<model cache>/<stem>-<sha256[:16]>``. transformers refuses ``save_pretrained`` on a GGUF-loaded
model, so the files are written here directly. The directory appears atomically (written beside it,
then renamed), so an interrupted conversion is redone rather than half-used, and later starts find it.

The weights are stored in float32: the dequantised values are exact in float32, and the loader casts to
whatever dtype the engine runs in.
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

log = logging.getLogger(__name__)

MODEL_CACHE_ENV = "ADASERVE_MODEL_CACHE"
_DONE = ".adaserve-converted"  # written last: a directory without it is not trusted


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


def ensure_converted(gguf: Path, *, cache: Path | None = None, progress: bool = True) -> Path:
    """The Hugging Face directory for ``gguf`` (keyed by the file's content), converting it on first use."""
    gguf = Path(gguf)
    if not gguf.is_file():
        raise GGUFError(f"GGUF file {gguf} does not exist")
    digest = file_digest(gguf)
    out = (cache or model_cache_dir()) / f"{gguf.stem}-{digest[:16]}"
    if is_converted(out):
        return out
    if progress:
        print(f"adaserve: converting {gguf.name} to a Hugging Face directory (once) -> {out}", file=sys.stderr)

    def write(tmp: Path) -> None:
        write_hf_dir(gguf, tmp, progress=progress)
        (tmp / _DONE).write_text(json.dumps({"source": str(gguf.resolve()), "sha256": digest}))

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
