"""A beam level's device ops (docs/architecture.md §4, issue 30): the picks of one level for every request at
once (``expand_on_device``: log-softmax, top-k and the path sums on the device, or one call of the CPU kernels'
``beam_picks``) and the trees' ancestor rows (``ancestor_rows``, grown level by level by ``grow_ancestors``).
Pure steps: ``speculate.beam_search`` runs them in its loop, and ``draft_steps`` inside its captured steps.

May import: numpy, torch, the model room, speculation.verify.
"""

from __future__ import annotations

import functools

import numpy as np
import torch

from adaserve.engine.model import native_kernels
from adaserve.engine.model.native_kernels import NativeKernels
from adaserve.engine.model.runner import joined_rows
from adaserve.engine.speculation.verify import first_argmax, top_k_indices

# a draft logit the grammar does not allow: finite, so a row's log-softmax and the path sums stay finite (a beam
# that must take a refused token, with fewer allowed than its width, gets a path probability of exp(-1e30) = 0)
REFUSED_LOGIT = -1e30
# a 1-wide level's picks take first_argmax's blocked reduction from this many logits (8 rows of a 4096-token
# vocabulary): measured in the engine on a CPU, below it the plain max(-1) costs no more
CHAIN_ARGMAX_BLOCKED_MIN = 1 << 15


def ancestor_rows(n: int, size: int, device: torch.device, *, first_level: int = 0) -> torch.Tensor:
    """[n, size, size] bool ancestor rows of ``n`` trees of ``size`` nodes, before any level past the first is filled
    in: each node its own ancestor (the diagonal), and the ``first_level`` nodes after the root (level 1, whose
    parent is always the root) the root too, as ``grow_ancestors(rows, 1, zeros)`` would make them (issue 30: the
    picks need not be read for them). ``grow_ancestors`` fills the other levels, in place."""
    return initial_rows(n, size, first_level, torch.device(device)).clone()  # one op: the shape's rows recur


@functools.lru_cache(maxsize=64)
def initial_rows(n: int, size: int, first_level: int, device: torch.device) -> torch.Tensor:
    """``ancestor_rows``' content, made once per shape and device (never written: callers get a clone), from the host
    rows (``_initial_host_rows``: one definition of the layout)."""
    return torch.from_numpy(_initial_host_rows(n, size, first_level).copy()).to(device)


def host_ancestor_rows(n: int, size: int, *, first_level: int = 0) -> np.ndarray:
    """``ancestor_rows`` in host memory, as numpy makes them (the CPU kernels' picks grow them there): a copy of one
    array per shape."""
    return _initial_host_rows(n, size, first_level).copy()


@functools.lru_cache(maxsize=64)
def _initial_host_rows(n: int, size: int, first_level: int) -> np.ndarray:
    """The rows as a search begins (``ancestor_rows``' docstring), read-only: the diagonal, and level 1's root bit."""
    rows = np.zeros((n, size, size), bool)
    rows[:, np.arange(size), np.arange(size)] = True
    rows[:, 1 : 1 + first_level, 0] = True
    rows.flags.writeable = False  # callers get a copy
    return rows


def grow_ancestors(anc: torch.Tensor, start: int, parent: torch.Tensor) -> None:
    """Rows ``start`` .. ``start + k`` of the [n, S, S] ancestor rows, for a new level's parents [n, k] (tree indices
    below ``start``), filled in place: a new node's row is its parent's row or'ed into its own, which holds only its
    diagonal bit (``ancestor_rows``). On the device: no parent is read on the host, and two ops a level (issue 30:
    growing a new [n, m + k, m + k] tensor took five)."""
    n, size, _ = anc.shape
    k = parent.shape[1]
    anc[:, start : start + k].logical_or_(torch.gather(anc, 1, parent[:, :, None].expand(n, k, size)))


