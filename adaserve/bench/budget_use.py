"""Did the budget bind, and did the SLO step make choices? Counted from every speculative iteration.

Per iteration (a ``SelectionRecord``): the candidates the draft offered, the budget B of that iteration
and what the policy kept. For AdaServe the two phases of Algorithm 2 are replayed on the same inputs
(pure, cheap) to split the kept nodes into those the SLO step assigned and those the global step did.

    budget_bound      the candidates held more nodes than B: selection had to leave some out
    slo_step_bound    the SLO step alone used up B (a request's target went unmet or was cut short)
    nodes_slo_step    drafted nodes (roots excluded) the SLO step assigned, summed over iterations
    nodes_global_step drafted nodes the throughput step added after it
"""

from __future__ import annotations

from dataclasses import dataclass

from adaserve.engine.speculation.policies import SelectionRecord
from adaserve.engine.speculation.selection import adaserve_phases


@dataclass
class BudgetUse:
    policy: str
    n_max: int = 16
    iterations: int = 0
    budget_sum: int = 0
    verified_sum: int = 0
    budget_bound: int = 0
    slo_step_bound: int = 0
    nodes_slo_step: int = 0
    nodes_global_step: int = 0

    def observe(self, rec: SelectionRecord) -> None:
        n = len(rec.candidates)
        budget = rec.ctx.budget
        kept = sum(len(s) for s in rec.selected)
        self.iterations += 1
        self.budget_sum += budget
        self.verified_sum += kept
        self.budget_bound += sum(c.size for c in rec.candidates) > budget
        if self.policy == "adaserve":
            slo, total = adaserve_phases(rec.candidates, rec.requirements, budget=budget, depth=rec.ctx.depth,
                                         n_max=self.n_max)
            used = sum(len(s) for s in slo)
            self.slo_step_bound += used >= budget
            self.nodes_slo_step += used - n
            self.nodes_global_step += sum(len(t) for t in total) - used
        else:  # no SLO step: every drafted node kept is the global step's
            self.nodes_global_step += kept - n

    def summary(self) -> dict[str, float | int | None]:
        it = self.iterations

        def share(k: int) -> float | None:
            return k / it if it else None

        return {
            "iterations": it,
            "mean_budget": self.budget_sum / it if it else None,
            "mean_verified": self.verified_sum / it if it else None,
            "budget_bound_share": share(self.budget_bound),
            "slo_step_bound_share": share(self.slo_step_bound) if self.policy == "adaserve" else None,
            "nodes_slo_step": self.nodes_slo_step,
            "nodes_global_step": self.nodes_global_step,
        }
