"""Which draft speculates for which request: Spin's learning-based draft selection (docs/architecture.md §14).

With several drafts, every decoding request has a current draft (an *arm*). Time is cut into slots of
``slot_iters`` of the request's own verifications; at a slot's end the request reports what the slot
gave, and its selector picks the arm for the next slot:

    reward of a slot     r = tokens emitted / (its share of draft time + its share of verification time
                                               + the recompute a switch into this slot cost)
    steady goodput       g = tokens emitted / (draft share + verification share)   (the switch left out)

Selectors, all without prior knowledge of a request's difficulty:

    ucb       UCB1-Tuned over every request's slots pooled, each request's own lean to a draft (once
              seen) shrunk in (k0 pseudo-slots), a switch priced as g * S / (S + c_switch)
    eps       epsilon-greedy over the pooled estimates (Spin's baseline; epsilon = 0.2 explores)
    length    Spin's prompt-length rule: prompts shorter than the running median of prompt lengths take
              the smallest draft, the others the largest
    dN        always draft N (the fixed single-draft baselines)

Pure Python: no torch, no model. The engine does the timing and calls ``choose`` / ``observe``.
"""

from __future__ import annotations

import bisect
import math
import random
from dataclasses import dataclass, field
from typing import Protocol

SELECTORS = ("ucb", "eps", "length", "dN")


@dataclass(frozen=True)
class SlotResult:
    """What one request's slot on one draft gave."""

    arm: int
    tokens: int  # tokens emitted (accepted draft tokens + the bonus token)
    seconds: float  # its share of draft and verification time, the switch excluded
    switch_s: float = 0.0  # recompute of the draft's KV for the tokens so far, when the slot began with a switch

    @property
    def steady(self) -> float:
        return self.tokens / self.seconds if self.seconds > 0 else 0.0

    @property
    def reward(self) -> float:
        total = self.seconds + self.switch_s
        return self.tokens / total if total > 0 else 0.0


@dataclass(frozen=True)
class Choice:
    """What a selector sees of a request when choosing: enough to price a switch and apply a rule."""

    request_id: str
    prompt_len: int
    current: int | None  # the arm of the slot that just ended (None: the request's first slot)
    switch_s: tuple[float, ...]  # predicted recompute seconds if the next slot runs on each arm (0 on its own)
    # per arm: this request's share of what that draft's group costs the requests outside it over the slot
    # (drafts run one after another: a group adds its d forwards to every other request's iteration)
    join_s: tuple[float, ...] = ()
    # the slot round: the requests of a batch choose together at each round's start (and newcomers during
    # it); the pool's choice is made once per round. None: a round of its own (a selector used alone)
    round: int | None = None
    batch: int = 1  # requests choosing at this round's start: the slots the pool's choice will take


class DraftSelector(Protocol):
    name: str

    def choose(self, c: Choice) -> int: ...

    def observe(self, request_id: str, result: SlotResult) -> None: ...

    def forget(self, request_id: str) -> None:
        """The request has finished: drop what is kept for it alone."""


@dataclass
class ArmStats:
    tokens: float = 0.0
    seconds: float = 0.0
    slots: int = 0

    def add(self, r: SlotResult) -> None:
        self.tokens += r.tokens
        self.seconds += r.seconds
        self.slots += 1

    @property
    def goodput(self) -> float:
        return self.tokens / self.seconds if self.seconds > 0 else 0.0

    @property
    def slot_s(self) -> float:
        return self.seconds / self.slots if self.slots else 0.0


@dataclass
class Fixed:
    arm: int
    name: str = "fixed"

    def choose(self, c: Choice) -> int:
        return self.arm

    def observe(self, request_id: str, result: SlotResult) -> None:
        return None

    def forget(self, request_id: str) -> None:
        return None


