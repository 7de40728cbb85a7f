"""Tensor parallelism (parallel.py): the shards, and TP=2 greedy output equal to TP=1 token for token.

The two-rank runs use gloo on the CPU, two processes started by torch.multiprocessing: one spawn serves
every checkpoint and policy (rank 1 loads each model in turn and serves until rank 0 says stop), so the
processes' start-up is paid once.
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.multiprocessing as mp
from safetensors.torch import load_file

from adaserve.engine.config import EngineConfig
from adaserve.engine.engine import Engine
from adaserve.engine.loading.loader import load_model
from adaserve.engine.model import parallel
from adaserve.engine.model.batch import Segment
from adaserve.engine.model.config import ModelConfig, UnsupportedModelError
from adaserve.engine.model.kv_cache import KVCacheConfig, SequenceKV
from adaserve.engine.model.parallel import TensorParallel
from adaserve.engine.model.runner import ModelRunner
from adaserve.engine.model.tree import TokenTree
from adaserve.engine.request import Request
from adaserve.engine.speculation.sampling import SamplingParams
from tests.models import make_checkpoint

CPU = torch.device("cpu")
POLICIES = ("incremental", "chain:4", "adaserve", "specinfer")


@dataclass(frozen=True)
class Case:
    name: str
    arch: str
    overrides: tuple[tuple[str, object], ...] = ()


CASES = (
    Case("llama-gqa", "llama"),  # 4 heads, 2 KV heads: one KV head per rank
    Case("llama-kv1", "llama", (("num_key_value_heads", 1),)),  # one KV head, replicated on both ranks
    Case("qwen2-tied", "qwen2", (("tie_word_embeddings", True),)),  # q/k/v bias, tied embedding and head
    Case("mistral", "mistral", (("num_key_value_heads", 4), ("attention_bias", False))),
    Case("llama-bias", "llama", (("attention_bias", True), ("mlp_bias", True))),  # o_proj/down_proj bias: once
    Case("qwen3", "qwen3", (("head_dim", 32), ("tie_word_embeddings", True))),  # q/k norms (replicated), wide heads
)


def config(static: bool = False) -> EngineConfig:
    return EngineConfig(attention="torch", kv=KVCacheConfig(page_size=4, num_pages=400), static_shapes=static)


def workload() -> list[Request]:
    rng = random.Random(0)
    return [Request(f"r{i}", [rng.randrange(2, 97) for _ in range(rng.randrange(1, 20))],
                    SamplingParams(max_tokens=10, ignore_eos=True)) for i in range(3)]


def generate(target: ModelRunner, draft: Path, policy: str) -> dict[str, list[int]]:
    cfg = EngineConfig(policy=policy, attention="torch", kv=config().kv, budget=24, prefill_chunk=8)
    drf = None if policy == "incremental" else ModelRunner(load_model(draft, device=CPU), cfg)
    eng = Engine(target, drf, cfg)
    reqs = workload()
    for r in reqs:
        eng.add_request(r)
    while eng.has_work:
        eng.step()
    return {r.request_id: r.output_ids for r in reqs}


def runs(case_dirs: list[tuple[Path, Path]]) -> list[tuple[int, str, bool]]:
    """(case index, policy, static shapes) of every engine run, in the order both ranks follow."""
    out = [(i, p, False) for i in range(len(case_dirs)) for p in POLICIES]
    return [*out, (0, "chain:4", True)]  # the static-shape path (eager on a CPU) under TP too


def rank_main(rank: int, size: int, port: int, case_dirs: list[tuple[Path, Path]], out: str) -> None:
    torch.set_num_threads(1)
    tp = parallel.init_rank(rank, size, port=port, device=CPU, timeout_s=300)
    results: dict[str, dict[str, list[int]]] = {}
    for i, p, static in runs(case_dirs):
        target, draft = case_dirs[i]
        model = load_model(target, device=CPU, tp=tp)
        if rank != 0:
            parallel.serve(ModelRunner(model, config(static)), tp)
            continue
        runner = parallel.TensorParallelRunner(model, config(static), tp)
        try:
            results[f"{i} {p} {static}"] = generate(runner, draft, p)
        finally:
            runner.close()
    if rank == 0:
        Path(out).write_text(json.dumps(results))


@pytest.fixture(scope="module")
def case_dirs(tmp_path_factory: pytest.TempPathFactory) -> list[tuple[Path, Path]]:
    root = tmp_path_factory.mktemp("tp")
    dirs = []
    for c in CASES:
        kw = dict(c.overrides)
        target = make_checkpoint(root / c.name, c.arch, seed=0, **kw)
        draft = make_checkpoint(root / f"{c.name}-draft", c.arch, seed=1, num_hidden_layers=1, **kw)
        dirs.append((target, draft))
    return dirs


# ---- the shards, on one process ----------------------------------------------------------------------
@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_shards_put_together_are_the_checkpoint(case_dirs: list[tuple[Path, Path]], case: Case) -> None:
    """Each rank's q/k/v/gate/up rows and o/down columns, concatenated over ranks, are the whole weight;
    with one KV head and two ranks both hold it; a row-parallel bias is on rank 0 only."""
    target = case_dirs[CASES.index(case)][0]
    full = load_file(str(target / "model.safetensors"))
    cfg = ModelConfig.from_dir(target)
    ranks = [load_model(target, device=CPU, tp=TensorParallel(r, 2)).state_dict() for r in range(2)]
    for name, w in full.items():
        if name == "lm_head.weight" and cfg.tie_word_embeddings:
            continue
        spec = parallel.shard_of(name, cfg, TensorParallel(0, 2))
        parts = [sd[name] for sd in ranks]
        if spec is None and name.endswith("bias") and (".o_proj." in name or ".down_proj." in name):
            torch.testing.assert_close(parts[0] + parts[1], w, rtol=0, atol=0)
        elif spec is None or (cfg.num_kv_heads == 1 and (".k_proj." in name or ".v_proj." in name)):
            assert all(torch.equal(p, w) for p in parts), name
        else:
            torch.testing.assert_close(torch.cat(parts, dim=spec[0]), w, rtol=0, atol=0)
            assert parts[0].shape[spec[0]] == w.shape[spec[0]] // 2, name


def test_local_config_divides_or_refuses() -> None:
    cfg = ModelConfig("llama", 97, 64, 96, 2, num_heads=6, num_kv_heads=3, head_dim=16, rms_norm_eps=1e-6,
                      rope_theta=1e4, max_position_embeddings=64, tie_word_embeddings=False)
    local = parallel.local_config(cfg, TensorParallel(1, 3))
    assert (local.num_heads, local.num_kv_heads, local.intermediate_size, local.hidden_size) == (2, 1, 32, 64)
    with pytest.raises(UnsupportedModelError, match="num_attention_heads=6"):
        parallel.local_config(cfg, TensorParallel(0, 4))
    with pytest.raises(UnsupportedModelError, match="num_key_value_heads=3"):
        parallel.local_config(cfg, TensorParallel(0, 2))


def test_kv_heads_replicated_when_fewer_than_ranks() -> None:
    cfg = ModelConfig("llama", 97, 64, 128, 2, num_heads=8, num_kv_heads=2, head_dim=8, rms_norm_eps=1e-6,
                      rope_theta=1e4, max_position_embeddings=64, tie_word_embeddings=False)
    assert [list(parallel.kv_heads(cfg, TensorParallel(r, 4))) for r in range(4)] == [[0], [0], [1], [1]]
    assert [list(parallel.kv_heads(cfg, TensorParallel(r, 2))) for r in range(2)] == [[0], [1]]


def test_segments_survive_the_broadcast_encoding() -> None:
    tree = TokenTree.from_lists([5, 6, 7, 8], [-1, 0, 0, 1])
    segs = [Segment(SequenceKV([3, 1, 4], 6), 6, tree, num_cached=1), Segment(SequenceKV([2]), 0, TokenTree.root(9))]
    sent: list[tuple[int, np.ndarray, int]] = []
    channel = parallel.Channel(TensorParallel(0, 1), CPU)
    channel.send = lambda cmd, payload, n=0: sent.append((cmd, payload, n))  # type: ignore[method-assign]
    channel.send_forward(segs)
    cmd, payload, n = sent[0]
    back = parallel.decode_segments(payload, n)
    assert cmd == parallel.FORWARD and len(back) == 2
    for a, b in zip(segs, back, strict=True):
        assert (a.prefix_len, a.num_cached, a.seq.pages) == (b.prefix_len, b.num_cached, b.seq.pages)
        assert np.array_equal(a.tree.tokens, b.tree.tokens) and np.array_equal(a.tree.parents, b.tree.parents)


def test_stored_quantized_checkpoint_is_refused_under_tp(tmp_path: Path, case_dirs) -> None:
    from safetensors.torch import save_model

    from adaserve.engine.model.quant import quantize_model

    model = quantize_model(load_model(case_dirs[0][0], device=CPU), "int8")
    out = tmp_path / "q"
    out.mkdir()
    (out / "config.json").write_text((case_dirs[0][0] / "config.json").read_text())
    save_model(model, str(out / "model.safetensors"))
    with pytest.raises(UnsupportedModelError, match="tensor parallelism over a checkpoint stored quantized"):
        load_model(out, device=CPU, tp=TensorParallel(0, 2))


# ---- two ranks ---------------------------------------------------------------------------------------
def test_tp2_greedy_equals_tp1_for_every_policy(case_dirs: list[tuple[Path, Path]], tmp_path: Path) -> None:
    out = tmp_path / "tp2.json"
    mp.spawn(rank_main, args=(2, parallel.free_port(), case_dirs, str(out)), nprocs=2)
    got = json.loads(out.read_text())
    for i, policy, static in runs(case_dirs):
        target, draft = case_dirs[i]
        want = generate(ModelRunner(load_model(target, device=CPU), config(static)), draft, policy)
        assert got[f"{i} {policy} {static}"] == want, (CASES[i].name, policy, static)


# ---- the engine builder starts the ranks -------------------------------------------------------------
def test_build_engine_starts_and_stops_the_ranks(case_dirs: list[tuple[Path, Path]]) -> None:
    """build_engine(tensor_parallel_size=2): this process is rank 0, one child process is rank 1; output as
    TP=1; close() stops the child."""
    from adaserve.engine.build import build_engine

    target, draft = case_dirs[0]
    outputs = []
    for n in (1, 2):
        built = build_engine(target=target, draft=draft, policy="chain:4", budget=16, attention="torch",
                             profile=False, progress=False, tensor_parallel_size=n)
        eng = built.engine
        reqs = workload()
        for r in reqs:
            eng.add_request(r)
        while eng.has_work:
            eng.step()
        outputs.append([r.output_ids for r in reqs])
        eng.target.close()
        assert eng.target.tensor_parallel_size == n
    assert outputs[0] == outputs[1]
    assert not [p for p in mp.active_children() if p.name.startswith("adaserve-tp-rank")]


def test_build_engine_refuses_a_size_that_does_not_divide(case_dirs: list[tuple[Path, Path]]) -> None:
    from adaserve.engine.build import EngineBuildError, build_engine

    with pytest.raises(EngineBuildError, match="tensor parallel size 3 does not divide num_attention_heads=4"):
        build_engine(target=case_dirs[0][0], draft=None, policy="incremental", budget=16, profile=False,
                     progress=False, tensor_parallel_size=3)
