"""Tensor parallelism (parallel.py): the shards, and TP=2 greedy output equal to TP=1 token for token.

The two-rank runs use gloo on the CPU, two processes started by torch.multiprocessing: one spawn serves
every checkpoint and policy (rank 1 loads each model in turn and serves until rank 0 says stop), so the
processes' start-up is paid once.
"""

from __future__ import annotations

import json
import random
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace
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
from adaserve.engine.model.kv_cache import KVCacheConfig, PagedKVCache, SequenceKV
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
    # SmolLM2's shape in small: 9 heads in 3 KV groups and 99 MLP columns, split unevenly over 2 ranks
    Case("llama-9-3", "llama", (("hidden_size", 72), ("num_attention_heads", 9), ("num_key_value_heads", 3),
                                ("intermediate_size", 99))),
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
    parallel.leave()


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
            assert parts[0].shape[spec[0]] == spec[2] - spec[1], name


def config_of(heads: int, kv_heads: int, columns: int = 1536) -> ModelConfig:
    return ModelConfig("llama", 97, 64, columns, 2, num_heads=heads, num_kv_heads=kv_heads, head_dim=8,
                       rms_norm_eps=1e-6, rope_theta=1e4, max_position_embeddings=64, tie_word_embeddings=False)


def shards(heads: int, kv_heads: int, size: int, columns: int = 1536) -> list[tuple[range, range, range]]:
    return [(s.q_heads, s.kv_heads, s.columns)
            for s in (parallel.split(config_of(heads, kv_heads, columns), r, size) for r in range(size))]


def test_split_by_kv_group_unevenly() -> None:
    """SmolLM2-135M's 9 heads / 3 KV heads: 2 ranks get 2 and 1 KV groups, query heads following them; 3 ranks
    one group each; the MLP columns halve or split into thirds."""
    assert shards(9, 3, 2) == [(range(0, 6), range(0, 2), range(0, 768)), (range(6, 9), range(2, 3), range(768, 1536))]
    assert shards(9, 3, 3) == [(range(0, 3), range(0, 1), range(0, 512)), (range(3, 6), range(1, 2), range(512, 1024)),
                               (range(6, 9), range(2, 3), range(1024, 1536))]
    assert [c for _, _, c in shards(9, 3, 2, columns=99)] == [range(0, 50), range(50, 99)]


def test_split_even_and_replicated() -> None:
    """32/8 over 4: two KV heads and eight query heads each; 4/1 over 2: the one KV head on both ranks, two query
    heads each; 9/3 over 4: KV head 0 replicated on ranks 0-1 (query heads 0-1 and 2), 1 and 2 on one rank each."""
    assert shards(32, 8, 4) == [(range(8 * r, 8 * r + 8), range(2 * r, 2 * r + 2), range(384 * r, 384 * r + 384))
                                for r in range(4)]
    assert [(q, kv) for q, kv, _ in shards(4, 1, 2)] == [(range(0, 2), range(0, 1)), (range(2, 4), range(0, 1))]
    assert [kv for _, kv, _ in shards(8, 2, 4)] == [range(0, 1), range(0, 1), range(1, 2), range(1, 2)]
    assert [(q, kv) for q, kv, _ in shards(9, 3, 4)] == [(range(0, 2), range(0, 1)), (range(2, 3), range(0, 1)),
                                                         (range(3, 6), range(1, 2)), (range(6, 9), range(2, 3))]


@pytest.mark.parametrize(("heads", "kv_heads", "columns"),
                         [(9, 3, 99), (32, 8, 100), (4, 1, 7), (12, 4, 30), (8, 8, 9)])
