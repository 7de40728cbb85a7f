"""The replay clock against the real engine: same schedule for chains, close for trees; and its pieces."""

from __future__ import annotations

import itertools
import math
from functools import cache

import numpy as np
import pytest
import torch

from adaserve.bench.replay_sweep import SweepSettings, engine_config
from adaserve.bench.sim.agreement import AgreementPool, AgreementTrace, agreement_of, record_agreement
from adaserve.bench.sim.clock import SimClock, run_simulated
from adaserve.bench.sim.device_model import load_profile_file
from adaserve.bench.sim.replay import RecordBank, ReplayEngine, ReplayRequest, level_of, replay_trees
from adaserve.engine.engine import Engine
from adaserve.engine.loading.catalog import resolve
from adaserve.engine.loading.loader import load_model
from adaserve.engine.model.runner import ModelRunner
from adaserve.engine.request import Request
from adaserve.engine.speculation.policies import TreeShape, make_policy
from adaserve.engine.speculation.sampling import SamplingParams

DEVICE = "artifact/llama-3.1-70b"
N_OUT = 40
# (arrival s, prompt ids, TPOT SLO ms): a burst, then stragglers; prompts long enough to need several chunks
WORKLOAD = [(0.0 if i < 6 else 0.05 * i, [(7 * i + k) % 300 + 3 for k in range(20 + 37 * i)],
             (36.0, 50.0, 150.0)[i % 3]) for i in range(12)]


@cache
def demo() -> tuple[ModelRunner, ModelRunner]:
    pair = resolve("demo-tiny", progress=False)
    assert pair.draft is not None
    cpu = torch.device("cpu")
    return (ModelRunner(load_model(pair.target, device=cpu, progress=False)),
            ModelRunner(load_model(pair.draft, device=cpu, progress=False)))


@cache
def recordings() -> tuple[AgreementTrace, ...]:
    target, draft = demo()
    pool = record_agreement(target, draft, [("c", ids, str(i)) for i, (_, ids, _) in enumerate(WORKLOAD)],
                            output_tokens=N_OUT)
    return tuple(pool.traces["c"])


def settings(**kw: object) -> SweepSettings:
    return SweepSettings(device_profile=DEVICE, prefill_chunk=128, max_batch=8, **kw)  # type: ignore[arg-type]


def real_run(system: str, s: SweepSettings) -> list[Request]:
    target, draft = demo()
    device = load_profile_file(DEVICE)
    cfg = engine_config(system, device, s)
    clock = SimClock()
    speculates = make_policy(cfg.policy, cfg).max_shape is not None
    eng = Engine(target, draft if speculates else None, cfg, clock=clock)
    reqs = [(t, Request(f"r{i}", ids, SamplingParams(max_tokens=N_OUT, ignore_eos=True), tpot_slo_ms=slo))
            for i, (t, ids, slo) in enumerate(WORKLOAD)]
    run_simulated(eng, reqs, device, clock, sched_s=device.sched_s)
    return [r for _, r in reqs]


def replay_run(system: str, s: SweepSettings) -> list[ReplayRequest]:
    device = load_profile_file(DEVICE)
    cfg = engine_config(system, device, s)
    reqs = [ReplayRequest(f"r{i}", "c", t, len(ids), N_OUT, slo, rec)
            for i, ((t, ids, slo), rec) in enumerate(zip(WORKLOAD, recordings(), strict=True))]
    assert cfg.target_cost is not None and cfg.draft_cost is not None
    ReplayEngine(cfg, device, cfg.target_cost, cfg.draft_cost).run(reqs)
    return reqs


@pytest.mark.parametrize("system", ["vllm", "sarathi", "vllm-spec:3", "chain:2", "chain:2|prefill_rule=slo",
                                    "chain:2|prefill_rule=slo;prefill_ttft_ms=250"])
def test_a_chain_or_plain_schedule_is_the_real_engines_exactly(system: str) -> None:
    """Chains accept exactly what the recording says (the draft's top-1 agreeing with the target in a row),
    so every verification, every token time and the order of admission must match the real engine's."""
    s = settings()
    real, replayed = real_run(system, s), replay_run(system, s)
    for a, b in zip(real, replayed, strict=True):
        assert a.metrics.accepted_per_step == b.accepted_per_step, a.request_id
        assert len(a.output_ids) == b.emitted == N_OUT
        assert a.metrics.first_token_s == pytest.approx(b.first_s, abs=1e-9)
        assert a.metrics.last_token_s == pytest.approx(b.last_s, abs=1e-9)
    if system.startswith(("vllm-spec", "chain")):  # the demo pair agrees often enough to test acceptance
        assert sum(sum(r.accepted_per_step) for r in replayed) > N_OUT


