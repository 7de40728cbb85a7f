"""Several drafts in one engine: per-request draft slots, grouped speculation, switch recompute, accounting.

    per iteration (decoding requests only, and only when the policy speculates):
      assign     at a round's start (every ``slot_iters`` iterations) every request's slot ends and it asks
                 its selector for a draft, the batch together; a newcomer asks at once; on a switch
                 the new draft's KV is brought up to the request's tokens so far in one forward per draft
                 (the recompute Spin charges a switch), timed and charged to the switching requests
      speculate  requests grouped by draft, one beam search per group (each draft has its own KV cache),
                 candidates back in the batch's order: selection and the one target verification see
                 every request's tree as with a single draft
      account    the tokens the request emitted and what its iteration costs on its draft, go into its
                 slot; a slot ends (at the next round, or when the request does) by reporting a ``SlotResult``

What an iteration "costs" a request is priced by the cost models, as if it ran alone:
    cost_r = depth * T_draft_j(ctx_r, width) + T_target(ctx_r, tree_r)
not by its share of the measured batch time. A share depends on how many requests ran beside it (a
verification of 50 trees costs little more than one of 5), so drafts explored while the engine was
quiet and exploited when it was busy would be compared across loads; the priced cost compares drafts
at equal load, and its ratio between two drafts is the batch's when forwards are memory-bound. The
tokens are measured. A switch is priced the same way (T_draft_j over the tokens it recomputes); the
measured recompute time is kept for reports (``DraftUse.switch_s``).

A request keeps the KV of every draft it has used, so switching back only feeds the tokens since. Every
draft reserves the request's worst case at admission, as the single draft does. Outputs never depend
on the draft: the target's verification decides every token (docs/architecture.md §14).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from adaserve.engine.cost.timing import ForwardSplitter, OnlineCostModel
from adaserve.engine.model.batch import Segment
from adaserve.engine.model.kv_cache import SequenceKV
from adaserve.engine.model.runner import ModelRunner
from adaserve.engine.model.tree import TokenTree
from adaserve.engine.request import Request
from adaserve.engine.speculation.draft_bandit import Choice, DraftSelector, SlotResult
from adaserve.engine.speculation.speculate import DraftInput, beam_search


@dataclass
class Slot:
    arm: int
    iters: int = 0
    tokens: int = 0
    seconds: float = 0.0
    switch_s: float = 0.0

    def result(self) -> SlotResult:
        return SlotResult(self.arm, self.tokens, self.seconds, self.switch_s)


@dataclass
class DraftUse:
    """What the drafts did over the run, for reports."""

    switches: int = 0
    switch_s: float = 0.0
    switch_tokens: int = 0
    slots: list[tuple[str, SlotResult]] = field(default_factory=list)  # (request id, slot), in order
    iterations: int = 0  # speculative iterations (also the pool's round clock: a round is slot_iters of them)
    mixed_iterations: int = 0  # of them, those that ran more than one draft (every request waited for each)


def group_share(batch: int, members: int, group_s: float) -> float:
    """One member's share of what a draft group costs the rest of the batch: every request outside the
    group waits ``group_s`` (the group's forwards over a slot), and the group's members split that."""
    return (batch - members) * group_s / members


class DraftPool:
    def __init__(self, drafts: list[ModelRunner], times: list[OnlineCostModel], selector: DraftSelector, *,
                 slot_iters: int, clock: Callable[[], float], target_time: OnlineCostModel) -> None:
        if len(drafts) < 2 or len(times) != len(drafts):
            raise ValueError("a draft pool needs at least two drafts, each with its cost model")
        self.drafts, self.times, self.selector = drafts, times, selector
        self.slot_iters, self.clock, self.target_time = slot_iters, clock, target_time
        self.slots: dict[str, Slot] = {}
        self.use = DraftUse()

    # ---- KV per draft ------------------------------------------------------------------------------
    @staticmethod
    def kv_of(req: Request, arm: int) -> SequenceKV:
        return req.draft_kv if arm == req.draft_index else req.other_draft_kv.setdefault(arm, SequenceKV())

    def release(self, req: Request) -> None:
        for arm, runner in enumerate(self.drafts):
            runner.cache.release(self.kv_of(req, arm))
        slot = self.slots.pop(req.request_id, None)
        if slot is not None and slot.iters:
            self._report(req.request_id, slot)
        self.selector.forget(req.request_id)

    # ---- cost prediction ---------------------------------------------------------------------------
    def predict_draft(self, decoding: list[Request]) -> Callable[[int, int], float]:
        """Seconds for one draft step of ``k`` tokens over ``n_ctx`` context, as the groups would run it:
        each draft's share of requests on its own model, one forward per group."""
        n = max(1, len(decoding))
        shares = [sum(r.draft_index == j for r in decoding) / n for j in range(len(self.drafts))]
        if not decoding:
            shares[0] = 1.0

        def predict(n_ctx: int, k: int) -> float:  # each request's context read by k / n of the tokens
            return sum(t.predict(int(n_ctx * s), max(1, round(k * s)), n_ctx * s * k / n)
                       for t, s in zip(self.times, shares, strict=True) if s > 0)

        return predict

    # ---- the iteration -----------------------------------------------------------------------------
    def assign(self, decoding: list[Request], *, depth: int, width: int) -> None:
        """A draft for every request whose slot ended; switched requests' new KV caught up, timed.

        Drafts run one after another, so a draft group makes every request outside it wait for its ``depth``
        forwards. Its selector sees that as ``join_s``, the group's cost shared by its members:

            join_j = (requests outside the group) x slot x depth x T_j(ctx, width) / (members with this one)

        A group of one pays it all; a group that holds nearly the whole batch pays nearly nothing. (Charging
        only a group of one let two or three requests keep a group alive at no cost to each: in the
        first runs the second draft ran in half to three quarters of the iterations on 8-26% of the slots.)"""
        catch_up: dict[int, list[Request]] = {}
        # slots are aligned: every request's slot ends at a round's start (a newcomer's first is shorter)
        done = self.use.iterations  # speculative iterations before this one (speculate counts them)
        boundary, round_no = done % self.slot_iters == 0, done // self.slot_iters
        deciding = {r.request_id for r in decoding if boundary or r.request_id not in self.slots}
        groups = [0] * len(self.drafts)  # requests on each draft whose draft is settled for this iteration
        for r in decoding:
            if r.request_id not in deciding:
                groups[r.draft_index] += 1
        for req in decoding:
            if req.request_id not in deciding:
                continue
            slot = self.slots.get(req.request_id)
            current = None if slot is None else slot.arm
            if slot is not None:
                self._report(req.request_id, slot)
            n = len(req.prompt_ids) + len(req.output_ids)
            # predicted recompute per arm: the tokens that arm's KV lacks (all but the root)
            switch = tuple(self.times[j].predict(0, max(0, n - 1 - self.kv_of(req, j).length))
                           if current is not None and j != current else 0.0 for j in range(len(self.drafts)))
            ctx = req.target_kv.length
            group_s = [self.slot_iters * depth * t.predict(ctx, width) for t in self.times]  # a group's forwards
            join = tuple(group_share(len(decoding), groups[j] + 1, group_s[j]) for j in range(len(self.drafts)))
            arm = self.selector.choose(Choice(req.request_id, len(req.prompt_ids), current, switch, join, round_no,
                                              len(deciding)))
            groups[arm] += 1
            if current is None:  # the first slot: no draft has seen the request yet
                req.draft_index = arm
            elif arm != current:
                self._switch(req, arm)
                catch_up.setdefault(arm, []).append(req)
            self.slots[req.request_id] = Slot(arm)
        for arm, reqs in catch_up.items():
            self._recompute(arm, reqs)

    def _switch(self, req: Request, arm: int) -> None:
        req.other_draft_kv[req.draft_index] = req.draft_kv
        req.draft_kv = req.other_draft_kv.pop(arm, SequenceKV())
        req.draft_index = arm
        self.use.switches += 1

    def _recompute(self, arm: int, reqs: list[Request]) -> None:
        """One forward of ``arm``'s draft over every switched request's missing tokens (the root stays
        pending for the beam search); its time goes to each request's slot by its share of tokens."""
        runner = self.drafts[arm]
        todo = [(r, r.ids_from(r.draft_kv.length)[:-1]) for r in reqs]
        todo = [(r, ids) for r, ids in todo if ids]
        if not todo:
            return
        t0 = self.clock()
        runner.forward([Segment(r.draft_kv, r.draft_kv.length, TokenTree.chain(ids)) for r, ids in todo],
                       all_logits=[False] * len(todo))
        for r, ids in todo:
            runner.cache.truncate(r.draft_kv, r.draft_kv.length + len(ids))
        self.use.switch_s += self.clock() - t0
        self.use.switch_tokens += sum(len(ids) for _, ids in todo)
        for r, ids in todo:  # priced alone, as the slot's other costs (account)
            self.slots[r.request_id].switch_s += self.times[arm].predict(r.draft_kv.length, len(ids))

    def speculate(self, decoding: list[Request], *, depth: int, width: int,
                  expansion: tuple[int, ...] | None) -> list[TokenTree]:
        """Every request's candidate tree from its own draft, one beam search per draft, in batch order."""
        out: list[TokenTree | None] = [None] * len(decoding)
        self.use.iterations += 1
        self.use.mixed_iterations += len({r.draft_index for r in decoding}) > 1
        for arm, runner in enumerate(self.drafts):
            idx = [i for i, r in enumerate(decoding) if r.draft_index == arm]
            if not idx:
                continue
            inputs = [DraftInput(decoding[i].draft_kv, decoding[i].ids_from(decoding[i].draft_kv.length),
                                 decoding[i].grammar) for i in idx]
            # each draft forward timed alone, with its own counts (the first also runs the catch-up tokens)
            split = ForwardSplitter(self.clock)
            split.start()
            trees = beam_search(runner, inputs, depth=depth, width=width, expansion=expansion,
                                on_forward=lambda rec, split=split: split(rec.n_context, rec.n_new, rec.n_cells))
            for c, b, y, k in split.finish():
                self.times[arm].observe(c, b, y, k)
            for i, t in zip(idx, trees, strict=True):
                out[i] = t
        return [t for t in out if t is not None]

    def account(self, decoding: list[Request], trees: list[TokenTree], emitted: list[int], *, depth: int,
                width: int) -> None:
        """Close the iteration: each request's tokens, and its cost priced alone on its draft (see above)."""
        for req, tree, n in zip(decoding, trees, emitted, strict=True):
            slot = self.slots.get(req.request_id)
            if slot is None:
                continue
            ctx = req.target_kv.length
            slot.iters += 1
            slot.tokens += n
            slot.seconds += depth * self.times[slot.arm].predict(ctx, width) + self.target_time.predict(ctx, tree.size)
            req.metrics.drafts_per_step.append(slot.arm)

    def _report(self, request_id: str, slot: Slot) -> None:
        res = slot.result()
        self.selector.observe(request_id, res)
        self.use.slots.append((request_id, res))
