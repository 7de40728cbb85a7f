"""Float q/k/v and gate/up joined into one product each (layers.join_linears; the loader does it on a GPU,
issue 30), checked on a CPU where the same function runs: the logits stay those of the separate products,
and speculation against the joined target is still lossless."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from adaserve.engine.config import EngineConfig
from adaserve.engine.engine import Engine
from adaserve.engine.loading.loader import load_model
from adaserve.engine.model.batch import Segment
from adaserve.engine.model.kv_cache import KVCacheConfig, SequenceKV
from adaserve.engine.model.layers import Attention, FewRowLinear, join_linears
from adaserve.engine.model.runner import ModelRunner
from adaserve.engine.model.tree import TokenTree
from tests.engine.helpers import CPU, outputs
from tests.engine.speculation.test_policies import mixed_workload
from tests.models import make_checkpoint


def joined_runner(path: Path, *, static: bool = False) -> ModelRunner:
    model = load_model(path, device=CPU)
    model.fuse_projections()
    cfg = EngineConfig(attention="torch", kv=KVCacheConfig(page_size=4, num_pages=4000), static_shapes=static)
    return ModelRunner(model, cfg)


def test_float_layers_join_side_by_side() -> None:
    torch.manual_seed(0)
    parts = [FewRowLinear(16, n, bias=True) for n in (8, 4, 4)]
    joined = join_linears(parts)
    assert isinstance(joined, FewRowLinear) and joined.out_features == 16
    x = torch.randn(5, 16)
    torch.testing.assert_close(joined(x), torch.cat([m(x) for m in parts], dim=-1), rtol=1e-6, atol=1e-6)
    assert join_linears([FewRowLinear(16, 8), FewRowLinear(12, 8)]) is None  # different inputs
    assert join_linears([FewRowLinear(16, 8, bias=True), FewRowLinear(16, 8, bias=False)]) is None


@pytest.mark.parametrize("arch,overrides", [("llama", {}), ("qwen2", {"tie_word_embeddings": False})])
def test_joined_model_gives_the_separate_products_logits(tmp_path: Path, arch: str, overrides: dict) -> None:
    path = make_checkpoint(tmp_path / arch, arch, seed=3, **overrides)
    ids = torch.randint(0, 97, (30,), generator=torch.Generator().manual_seed(0)).tolist()
    outs = []
    for join in (False, True):
        r = joined_runner(path) if join else ModelRunner(load_model(path, device=CPU), EngineConfig(
            attention="torch", kv=KVCacheConfig(page_size=4, num_pages=4000)))
        if join:
            attn = r.model.model.layers[0].self_attn
            assert isinstance(attn, Attention) and attn.qkv_proj is not None and attn.q_proj is None
        outs.append(r.forward([Segment(SequenceKV(), 0, TokenTree.chain(ids))], all_logits=[True])[0])
    torch.testing.assert_close(outs[1], outs[0], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("policy", ["adaserve", "chain:3", "specinfer"])
@pytest.mark.parametrize("static", [False, True])
def test_speculation_is_lossless_against_the_joined_target(target_dir: Path, draft_dir: Path, policy: str,
                                                           static: bool) -> None:
    outs = []
    for spec in (False, True):
        cfg = EngineConfig(policy=policy if spec else "incremental", budget=20, prefill_chunk=24,
                           static_shapes=static)
        eng = Engine(joined_runner(target_dir, static=static), joined_runner(draft_dir, static=static) if spec
                     else None, cfg)
        outs.append(outputs(eng, mixed_workload(10, 3)))
    assert outs[0] == outs[1]
