"""load_tokenizer's transformers path (for checkpoints tokenizer.py does not take: test_tokenizer.py): the tokenizer
AutoTokenizer gives, without importing the model's config class where the tokenizer config names the generic
TokenizersBackend (loader._generic_tokenizer says why)."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from adaserve.engine.loading.catalog import committed_models
from adaserve.engine.loading.loader import (
    _generic_tokenizer,
    _native_tokenizer,
    _transformers_tokenizer,
    load_tokenizer,
)
from tests.models import smollm2_pair

TEXTS = ["Hello world", "<|im_start|>user\nhi<|im_end|>", "  spaces\t\ttabs\n\nnew lines ünïcödé 漢字 🙂",
         "def f(x):\n    return x**2", ""]


# a model type transformers' tables leave alone (so AutoTokenizer keeps the declared generic class) that
# tokenizer.py's rule does not take (loader.NATIVE_MODEL_TYPES): the transformers path
OTHER_TYPE = "smollm3"


def generic_dir(tmp_path: Path, **changes: Any) -> Path:
    """The demo target's tokenizer and config (model type OTHER_TYPE), its tokenizer config naming
    TokenizersBackend (plus ``changes``)."""
    src = committed_models() / "demo" / "target"
    out = tmp_path / "tok"
    out.mkdir()
    shutil.copy(src / "tokenizer.json", out / "tokenizer.json")
    cfg = json.loads((src / "config.json").read_text())
    (out / "config.json").write_text(json.dumps({**cfg, "model_type": OTHER_TYPE}))
    cfg = json.loads((src / "tokenizer_config.json").read_text())
    (out / "tokenizer_config.json").write_text(json.dumps({**cfg, "tokenizer_class": "TokenizersBackend", **changes}))
    return out


def assert_same(a: Any, b: Any) -> None:
    assert type(a) is type(b)
    assert a.get_vocab() == b.get_vocab()
    assert a.all_special_ids == b.all_special_ids and a.eos_token_id == b.eos_token_id
    assert a.init_kwargs == b.init_kwargs
    for text in TEXTS:
        assert a.encode(text) == b.encode(text)
        ids = [*a.encode(text), 1, 2, 3]
        assert a.decode(ids) == b.decode(ids)
        assert a.decode(ids, skip_special_tokens=True) == b.decode(ids, skip_special_tokens=True)
    if a.chat_template is not None or b.chat_template is not None:
        msgs = [{"role": "user", "content": "Hi"}]
        assert a.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False) == \
            b.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False)


def test_generic_tokenizer_is_what_autotokenizer_gives(tmp_path: Path) -> None:
    from transformers import AutoTokenizer

    path = generic_dir(tmp_path)
    assert _generic_tokenizer(path) and not _native_tokenizer(path)
    assert_same(load_tokenizer(path), AutoTokenizer.from_pretrained(str(path), local_files_only=True))


def test_default_model_tokenizer_through_transformers_is_what_autotokenizer_gives() -> None:
    """The transformers path on the default model (which load_tokenizer sends to tokenizer.py instead)."""
    from transformers import AutoTokenizer

    target = smollm2_pair(with_draft=False).target
    assert _generic_tokenizer(target) and _native_tokenizer(target)
    assert_same(_transformers_tokenizer(target), AutoTokenizer.from_pretrained(str(target), local_files_only=True))


def test_generic_tokenizer_imports_no_model_config_class(tmp_path: Path) -> None:
    path = generic_dir(tmp_path)
    code = ("import sys; from adaserve.engine.loading.loader import load_tokenizer; "
            f"load_tokenizer({str(path)!r}); "
            "print(sorted(m for m in sys.modules "
            f"if m.startswith('transformers.models.{OTHER_TYPE}') or m == 'sympy'))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip().splitlines()[-1] == "[]"


@pytest.mark.parametrize("changes, model_type", [
    ({"tokenizer_class": "PreTrainedTokenizerFast"}, OTHER_TYPE),  # the demo's own: AutoTokenizer decides
    ({"auto_map": {"AutoTokenizer": [None, "x.Tok"]}}, OTHER_TYPE),  # remote code
    ({}, "qwen2"),  # a type whose declared class transformers replaces
    ({}, "bert"),  # a type with a tokenizer class of its own
])
def test_other_tokenizers_go_through_autotokenizer(tmp_path: Path, changes: dict[str, Any], model_type: str) -> None:
    path = generic_dir(tmp_path, **changes)
    cfg = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**cfg, "model_type": model_type}))
    assert not _generic_tokenizer(path) and not _native_tokenizer(path)
