"""The engine: one ``step()`` = admit, prefill chunks, speculate, select, verify, commit.

    waiting --admit (reserve KV)--> prefill --chunks--> decode --stop / length / abort--> finished

One target forward carries every prefill chunk and every verification tree. ``step`` only reads time
through ``clock``; whoever calls it (``run`` below, the background ``EngineLoop``, a test) decides
when requests arrive.
"""

from __future__ import annotations

import itertools
import logging
import math
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field

import numpy as np
import torch

from adaserve.engine.config import EngineConfig
from adaserve.engine.cost.cost_model import CostModel
from adaserve.engine.cost.host_cost import HostCost
from adaserve.engine.cost.timing import ForwardSplitter, OnlineCostModel, PromptLoad, scaled
from adaserve.engine.model.batch import Segment
from adaserve.engine.model.runner import ModelRunner
from adaserve.engine.model.tree import TokenTree
from adaserve.engine.multi_draft import DraftPool
from adaserve.engine.prefill_chunk import DecodingSLO, PrefillTTFT, recent_figures, slo_prefill_chunk, ttft_left_s
from adaserve.engine.request import Phase, Request, requirement, requirement_line
from adaserve.engine.speculation.acceptance import RankAcceptance
from adaserve.engine.speculation.adaptive import recent_ratios
from adaserve.engine.speculation.draft_bandit import make_selector
from adaserve.engine.speculation.grammar import GrammarCompiler, mask_logits
from adaserve.engine.speculation.iteration_budget import drafted_values, goodput_budget, slo_budget, token_price
from adaserve.engine.speculation.logits_processors import path_tokens, process_tree_logits
from adaserve.engine.speculation.logprobs import TokenLogprob, token_logprobs
from adaserve.engine.speculation.policies import (
    BatchView,
    SelectionContext,
    SelectionRecord,
    TreeShape,
    is_budgeted,
    make_policy,
    reads_slo_lines,
    split_policy,
)
from adaserve.engine.speculation.speculate import DraftInput, beam_search
from adaserve.engine.speculation.verify import WalkInput, commit_moves, draw_at_nodes, walk_trees
from adaserve.engine.stop_strings import StopStringMatcher

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class TokenEvent:
    request_id: str
    new_tokens: list[int]
    finished: bool
    finish_reason: str | None
    logprobs: list[TokenLogprob] | None = None  # one per new token, when the request asked for them


@dataclass
class StepMetrics:
    """One iteration, in a form benchmarks aggregate (``to_dict`` is one JSON line)."""

    n_decode: int = 0
    n_prefill: int = 0
    prefill_tokens: int = 0
    depth: int = 0
    width: int = 0
    budget: int = 0
    tokens_verified: int = 0  # tree nodes sent to the target, roots included
    tokens_accepted: int = 0  # draft tokens the target confirmed
    tokens_emitted: int = 0
    t_speculate_s: float = 0.0
    t_select_s: float = 0.0  # the scheduler's own time
    t_verify_s: float = 0.0
    t_step_s: float = 0.0
    # the engine's own cost, in wall seconds whatever ``clock`` is (the bench's may be simulated): the
    # step, and the part of it inside the target's and the draft's model forwards (CausalLM.forward)
    t_wall_s: float = 0.0
    t_forward_s: float = 0.0
    predicted_iter_s: float = 0.0
    per_request_verified: dict[str, int] = field(default_factory=dict)

    @property
    def budget_used(self) -> float:
        return self.tokens_verified / self.budget if self.budget else 0.0

    @property
    def host_s(self) -> float:
        """Draft and scheduler time before the target's forward (the SLO prefill rule's t_iter)."""
        return self.t_speculate_s + self.t_select_s

    @property
    def non_forward_share(self) -> float:
        """The engine's own cost: scheduling, selection, tree building, layout, walk, commit, bookkeeping."""
        return max(0.0, 1.0 - self.t_forward_s / self.t_wall_s) if self.t_wall_s > 0 else 0.0

    def to_dict(self) -> dict:
        return {**asdict(self), "budget_used": self.budget_used, "non_forward_share": self.non_forward_share}


@dataclass
class RunTotals:
    """Scheduler and step time summed since the engine started (``history`` keeps only the recent steps):
    the bench's scheduler time share needs the whole run."""

    t_select_s: float = 0.0
    t_step_s: float = 0.0

    def add(self, m: StepMetrics) -> None:
        self.t_select_s += m.t_select_s
        self.t_step_s += m.t_step_s


MIN_TPOT_SLO_MS = 1e-3  # the least TPOT target a request may ask for (1 microsecond)
_NO_STOP_IDS: frozenset[int] = frozenset()


