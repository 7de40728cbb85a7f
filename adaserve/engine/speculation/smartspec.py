"""SmartSpec's goodput-guided proposal length (SmartSpec Sec. 4.3-4.4, Alg. 1-2; docs/architecture.md §6).

Every decoding request proposes the same chain length k this step. The expected tokens a request
emits with acceptance rate alpha is l(alpha, k) = (1 - alpha^(k+1)) / (1 - alpha) (bonus included), and
the step costs k draft forwards plus one target forward over n*(k+1) tokens:

    goodput(k) = n * l(alpha, k) / (k * T_draft(N_ctx, n) + T_target(N_ctx, n * (k + 1)))

k = 0 (no speculation) is a candidate, so a saturated batch stops speculating. alpha is the moving
average of observed per-token acceptance (accepted / proposed) over recent steps.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field


def expected_emitted(alpha: float, k: int) -> float:
    """l(alpha, k): expected tokens one request emits with k proposed tokens, bonus included."""
    if alpha >= 1.0:
        return k + 1.0
    return (1.0 - alpha ** (k + 1)) / (1.0 - alpha)


def best_length(*, n: int, n_context: int, alpha: float, max_k: int,
                t_target: Callable[[int, int], float], t_draft: Callable[[int, int], float]) -> int:
    """The k in [0, max_k] that maximises predicted goodput (Algorithm 2 over one batch)."""
    best_k, best = 0, -1.0
    for k in range(max_k + 1):
        cost = t_target(n_context, n * (k + 1)) + k * t_draft(n_context, n)
        goodput = n * expected_emitted(alpha, k) / max(cost, 1e-9)
        if goodput > best:
            best_k, best = k, goodput
    return best_k


@dataclass
class AcceptanceAverage:
    """Moving average of per-step acceptance rates (SmartSpec Algorithm 1, lines 3-8)."""

    window: int = 32
    prior: float = 0.7  # alone until the first speculative step is observed
    # the prior counts as this many observed steps. Without it one unlucky first step (0 of 4 accepted)
    # set alpha = 0, SmartSpec chose k = 0, never speculated again and so never observed anything else:
    # (tests/engine/speculation/test_policies.py::test_smartspec_recovers_from_an_unlucky_first_step)
    prior_weight: float = 2.0
    rates: deque[float] = field(default_factory=deque)

    @property
    def alpha(self) -> float:
        return (sum(self.rates) + self.prior_weight * self.prior) / (len(self.rates) + self.prior_weight)

    def observe(self, accepted: int, proposed: int) -> None:
        if proposed <= 0:
            return
        self.rates.append(min(1.0, accepted / proposed))
        while len(self.rates) > self.window:
            self.rates.popleft()
