"""Token selection: which candidate nodes each request sends to verification (AdaServe section 4.3).

The draft's beam search gives every request a candidate tree whose node ``v`` carries log f(v), the draft's
path probability. Selection is pure CPU work over those numbers. It returns, per request, the sorted node
indices to keep (always 0, closed under parents), ready for ``cand.subtree(selected)``.

The budgeted policies (docs/architecture.md §5-6): ``select_adaserve`` (Algorithm 2),
``select_global_greedy`` and ``select_equal_greedy``. The policies without a budget (chain:K, SpecInfer,
SmartSpec) verify the whole candidate tree; SpecInfer's static shape comes from the beam search itself.
How far Algorithm 2 lands from the optimum on the same candidates is measured against Algorithm 1
(optimal_trees.py) by the benchmark (bench/selection_gap.py).

Why greedy-by-f keeps trees connected (Appendix B): f(child) < f(parent), so a parent always ranks above
its child. We make the decrease strict (``TokenTree.with_strict_decrease``) and break the remaining ties
between unrelated nodes by node index; since ``parents[i] < i`` that tie-break also ranks parents first.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from adaserve.engine.model.tree import TokenTree

# SpecInfer's default static tree: a node at depth i keeps its top SPECINFER_EXPANSION[i] children
# (speculate.beam_search builds it).
SPECINFER_EXPANSION: tuple[int, ...] = (1, 1, 3, 1, 1, 1, 1, 1)

# The order in which the SLO phase serves requests. The paper's text (section 4.3) serves the largest A(r)
# first, the requests furthest behind; the artifact's scheduler (flexflow-serve, branch specscheduler,
# RequestManager::prune_token_tree) sorts by A(r) ascending, the requests nearest their target first. Under
# a budget that binds the two differ: the furthest behind often need more than one iteration can give
# (A(r) of 70-120 tokens), and taking whole trees for them starves requests a few tokens would save
# (docs/benchmarks.md, issue 29's traces).
SLO_ORDERS = ("smallest-need", "largest-need")


def slo_requirement(*, elapsed_s: float, tokens_so_far: int, t_iter_s: float, tpot_slo_s: float) -> float:
    """A(r) = (l_r + t_iter) / tpot_r - o_r: tokens r must emit this iteration to be on its TPOT SLO.

    It counts every emitted token, the target's bonus token included (Eq. 2: o_r + acc(T_r) is the token
    count after the iteration, and acc(T) = sum_{v in T} f(v) with f(root) = 1). Negative when r is ahead.
    """
    if tpot_slo_s <= 0:
        raise ValueError(f"tpot_slo_s must be > 0, got {tpot_slo_s}")
    if elapsed_s < 0 or t_iter_s < 0:
        raise ValueError("elapsed_s and t_iter_s must be >= 0")
    if tokens_so_far < 0:
        raise ValueError(f"tokens_so_far must be >= 0, got {tokens_so_far}")
    return (elapsed_s + t_iter_s) / tpot_slo_s - tokens_so_far


def requirement_line(*, elapsed_s: float, tokens_so_far: int, tpot_slo_s: float) -> tuple[float, float]:
    """A(r) as a line in the iteration's length: (base, rate) with A(r) = base + rate * t_iter, i.e.
    (l_r / tpot_r - o_r, 1 / tpot_r) (slo_requirement's checks apply). The SLO budget rule prices many t_iter."""
    base = slo_requirement(elapsed_s=elapsed_s, tokens_so_far=tokens_so_far, t_iter_s=0.0, tpot_slo_s=tpot_slo_s)
    return base, 1.0 / tpot_slo_s


# ---- helpers ------------------------------------------------------------------------------------------
def strict_log_probs(cand: TokenTree) -> np.ndarray:
    """log f with f(child) < f(parent); ties (e.g. a draft probability of exactly 1) are nudged."""
    return cand.log_probs if cand.strictly_decreasing else cand.with_strict_decrease().log_probs


def _rank(lp: np.ndarray, nodes: np.ndarray) -> np.ndarray:
    """``nodes`` sorted by descending f, ties by index (parents first: parents[i] < i)."""
    return nodes[np.lexsort((nodes, -lp[nodes]))]


def _as_lists(chosen: Sequence[np.ndarray]) -> list[list[int]]:
    return [np.sort(c).tolist() for c in chosen]  # Python ints, ascending


def _check_roots_fit(n: int, budget: int) -> None:
    # The engine sizes the batch so every root fits; a root cannot be dropped (it is the request's
    # last token, its KV is written by this very verification), so too small a budget is a caller bug.
    if budget < n:
        raise ValueError(f"budget {budget} cannot hold the roots of {n} requests")


@dataclass(frozen=True)
class Padded:
    """A batch's log f as one array: ``lp`` [n, M] with -inf past each tree's size, ``sizes`` [n]."""

    lp: np.ndarray
    sizes: np.ndarray


LogF = Sequence[np.ndarray] | Padded  # per request log f, or ``_padded`` of them already (computed once)


def _padded(lps: LogF) -> Padded:
    """One array for the whole batch."""
    if isinstance(lps, Padded):
        return lps
    sizes = np.fromiter((len(lp) for lp in lps), np.int64, len(lps))
    # C forms: ufunc reductions, np.array of equal rows for np.stack (issue 30: numpy's Python layer, every iteration)
    m = int(np.maximum.reduce(sizes, initial=1))
    if np.logical_and.reduce(sizes == m):
        return Padded(np.array(lps, np.float64).reshape(len(lps), m), sizes)
    out = np.full((len(lps), m), -np.inf)
    for i, lp in enumerate(lps):
        out[i, : len(lp)] = lp
    return Padded(out, sizes)


@dataclass(frozen=True)
class RankedNodes:
    """A batch's drafted nodes ranked per request, and what taking the top k of them is expected to give.

    ranked[i]: request i's drafted node indices by descending f, ties by index (parents first); padding last.
    n_acc[i, k] = 1 + f(v_1) + ... + f(v_k): expected tokens with the root and its top k nodes verified.
    """

    ranked: np.ndarray  # [n, M - 1]
    n_acc: np.ndarray  # [n, M]
    sizes: np.ndarray  # [n] candidate tree sizes, root included
    value: np.ndarray  # [n, M - 1] f of ``ranked``'s nodes (0 for padding)

    @classmethod
    def of(cls, lps: LogF) -> RankedNodes:
        padded = _padded(lps)
        lp, sizes = padded.lp, padded.sizes
        n = len(lp)
        ranked = (-lp[:, 1:]).argsort(axis=1, kind="stable") + 1
        f = np.exp(lp[np.arange(n)[:, None], ranked])  # np.take_along_axis's values, without its Python layer
        n_acc = 1.0 + np.concatenate([np.zeros((n, 1)), f.cumsum(axis=1)], axis=1)
        return cls(ranked, n_acc, sizes, f)

    def reach(self, n_max: int) -> np.ndarray:
        """n_acc of the largest tree the SLO phase may give each request (|T| <= n_max)."""
        k = np.minimum(self.sizes - 1, n_max - 1)
        return self.n_acc[np.arange(len(k)), k]


def slo_wishes(nodes: RankedNodes, req: np.ndarray, *, depth: int, n_max: int, min_value: float = 0.0) -> np.ndarray:
    """k(r): how many of its own top nodes request r takes in the SLO phase, the least k with
    n_acc[k] >= A_cap(r) = min(A(r), d+1), at most n_max - 1 and at most its drafted nodes, and none of
    them valued below ``min_value`` (0: no floor; see select_adaserve)."""
    a_cap = np.minimum(req, depth + 1)  # at most d drafted + 1 bonus
    need = (nodes.n_acc < a_cap[:, None]).sum(axis=1)
    if min_value > 0:  # ranked by f, highest first: the nodes worth at least min_value are a prefix
        need = np.minimum(need, (nodes.value >= min_value).sum(axis=1))
    return np.maximum(0, np.minimum(np.minimum(need, n_max - 1), nodes.sizes - 1))


def slo_grants(want: np.ndarray, req: np.ndarray, *, budget: int, order: str) -> np.ndarray:
    """What each request gets of its wish: the budget goes to wishes in ``order`` of A(r) (SLO_ORDERS),
    request i gets min(k(i), what the requests before it left), a clipped running sum; ties keep batch order."""
    by_need = (-req if order == "largest-need" else req).argsort(kind="stable")
    before = want[by_need].cumsum() - want[by_need]
    k = np.empty(len(want), np.int64)
    # every root costs 1; never over budget (np.clip's values, without its Python layer)
    k[by_need] = np.minimum(np.maximum(budget - len(want) - before, 0), want[by_need])
    return k


def _slo_phase(lps: LogF, req: np.ndarray, *, budget: int, depth: int,
               n_max: int, order: str = "largest-need", min_value: float = 0.0) -> list[np.ndarray]:
    """Algorithm 2 lines 3-17. Returns the chosen node indices per request (root first).

    Vectorised over the batch: each request's wish k(r) (its own highest-f nodes until n_acc >= A_cap(r),
    at most n_max - 1) is computed for all at once (slo_wishes); the budget then goes to them in ``order``
    of A(r) (slo_grants).
    """
    return _slo_phase_and_cut(lps, req, budget=budget, depth=depth, n_max=n_max, order=order,
                              min_value=min_value)[0]


def _slo_phase_and_cut(lps: LogF, req: np.ndarray, *, budget: int, depth: int, n_max: int, order: str,
                       min_value: float) -> tuple[list[np.ndarray], int]:
    """The SLO phase (``_slo_phase``), and how many nodes the floor ``min_value`` kept out of it: what the
    phase grants without the floor less what it grants with it."""
    padded = _padded(lps)
    if len(padded.sizes) == 0:
        return [], 0
    nodes = RankedNodes.of(padded)
    k = slo_grants(slo_wishes(nodes, req, depth=depth, n_max=n_max, min_value=min_value), req, budget=budget,
                   order=order)
    cut = 0
    if min_value > 0:
        plain = slo_grants(slo_wishes(nodes, req, depth=depth, n_max=n_max), req, budget=budget, order=order)
        cut = int(plain.sum() - k.sum())
    return [np.concatenate(([0], nodes.ranked[i, : k[i]])) for i in range(len(k))], cut


def _throughput_phase(lps: LogF, chosen: Sequence[np.ndarray], *, budget: int) -> list[np.ndarray]:
    """Algorithm 2 lines 18-23: spend what is left of ``budget`` on the globally highest-f nodes.

    Works from any connected start: a remaining node's parent is chosen already or remains with a
    strictly higher f, so it is taken first. Ties go to the earlier request, then the lower index.
    """
    counts = np.fromiter((len(c) for c in chosen), np.int64, len(chosen))
    left = budget - int(counts.sum())
    if left <= 0 or not chosen:
        return list(chosen)
    lp = _padded(lps).lp
    m = lp.shape[1]
    free = np.isfinite(lp)
    free[np.arange(len(chosen)).repeat(counts), np.concatenate(chosen).astype(np.int64)] = False
    flat = free.ravel().nonzero()[0]  # row-major: by request, then node index
    top = flat[(-lp.reshape(-1)[flat]).argsort(kind="stable")[:left]]  # one global heap, as a sort
    # each request's share of ``top`` in top's order: a stable sort by request, cut at each request's end
    top = top[(top // m).argsort(kind="stable")]
    ends = np.bincount(top // m, minlength=len(chosen)).cumsum().tolist()
    nodes = top % m
    return [np.concatenate((c, nodes[a:b])) for c, a, b in zip(chosen, [0, *ends[:-1]], ends, strict=True)]


# ---- policies -----------------------------------------------------------------------------------------
def select_adaserve(cands: Sequence[TokenTree], requirements: Sequence[float], *, budget: int, depth: int,
                    n_max: int, order: str = "largest-need", min_value: float = 0.0) -> list[list[int]]:
    """SLO-customized selection (Algorithm 2): an SLO phase, then a throughput phase.

    Every root costs 1 and counts f = 1.0. Requests in descending A(r) take their own highest-f nodes
    until n_acc = sum_{v in T} f(v) >= A_cap(r) = min(A(r), d+1), or |T| = n_max, or the budget is gone;
    then the rest of the budget goes to the highest-f remaining nodes across all requests.

    Departures from the pseudocode: the loops there run while ``B >= 0``, which overspends by one; here
    the total never exceeds ``budget``. ``budget < len(cands)`` raises ValueError (roots must fit).

    ``min_value`` (ours, 0 = Algorithm 2): the SLO phase takes no node with f below it, the price of one
    verified token (iteration_budget.token_price), and the throughput phase then spends B less the nodes
    the floor kept out, so they leave the iteration instead of going to other requests. A request whose
    target is beyond its tree (A_cap above what the whole tree is worth, which a margin or a tight TPOT makes
    common) would otherwise take its whole tree, siblings worth 0.01 tokens included: at Figure 11's 0.8x
    coding SLO that was 12-13 nodes for every coding request, ~5 of them worth anything. Handed on to the
    throughput phase, the slots went to requests with slack (at Figure 10's 0.1 urgent share, coding
    attainment 0.95 -> 0.82); left out, the iteration is shorter for the requests that needed it
    (docs/benchmarks.md). The total is then at most ``budget``, and may be less.

    Figure 5 convention. Its caption meets A_cap(r0) = 0.6 with one node of f = 0.7, which under
    Algorithm 2 (n_acc starts at 1.0 for the root) would be met by the root alone. We keep Algorithm 2:
    A(r) counts the bonus token, as Eq. 2-5 do (acc(T) = sum f(v) over T, root included) and as the cap
    d+1 (d drafted tokens + 1 bonus) requires. The figure's 0.6 and 0.8 are then tokens to accept beyond
    the bonus, i.e. A(r) - 1: Figure 5 is reproduced by A(r0) = 1.6, A(r1) = 1.8
    (tests/engine/speculation/test_selection.py::test_figure5_worked_example).
    """
    req = _validated(cands, requirements, budget=budget, depth=depth, n_max=n_max)
    _check_options(order, min_value)
    lps = [strict_log_probs(c) for c in cands]
    if _every_node_kept(lps, budget=budget, min_value=min_value):
        return [list(range(len(lp))) for lp in lps]
    if len(lps) == 1 and np.isfinite(lps[0][1:]).all():
        return [_lone_request(lps[0], float(req[0]), budget=budget, depth=depth, n_max=n_max, min_value=min_value)]
    _, total = _phases(lps, req, budget=budget, depth=depth, n_max=n_max, order=order, min_value=min_value)
    return _as_lists(total)


def _lone_request(lp: np.ndarray, req: float, *, budget: int, depth: int, n_max: int,
                  min_value: float) -> list[int]:
    """Both phases for a batch of one request (the order of requests then plays no part), in a third of the
    steps: they take its nodes in one order, by descending f with ties by index (``RankedNodes``' stable sort and
    the throughput phase's agree), so what they keep is a prefix of that order, of length

        k    = the SLO phase's grant: its wish (``slo_wishes``), at most budget - 1 (the root costs 1)
        left = budget - cut - 1 - k       the throughput phase's share; cut = what the floor kept out of the grant
        K    = k + min(max(left, 0), drafted - k)

    ``lp``: the request's strict log f, every drafted value finite (the throughput phase passes over the others:
    the caller checks). The same lists as ``_phases`` (tests/engine/speculation/test_selection.py).

    The scalar form of ``RankedNodes.of``, ``slo_wishes`` and ``slo_grants`` for one row, written out rather than
    called: built from them, the selection took 88 us a call at one request against 47 for this form in numpy
    (docs/benchmarks.md, "The lone request's selection"); since over Python numbers, but f's exponentials (numpy's,
    for the phases' bits), as a lone tree's handful of nodes cost less so than in numpy calls that each run cold
    once an iteration ("Seventeenth round")."""
    values = lp.tolist()
    ranked = sorted(range(1, len(values)), key=lambda i: -values[i])  # RankedNodes.ranked: stable, ties by index
    f = np.exp(lp[ranked]).tolist()
    a_cap = min(req, depth + 1)  # A_cap = min(A(r), d + 1)
    # RankedNodes.n_acc = 1 + the running sum of f (a cumulative sum adds in order): the nodes it needs
    need, total = int(a_cap > 1.0), 0.0
    for x in f:
        total += x
        need += 1.0 + total < a_cap
    cap = min(n_max - 1, len(lp) - 1)
    room = max(budget - 1, 0)
    plain = min(max(0, min(need, cap)), room)  # the grant without the floor
    k = plain
    if min_value > 0:  # the nodes worth at least the floor are a prefix of ``ranked``
        k = min(max(0, min(need, sum(x >= min_value for x in f), cap)), room)
    left = budget - (plain - k) - 1 - k
    keep = k + max(0, min(left, len(lp) - 1 - k))
    return [0, *sorted(ranked[:keep])]


def _every_node_kept(lps: Sequence[np.ndarray], *, budget: int, min_value: float) -> bool:
    """Whether Algorithm 2 keeps every candidate node: they all fit in the budget and none is worth less than
    the floor. The SLO phase then grants every wish in full and the floor cuts nothing, so the throughput phase
    has room for every node left (all of them finite): the whole trees, which a small batch often sends
    (issue 29: the host time selection costs adaserve against a chain). Checked in two numpy passes instead of
    running both phases."""
    if sum(len(lp) for lp in lps) > budget:
        return False
    if not lps:
        return True
    drafted = lps[0][1:] if len(lps) == 1 else np.concatenate([lp[1:] for lp in lps])  # one request: no copy
    if not np.isfinite(drafted).all():
        return False
    return min_value <= 0 or bool(np.exp(drafted.min(initial=0.0)) >= min_value)


def adaserve_phases(cands: Sequence[TokenTree], requirements: Sequence[float], *, budget: int, depth: int,
                    n_max: int, order: str = "largest-need",
                    min_value: float = 0.0) -> tuple[list[np.ndarray], list[np.ndarray]]:
    """Algorithm 2's two phases apart: the nodes after the SLO phase and after the throughput phase, per
    request (unsorted). The bench counts how many nodes each phase assigned."""
    req = _validated(cands, requirements, budget=budget, depth=depth, n_max=n_max)
    _check_options(order, min_value)
    return _phases([strict_log_probs(c) for c in cands], req, budget=budget, depth=depth, n_max=n_max, order=order,
                   min_value=min_value)


def _phases(lps: Sequence[np.ndarray], req: np.ndarray, *, budget: int, depth: int, n_max: int, order: str,
            min_value: float) -> tuple[list[np.ndarray], list[np.ndarray]]:
    """``adaserve_phases`` on arguments already checked, from the candidates' ``strict_log_probs``."""
    padded = _padded(lps)  # once for both phases
    slo, cut = _slo_phase_and_cut(padded, req, budget=budget, depth=depth, n_max=n_max, order=order,
                                  min_value=min_value)
    return slo, _throughput_phase(padded, slo, budget=budget - cut)  # what the floor kept out is not handed on


def select_global_greedy(cands: Sequence[TokenTree], *, budget: int) -> list[list[int]]:
    """GlobalGreedy: roots, then the globally highest-f nodes until the budget is spent (no SLO phase)."""
    _check_roots_fit(len(cands), budget)
    lps = [strict_log_probs(c) for c in cands]
    roots = [np.zeros(1, np.int64) for _ in cands]
    return _as_lists(_throughput_phase(lps, roots, budget=budget))


def select_equal_greedy(cands: Sequence[TokenTree], *, budget: int) -> list[list[int]]:
    """EqualGreedy: request i gets B // n tokens (the first B % n requests one more), root included, and
    fills them with its own highest-f nodes. A share larger than the candidate tree is not passed on."""
    n = len(cands)
    _check_roots_fit(n, budget)
    out = []
    for i, c in enumerate(cands):
        share = budget // n + (1 if i < budget % n else 0)
        order = _rank(strict_log_probs(c), np.arange(1, c.size))
        out.append(np.concatenate(([0], order[: share - 1])))
    return _as_lists(out)


def _check_options(order: str, min_value: float) -> None:
    if order not in SLO_ORDERS:
        raise ValueError(f"SLO order must be one of {', '.join(SLO_ORDERS)}, got {order!r}")
    if not min_value >= 0:
        raise ValueError(f"min_value must be >= 0, got {min_value}")


def _validated(cands: Sequence[TokenTree], requirements: Sequence[float], *, budget: int, depth: int,
               n_max: int) -> np.ndarray:
    """Check select_adaserve's arguments; return A(r) as an array."""
    if depth < 0:
        raise ValueError(f"depth must be >= 0, got {depth}")
    if n_max < 1:
        raise ValueError(f"n_max must be >= 1, got {n_max}")
    _check_roots_fit(len(cands), budget)
    req = np.asarray(requirements, np.float64).reshape(-1)
    if len(req) != len(cands):
        raise ValueError(f"{len(cands)} candidate trees but {len(req)} requirements")
    if np.isnan(req).any():
        raise ValueError("NaN SLO requirement")
    return req
