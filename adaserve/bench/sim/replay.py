"""The replay clock: the engine's scheduling on the simulated clock, with acceptance replayed from recordings.

A simulated run with real models (clock.py) spends most of its host time in the models' forwards and the
engine's tensor work, though only two things about them matter to the schedule: how long each forward
takes (the device profile says) and which drafted tokens the target accepts. This module keeps the first
and replays the second from recorded draft/target agreement (agreement.py), so a 360 s trace at 4.8 req/s
runs in seconds to a minute instead of an hour.

What is the engine's own code here, and what mirrors it:

    the engine's own     the policy (tree shape and selection: policies.py, selection.py), A(r)
                         (selection.slo_requirement), the goodput budget (iteration_budget.py), learnt node
                         values (acceptance.RankAcceptance), the SLO prefill rule (prefill_chunk.py), the
                         profiled cost models the engine predicts with, and the device's prices
    mirrored here        Engine.step's order: admit, prefill chunks, the draft's beam search, budget and
                         selection, one target forward over prefill + trees, the walk, emission; the
                         admission and prefill rules (max_batch, mixed / separate, chunk), the draft's
                         catch-up tokens in its first beam step. tests/bench/sim/test_replay.py runs the
                         real engine and this replay on one workload and checks they agree.
    replayed             the draft's candidate trees and the target's choice (below)

Candidate trees, per decoding request with o tokens emitted and a recording (q, choice):

    the root sits on the target's path at row o; a node on the path at row p expands to the draft's
    top-k children with conditional probabilities q[p, :k]; the child of rank choice[p] is on the path
    (row p + 1); the others are off it
    a node off the path expands with q of a random row of the same recording (its children can never be
    accepted; their probabilities only shape beam pruning and selection)
    beam search as speculate.beam_search: the top ``width`` of all expansions by path probability per
    level (or a static per-node fan-out for SpecInfer), strict decrease as the engine applies it
    the walk accepts the selected on-path nodes: they form a chain from the root, so their count is the
    number of accepted draft tokens; the target's bonus token follows

Assumptions (the departures from a real run, stated where results are reported): off-path rows are drawn
independently of their context; a request without its own recording replays one of its class, chosen by
the seed; KV memory is a token count (None: unlimited), not pages of a real cache.

May import: the engine, and this room's device model.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np

from adaserve.bench.sim.agreement import AgreementTrace
from adaserve.bench.sim.clock import SimTotals
from adaserve.bench.sim.device_model import DeviceProfile
from adaserve.engine.config import EngineConfig
from adaserve.engine.cost.cost_model import CostModel
from adaserve.engine.model.tree import TokenTree
from adaserve.engine.prefill_chunk import DecodingSLO, PrefillTTFT, recent_figures, slo_prefill_chunk, ttft_left_s
from adaserve.engine.speculation.acceptance import RankAcceptance
from adaserve.engine.speculation.adaptive import recent_ratios
from adaserve.engine.speculation.iteration_budget import goodput_budget, slo_budget, token_price
from adaserve.engine.speculation.policies import (
    BatchView,
    Policy,
    SelectionContext,
    TreeShape,
    is_budgeted,
    make_policy,
    reads_slo_lines,
)
from adaserve.engine.speculation.selection import requirement_line, slo_requirement

WAITING, PREFILL, DECODE, DONE = range(4)


@dataclass
class ReplayRequest:
    """A request of the replayed workload, and its progress."""

    request_id: str
    slo_class: str
    arrival_s: float
    prompt_len: int
    out_len: int
    tpot_slo_ms: float | None
    record: AgreementTrace
    ttft_slo_ms: float | None = None  # None: the engine's prefill_ttft_ms
    phase: int = WAITING
    prefilled: int = 0  # prompt tokens in the target KV
    emitted: int = 0  # output tokens so far
    draft_len: int = 0  # tokens in the draft KV
    # when the driver handed it to the engine: the step boundary after its arrival, where the real engine on the
    # simulated clock stamps its arrival (run_simulated, Engine.add_request), which the SLO prefill rule reads
    queued_s: float | None = None
    admitted_s: float | None = None  # when admission gave it a running slot (TTFT = queue + prefill)
    first_s: float | None = None
    last_s: float | None = None
    accepted_per_step: list[int] = field(default_factory=list)
    verified_per_step: list[int] = field(default_factory=list)

    @property
    def kv_len(self) -> int:
        """Tokens in the target KV while decoding: prompt and output but the root (the last emitted token)."""
        return self.prompt_len + self.emitted - 1

    @property
    def tpot_ms(self) -> float | None:
        if self.first_s is None or self.last_s is None or self.emitted < 2:
            return None
        return 1e3 * (self.last_s - self.first_s) / (self.emitted - 1)

    @property
    def ttft_ms(self) -> float | None:
        return None if self.first_s is None else 1e3 * (self.first_s - self.arrival_s)


@dataclass
class ReplayTotals(SimTotals):
    """Where the simulated time went (clock.SimTotals' fields), what the iterations verified, and when the
    last one ended."""

    tokens_verified: int = 0
    tokens_accepted: int = 0
    decode_iterations: int = 0
    end_s: float = 0.0


@dataclass(frozen=True)
class Verified:
    """One request's verification: tree size, accepted draft tokens, the tree's depth; the tree and the
    accepted path (node indices) only where learnt node values need them."""

    size: int
    accepted: int
    depth: int
    tree: TokenTree | None = None
    path: list[int] | None = None


ROOT_ONLY = Verified(1, 0, 0)


@dataclass
class _Step:
    """What the SLO prefill rule reads of recent iterations (Engine.history's StepMetrics, in part)."""

    n_decode: int
    tokens_accepted: int
    tokens_verified: int
    host_s: float


# ---- candidate trees ----------------------------------------------------------------------------------
@dataclass
class RecordBank:
    """Every recording a run replays, end to end in one array, so a batch's trees grow level by level in numpy."""

    log_q: np.ndarray  # [rows, W]: log q, at most -STRICT_DECREASE_EPS (AgreementTrace.log_q)
    choice: np.ndarray  # [rows]
    offset: dict[int, tuple[int, int]]  # id(recording) -> (first row, length)

    @classmethod
    def of(cls, records: Sequence[AgreementTrace]) -> RecordBank:
        distinct = list({id(r): r for r in records}.values())
        if not distinct:
            return cls(np.zeros((0, 1)), np.zeros(0, np.int64), {})
        width = min(r.width for r in distinct)
        offset, start = {}, 0
        for r in distinct:
            offset[id(r)] = (start, r.length)
            start += r.length
        return cls(np.concatenate([r.log_q[:, :width] for r in distinct]),
                   np.concatenate([r.choice for r in distinct]), offset)

    @property
    def width(self) -> int:
        return int(self.log_q.shape[1])


def replay_trees(bank: RecordBank, records: Sequence[AgreementTrace], rows: Sequence[int], shape: TreeShape,
                 rng: np.random.Generator) -> tuple[list[TokenTree], np.ndarray]:
    """Candidate trees for a batch, request i at output row ``rows[i]`` (tokens emitted so far) of its
    recording, and [n, M] which nodes lie on the target's path (see the module docstring). Token ids are
    node numbers: nothing reads them. Path log-probabilities decrease strictly, as the engine's
    (``TokenTree.with_strict_decrease``): every log q is at most -STRICT_DECREASE_EPS."""
    n = len(records)
    start = np.asarray([bank.offset[id(r)][0] for r in records], np.int64)[:, None]
    length = np.asarray([bank.offset[id(r)][1] for r in records], np.int64)[:, None]
    beam = shape.expansion is None
    levels = shape.depth if beam else len(shape.expansion)  # type: ignore[arg-type]
    # the frontier, [n, F]: log f, the recording's row of each node's context (-1: off the path), node index
    f_lp = np.zeros((n, 1))
    f_row = np.asarray(rows, np.int64)[:, None]
    f_idx = np.zeros((n, 1), np.int64)
    parents, lps, goods = [np.full((n, 1), -1, np.int64)], [f_lp], [np.ones((n, 1), bool)]
    count = 1
    for step in range(levels):
        k = min(shape.width if beam else shape.expansion[step], bank.width)  # type: ignore[index]
        on = (f_row >= 0) & (f_row < length)
        # off the path (or past the recording): a random row's probabilities, and nothing accepted
        g = start + np.where(on, f_row, rng.integers(0, length, size=f_row.shape))
        pick = np.where(on, bank.choice[g], -1)  # [n, F]
        c_lp = (f_lp[:, :, None] + bank.log_q[g][:, :, :k]).reshape(n, -1)  # [n, F * k], frontier-major
        c_good = (np.arange(k)[None, None, :] == pick[:, :, None]).reshape(n, -1)
        c_row = np.where(c_good, np.repeat(f_row + 1, k, axis=1), -1)
        c_par = np.repeat(f_idx, k, axis=1)
        if beam:  # the top ``width`` by path probability; ties keep frontier-major order
            top = np.argsort(-c_lp, axis=1, kind="stable")[:, : shape.width]
            c_lp, c_good, c_row, c_par = (np.take_along_axis(a, top, axis=1) for a in (c_lp, c_good, c_row, c_par))
        m = c_lp.shape[1]
        f_lp, f_row, f_idx = c_lp, c_row, np.broadcast_to(np.arange(count, count + m), (n, m))
        parents.append(c_par)
        lps.append(c_lp)
        goods.append(c_good)
        count += m
    par_all, lp_all, good_all = (np.concatenate(a, axis=1) for a in (parents, lps, goods))
    tokens = np.arange(count, dtype=np.int64)
    # valid by construction: node 0 the root, every level appended after its parents, log f finite
    return [TokenTree.trusted(tokens, par_all[i], lp_all[i]) for i in range(n)], good_all


def level_of(shape: TreeShape) -> np.ndarray:
    """Each node's depth in a candidate tree of ``shape`` (replay_trees numbers nodes level by level)."""
    sizes = [1]
    for step in range(shape.depth if shape.expansion is None else len(shape.expansion)):
        sizes.append(shape.width if shape.expansion is None else sizes[-1] * shape.expansion[step])
    return np.repeat(np.arange(len(sizes)), sizes)


# ---- the loop -----------------------------------------------------------------------------------------
@dataclass
class ReplayEngine:
    """One system's schedule over a replayed workload (Engine.step's order; see the module docstring)."""

    cfg: EngineConfig
    device: DeviceProfile
    target_cost: CostModel  # the engine's profiled predictions (frozen, as a profiled worker's)
    draft_cost: CostModel
    seed: int = 0
    kv_tokens: int | None = None
    now: float = 0.0
    policy: Policy = field(init=False)
    waiting: deque[ReplayRequest] = field(default_factory=deque)
    running: list[ReplayRequest] = field(default_factory=list)
    totals: ReplayTotals = field(default_factory=ReplayTotals)
    step_listeners: list[Callable[[dict], None]] = field(default_factory=list)
    # after each selection: the decoding requests' ids, A(r) + margin as selection saw it, the verified tree
    # sizes and accepted counts, the tree shape, the budget and the predicted iteration (a trace's per-request view)
    selection_listeners: list[Callable[[dict], None]] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.policy = make_policy(self.cfg.policy, self.cfg)
        if "@" in self.cfg.policy:
            raise ValueError("the replay clock runs one draft: a policy with a draft selector needs the real engine")
        self.rng = np.random.default_rng(self.seed)
        self.bank = RecordBank.of([])
        self.acceptance = (RankAcceptance() if self.cfg.node_value == "learned" and is_budgeted(self.policy)
                           else None)
        self.reserved = 0
        self.history: deque[_Step] = deque(maxlen=16)
        shape = self.policy.max_shape
        self.tree_max = 1 if shape is None else shape.max_nodes

    # ---- requests ----
    def _reservation(self, r: ReplayRequest) -> int:
        return r.prompt_len + r.out_len + self.tree_max

    def _admit(self) -> None:
        while self.waiting and len(self.running) < self.cfg.max_batch:
            r = self.waiting[0]
            need = self._reservation(r)
            if self.kv_tokens is not None and self.reserved + need > self.kv_tokens:
                return
            self.waiting.popleft()
            self.reserved += need
            r.phase = PREFILL
            r.admitted_s = self.now
            self.running.append(r)

    def _finish(self, r: ReplayRequest) -> None:
        r.phase = DONE
        self.reserved -= self._reservation(r)
        self.running.remove(r)

    # ---- prefill (Engine._prefill_chunk, Engine._prefill_segments) ----
    def _prefill_chunk(self) -> int:
        cfg = self.cfg
        if cfg.prefill_rule != "slo" or not any(r.phase == PREFILL for r in self.running):
            return cfg.prefill_chunk
        decoding = [r for r in self.running if r.phase == DECODE]
        slos = [DecodingSLO(self.now - r.first_s, max(0, r.emitted - 1), r.tpot_slo_ms / 1e3)
                for r in decoding if r.tpot_slo_ms is not None and r.first_s is not None]
        if not slos:
            return cfg.prefill_chunk
        per_req, verify, host = recent_figures(list(self.history), len(decoding))  # the last 16 (maxlen)
        n_ctx = sum(r.kv_len for r in decoding)
        prefilling = [PrefillTTFT(r.prompt_len - r.prefilled,
                                  ttft_left_s(r.queued_s if r.queued_s is not None else r.arrival_s,
                                              r.ttft_slo_ms or cfg.prefill_ttft_ms, self.now))
                      for r in self.running if r.phase == PREFILL]
        return slo_prefill_chunk(
            slos, min_chunk=min(cfg.prefill_min_chunk, cfg.prefill_chunk), max_chunk=cfg.prefill_chunk,
            tokens_per_iter=per_req, t_iter=lambda p: host + self.target_cost.predict(n_ctx, round(verify) + p),
            prefilling=prefilling)

    def _prefill_segments(self) -> list[tuple[ReplayRequest, int]]:
        whole = self.cfg.prefill_mode == "separate"
        left = self._prefill_chunk()
        out: list[tuple[ReplayRequest, int]] = []
        for r in self.running:
            if r.phase != PREFILL or left <= 0:
                continue
            rest = r.prompt_len - r.prefilled
            if whole and out and rest > left:
                break
            chunk = rest if whole else min(rest, left)
            left -= chunk
            out.append((r, chunk))
        return out

    # ---- one iteration (Engine.step) ----
    def step(self) -> None:
        t_start = self.now
        self._admit()
        prefill = self._prefill_segments()
        prefill_tokens = sum(c for _, c in prefill)
        separate = bool(prefill) and self.cfg.prefill_mode == "separate"
        decoding = [] if separate else [r for r in self.running if r.phase == DECODE]
        verified_trees, t_draft = self._speculate_and_select(decoding, prefill_tokens, t_start)
        # one target forward: the prompt chunks and every tree
        n_new = prefill_tokens + sum(v.size for v in verified_trees)
        n_ctx = sum(r.prefilled for r, _ in prefill) + sum(r.kv_len for r in decoding)
        t_target = self.device.target.seconds(n_new, n_ctx) if n_new else 0.0
        self.now += t_target
        self.totals.target_s += t_target
        emitted: list[tuple[ReplayRequest, int]] = []
        for r, c in prefill:
            r.prefilled += c
            if r.prefilled == r.prompt_len:
                r.phase = DECODE
                emitted.append((r, 1))
        accepted_total = proposed = rejections = verified = 0
        if self.acceptance is not None:  # learnt values count every verified tree
            seen = [v for v in verified_trees if v.tree is not None and v.path is not None]
            self.acceptance.observe_many([v.tree for v in seen], [v.path for v in seen])  # type: ignore[misc]
        for r, v in zip(decoding, verified_trees, strict=True):
            r.accepted_per_step.append(v.accepted)
            r.verified_per_step.append(v.size)
            accepted_total += v.accepted
            verified += v.size
            proposed += v.size - 1
            rejections += v.size > 1 and v.accepted < v.depth  # the path stopped short of the deepest level
            emitted.append((r, v.accepted + 1))
        if proposed:
            self.policy.observe(accepted_total, proposed)
            self.policy.observe_paths(accepted_total, rejections)
        for r, k in emitted:  # Engine._emit: every token of the iteration lands now
            k = min(k, r.out_len - r.emitted)
            if r.first_s is None:
                r.first_s = self.now
            r.emitted += k
            r.last_s = self.now
            if r.emitted >= r.out_len:
                self._finish(r)
        sched = self.device.sched_s
        self.now += sched
        self.totals.sched_s += sched
        self.totals.iterations += 1
        self.totals.per_step_s.append(self.now - t_start)
        if decoding:
            self.totals.decode_iterations += 1
            self.totals.tokens_verified += verified
            self.totals.tokens_accepted += accepted_total
        self.history.append(_Step(len(decoding), accepted_total, verified, t_draft))
        for listener in self.step_listeners:
            listener({"t_start": t_start, "n_decode": len(decoding), "prefill_tokens": prefill_tokens,
                      "n_prefill": sum(r.phase == PREFILL for r in self.running), "n_waiting": len(self.waiting),
                      "verified": verified, "accepted": accepted_total, "t_draft": t_draft, "t_target": t_target})

    def _speculate_and_select(self, decoding: list[ReplayRequest], prefill_tokens: int,
                              t_start: float) -> tuple[list[Verified], float]:
        if not decoding:
            return [], 0.0
        roots = [ROOT_ONLY] * len(decoding)
        n_ctx = sum(r.kv_len for r in decoding)
        # A(r) = base + rate * t_iter per request, where the shape or the budget rule prices SLOs (as Engine's)
        slo_budgeted = self.cfg.budget_rule == "slo" and is_budgeted(self.policy)
        has_slo = [r.tpot_slo_ms is not None and r.first_s is not None for r in decoding]
        lines = None
        if slo_budgeted or reads_slo_lines(self.policy):
            lines = np.array([requirement_line(elapsed_s=max(0.0, t_start - r.first_s),
                                               tokens_so_far=max(0, r.emitted - 1),
                                               tpot_slo_s=r.tpot_slo_ms / 1e3) if s else (0.0, 0.0)
                              for r, s in zip(decoding, has_slo, strict=True)]).reshape(-1, 2)
        ratios = (np.array([recent_ratios(r.accepted_per_step, r.verified_per_step) for r in decoding]).reshape(-1, 2)
                  if reads_slo_lines(self.policy) else None)
        view = BatchView(n_active=len(decoding), n_context=n_ctx, budget=self.cfg.budget,
                         predict_target=self.target_cost.predict, predict_draft=self.draft_cost.predict,
                         prefill_tokens=prefill_tokens,
                         rank_rates=None if self.acceptance is None else self.acceptance.rank_rates,
                         slo_lines=lines, request_ratios=ratios)
        shape = self.policy.tree_shape(view)
        if shape is None or shape.depth < 1:
            return roots, 0.0
        # a plain streak's probe: one request drafts, the one with the fewest tokens to catch up (as Engine's)
        drafting = ([min(decoding, key=lambda r: r.prompt_len + r.emitted - r.draft_len)]
                    if shape.probe and len(decoding) > 1 else decoding)
        # the draft's beam search: a first forward with every request's catch-up tokens, then one per level
        # over the frontier (Engine._speculate_and_select, speculate.beam_search)
        catch_up = sum(r.prompt_len + r.emitted - r.draft_len for r in drafting)
        draft_ctx = sum(r.draft_len for r in drafting)
        t = self.device.draft.seconds(catch_up, draft_ctx)
        levels = shape.depth if shape.expansion is None else len(shape.expansion)
        committed = sum(r.prompt_len + r.emitted - 1 for r in drafting)
        level_nodes, cached = 1, 1  # nodes in the newest level; nodes before it (root included)
        for step in range(1, levels):
            level_nodes = shape.width if shape.expansion is None else level_nodes * shape.expansion[step - 1]
            t += self.device.draft.seconds(len(drafting) * level_nodes, committed + len(drafting) * cached)
            cached += level_nodes
        for r in drafting:
            r.draft_len = r.prompt_len + r.emitted
        self.now += t
        self.totals.draft_s += t
        t1 = self.now
        drafted, good = replay_trees(self.bank, [r.record for r in drafting], [r.emitted for r in drafting],
                                     shape, self.rng)
        if drafting is decoding:
            cands, on_path = drafted, list(good)
        else:  # the others' roots, each on the path
            cands = [drafted[0] if r is drafting[0] else TokenTree.root(0) for r in decoding]
            on_path = [good[0] if r is drafting[0] else np.ones(1, bool) for r in decoding]
        scored = cands if self.acceptance is None else self.acceptance.calibrate_many(cands)
        budget = max(self.cfg.budget, len(decoding))
        if self.cfg.budget_rule == "goodput" and is_budgeted(self.policy):
            budget = goodput_budget(scored, floor=budget, t_spent_s=t1 - t_start,
                                    t_target=lambda k: self.target_cost.predict(n_ctx, k + prefill_tokens))
        elif slo_budgeted and lines is not None:
            budget = slo_budget(scored, base=lines[:, 0], rate=lines[:, 1],
                                margin=np.where(has_slo, self.cfg.slo_margin, 0.0), depth=shape.depth,
                                n_max=self.cfg.n_max, order=self.cfg.slo_order,
                                t_spent_s=t1 - t_start,
                                t_target=lambda k: self.target_cost.predict(n_ctx, k + prefill_tokens))
        verify = min(budget, sum(c.size for c in cands)) + prefill_tokens
        t_iter = (t1 - t_start) + self.target_cost.predict(n_ctx, verify)
        floor = 0.0
        if self.cfg.slo_floor == "price" and is_budgeted(self.policy):
            floor = token_price(scored, budget=budget, t_spent_s=t1 - t_start,
                                t_target=lambda k: self.target_cost.predict(n_ctx, k + prefill_tokens))
        ctx = SelectionContext(budget=budget, depth=shape.depth, now_s=t_start, t_iter_s=t_iter, min_value=floor)
        needs = [0.0 if r.tpot_slo_ms is None or r.first_s is None else self.cfg.slo_margin + slo_requirement(
            elapsed_s=max(0.0, t_start - r.first_s), tokens_so_far=max(0, r.emitted - 1), t_iter_s=t_iter,
            tpot_slo_s=r.tpot_slo_ms / 1e3) for r in decoding]  # A(r) + margin, as Engine's requirement()
        chosen = self.policy.select(scored, needs, ctx)
        level = level_of(shape)
        out = []
        for c, good, sel in zip(cands, on_path, chosen, strict=True):
            keep = np.asarray(sorted(sel), np.int64)
            acc = int(np.count_nonzero(good[keep])) - 1  # the on-path nodes verified: a chain from the root
            tree = path = None
            if self.acceptance is not None:  # learnt values count every verified tree
                tree = c if len(keep) == c.size else c.subtree(keep)
                path = np.flatnonzero(good[keep]).tolist()
            out.append(Verified(len(keep), acc, int(level[keep].max()), tree, path))
        if self.selection_listeners:
            # what selection believed each verified tree worth: its nodes' values (the bonus root's 1 included)
            believed = [float(np.exp(c.log_probs[sorted(sel)]).sum()) for c, sel in zip(scored, chosen, strict=True)]
            for listener in self.selection_listeners:
                listener({"t_start": t_start, "ids": [r.request_id for r in decoding], "needs": needs,
                          "sizes": [v.size for v in out], "accepted": [v.accepted for v in out], "believed": believed,
                          "depth": shape.depth, "width": shape.width, "budget": budget, "t_iter_pred": t_iter,
                          "min_value": floor})
        return out, t

    # ---- a driver (clock.run_simulated) ----
    def run(self, requests: Sequence[ReplayRequest], on_progress: Callable[[int], None] | None = None) -> ReplayTotals:
        pending = deque(sorted(requests, key=lambda r: r.arrival_s))
        self.bank = RecordBank.of([r.record for r in requests])
        done_before = 0
        while pending or self.waiting or self.running:
            while pending and pending[0].arrival_s <= self.now:
                r = pending.popleft()
                r.queued_s = self.now
                self.waiting.append(r)
            if not (self.waiting or self.running):
                self.totals.idle_s += pending[0].arrival_s - self.now
                self.now = pending[0].arrival_s
                continue
            n_before = len(self.running) + len(self.waiting)
            self.step()
            if on_progress is not None:
                finished = n_before - len(self.running) - len(self.waiting)
                if finished:
                    done_before += finished
                    on_progress(finished)
        self.totals.end_s = self.now
        return self.totals