def test_every_head_and_column_on_one_rank_with_its_kv_head(heads: int, kv_heads: int, columns: int) -> None:
    """For every size up to the head count: the ranks' query heads and columns partition the model's, each
    rank's query heads read only KV heads it holds, and every KV head is held somewhere."""
    group = heads // kv_heads
    for size in range(1, heads + 1):
        if size > columns:
            continue
        got = shards(heads, kv_heads, size, columns)
        assert [h for q, _, _ in got for h in q] == list(range(heads)), size
        assert [c for _, _, c in got for c in c] == list(range(columns)), size
        assert all(q and all(h // group in kv for h in q) for q, kv, _ in got), size
        assert {k for _, kv, _ in got for k in kv} == set(range(kv_heads)), size


def test_local_config_splits_or_refuses() -> None:
    cfg = ModelConfig("llama", 97, 64, 96, 2, num_heads=6, num_kv_heads=3, head_dim=16, rms_norm_eps=1e-6,
                      rope_theta=1e4, max_position_embeddings=64, tie_word_embeddings=False)
    local = parallel.local_config(cfg, TensorParallel(1, 3))
    assert (local.num_heads, local.num_kv_heads, local.intermediate_size, local.hidden_size) == (2, 1, 32, 64)
    local = parallel.local_config(cfg, TensorParallel(0, 2))  # 3 KV groups over 2 ranks: 2 of them here
    assert (local.num_heads, local.num_kv_heads, local.intermediate_size) == (4, 2, 48)
    local = parallel.local_config(cfg, TensorParallel(1, 4))  # 4 ranks over 3 groups: group 0 on ranks 0-1
    assert (local.num_heads, local.num_kv_heads, local.intermediate_size) == (1, 1, 24)
    with pytest.raises(UnsupportedModelError, match="tensor parallel size 7 is more than num_attention_heads=6"):
        parallel.local_config(cfg, TensorParallel(0, 7))
    with pytest.raises(UnsupportedModelError, match="intermediate_size=3"):
        parallel.local_config(replace(cfg, intermediate_size=3), TensorParallel(0, 4))


def test_every_rank_gets_rank_0s_page_count() -> None:
    """Uneven KV heads would size the ranks' caches differently from the same memory; pages_for pins rank 0's
    count (it holds the most KV heads), so a rank with fewer allocates less rather than unused pages."""
    cfg = config_of(9, 3)
    kv = KVCacheConfig(page_size=4, memory_bytes=2**20)
    pinned = parallel.pages_for(kv, cfg, 2, torch.float32)
    per_page = 2 * cfg.num_layers * 2 * cfg.head_dim * 4 * 4  # K and V, 2 layers, rank 0's 2 KV heads, fp32
    assert pinned.num_pages == 2**20 // per_page
    caches = [PagedKVCache(parallel.local_config(cfg, TensorParallel(r, 2)), pinned, dtype=torch.float32, device=CPU)
              for r in range(2)]
    assert [(c.num_pages, c.k.shape[2]) for c in caches] == [(pinned.num_pages, 2), (pinned.num_pages, 1)]
    assert parallel.pages_for(kv, cfg, 1, torch.float32) is kv
    assert parallel.pages_for(replace(kv, num_pages=7), cfg, 2, torch.float32).num_pages == 7


class ThreadSum:
    """An all-reduce among ``n`` threads standing in for ranks: each puts its part, all wait, all take the sum."""

    def __init__(self, n: int) -> None:
        self.parts: list[torch.Tensor | None] = [None] * n
        self.barrier = threading.Barrier(n, timeout=60)

    def for_rank(self, rank: int) -> Callable[[torch.Tensor], torch.Tensor]:
        def reduce(x: torch.Tensor) -> torch.Tensor:
            self.parts[rank] = x
            self.barrier.wait()
            total = torch.stack([p for p in self.parts if p is not None]).sum(0)
            self.barrier.wait()  # every rank has summed before any writes its next part
            return total

        return reduce


@pytest.mark.parametrize("size", [2, 3, 4])
def test_uneven_shards_sum_to_the_whole_model(case_dirs: list[tuple[Path, Path]], size: int) -> None:
    """9 heads / 3 KV heads / 99 columns over 2, 3 and 4 ranks (4: KV head 0 replicated on two ranks, the
    others on one), threads for ranks in one process: the sharded forward's logits are the whole model's."""
    target = case_dirs[[c.name for c in CASES].index("llama-9-3")][0]
    tokens = [5, 17, 3, 88, 42, 9, 61]

    def logits(runner: ModelRunner) -> torch.Tensor:
        seg = Segment(SequenceKV(), 0, TokenTree.chain(tokens))
        return runner.forward([seg], all_logits=[True])[0]

    want = logits(ModelRunner(load_model(target, device=CPU), config()))
    runners = []
    reduce = ThreadSum(size)
    for r in range(size):
        model = load_model(target, device=CPU, tp=TensorParallel(r, size))
        for layer in model.model.layers:
            layer.self_attn.reduce = layer.mlp.reduce = reduce.for_rank(r)
        runners.append(ModelRunner(model, config()))
    with ThreadPoolExecutor(size) as pool:
        got = list(pool.map(logits, runners))
    for g in got:
        torch.testing.assert_close(g, want, rtol=1e-4, atol=1e-4)
    assert torch.equal(got[0].argmax(-1), want.argmax(-1))


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


def test_build_engine_refuses_more_ranks_than_heads(case_dirs: list[tuple[Path, Path]]) -> None:
    from adaserve.engine.build import EngineBuildError, build_engine

    with pytest.raises(EngineBuildError, match="tensor parallel size 5 is more than num_attention_heads=4"):
        build_engine(target=case_dirs[0][0], draft=None, policy="incremental", budget=16, profile=False,
                     progress=False, tensor_parallel_size=5)


# ---- the default model (issue 31: this runs in CI, ~30 s) ------------------------------------------------
def test_smollm2_tp2_greedy_equals_tp1() -> None:
    """SmolLM2-135M (9 heads in 3 KV groups: ranks of 6 and 3 query heads, 2 and 1 KV heads; 1536 MLP columns)
    at TP=2 through build_engine gives TP=1's greedy tokens, incremental and adaserve with its draft."""
    from transformers import AutoTokenizer

    from adaserve.engine.build import build_engine
    from tests.models import smollm2_pair

    pair = smollm2_pair()
    tok = AutoTokenizer.from_pretrained(str(pair.target))
    ids = tok.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}],
                                  add_generation_prompt=True, tokenize=True)
    ids = list(ids["input_ids"] if hasattr(ids, "keys") else ids)
    outputs: dict[tuple[str, int], list[int]] = {}
    for policy in ("incremental", "adaserve"):
        for n in (1, 2):
            built = build_engine(target=pair.target, draft=pair.draft, policy=policy, budget=32, profile=False,
                                 progress=False, tensor_parallel_size=n)
            req = Request("s", ids, SamplingParams(max_tokens=8, ignore_eos=True))
            built.engine.run([(0.0, req)])
            built.engine.target.close()
            assert built.engine.target.tensor_parallel_size == n
            outputs[policy, n] = req.output_ids
    assert len(outputs["incremental", 1]) == 8
    assert outputs["incremental", 2] == outputs["incremental", 1]
    assert outputs["adaserve", 2] == outputs["adaserve", 1] == outputs["incremental", 1]
