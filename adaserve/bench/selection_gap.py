"""How far the engine's token selection lands from Algorithm 1's optimum on the same candidate trees.

Each speculative iteration the engine hands its selection listeners a ``SelectionRecord``: the draft's
candidate trees, A(r) per request, the budget and what the policy kept. Algorithm 1
(engine/speculation/optimal_trees.py) solves the same problem exactly: keep connected trees holding at most B nodes
in all, every request's tree reaching its target, with the most expected accepted tokens sum f(v).

The target is A_cap(r) = min(A(r), d + 1), as Algorithm 2 uses, further capped at the f-mass the
request's finite candidate tree holds. Without that last cap a request far behind its SLO (A_cap = d + 1,
more than any depth-d beam tree holds) would make every iteration infeasible; with it, such a request
asks for its whole tree, which is what Algorithm 2 gives it. Per iteration this records:

    expected   sum f(v) over the nodes the policy kept (roots count 1)
    optimum    Algorithm 1's sum f(v); None when B cannot meet every target (then nothing can)
    met        requests whose kept f-mass reached their target
    ceiling    the most sum f(v) B allows with no targets at all (Algorithm 1 with A = 0)

Algorithm 2 equals Algorithm 1 when the optimum exists and nothing else caps it (n_max, tested in
tests/engine/speculation/test_optimal_trees.py); a policy without an SLO phase can exceed ``optimum`` by leaving a
target unmet, which ``met`` shows. The records are kept during the run and measured afterwards, so the
real-time benchmark does not pay for Algorithm 1 inside its iterations.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

import numpy as np

from adaserve.engine.speculation.optimal_trees import optimal_trees
from adaserve.engine.speculation.policies import SelectionRecord

# Policies that choose within the budget B; the others verify their whole candidate trees, so Algorithm 1
# at budget B would answer a different question.
BUDGETED_POLICIES = ("adaserve", "equal-greedy", "global-greedy", "beam")
TOL = 1e-9  # f-mass sums in different orders


def budgeted(policy: str) -> bool:
    return policy.partition(":")[0] in BUDGETED_POLICIES


@dataclass(frozen=True)
class GapRow:
    """One iteration: the policy's selection against Algorithm 1's optimum."""

    requests: int
    budget: int
    expected: float
    optimum: float | None
    met: int
    ceiling: float

    @property
    def optimal(self) -> bool:
        """The policy met every target and kept as much expected f-mass as the optimum (within float noise)."""
        return self.optimum is not None and self.met == self.requests and self.expected >= self.optimum - 1e-6


def measure(rec: SelectionRecord) -> GapRow:
    cands, n = rec.candidates, len(rec.candidates)
    mass = [float(np.exp(c.log_probs).sum()) for c in cands]
    # a hair below the tree's own mass, so float summation order cannot make "the whole tree" unreachable
    targets = [min(a, rec.ctx.depth + 1, m - TOL) for a, m in zip(rec.requirements, mass, strict=True)]
    kept = [float(np.exp(c.log_probs[s]).sum()) for c, s in zip(cands, rec.selected, strict=True)]
    best = optimal_trees(cands, targets, budget=rec.ctx.budget)
    ceiling = optimal_trees(cands, [0.0] * n, budget=rec.ctx.budget)
    return GapRow(
        requests=n,
        budget=rec.ctx.budget,
        expected=sum(kept),
        optimum=None if best is None else best.expected_accepted,
        met=sum(k >= t - TOL for k, t in zip(kept, targets, strict=True)),
        ceiling=ceiling.expected_accepted if ceiling is not None else sum(kept),
    )


@dataclass
class SelectionGap:
    """Collects an engine's selection records (``observe`` is its listener) and measures them on demand."""

    records: list[SelectionRecord] = field(default_factory=list)
    stride: int = 1  # keep every stride-th iteration: Algorithm 1 on thousands of simulated ones is slow
    _seen: int = 0

    def observe(self, rec: SelectionRecord) -> None:
        if self._seen % self.stride == 0:
            self.records.append(rec)
        self._seen += 1

    def rows(self) -> list[GapRow]:
        """The per-iteration trace."""
        return [measure(r) for r in self.records]

    def summary(self) -> dict[str, float | int | None]:
        rows = self.rows()
        feasible = [r for r in rows if r.optimum is not None]

        def mean(xs: list[float]) -> float | None:
            return float(np.mean(xs)) if xs else None

        return {
            "iterations": len(rows),
            "feasible_iterations": len(feasible),  # B could meet every request's target
            "optimal_share": mean([float(r.optimal) for r in feasible]),
            "targets_met_share": mean([r.met / r.requests for r in feasible]),
            "mean_expected_accepted": mean([r.expected for r in feasible]),
            "mean_optimal_accepted": mean([r.optimum for r in feasible if r.optimum is not None]),
            "mean_gap_tokens": mean([r.optimum - r.expected for r in feasible if r.optimum is not None]),
            # all iterations: how much of what B could buy without targets the policy kept
            "share_of_ceiling": (sum(r.expected for r in rows) / sum(r.ceiling for r in rows)) if rows else None,
        }

    def trace(self) -> list[dict]:
        """The per-iteration trace as JSON-ready rows."""
        return [{**asdict(r), "optimal": r.optimal} for r in self.rows()]
