"""Speculation: batched beam search on the draft model across all requests (docs/architecture.md §4).

Step 1 feeds every request's tokens the draft has not seen yet (accepted tokens of the last
iteration, ending with the root) and keeps the root's top-w children. Steps 2..d feed the w newest
beams of every request; each beam attends to its request's context and its own ancestors (tree
mask), and the top-w of the w*V extensions by cumulative log-probability form the next level.
Beam nodes' draft KV is scratch, dropped when speculation ends.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from adaserve.engine.model.batch import Segment
from adaserve.engine.model.kv_cache import SequenceKV
from adaserve.engine.model.runner import ForwardRecord, ModelRunner
from adaserve.engine.model.tree import TokenTree


@dataclass
class DraftInput:
    seq: SequenceKV  # the request's draft KV; ``seq.length`` tokens committed
    pending: list[int]  # tokens not yet in the draft KV; the last one is the root


def beam_search(draft: ModelRunner, inputs: list[DraftInput], *, depth: int, width: int,
                expansion: tuple[int, ...] | None = None,
                on_forward: Callable[[ForwardRecord], None] | None = None) -> list[TokenTree]:
    """Candidate trees (root + ``depth`` levels of ``width`` nodes) with draft path log-probs.

    With ``expansion`` (SpecInfer's static trees) every node at depth i instead keeps its own top
    ``expansion[i]`` children, and ``depth = len(expansion)``.

    Every request's tree has the same number of nodes at every level (``width``, or the product of the
    expansions), so a level is one batched step over all requests: one log-softmax and one top-k over
    ``[n, F * V]`` (``[n, F, V]`` for static trees) and one copy of the picks to the host.

    ``on_forward`` is called after each draft forward with what it computed (its ``ForwardRecord``): the
    first carries every request's catch-up tokens, the others ``n * width`` beam nodes, so a caller that
    reads its clock there times each forward with its own token and context counts (timing.ForwardSplitter).
    It is called once the level's picks have reached the host: on a GPU the forward is queued, not done,
    when ``forward`` returns, and the copy of the picks is what waits for it.
    """
    if expansion is not None:
        depth = len(expansion)
        if min(expansion, default=0) < 1:
            raise ValueError("every static expansion factor must be >= 1")
    if depth < 1 or width < 1:
        raise ValueError("beam search needs depth >= 1 and width >= 1")
    segs = [Segment(x.seq, x.seq.length, TokenTree.chain(x.pending)) for x in inputs]
    logits = draft.forward(segs, all_logits=[False] * len(segs))
    for x in inputs:  # the pending tokens are real: they stay in the draft KV
        draft.cache.truncate(x.seq, x.seq.length + len(x.pending))

    # [n, M] per request: tokens, parents, log path probabilities of the tree so far; node 0 is the root
    n = len(inputs)
    toks = np.asarray([[x.pending[-1]] for x in inputs], np.int64)
    pars = np.full((n, 1), -1, np.int64)
    lps = np.zeros((n, 1))
    # the frontier's log path probabilities stay on the device from one level to the next: no copy back
    base = torch.zeros((n, 1), dtype=torch.float64, device=logits[0].device)
    for step in range(depth):
        m = toks.shape[1]
        frontier = m - len(logits[0])  # the frontier is the last F nodes of every tree
        k = None if expansion is None else expansion[step]
        tok, parent, value, base = _expand(logits, base, width=width, per_node=k)
        _seen(draft, on_forward)  # the forward that made ``logits`` is done: its picks are on the host
        toks = np.concatenate([toks, tok], axis=1)
        pars = np.concatenate([pars, frontier + parent], axis=1)
        lps = np.concatenate([lps, value], axis=1)
        if step == depth - 1:
            break
        # root sits at the last committed slot; earlier beams are cached, the new level is new
        segs = [Segment(x.seq, x.seq.length - 1, TokenTree(toks[r], pars[r], lps[r]), num_cached=m)
                for r, x in enumerate(inputs)]
        logits = draft.forward(segs, all_logits=[True] * n)

    for x in inputs:  # drop the scratch beams
        draft.cache.truncate(x.seq, x.seq.length)
    return [TokenTree(toks[r], pars[r], lps[r]).with_strict_decrease() for r in range(n)]


def _seen(draft: ModelRunner, on_forward: Callable[[ForwardRecord], None] | None) -> None:
    if on_forward is not None and draft.last_forward is not None:
        on_forward(draft.last_forward)


def expand_level(logits: list[torch.Tensor], base: np.ndarray | torch.Tensor, *, width: int,
                 per_node: int | None = None) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """One beam level for every request at once.

    logits: per request [F, V], the draft's logits at its F frontier nodes; base [n, F]: their log path
    probabilities. score(f, v) = base[f] + log softmax(logits[f])[v], in float64.

    Beam: the top ``width`` of the F * V extensions. Only a node's own top-``width`` children can be among
    them (base[f] is one constant per node), and log softmax keeps a row's order, so each row's top-k of
    the raw logits, less the row's logsumexp, gives every candidate: the [n, F * V] scores are never built.
    Static (``per_node``): each frontier node's own top ``per_node``, node-major.
    The reductions run once over ``[n, F, V]``; the picks reach the host in one copy.
    Returns (tokens, frontier index of the parent, log path probability), each [n, k].
    """
    tok, parent, value, _ = _expand(logits, base, width=width, per_node=per_node)
    return tok, parent, value


def _expand(logits: list[torch.Tensor], base: np.ndarray | torch.Tensor, *, width: int,
            per_node: int | None = None) -> tuple[np.ndarray, np.ndarray, np.ndarray, torch.Tensor]:
    """``expand_level``, and the level's log path probabilities left on the device (the next level's base)."""
    n, f = base.shape
    if any(lg.shape[0] != f for lg in logits) or len(logits) != n:
        raise ValueError(f"expected {n} requests' logits of {f} rows each (one per frontier node)")
    v = logits[0].shape[-1]
    k_node = min(per_node if per_node is not None else width, v)
    x = torch.cat(logits).float().view(n, f, v)  # every request's frontier has F rows: one batched level
    top_f = torch.topk(x, k_node, dim=-1)
    values = top_f.values.double() - torch.logsumexp(x, dim=-1).double()[:, :, None]  # [n, F, k]
    if isinstance(base, np.ndarray):
        base = torch.from_numpy(np.ascontiguousarray(base, np.float64)).to(values.device, non_blocking=True)
    score = base.to(torch.float64)[:, :, None] + values
    # flat index of a candidate in its request's [F, V] grid: f * V + token
    flat = top_f.indices + v * torch.arange(f, device=values.device)[None, :, None]
    if per_node is None:
        top = torch.topk(score.view(n, f * k_node), min(width, f * k_node), dim=-1)
        values, flat = top.values, flat.view(n, -1).gather(1, top.indices)
    else:
        values, flat = score.view(n, -1), flat.view(n, -1)
    lo, hi = torch.aminmax(x)  # both finite iff every logit is (NaN propagates)
    check = (lo.double() + hi.double()).reshape(1)
    host = torch.cat([values.flatten(), flat.flatten().double(), check]).cpu().numpy()
    if not np.isfinite(host[-1]):
        raise FloatingPointError("draft produced non-finite log-probs: refusing to build a tree")
    k = values.shape[1]
    picked = host[n * k : 2 * n * k].astype(np.int64).reshape(n, k)  # exact: indices < 2**53
    return picked % v, picked // v, host[: n * k].reshape(n, k), values
