"""Speculation: batched beam search on the draft model across all requests (docs/architecture.md §4).

Step 1 feeds every request's tokens the draft has not seen yet (accepted tokens of the last
iteration, ending with the root) and keeps the root's top-w children. Steps 2..d feed the w newest
beams of every request; each beam attends to its request's context and its own ancestors (tree
mask), and the top-w of the w*V extensions by cumulative log-probability form the next level.
Beam nodes' draft KV is scratch, dropped when speculation ends.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from adaserve.engine.batch import Segment
from adaserve.engine.kv_cache import SequenceKV
from adaserve.engine.runner import ModelRunner
from adaserve.engine.tree import TokenTree


@dataclass
class DraftInput:
    seq: SequenceKV  # the request's draft KV; ``seq.length`` tokens committed
    pending: list[int]  # tokens not yet in the draft KV; the last one is the root


def beam_search(draft: ModelRunner, inputs: list[DraftInput], *, depth: int, width: int,
                expansion: tuple[int, ...] | None = None) -> list[TokenTree]:
    """Candidate trees (root + ``depth`` levels of ``width`` nodes) with draft path log-probs.

    With ``expansion`` (SpecInfer's static trees) every node at depth i instead keeps its own top
    ``expansion[i]`` children, and ``depth = len(expansion)``.
    """
    if expansion is not None:
        depth = len(expansion)
        if min(expansion, default=0) < 1:
            raise ValueError("every static expansion factor must be >= 1")
    if depth < 1 or width < 1:
        raise ValueError("beam search needs depth >= 1 and width >= 1")
    segs = [Segment(x.seq, x.seq.length, TokenTree.chain(x.pending)) for x in inputs]
    last = draft.forward(segs, all_logits=[False] * len(segs))
    for x in inputs:  # the pending tokens are real: they stay in the draft KV
        draft.cache.truncate(x.seq, x.seq.length + len(x.pending))

    # per request: tokens, parents, log-probs of the tree so far; node 0 is the root
    toks = [[x.pending[-1]] for x in inputs]
    pars = [[-1] for _ in inputs]
    lps = [[0.0] for _ in inputs]
    frontier = [[0] for _ in inputs]
    logits = last
    for step in range(depth):
        for r, lg in enumerate(logits):
            logp = torch.log_softmax(lg.float(), dim=-1)  # [len(frontier), V]
            if not torch.isfinite(logp).all():
                raise FloatingPointError("draft produced non-finite log-probs: refusing to build a tree")
            base = torch.tensor([lps[r][f] for f in frontier[r]], dtype=torch.float64, device=logp.device)
            score = base[:, None] + logp.double()  # [F, V] cumulative log path probability
            v = score.shape[1]
            if expansion is None:  # beam: the top-w extensions over all frontier nodes
                top = torch.topk(score.flatten(), min(width, score.numel()))
                picks = [(val, i // v, i % v) for val, i in zip(top.values.tolist(), top.indices.tolist(),
                                                                strict=True)]
            else:  # static: each frontier node keeps its own top-k children
                top = torch.topk(score, min(expansion[step], v), dim=-1)
                picks = [(val, f, tok) for f in range(score.shape[0])
                         for val, tok in zip(top.values[f].tolist(), top.indices[f].tolist(), strict=True)]
            new_nodes = []
            for val, f, tok in picks:
                toks[r].append(tok)
                pars[r].append(frontier[r][f])
                lps[r].append(val)
                new_nodes.append(len(toks[r]) - 1)
            frontier[r] = new_nodes
        if step == depth - 1:
            break
        segs = []
        for r, x in enumerate(inputs):
            tree = TokenTree.from_lists(toks[r], pars[r], lps[r])
            # root sits at the last committed slot; earlier beams are cached, the frontier is new
            segs.append(Segment(x.seq, x.seq.length - 1, tree, num_cached=tree.size - len(frontier[r])))
        logits = draft.forward(segs, all_logits=[True] * len(segs))

    for x in inputs:  # drop the scratch beams
        draft.cache.truncate(x.seq, x.seq.length)
    return [
        TokenTree(np.asarray(t, np.int64), np.asarray(p, np.int64), np.asarray(lp)).with_strict_decrease()
        for t, p, lp in zip(toks, pars, lps, strict=True)
    ]