class Engine:
    def __init__(self, target: ModelRunner, draft: ModelRunner | Sequence[ModelRunner] | None,
                 cfg: EngineConfig | None = None, *, clock: Callable[[], float] = time.perf_counter,
                 detokenize: Callable[[list[int]], str] | None = None) -> None:
        """``draft``: one draft, none, or several (each request then speculates on one of them at a time,
        chosen by the policy's draft selector: multi_draft.py)."""
        cfg = cfg or EngineConfig()
        policy = make_policy(cfg.policy, cfg)  # the engine's own: SmartSpec's keeps per-engine state
        drafts = [] if draft is None else [draft] if isinstance(draft, ModelRunner) else list(draft)
        if policy.max_shape is not None and not drafts:
            raise ValueError(f"policy {policy.name!r} speculates and needs a draft model")
        for d in drafts:
            if d.vocab_size != target.vocab_size:
                raise ValueError(f"draft vocab {d.vocab_size} != target vocab {target.vocab_size}")
        self.drafts = drafts
        self.target, self.draft, self.policy, self.cfg = target, (drafts[0] if drafts else None), policy, cfg
        self.clock = clock
        self.detokenize = detokenize
        # structured output needs the tokenizer's vocabulary: build.build_engine sets it where there is one
        self.grammars: GrammarCompiler | None = None
        self.stop_ids = frozenset(target.model.cfg.eos_token_ids)
        flat = CostModel(0.0, 0.0, cfg.initial_forward_s)
        self.target_time = OnlineCostModel(cfg.target_cost or flat, frozen=cfg.target_cost is not None)
        self.draft_time = OnlineCostModel(cfg.draft_cost or CostModel(0.0, 0.0, cfg.initial_forward_s / 4),
                                          frozen=cfg.draft_cost is not None)
        # what a drafted node is worth, learnt only where a policy weighs nodes (the budgeted ones)
        self.acceptance = (RankAcceptance() if cfg.node_value == "learned" and is_budgeted(policy) else None)
        self.pool: DraftPool | None = None
        # one acceptance model per draft: drafts differ in how far their sibling ranks can be trusted
        self.acceptances = [self.acceptance]
        if len(drafts) > 1 and policy.max_shape is not None:
            self.pool = self._draft_pool(cfg)
            if self.acceptance is not None:
                self.acceptances += [RankAcceptance() for _ in drafts[1:]]
        for r in [target, *drafts]:  # runners another engine used start cold (the bench shares them)
            r.cache.enable_prefix_caching(cfg.prefix_caching)
        self.waiting: list[Request] = []
        self.running: list[Request] = []
        # pages promised to admitted requests: target, then each draft
        self.reserved = [0] * (1 + max(1, len(drafts)))
        self.history: deque[StepMetrics] = deque(maxlen=cfg.history_len)
        # host seconds per iteration outside the forwards, learnt from decode-only iterations (host_cost.py)
        self.host_time = HostCost()
        self.totals = RunTotals()
        self.step_listeners: list[Callable[[StepMetrics], None]] = []
        # called with every speculative iteration's candidates and choice; nothing is recorded without one
        self.selection_listeners: list[Callable[[SelectionRecord], None]] = []

    def _draft_pool(self, cfg: EngineConfig) -> DraftPool:
        """Several drafts: per-draft cost models (the first is ``draft_time``) and the policy's selector."""
        extra = cfg.drafts.extra_costs
        sizes = tuple(float(sum(p.numel() for p in d.model.parameters())) for d in self.drafts)
        # a draft without a profiled cost starts from the first's scaled by size, and learns online
        times = [self.draft_time] + [
            OnlineCostModel(extra[i - 1], frozen=True) if i - 1 < len(extra)
            else OnlineCostModel(scaled(self.draft_time.model, sizes[i] / sizes[0]))
            for i in range(1, len(self.drafts))]
        selector = make_selector(split_policy(cfg.policy)[1] or "ucb", sizes=sizes)
        return DraftPool(self.drafts, times, selector, slot_iters=cfg.drafts.slot_iters, clock=self.clock,
                         target_time=self.target_time)

    # ---- requests in and out ----------------------------------------------------------------------
    @property
    def max_context(self) -> int:
        return min([self.target.model.cfg.max_position_embeddings,
                    *(d.model.cfg.max_position_embeddings for d in self.drafts)])

    def _tree_max(self) -> int:
        shape = self.policy.max_shape
        return 1 if shape is None else shape.max_nodes

    def _reservation(self, req: Request) -> tuple[int, int]:
        # worst case: every token of prompt and output, plus the largest tree written past them
        n = len(req.prompt_ids) + req.params.max_tokens
        tree = self._tree_max()
        tgt = self.target.cache.pages_for(n + tree)
        drf = self.draft.cache.pages_for(n + tree) if self.draft is not None and tree > 1 else 0
        return tgt, drf

    def check_request(self, req: Request) -> None:
        """The engine's one request validation: ValueError, naming the field, if it could never serve ``req``.

        Every way in calls it once (``add_request``, ``EngineLoop.submit``); nothing past it re-checks a
        request. Read-only, so any thread may call it. ``req.params`` checked itself when it was built.
        """
        if not isinstance(req.request_id, str) or not req.request_id:
            raise ValueError("request_id: must be a non-empty string")
        if not req.prompt_ids:
            raise ValueError("prompt_ids: the prompt must contain at least one token")
        vocab = self.target.vocab_size
        if any(not 0 <= t < vocab for t in req.prompt_ids):
            raise ValueError(f"prompt_ids: prompt token ids must be in [0, {vocab})")
        if any(not 0 <= t < vocab for t in req.params.stop_token_ids):
            raise ValueError(f"stop_token_ids: token ids must be in [0, {vocab})")
        if any(not 0 <= t < vocab for t, _ in req.params.logit_bias):
            raise ValueError(f"logit_bias: token ids must be in [0, {vocab})")
        if not 0 <= req.resumed <= len(req.prompt_ids):
            raise ValueError("resumed: must be between 0 and the prompt's length")
        if req.params.grammar is not None and req.grammar is None:
            self.start_grammar(req)
        # A(r) divides by the target every iteration: a zero, NaN or denormal here (5e-324 ms is 0 s once
        # divided by 1000) would fail mid-batch; no device serves a token in under a microsecond
        if req.tpot_slo_ms is not None and not (math.isfinite(req.tpot_slo_ms) and req.tpot_slo_ms >= MIN_TPOT_SLO_MS):
            raise ValueError(f"tpot_slo_ms: must be a finite number >= {MIN_TPOT_SLO_MS} ms, got {req.tpot_slo_ms!r}")
        depth = 0 if self.policy.max_shape is None else self.policy.max_shape.depth
        if len(req.prompt_ids) + req.params.max_tokens + depth + 1 > self.max_context:
            raise ValueError(
                f"max_tokens: prompt ({len(req.prompt_ids)} tokens) + max_tokens ({req.params.max_tokens}) exceeds "
                f"the model context of {self.max_context} tokens"
            )
        tgt, drf = self._reservation(req)
        if tgt > self.target.cache.num_pages or any(drf > d.cache.num_pages for d in self._reserving_drafts()):
            raise ValueError("max_tokens: prompt + max_tokens need more KV cache than the engine has in total")

    def start_grammar(self, req: Request) -> None:
        """Structured output: the request's grammar matcher, past a continuation's earlier output (grammar.py).
        ValueError when the engine has no tokenizer or the grammar is invalid. ``check_request`` calls it for a
        request that has none yet; a caller may call it first on another thread (a complex grammar takes a
        while to compile). It writes ``req.grammar`` and nothing else."""
        spec = req.params.grammar
        if spec is None:
            return
        if self.grammars is None:
            raise ValueError("structured output needs the model's tokenizer, and this engine has none")
        earlier = req.prompt_ids[len(req.prompt_ids) - req.resumed :] if req.resumed else []
        req.grammar = self.grammars.start(spec, earlier)

    def add_request(self, req: Request) -> None:
        """Validate ``req`` (``check_request``) and queue it."""
        self.check_request(req)
        self._enqueue(req)

    def _enqueue(self, req: Request) -> None:
        """Queue a request ``check_request`` has passed. EngineLoop checks on the caller's thread and
        queues on the engine's; only the id can clash by then, since it depends on who else is queued."""
        if any(r.request_id == req.request_id for r in self.waiting + self.running):
            raise ValueError(f"request_id: {req.request_id!r} is already in use")
        req.metrics.arrival_s = self.clock()
        self.waiting.append(req)

    def abort(self, request_id: str) -> bool:
        """Stop a request now; its KV pages are free when this returns."""
        for req in self.waiting:
            if req.request_id == request_id:
                self.waiting.remove(req)
                req.phase, req.finish_reason = Phase.FINISHED, "abort"
                return True
        for req in self.running:
            if req.request_id == request_id:
                self._finish(req, "abort")
                return True
        return False

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def kv_usage(self) -> float:
        c = self.target.cache
        return 1.0 - c.free_pages / c.num_pages

    def _reserving_drafts(self) -> list[ModelRunner]:
        """The drafts a request reserves KV in: the one draft, or every draft of a pool (a request may
        run on each in turn and keeps each one's KV)."""
        return self.drafts if self.pool is not None else self.drafts[:1]

    def _admit(self) -> None:
        while self.waiting and len(self.running) < self.cfg.max_batch:
            req = self.waiting[0]
            tgt, drf = self._reservation(req)
            if self.reserved[0] + tgt > self.target.cache.num_pages:
                return
            if any(self.reserved[1 + j] + drf > d.cache.num_pages for j, d in enumerate(self._reserving_drafts())):
                return
            self.waiting.pop(0)
            self.reserved[0] += tgt
            for j in range(len(self._reserving_drafts())):
                self.reserved[1 + j] += drf
            req.reserved_pages = (tgt, drf)
            req.phase = Phase.PREFILL
            self._reuse_prefix(req)
            self.running.append(req)

    def _reuse_prefix(self, req: Request) -> None:
        """Prefix caching (kv_cache.py): start the request's KV from its prompt's longest cached prefix, so it
        prefills only the rest. The target recomputes at least the last prompt token, whose logits give the
        first output token; the draft may reuse the whole prompt (its first beam step feeds that token).
        Several drafts' caches share nothing (a request's first draft is chosen later, multi_draft.py). The
        reservation stays the worst case: shared pages are counted once per holder."""
        req.target_kv.tokens = req.ids_from
        req.metrics.cached_tokens = self.target.cache.reuse_prefix(req.target_kv, req.prompt_ids,
                                                                   limit=len(req.prompt_ids) - 1)
        if self.pool is None and self.draft is not None and req.reserved_pages[1]:
            req.draft_kv.tokens = req.ids_from
            self.draft.cache.reuse_prefix(req.draft_kv, req.prompt_ids, limit=len(req.prompt_ids))

    def _finish(self, req: Request, reason: str) -> None:
        req.phase, req.finish_reason = Phase.FINISHED, reason
        self.target.cache.release(req.target_kv)
        if self.pool is not None:
            self.pool.release(req)
        elif self.draft is not None:
            self.draft.cache.release(req.draft_kv)
        self.reserved[0] -= req.reserved_pages[0]
        for j in range(len(self._reserving_drafts())):
            self.reserved[1 + j] -= req.reserved_pages[1]
        req.reserved_pages = (0, 0)
        self.running.remove(req)

    # ---- one iteration -----------------------------------------------------------------------------
    def step(self) -> list[TokenEvent]:
        t_start = self.clock()
        own_start = self._own_time()
        self._admit()
        m = StepMetrics(budget=self.cfg.budget)
        prefill = self._prefill_segments(m)
        # "separate" (vLLM v0 without chunked prefill): an iteration that prefills decodes nothing
        separate = prefill and self.cfg.prefill_mode == "separate"
        decoding = [] if separate else [r for r in self.running if r.phase is Phase.DECODE]
        # the prompt chunks' own keys: their tokens are priced over them, not over the decoding requests' (timing.py)
        prompt = PromptLoad.of((seg.tree.size, seg.prefix_len) for _, seg in prefill) if prefill else None
        trees = self._speculate_and_select(decoding, m, t_start, prompt)

        t0 = self.clock()
        segments = [seg for _, seg in prefill]
        segments += [Segment(r.target_kv, r.target_kv.length, t) for r, t in zip(decoding, trees, strict=True)]
        want_all = [False] * len(prefill) + [True] * len(decoding)
        logits = self.target.forward(segments, all_logits=want_all) if segments else []
        emitted: dict[str, list[int]] = {}
        first: list[tuple[Request, TokenTree, torch.Tensor]] = []  # last prefill chunks: their logits give token 1
        # each walk's forward segment, and the head's own first maxima per segment (an int8 head on the integer
        # kernels: ModelRunner.last_argmax), which a greedy walk takes where nothing changed its rows
        at: list[int] = []
        for i, ((req, seg), lg) in enumerate(zip(prefill, logits[: len(prefill)], strict=True)):
            self.target.cache.truncate(req.target_kv, seg.kv_len)
            if req.target_kv.length == len(req.prompt_ids):
                first.append((req, TokenTree.root(req.prompt_ids[-1]), lg))
                at.append(i)
        at += range(len(prefill), len(logits))  # the decoding walks' segments, after the first tokens'
        drawn = self.target.last_argmax if segments else None  # this forward's, when one ran
        known = (drawn.view(-1, 1).split_with_sizes([lg.shape[0] for lg in logits]) if drawn is not None
                 else [None] * len(logits))
        walks = [*first, *zip(decoding, trees, logits[len(prefill) :], strict=True)]
        masked = [self._masked(r, t, lg) for r, t, lg in walks]
        processed = [self._processed(r, t, x) for (r, t, _), x in zip(walks, masked, strict=True)]
        walk_inputs = [WalkInput(t, x, r.params, r.generator, self._stop_ids(r), r.remaining,
                                 argmax=known[i] if x is lg else None)
                       for (r, t, lg), x, i in zip(walks, processed, at, strict=True)]
        # one batched draw for every walk, and its one copy to the host: on a GPU that copy is what waits for
        # the forward (which is queued, not synchronised), so the forward is timed up to it
        draws = draw_at_nodes(walk_inputs)
        t_fwd = self.clock() - t0
        results = walk_trees(walk_inputs, draws)  # then host work per request
        # each emitted token's row: token i was drawn at accepted node i (logprobs.py)
        logprobs = {r.request_id: token_logprobs(x, res.accepted_nodes[: len(res.tokens)], res.tokens,
                                                 r.params.logprobs)
                    for (r, _, _), x, res in zip(walks, masked, results, strict=True) if r.params.logprobs is not None}
        for (req, _, _), res in zip(first, results, strict=False):
            req.phase = Phase.DECODE
            emitted[req.request_id] = res.tokens
        decoded = results[len(first) :]
        # one KV compaction for every request, before any truncation returns the pages it reads
        self.target.cache.move_many([(r.target_kv, *commit_moves(res.accepted_nodes, r.target_kv.length))
                                     for r, res in zip(decoding, decoded, strict=True)])
        proposed = rejections = 0
        for req, tree, res in zip(decoding, trees, decoded, strict=True):
            self.target.cache.truncate(req.target_kv, req.target_kv.length + len(res.accepted_nodes))
            req.metrics.accepted_per_step.append(res.num_accepted)
            req.metrics.verified_per_step.append(tree.size)
            m.tokens_accepted += res.num_accepted
            proposed += tree.size - 1
            # the accepted path stopped short of the tree's deepest level: a rejection
            rejections += tree.size > 1 and res.num_accepted < tree.depth
            emitted[req.request_id] = res.tokens
        if self.acceptance is not None:  # each draft's values learn from the trees it drafted, in batch order
            for k, acc in enumerate(self.acceptances):
                mine = [i for i, r in enumerate(decoding) if r.draft_index == k]
                if acc is not None and mine:
                    acc.observe_many([trees[i] for i in mine], [decoded[i].accepted_nodes for i in mine])
        if self.pool is not None and m.depth:
            self.pool.account(decoding, trees, [len(r.tokens) for r in decoded], depth=m.depth, width=m.width)
        rec = self.target.last_forward  # the verification's counts, as the runner reported them
        if segments and rec is not None:
            self.target_time.observe(rec.n_context, rec.n_new, t_fwd, rec.n_cells)
        if proposed:
            self.policy.observe(m.tokens_accepted, proposed)
            self.policy.observe_paths(m.tokens_accepted, rejections)
        m.t_verify_s = self.clock() - t0
        events = self._emit(emitted, m, logprobs)
        m.t_step_s = self.clock() - t_start
        m.t_wall_s, m.t_forward_s = (b - a for a, b in zip(own_start, self._own_time(), strict=True))
        if self.cfg.host_cost and m.n_decode and not m.n_prefill:
            self.host_time.observe(m.depth, m.n_decode, m.t_wall_s - m.t_forward_s)
        self.history.append(m)
        self.totals.add(m)
        for listener in self.step_listeners:
            listener(m)
        return events

    def _own_time(self) -> tuple[float, float]:
        """(wall clock, wall seconds both models have spent in forwards so far): StepMetrics' own-cost pair."""
        fwd = self.target.model.forward_seconds + sum(d.model.forward_seconds for d in self.drafts)
        return time.perf_counter(), fwd

    def _masked(self, req: Request, tree: TokenTree, logits: torch.Tensor) -> torch.Tensor:
        """The target's logits at every node of ``tree`` with what the request's grammar refuses after the node's
        path at -inf (grammar.py); ``logits`` itself without a grammar. What logprobs report (logprobs.py)."""
        if req.grammar is None:
            return logits
        return mask_logits(logits, req.grammar.allowed([tuple(p) for p in path_tokens(tree)]))

    def _processed(self, req: Request, tree: TokenTree, logits: torch.Tensor) -> torch.Tensor:
        """The (grammar-masked) rows at every node of ``tree`` as the request's logits processors leave them, each
        node with its own path as output so far (logits_processors.py): with the mask, the rows plain decoding would
        draw from. The grammar's mask comes first, as vLLM applies its bitmask before sampling."""
        if not req.params.processes_logits:
            return logits
        return process_tree_logits(logits, tree, req.params, prompt_ids=req.prompt_ids, output_ids=req.history(),
                                   emitted=len(req.output_ids), stop_ids=self._stop_ids(req))

    def _stop_ids(self, req: Request) -> frozenset[int]:
        if not req.params.stop_token_ids:  # no set to build per request and call (twice an iteration each)
            return _NO_STOP_IDS if req.params.ignore_eos else self.stop_ids
        ids = frozenset(req.params.stop_token_ids)
        return ids if req.params.ignore_eos else ids | self.stop_ids

    def _prefill_chunk(self) -> int:
        """Prompt tokens this iteration may carry: ``prefill_chunk``, or under the "slo" rule the largest chunk
        with which the decoding requests that can meet their TPOT SLO this iteration still do (prefill_chunk.py).

        The iteration it is charged to is predicted from the recent ones: their draft and scheduler time,
        plus one target forward over their mean verified tokens and the chunk, at today's context (the chunk's
        tokens over its own requests' keys: ``_prompt_load``)."""
        cfg = self.cfg
        if cfg.prefill_rule != "slo" or not any(r.phase is Phase.PREFILL for r in self.running):
            return cfg.prefill_chunk
        now = self.clock()
        decoding = [r for r in self.running if r.phase is Phase.DECODE]
        slos = [DecodingSLO(now - r.metrics.first_token_s, max(0, len(r.output_ids) - 1), r.tpot_slo_ms / 1e3)
                for r in decoding if r.tpot_slo_ms is not None and r.metrics.first_token_s is not None]
        if not slos:
            return cfg.prefill_chunk
        per_req, verify, host = recent_figures(list(itertools.islice(reversed(self.history), 16)), len(decoding))
        n_ctx = sum(r.target_kv.length for r in decoding)
        prefilling = [PrefillTTFT(len(r.prompt_ids) - r.target_kv.length,
                                  ttft_left_s(r.metrics.arrival_s, r.ttft_slo_ms or cfg.prefill_ttft_ms, now))
                      for r in self.running if r.phase is Phase.PREFILL]
        return slo_prefill_chunk(
            slos, min_chunk=min(cfg.prefill_min_chunk, cfg.prefill_chunk), max_chunk=cfg.prefill_chunk,
            tokens_per_iter=per_req, prefilling=prefilling,
            t_iter=lambda p: host + self.target_time.for_batch(len(decoding), self._prompt_load(p))(
                n_ctx, round(verify) + p))

    def _prompt_load(self, tokens: int) -> PromptLoad:
        """The load of the prompt chunks ``tokens`` prompt tokens make ("mixed": ``_cut_prompts``)."""
        return PromptLoad.of((take, req.target_kv.length) for req, take in self._cut_prompts(tokens, whole=False))

    def _cut_prompts(self, left: int, *, whole: bool) -> list[tuple[Request, int]]:
        """Each request being prefilled and the prompt tokens it takes from ``left``, in admission order, each from
        where its KV ends: "mixed" (``whole`` False) cuts the last one; "separate" takes whole prompts while they fit
        (the first always)."""
        out: list[tuple[Request, int]] = []
        for req in self.running:
            if req.phase is not Phase.PREFILL or left <= 0:
                continue
            rest = len(req.prompt_ids) - req.target_kv.length
            if whole and out and rest > left:
                break  # first come first served: a prompt that does not fit waits, and so do those behind it
            take = rest if whole else min(rest, left)
            left -= take
            out.append((req, take))
        return out

    def _prefill_segments(self, m: StepMetrics) -> list[tuple[Request, Segment]]:
        """This iteration's prompt chunks: up to ``_prefill_chunk()`` tokens (``_cut_prompts``)."""
        out = []
        for req, take in self._cut_prompts(self._prefill_chunk(), whole=self.cfg.prefill_mode == "separate"):
            done = req.target_kv.length
            m.prefill_tokens += take
            m.n_prefill += 1
            out.append((req, Segment(req.target_kv, done, TokenTree.chain(req.prompt_ids[done : done + take]))))
        return out

    def predict_iteration(self, shape: TreeShape | None, n: int, n_context: int, prompt: PromptLoad | None = None,
                          predict_draft: Callable[[int, int], float] | None = None) -> float:
        """Predicted seconds for an iteration: d draft forwards + one target forward over at most B tree
        tokens plus the prompt chunks riding in the same forward (each request's context read by its share of
        the tree tokens, each chunk's by its own: ``OnlineCostModel.for_batch``)."""
        verify = min(self.cfg.budget, n * (1 if shape is None else shape.max_nodes))
        t = self.target_time.for_batch(n, prompt)(n_context, verify + (0 if prompt is None else prompt.tokens))
        if shape is not None:
            t += shape.depth * (predict_draft or self.draft_time.for_batch(n))(n_context, n * max(1, shape.width))
        return t

    def _speculate_and_select(self, decoding: list[Request], m: StepMetrics, t_start: float,
                              prompt: PromptLoad | None = None) -> list[TokenTree]:
        m.n_decode = len(decoding)
        if not decoding:
            return []
        n_ctx = sum(r.target_kv.length for r in decoding)
        # the shapes' prices: each request's context read by its share of a forward's tokens, and the prompt chunks'
        # tokens by their own (timing.py)
        predict_target = self.target_time.for_batch(len(decoding), prompt)
        predict_draft = (self.draft_time.for_batch(len(decoding)) if self.pool is None
                         else self.pool.predict_draft(decoding))
        # one draft's learnt sibling rates steer the width (several drafts: each has its own; Eq. 9 then)
        rates = self.acceptance.rank_rates if self.acceptance is not None and self.pool is None else None
        # A(r) = base + rate * t_iter per request, where the shape or the budget rule prices SLOs
        slo_budgeted = self.cfg.budget_rule == "slo" and is_budgeted(self.policy)
        slo_shaped = reads_slo_lines(self.policy)
        lines = (np.array([requirement_line(r, now_s=t_start) for r in decoding]).reshape(-1, 2)
                 if slo_budgeted or slo_shaped else None)
        ratios = (np.array([recent_ratios(r.metrics.accepted_per_step, r.metrics.verified_per_step)
                            for r in decoding]).reshape(-1, 2) if slo_shaped else None)
        view = BatchView(n_active=len(decoding), n_context=n_ctx, budget=self.cfg.budget,
                         predict_target=predict_target, predict_draft=predict_draft,
                         prefill_tokens=m.prefill_tokens, rank_rates=rates, slo_lines=lines, request_ratios=ratios,
                         predict_host=self.host_time.predict if self.cfg.host_cost else None)
        shape = self.policy.tree_shape(view)
        m.predicted_iter_s = self.predict_iteration(shape, len(decoding), n_ctx, prompt, predict_draft)
        if shape is None or shape.depth < 1 or self.draft is None:
            # plain decoding: each request's lone root (built only here: a speculating iteration never reads them)
            roots = TokenTree.roots([r.last_token for r in decoding])
            m.tokens_verified = len(roots)
            m.per_request_verified = {r.request_id: 1 for r in decoding}
            return roots
        m.depth, m.width = shape.depth, shape.width
        t0 = self.clock()
        # a plain streak's probe (TreeShape.probe): only the request with the fewest tokens for the draft to catch up
        # drafts; the others' trees are their roots, as in a plain iteration (several drafts: every request, their
        # rounds keep slots aligned across the batch)
        drafting = ([min(decoding, key=lambda r: r.draft_pending)]
                    if shape.probe and len(decoding) > 1 and self.pool is None else decoding)
        if self.pool is not None:  # several drafts: each request's own, one beam search per draft
            self.pool.assign(decoding, depth=shape.depth, width=shape.width)
            drafted = self.pool.speculate(decoding, depth=shape.depth, width=shape.width, expansion=shape.expansion)
            t1 = self.clock()
        else:
            inputs = [DraftInput(r.draft_kv, r.ids_from(r.draft_kv.length), r.grammar) for r in drafting]
            # each draft forward timed alone, with its own counts: the first also runs the catch-up tokens
            split = ForwardSplitter(self.clock)
            split.start()
            drafted = beam_search(self.draft, inputs, depth=shape.depth, width=shape.width,
                                  expansion=shape.expansion,
                                  on_forward=lambda rec: split(rec.n_context, rec.n_new, rec.n_cells))
            for c, b, y, k in split.finish():
                self.draft_time.observe(c, b, y, k)
            t1 = self.clock()
        cands = (drafted if drafting is decoding
                 else [drafted[0] if r is drafting[0] else TokenTree.root(r.last_token) for r in decoding])
        # selection weighs nodes by f(v); "learned": acceptance by sibling rank, not the draft's own guess
        acc = self.acceptances
        scored = cands if acc[0] is None else self._calibrated(decoding, cands)
        budget = max(self.cfg.budget, len(decoding))
        # f(v) over the batch, sorted once for the budget rule and the price, where either runs
        reads_values = self.cfg.budget_rule in ("goodput", "slo") or self.cfg.slo_floor == "price"
        values = drafted_values(scored) if reads_values and is_budgeted(self.policy) else None
        if self.cfg.budget_rule == "goodput" and is_budgeted(self.policy):
            budget = goodput_budget(scored, floor=budget, t_spent_s=t1 - t_start, values=values,
                                    t_target=lambda k: predict_target(n_ctx, k + m.prefill_tokens))
        elif slo_budgeted and lines is not None:
            budget = slo_budget(scored, base=lines[:, 0], rate=lines[:, 1],
                                margin=np.where(lines[:, 1] > 0, self.cfg.slo_margin, 0.0), depth=shape.depth,
                                n_max=self.cfg.n_max, order=self.cfg.slo_order, t_spent_s=t1 - t_start, values=values,
                                t_target=lambda k: predict_target(n_ctx, k + m.prefill_tokens))
        m.budget = budget
        # A(r): this iteration's tokens land at t_start + t_iter, t_iter = the draft time already spent plus
        # the predicted verification (counting the draft's time once, not in a predicted whole iteration
        # on top of a clock read after it)
        verify = min(budget, sum(c.size for c in cands)) + m.prefill_tokens
        t_iter = (t1 - t_start) + predict_target(n_ctx, verify)
        floor = 0.0
        if self.cfg.slo_floor == "price" and is_budgeted(self.policy):
            floor = token_price(scored, budget=budget, t_spent_s=t1 - t_start, values=values,
                                t_target=lambda k: predict_target(n_ctx, k + m.prefill_tokens))
        ctx = SelectionContext(budget=budget, depth=shape.depth, now_s=t_start, t_iter_s=t_iter, min_value=floor)
        # A(r) (§5) plus the margin the SLO phase aims above it
        needs = [requirement(r, now_s=ctx.now_s, t_iter_s=ctx.t_iter_s, margin=self.cfg.slo_margin) for r in decoding]
        chosen = self.policy.select(scored, needs, ctx)
        trees = [c.subtree(sel) for c, sel in zip(cands, chosen, strict=True)]
        m.t_speculate_s, m.t_select_s = t1 - t0, self.clock() - t1
        m.tokens_verified = sum(t.size for t in trees)
        m.per_request_verified = {r.request_id: t.size for r, t in zip(decoding, trees, strict=True)}
        if self.selection_listeners:
            record = SelectionRecord(scored, needs, chosen, ctx)
            for listener in self.selection_listeners:
                listener(record)
        return trees

    def _calibrated(self, decoding: list[Request], cands: list[TokenTree]) -> list[TokenTree]:
        """Each candidate tree valued by its own draft's learnt acceptance (acceptance.py), one pass per draft."""
        out: list[TokenTree] = list(cands)
        for k, acc in enumerate(self.acceptances):
            mine = [i for i, r in enumerate(decoding) if r.draft_index == k]
            if acc is not None and mine:
                for i, t in zip(mine, acc.calibrate_many([cands[i] for i in mine]), strict=True):
                    out[i] = t
        return out

    def _emit(self, emitted: dict[str, list[int]], m: StepMetrics,
              logprobs: dict[str, list[TokenLogprob]] | None = None) -> list[TokenEvent]:
        now = self.clock()
        events = []
        for req in list(self.running):
            toks = emitted.get(req.request_id)
            if not toks:
                continue
            if req.metrics.first_token_s is None:
                req.metrics.first_token_s = now
            toks, stop_hit = self._cut_at_stop_string(req, toks)
            req.output_ids.extend(toks)
            if req.grammar is not None:
                req.grammar.advance(toks)
            req.metrics.num_tokens = len(req.output_ids)
            req.metrics.last_token_s = now
            m.tokens_emitted += len(toks)
            reason = self._finish_reason(req, toks, stop_hit)
            if reason is not None:
                self._finish(req, reason)
            lps = None if logprobs is None or req.request_id not in logprobs else logprobs[req.request_id][: len(toks)]
            events.append(TokenEvent(req.request_id, toks, reason is not None, reason, lps))
        return events

    def _cut_at_stop_string(self, req: Request, toks: list[int]) -> tuple[list[int], bool]:
        """The tokens up to the one that completes a stop string (none after it), and whether one did.

        Incremental (stop_strings.py): each token decodes a few tokens and searches its new text plus the
        longest stop string's tail, not the whole output again."""
        if not req.params.stop or self.detokenize is None:
            return toks, False
        if req.stop_matcher is None:
            req.stop_matcher = StopStringMatcher(req.params.stop, self.detokenize)
            req.stop_matcher.first_stop(req.output_ids)  # tokens emitted before (none, unless set late)
        k = req.stop_matcher.first_stop(toks)
        return (toks, False) if k is None else (toks[:k], True)

    def _finish_reason(self, req: Request, new: list[int], stop_hit: bool) -> str | None:
        if stop_hit or new[-1] in self._stop_ids(req):
            return "stop"
        return "length" if req.remaining <= 0 else None

    # ---- a simple driver ----------------------------------------------------------------------------
    def run(self, arrivals: list[tuple[float, Request]],
            on_step: Callable[[list[TokenEvent]], None] | None = None) -> list[Request]:
        """Serve requests arriving at the given offsets (seconds from now) until all have finished."""
        pending = sorted(arrivals, key=lambda a: a[0])
        start = self.clock()
        while pending or self.has_work:
            now = self.clock() - start
            while pending and pending[0][0] <= now:
                self.add_request(pending.pop(0)[1])
            if not self.has_work:
                time.sleep(max(0.0, min(pending[0][0] - now, 0.05)))
                continue
            events = self.step()
            if on_step is not None:
                on_step(events)
        return [req for _, req in arrivals]