@pytest.mark.parametrize("system", ["adaserve", "adaserve+ours"])
def test_a_tree_schedule_is_close_to_the_real_engines(system: str) -> None:
    """Trees differ off the target's path (replayed rows, not the draft's own), so the schedule is close,
    not equal: accepted tokens per verification within 15%, finishing times within 10%."""
    s = settings()
    real, replayed = real_run(system, s), replay_run(system, s)
    acc_real = np.mean([a for r in real for a in r.metrics.accepted_per_step])
    acc_replay = np.mean([a for r in replayed for a in r.accepted_per_step])
    assert acc_replay == pytest.approx(acc_real, rel=0.15)
    end_real = max(r.metrics.last_token_s or 0.0 for r in real)
    end_replay = max(r.last_s or 0.0 for r in replayed)
    assert end_replay == pytest.approx(end_real, rel=0.10)


def test_agreement_of_ranks_the_target_token_among_the_drafts_top_w() -> None:
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.2, 0.0 + 1e-9], [0.1, 0.2, 0.3, 0.4]]))
    q, choice = agreement_of(logits, [1, 0], 2)
    assert q[0] == pytest.approx([0.5, 0.3], rel=1e-6)
    assert choice.tolist() == [1, -1]  # token 1 is the draft's second choice; token 0 is not in row 1's top 2


def trace(q_rows: list[list[float]], choice: list[int]) -> AgreementTrace:
    return AgreementTrace("c", np.asarray(q_rows), np.asarray(choice))


def test_replayed_trees_put_the_targets_choices_on_the_path_and_keep_the_beam() -> None:
    rec = trace([[0.6, 0.3, 0.1]] * 6, [1, 0, 0, 2, 0, 0])
    bank = RecordBank.of([rec])
    shape = TreeShape(depth=3, width=2)
    [tree], good = replay_trees(bank, [rec], [0], shape, np.random.default_rng(0))
    assert tree.size == 1 + 3 * 2
    assert level_of(shape).tolist() == [0, 1, 1, 2, 2, 3, 3]
    # level 1: the root's top two (0.6, 0.3); the target took rank 1 (0.3), then rank 0 twice
    assert math.exp(tree.log_probs[1]) == pytest.approx(0.6) and math.exp(tree.log_probs[2]) == pytest.approx(0.3)
    on = np.flatnonzero(good[0]).tolist()
    assert on[:2] == [0, 2]
    assert all(tree.parents[b] == a for a, b in itertools.pairwise(on))  # the on-path nodes are a chain
    assert np.all(tree.log_probs[1:] < tree.log_probs[tree.parents[1:]])  # strictly decreasing, as the engine's


def test_a_pool_survives_its_file(tmp_path: object) -> None:
    from pathlib import Path

    path = Path(str(tmp_path)) / "pool.npz"
    pool = AgreementPool({"coding": [trace([[0.7, 0.2]] * 3, [0, -1, 1])]}, {"model": "x"})
    pool.save(path)
    back = AgreementPool.load(path)
    assert back.meta == {"model": "x"}
    assert back.traces["coding"][0].choice.tolist() == [0, -1, 1]
    assert back.summary()["coding"]["p_rank"] == [pytest.approx(1 / 3, abs=1e-4), pytest.approx(1 / 3, abs=1e-4)]
    (Path(str(tmp_path)) / "bad.npz").write_bytes(b"not a pool")
    with pytest.raises(ValueError, match="not an agreement pool"):
        AgreementPool.load(Path(str(tmp_path)) / "bad.npz")


def test_a_probe_schedule_is_the_real_engines_exactly() -> None:
    """A plain streak's probe (TreeShape.probe: one request drafts, the one with the fewest tokens to catch up) is
    replayed as the engine runs it: chains of 2 every third iteration, the same acceptance and token times."""
    s = settings()
    device = load_profile_file(DEVICE)
    cfg = engine_config("chain:2", device, s)

    def probing(policy: object) -> None:
        shapes = iter([None, None, TreeShape(2, 1, probe=True)] * 1000)
        object.__setattr__(policy, "tree_shape", lambda view: next(shapes))

    target, draft = demo()
    clock = SimClock()
    eng = Engine(target, draft, cfg, clock=clock)
    probing(eng.policy)
    real = [(t, Request(f"r{i}", ids, SamplingParams(max_tokens=N_OUT, ignore_eos=True), tpot_slo_ms=slo))
            for i, (t, ids, slo) in enumerate(WORKLOAD)]
    run_simulated(eng, real, device, clock, sched_s=device.sched_s)
    replayed = [ReplayRequest(f"r{i}", "c", t, len(ids), N_OUT, slo, rec)
                for i, ((t, ids, slo), rec) in enumerate(zip(WORKLOAD, recordings(), strict=True))]
    assert cfg.target_cost is not None and cfg.draft_cost is not None
    rep = ReplayEngine(cfg, device, cfg.target_cost, cfg.draft_cost)
    probing(rep.policy)
    rep.run(replayed)
    for (_, a), b in zip(real, replayed, strict=True):
        assert a.metrics.accepted_per_step == b.accepted_per_step, a.request_id
        assert a.metrics.last_token_s == pytest.approx(b.last_s, abs=1e-9)
    # a probe verified one request's chain: most verifications of the roots alone, some chains accepted
    assert sum(sum(b.accepted_per_step) for b in replayed) > 0
    assert sum(v == 1 for b in replayed for v in b.verified_per_step) > sum(v > 1 for b in replayed
                                                                              for v in b.verified_per_step)
