"""Model names, GGUF/derived-draft directories, and tied checkpoints saved under either name."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from adaserve.engine.loading import catalog
from adaserve.engine.loading.loader import load_model
from tests.models import make_checkpoint

CPU = torch.device("cpu")


@pytest.mark.parametrize("keep", ["lm_head.weight", "model.embed_tokens.weight"])
def test_tied_checkpoint_loads_whichever_name_it_kept(tmp_path: Path, keep: str) -> None:
    src = make_checkpoint(tmp_path / "src", tie_word_embeddings=True)
    state = load_file(str(src / "model.safetensors"))
    table = state.get("model.embed_tokens.weight", state.get("lm_head.weight"))
    state = {k: v for k, v in state.items() if k not in ("lm_head.weight", "model.embed_tokens.weight")}
    state[keep] = table
    out = tmp_path / keep
    out.mkdir()
    save_file(state, str(out / "model.safetensors"))
    (out / "config.json").write_text((src / "config.json").read_text())
    model = load_model(out, device=CPU)
    assert torch.equal(model.model.embed_tokens.weight, table)
    assert model.lm_head.weight is model.model.embed_tokens.weight


def test_untied_checkpoint_without_embedding_is_refused(tmp_path: Path) -> None:
    src = make_checkpoint(tmp_path / "src", tie_word_embeddings=False)
    state = load_file(str(src / "model.safetensors"))
    del state["model.embed_tokens.weight"]
    save_file(state, str(src / "model.safetensors"))
    with pytest.raises(ValueError, match="embed_tokens"):
        load_model(src, device=CPU)


def test_unknown_model_names_what_is_accepted(tmp_path: Path) -> None:
    with pytest.raises(catalog.ModelNotFoundError, match="smollm2-135m-instruct"):
        catalog.resolve(str(tmp_path / "nope"))
    with pytest.raises(catalog.ModelNotFoundError, match="does not exist"):
        catalog.resolve(str(tmp_path / "missing.gguf"))


def test_demo_tiny_is_the_repository_pair() -> None:
    pair = catalog.resolve(catalog.DEMO_MODEL)
    assert pair.name == "demo"
    assert (pair.target / "config.json").is_file() and pair.draft is not None and (pair.draft / "config.json").is_file()


def test_directory_with_explicit_draft(target_dir: Path, draft_dir: Path) -> None:
    pair = catalog.resolve(str(target_dir), draft=str(draft_dir))
    assert (pair.target, pair.draft, pair.name) == (target_dir, draft_dir, target_dir.name)


def test_derived_draft_materialises_once_as_a_plain_checkpoint(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """E_draft = E_target @ P: the materialised directory loads like any checkpoint, with that embedding."""
    monkeypatch.setenv("ADASERVE_MODEL_CACHE", str(tmp_path / "cache"))
    target = make_checkpoint(tmp_path / "target", tie_word_embeddings=True)
    small = make_checkpoint(tmp_path / "small", tie_word_embeddings=True, hidden_size=32, intermediate_size=64,
                            num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1)
    state = load_file(str(small / "model.safetensors"))
    for k in ("model.embed_tokens.weight", "lm_head.weight"):
        state.pop(k, None)
    proj = torch.randn(64, 32)
    state["embed_proj"] = proj
    committed = tmp_path / "committed"
    committed.mkdir()
    save_file(state, str(committed / "draft.safetensors"))
    cfg = json.loads((small / "config.json").read_text())
    (committed / "config.json").write_text(json.dumps(cfg))

    out = catalog.ensure_draft(committed, target, progress=False)
    assert out.parent == tmp_path / "cache"
    drafted = load_model(out, device=CPU)
    e_target = load_model(target, device=CPU).model.embed_tokens.weight
    expected = (e_target @ proj).to(torch.bfloat16).float()
    assert torch.allclose(drafted.model.embed_tokens.weight, expected)
    stamp = (out / "config.json").stat().st_mtime_ns
    assert catalog.ensure_draft(committed, target, progress=False) == out
    assert (out / "config.json").stat().st_mtime_ns == stamp  # reused, not rewritten


def test_a_derived_draft_is_its_sources_listed_layers(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """``derive.json`` instead of weights: the source's listed layers, renumbered in order, with its embedding and
    final norm, and a draft materialised from that (smollm2-draft-small is the default draft's layers 0 and 1)."""
    monkeypatch.setenv("ADASERVE_MODEL_CACHE", str(tmp_path / "cache"))
    target = make_checkpoint(tmp_path / "target", tie_word_embeddings=True)
    src = make_checkpoint(tmp_path / "src", tie_word_embeddings=True, hidden_size=32, intermediate_size=64,
                          num_hidden_layers=3, num_attention_heads=2, num_key_value_heads=1)
    full = load_file(str(src / "model.safetensors"))
    state = {k: v for k, v in full.items() if k not in ("model.embed_tokens.weight", "lm_head.weight")}
    state["embed_proj"] = torch.randn(64, 32)
    source = tmp_path / "models" / "source"
    source.mkdir(parents=True)
    save_file(state, str(source / "draft.safetensors"))
    cfg = json.loads((src / "config.json").read_text())
    (source / "config.json").write_text(json.dumps(cfg))
    small = tmp_path / "models" / "small"
    small.mkdir()
    (small / "config.json").write_text(json.dumps({**cfg, "num_hidden_layers": 2}))
    assert not catalog.has_weights(small, "draft.safetensors")
    (small / catalog.DERIVE_FILE).write_text(json.dumps({"from": "source", "layers": [0, 2]}))
    assert catalog.has_weights(small, "draft.safetensors")

    tensors, _ = catalog.derived_tensors(small, "draft.safetensors")
    renamed = {k.replace(".layers.2.", ".layers.1."): v for k, v in state.items() if ".layers.1." not in k}
    assert set(tensors) == set(renamed)
    assert all(torch.equal(tensors[k], renamed[k]) for k in tensors)
    drafted = load_model(catalog.ensure_draft(small, target, progress=False), device=CPU)
    assert len(drafted.model.layers) == 2


def test_the_demo_draft_is_built_from_its_target_once(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """demo-tiny's draft: the committed target's layers 0, 4 and 5, written beside its config once (no weights file
    is committed for it); a read-only directory gets a copy in the model cache instead."""
    import shutil

    monkeypatch.setenv("ADASERVE_MODEL_CACHE", str(tmp_path / "cache"))
    models = tmp_path / "models"
    shutil.copytree(catalog.committed_models() / "demo" / "target", models / "demo" / "target")
    draft = models / "demo" / "draft"
    shutil.copytree(catalog.committed_models() / "demo" / "draft", draft,
                    ignore=shutil.ignore_patterns("model.safetensors", catalog.DEMO_DRAFT_STAMP))
    assert catalog.ensure_demo_draft(models) == draft
    target = load_file(str(models / "demo" / "target" / "model.safetensors"))
    got = load_file(str(draft / "model.safetensors"))
    want = {k.replace(".layers.4.", ".layers.1.").replace(".layers.5.", ".layers.2."): v for k, v in target.items()
            if not any(f".layers.{i}." in k for i in (1, 2, 3))}
    assert set(got) == set(want)
    assert all(torch.equal(got[k], want[k]) for k in got)
    assert len(load_model(draft, device=CPU).model.layers) == 3
    stamp = (draft / "model.safetensors").stat().st_mtime_ns
    assert catalog.ensure_demo_draft(models) == draft
    assert (draft / "model.safetensors").stat().st_mtime_ns == stamp  # built once

    # a retrained target (here: its norms doubled) is never served a stale draft: the draft is built again
    save_file({k: v * 2 if "norm" in k else v for k, v in target.items()},
              str(models / "demo" / "target" / "model.safetensors"))
    assert catalog.ensure_demo_draft(models) == draft
    rebuilt = load_file(str(draft / "model.safetensors"))
    assert torch.equal(rebuilt["model.norm.weight"], 2 * got["model.norm.weight"])

    (draft / "model.safetensors").unlink()
    chmod = Path.chmod

    def read_only(path: Path, mode: int) -> None:  # the directory refuses the weights (tests may run as root)
        if path.parent == draft:
            raise PermissionError(f"read-only: {path}")
        chmod(path, mode)

    monkeypatch.setattr(Path, "chmod", read_only)
    out = catalog.ensure_demo_draft(models)
    assert out.parent == tmp_path / "cache" and not (draft / "model.safetensors").exists()
    assert len(load_model(out, device=CPU).model.layers) == 3


def test_gguf_conversion_is_keyed_by_content_reused_and_never_half_published(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from adaserve.engine.loading import gguf

    calls: list[Path] = []

    def fake_write(src: Path, out: Path, *, progress: bool) -> None:  # stands in for transformers' dequantising
        calls.append(out)
        if src.read_bytes() == b"broken":
            raise gguf.GGUFError("cannot read")
        (out / "config.json").write_text("{}")

    monkeypatch.setattr(gguf, "write_hf_dir", fake_write)
    cache = tmp_path / "cache"
    src = tmp_path / "m.gguf"
    src.write_bytes(b"weights")
    out = gguf.ensure_converted(src, cache=cache, progress=False)
    assert out.parent == cache and out.name.startswith("m-") and gguf.is_converted(out)
    assert gguf.ensure_converted(src, cache=cache, progress=False) == out and len(calls) == 1  # reused
    renamed = tmp_path / "other-name.gguf"
    renamed.write_bytes(b"weights")
    assert gguf.ensure_converted(renamed, cache=cache, progress=False).name.endswith(out.name[len("m"):])

    (out / ".adaserve-converted").unlink()  # as if a run died before finishing
    assert gguf.ensure_converted(src, cache=cache, progress=False) == out and len(calls) == 3
    assert gguf.is_converted(out)

    src.write_bytes(b"broken")
    with pytest.raises(gguf.GGUFError, match="cannot read"):
        gguf.ensure_converted(src, cache=cache, progress=False)
    assert sorted(p.name for p in cache.iterdir() if p.name.startswith(".")) == []  # no temp left behind


def test_publish_keeps_a_copy_another_process_finished_first(tmp_path: Path) -> None:
    from adaserve.engine.loading.gguf import publish_dir

    out = tmp_path / "m"

    def theirs_then_ours(tmp: Path) -> None:
        out.mkdir()  # another process publishes while we write
        (out / "done").write_text("theirs")
        (tmp / "done").write_text("ours")

    assert publish_dir(out, theirs_then_ours, done="done") == out
    assert (out / "done").read_text() == "theirs" and [p.name for p in tmp_path.iterdir()] == ["m"]