def expand_on_device(logits: list[torch.Tensor] | torch.Tensor, base: np.ndarray | torch.Tensor, *, width: int,
                      per_node: int | None = None, allowed: torch.Tensor | None = None, frontier: int = 0,
                      kernels: NativeKernels | None
                      ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, tuple[torch.Tensor, torch.Tensor] | None]:
    """``expand_level`` left on the device: tokens, parent (``frontier`` + its frontier index: its tree index when
    ``frontier`` is the frontier's first node), log path probabilities (each [n, k]) and the least and the greatest
    logit (0-d tensors), both finite iff every logit is (None: the CPU kernels' picks found every logit finite).
    ``allowed`` [n, F, V]: the tokens a grammar allows at each frontier node; the others get REFUSED_LOGIT.
    ``kernels``: the CPU kernels to pick with on a CPU (``native_kernels.chosen()``, looked up once a search by the
    caller), None for the torch ops."""
    n, f = base.shape
    if isinstance(logits, list) and (any(lg.shape[0] != f for lg in logits) or len(logits) != n):
        raise ValueError(f"expected {n} requests' logits of {f} rows each (one per frontier node)")
    # every request's frontier has F rows: one batched level (a view of the forward's logits, not a copy)
    joined = joined_rows(logits) if isinstance(logits, list) else logits
    if joined.shape[0] != n * f:
        raise ValueError(f"expected {n} requests' logits of {f} rows each (one per frontier node)")
    v = joined.shape[-1]
    k_node = min(per_node if per_node is not None else width, v)
    if allowed is None:
        native = native_level(joined, base, k_node=k_node, width=None if per_node is not None else width,
                               frontier=frontier, kernels=kernels)
        if native is not None:
            return native
    x = joined.float().view(n, f, v)
    # the least and the greatest logit: both finite iff every logit is (NaN propagates); one pass, no float64
    # sum over [n, F, V] (several times dearer on a CPU)
    lo, hi = torch.aminmax(x)
    if allowed is not None:
        x = x.masked_fill(~allowed, REFUSED_LOGIT)
    if k_node == 1:
        # one child per node (chains, SpecInfer's 1-wide levels): its first maximum, as greedy decoding picks it.
        # On a CPU topk(1) is a scalar pass over the row (~1.2 ms per draft level at 32 chains of a 4096-token
        # vocabulary, issue 30); first_argmax's blocked reduction is vectorised. A tie at the top goes to the
        # lowest token id (topk left its order unspecified); the value is the same maximum either way
        picks = first_argmax(x.view(n * f, v), blocked_min=CHAIN_ARGMAX_BLOCKED_MIN).view(n, f, 1)
    else:  # blocked on a CPU, where torch.topk is a scalar pass over each row (issue 30)
        picks = top_k_indices(x, k_node)
    # [n, F, k]: the picks' log-probabilities (one log_softmax pass costs half a logsumexp's on a CPU, issue 30)
    values = torch.log_softmax(x, dim=-1).gather(-1, picks)
    if isinstance(base, np.ndarray):
        base = torch.from_numpy(np.ascontiguousarray(base, np.float64)).to(values.device, non_blocking=True)
    elif base.dtype != torch.float64:
        base = base.to(torch.float64)
    # the sums in float64: the float32 picks are promoted exactly, as ``.double()`` would (one op fewer)
    score = base[:, :, None] + values
    # candidate j of a request's [F * k] grid: frontier node j // k, token picks[.., j] (issue 30:
    # no flat [F, V] index to build and take apart)
    tok = picks.view(n, f * k_node)
    if f * k_node == 1:  # one candidate per request (a chain's level): it is the level, nothing to rank
        return tok, torch.full((n, 1), frontier, dtype=torch.int64, device=tok.device), score.view(n, 1), (lo, hi)
    if per_node is None:
        top = torch.topk(score.view(n, f * k_node), min(width, f * k_node), dim=-1)
        values, tok = top.values, tok.gather(1, top.indices)
        parent = top.indices // k_node if k_node > 1 else top.indices
        if frontier:
            parent = parent + frontier
    else:
        values = score.view(n, -1)
        # frontier + j // k for every candidate j, exactly: (frontier * k + j) // k
        parent = (torch.arange(frontier * k_node, (frontier + f) * k_node, device=values.device) // k_node
                  ).expand(n, -1)
    return tok, parent, values, (lo, hi)


# a level the kernel found not finite, as ``_to_host`` reads its check: both bounds NaN
_NOT_FINITE = torch.full((), float("nan"))


def kernel_takes(k: int, f: int) -> bool:
    """Whether ``beam_picks`` takes a level of ``k`` picks per node from ``f`` frontier nodes (its limits)."""
    return k <= native_kernels.PICKS_MAX_K and f * k <= native_kernels.PICKS_MAX_CANDIDATES


def native_level(logits: torch.Tensor, base: np.ndarray | torch.Tensor, *, k_node: int, width: int | None,
                  frontier: int, kernels: NativeKernels | None
                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, tuple[torch.Tensor, torch.Tensor] | None] | None:
    """``expand_on_device``'s level in one call of the CPU kernels' ``beam_picks`` (native/picks.c), where they
    load and are not ``off`` (``kernels``, native_kernels.chosen's): on a CPU the dozen torch ops of a level cost
    more than the level's arithmetic (issue 30). None where the torch ops run instead: another device, no kernels, a
    k past the kernel's limits. The picks are the same tokens as the torch ops' (ties to the lower id); a
    value may differ in its last float32 bits (another exponential, another summation order)."""
    if logits.device.type != "cpu":
        return None
    n, f = base.shape
    if kernels is None or not kernel_takes(k_node, f):
        return None
    x = logits if logits.dtype == torch.float32 else logits.float()  # no call for the float32 rows a CPU computes
    if not x.is_contiguous():
        x = x.contiguous()
    if isinstance(base, np.ndarray):
        base = torch.from_numpy(np.ascontiguousarray(base, np.float64))
    elif base.dtype != torch.float64 or not base.is_contiguous():
        base = base.to(torch.float64).contiguous()
    out = kernels.beam_picks(x, base, k=k_node, width=width, frontier=frontier)
    if out is None:  # a logit that is not finite: ``_to_host`` refuses the tree once the search is done
        kept = f * k_node if width is None else min(width, f * k_node)
        zeros = torch.zeros((n, kept), dtype=torch.int64)
        return zeros, zeros + frontier, torch.zeros((n, kept), dtype=torch.float64), (_NOT_FINITE, _NOT_FINITE)
    tok, parent, value = out
    return tok, parent, value, None  # every logit finite: checked as they were picked