@dataclass
class PromptLength:
    """Spin's greedy rule: short prompts on the smallest draft, long ones on the largest."""

    sizes: tuple[float, ...]  # parameters per draft
    name: str = "length"
    _lengths: list[int] = field(default_factory=list)  # every prompt length seen, sorted
    _arm: dict[str, int] = field(default_factory=dict)

    def choose(self, c: Choice) -> int:
        if c.request_id in self._arm:  # the rule depends on the prompt only: decided once
            return self._arm[c.request_id]
        bisect.insort(self._lengths, c.prompt_len)
        median = self._lengths[len(self._lengths) // 2]
        small = min(range(len(self.sizes)), key=lambda i: self.sizes[i])
        large = max(range(len(self.sizes)), key=lambda i: self.sizes[i])
        arm = small if c.prompt_len < median else large
        self._arm[c.request_id] = arm
        return arm

    def observe(self, request_id: str, result: SlotResult) -> None:
        return None

    def forget(self, request_id: str) -> None:
        self._arm.pop(request_id, None)


@dataclass
class EpsilonGreedy:
    """The best arm by pooled goodput, except with probability ``epsilon`` a uniformly random one."""

    n_arms: int
    epsilon: float = 0.2
    seed: int = 0
    name: str = "eps"
    pooled: list[ArmStats] = field(default_factory=list)
    _rng: random.Random = field(init=False)

    def __post_init__(self) -> None:
        self.pooled = [ArmStats() for _ in range(self.n_arms)]
        self._rng = random.Random(self.seed)

    def choose(self, c: Choice) -> int:
        untried = [j for j, s in enumerate(self.pooled) if s.slots == 0]
        if untried:
            return untried[0]
        if self._rng.random() < self.epsilon:
            return self._rng.randrange(self.n_arms)
        return max(range(self.n_arms), key=lambda j: self.pooled[j].goodput)

    def observe(self, request_id: str, result: SlotResult) -> None:
        self.pooled[result.arm].add(result)

    def forget(self, request_id: str) -> None:
        return None


@dataclass
class UCBDrafts:
    """UCB over the pooled slots of all requests, personalised by a request's own evidence, switches priced.

    Slot rewards are normalised by the best pooled goodput (x = r / g_max, about 0..1.5), and:

        pooled g_j, N_j, V_j   goodput, slots and variance of x on draft j over every request's slots
        bonus_j   = c * sqrt(ln N / N_j * min(1/4, V_j + sqrt(2 ln N / N_j)))          (UCB1-Tuned)
        d_i       = mean over the request's slots of g_ij / g_j     (how easy it is: the same on every draft)
        e_ij      = (n_ij * (g_ij / g_j) / d_i + k0) / (n_ij + k0)  (its own lean to j, shrunk to 1)
        score_ij  = (g_j * e_ij / g_max + bonus_j) * S_j / (S_j + switch_ij + join_ij)
        leader    = argmax_j g_j / g_max + bonus_j(N_j + B)   once per round: the pool's choice, each
                                                              draft's width as if it took the round's B slots

    N: all slots, n_ij: the request's slots on j, S_j: mean slot seconds on j, switch_ij: predicted
    recompute if the next slot moves to j, join_ij: the request's share of what j's draft group costs the
    requests outside it (0 for the leader). Each arm first gets ``min_slots`` slots.

    *Exploration moves the whole batch.* Drafts run one after another on one device, so a group on a
    second draft adds its forwards to every request's iteration, however few requests it holds: in the
    first runs 8-26% of the slots on the small draft had it running in half to three quarters of the
    iterations. The pool's slots are aligned (every request's slot ends at the same iteration), and the
    pool's choice, exploration included (the first slots, a draft led by its bonus), is made once per
    round and taken by every request: a round spent exploring costs the gap between the drafts, not an
    extra group, and it gives a batch's worth of slots at once. A request leaves the pool's choice only
    where its own lean pays its share of a separate group (join_ij).

    A request's difficulty cancels out of the ranking (a hard request is hard on every draft); only its
    lean to one draft, seen once it has run on more than one, moves it away from the pool's choice. The
    switch factor turns a slot's goodput into the reward the slot would get with the recompute counted
    (SlotResult.reward). Slots in flight count as pulls (N_j, N and the first slots include the slots chosen
    and not yet reported, their outcome taken to be the arm's mean: batched UCB's correction for delayed
    feedback), which matters for newcomers choosing during a round and for a selector used alone.
    """

    n_arms: int
    c: float = 0.7
    k0: float = 2.0
    min_slots: int = 8  # every draft gets this many slots first, while the engine fills (cheap, and less noisy)
    name: str = "ucb"
    pooled: list[ArmStats] = field(default_factory=list)
    sr: list[float] = field(default_factory=list)  # per arm: sum of slot rewards, and of their squares
    sq: list[float] = field(default_factory=list)
    own: dict[str, list[ArmStats]] = field(default_factory=dict)
    pending: list[int] = field(default_factory=list)  # per arm: slots chosen and not yet reported
    _open: dict[str, int] = field(default_factory=dict)  # request -> the arm of its slot in flight
    _round: int | None = None  # the round the pool's choice was made for
    _leader: int | None = None
    _first: bool = True  # the round gives a draft its first slots

    def __post_init__(self) -> None:
        self.pooled = [ArmStats() for _ in range(self.n_arms)]
        self.sr, self.sq = [0.0] * self.n_arms, [0.0] * self.n_arms
        self.pending = [0] * self.n_arms

    def pulls(self, j: int) -> int:
        """Slots on arm ``j``, reported or in flight."""
        return self.pooled[j].slots + self.pending[j]

    def choose(self, c: Choice) -> int:
        self._close(c.request_id)  # a slot chosen before and never reported (not expected: the engine reports)
        arm = self._choose(c)
        self._open[c.request_id] = arm
        self.pending[arm] += 1
        return arm

    def _close(self, request_id: str) -> None:
        arm = self._open.pop(request_id, None)
        if arm is not None:
            self.pending[arm] -= 1

    def _choose(self, c: Choice) -> int:
        if c.round is None or c.round != self._round:
            self._round = c.round
            self._leader, self._first = self._pool_choice(c.current, c.batch)
        if self._leader is None:  # nothing has reported yet: stay, or start on the first draft (the one profiled)
            return c.current if c.current is not None else 0
        return self._leader if self._first else self._ucb(c, self._leader)

    def _pool_choice(self, current: int | None, batch: int) -> tuple[int | None, bool]:
        """The draft every request without a lean of its own takes this round (None: no draft has reported
        yet), and whether it is a draft's first slots (then every request takes it).

        Each draft is ranked by the index it would have *after* taking the round: its ``batch`` slots
        counted as pulls, their outcome its mean (the in-flight correction, applied to the round before it
        is chosen). A round adds a whole batch of slots at once, so a draft whose bonus leads by a little
        would otherwise take a batch's worth of exploration where one more slot would have settled it."""
        few = [j for j in range(self.n_arms) if self.pulls(j) < self.min_slots]
        if few:  # one slot's goodput varies by +-40%: a lead taken on two or three slots herds the batch
            return (current if current in few else min(few, key=self.pulls)), True
        known = [j for j in range(self.n_arms) if self.pooled[j].slots]  # a draft's first slots may be in flight
        if not known:
            return None, False
        g_max = max(s.goodput for s in self.pooled) or 1.0
        return max(known, key=lambda j: self.pooled[j].goodput / g_max + self._bonus(j, g_max, batch)), False

    def _bonus(self, j: int, g_max: float, extra: int = 0) -> float:
        """UCB1-Tuned's width for draft ``j``, with ``extra`` slots more on it (pending, not yet chosen)."""
        pool, n_j = self.pooled[j], self.pulls(j) + extra  # pending slots narrow the width, not the mean
        n_all = sum(self.pulls(k) for k in range(self.n_arms)) + extra
        m1, m2 = self.sr[j] / pool.slots, self.sq[j] / pool.slots  # E[r], E[r^2] over reported slots
        var = max(0.0, m2 - m1 * m1) / g_max**2
        log_n = math.log(max(n_all, 1))
        return self.c * math.sqrt(log_n / n_j * min(0.25, var + math.sqrt(2 * log_n / n_j)))

    def _ucb(self, c: Choice, leader: int) -> int:
        g = [s.goodput for s in self.pooled]
        g_max = max(g) or 1.0
        arms = [j for j in range(self.n_arms) if self.pooled[j].slots]
        mine = self.own.get(c.request_id)
        lean = [1.0] * self.n_arms
        if mine is not None and sum(m.slots for m in mine) > 0:
            tried = [j for j, m in enumerate(mine) if m.slots and g[j] > 0]
            d = sum(mine[j].slots * mine[j].goodput / g[j] for j in tried) / max(1, sum(mine[j].slots for j in tried))
            if d > 0:
                lean = [(mine[j].slots * (mine[j].goodput / g[j]) / d + self.k0) / (mine[j].slots + self.k0)
                        if j in tried else 1.0 for j in range(self.n_arms)]

        def score(j: int) -> float:
            switch = c.switch_s[j] if j != c.current else 0.0
            if c.join_s and j != leader:  # the leader's group is the batch: it delays nobody
                switch += c.join_s[j]
            slot_s = self.pooled[j].slot_s
            keep = slot_s / (slot_s + switch) if slot_s > 0 else 1.0  # the share of the slot left for tokens
            return (g[j] / g_max * lean[j] + self._bonus(j, g_max)) * keep

        return max(arms, key=score)

    def observe(self, request_id: str, result: SlotResult) -> None:
        self._close(request_id)
        self.pooled[result.arm].add(result)
        self.sr[result.arm] += result.steady
        self.sq[result.arm] += result.steady ** 2
        self.own.setdefault(request_id, [ArmStats() for _ in range(self.n_arms)])[result.arm].add(result)

    def forget(self, request_id: str) -> None:
        self._close(request_id)  # it ended before its slot ran an iteration: that slot will never report
        self.own.pop(request_id, None)


def pinned_draft(spec: str) -> int | None:
    """The draft a selector spec ``dN`` pins (N), or None for any other spec."""
    return int(spec[1:]) if spec.startswith("d") and spec[1:].isdigit() else None


def make_selector(spec: str, *, sizes: tuple[float, ...], seed: int = 0) -> DraftSelector:
    """A selector by name (``SELECTORS``) over ``len(sizes)`` drafts."""
    n = len(sizes)
    if spec == "ucb":
        return UCBDrafts(n)
    if spec == "eps":
        return EpsilonGreedy(n, seed=seed)
    if spec == "length":
        return PromptLength(sizes)
    if (arm := pinned_draft(spec)) is not None:
        if arm >= n:
            raise ValueError(f"draft selector {spec!r}: there are only {n} drafts (d0..d{n - 1})")
        return Fixed(arm, name=spec)
    raise ValueError(f"unknown draft selector {spec!r}; expected one of {', '.join(SELECTORS)}")
