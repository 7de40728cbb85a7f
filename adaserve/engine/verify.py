"""Verification: walk a request's token tree against the target's logits (docs/architecture.md §7).

At the current node draw y from the target (argmax when greedy); if y is a child's token, accept that
child and continue from it; otherwise y is the bonus token and the walk stops. Every emitted token is
thus a draw from the target's own distribution at its context, whatever the tree holds: the tree
(built deterministically by beam search) only decides how many draws one forward can confirm. This
is lossless for greedy and sampling alike.

An emitted stop token (EOS or a stop id) ends the request at once: no bonus after it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from adaserve.engine.sampling import SamplingParams, draw, processed_probs
from adaserve.engine.tree import TokenTree


@dataclass(frozen=True)
class WalkResult:
    tokens: list[int]  # emitted tokens: accepted draft tokens, then (unless stopped) the bonus
    accepted_nodes: list[int]  # tree indices of accepted nodes, root first: [0, a_1, ..., a_k]

    @property
    def num_accepted(self) -> int:
        """Draft tokens confirmed by the target (the bonus is not counted)."""
        return len(self.accepted_nodes) - 1


def walk_tree(tree: TokenTree, logits: torch.Tensor, params: SamplingParams, *, generator: torch.Generator,
              stop_ids: frozenset[int], budget: int) -> WalkResult:
    """logits [M, V]: the target's logits at every tree node. ``budget``: tokens still allowed."""
    children = tree.children()
    greedy_choice = logits.argmax(-1).tolist() if params.greedy else None
    tokens: list[int] = []
    path = [0]
    node = 0
    while len(tokens) < budget:
        if greedy_choice is not None:
            y = greedy_choice[node]
        else:
            y = draw(processed_probs(logits[node : node + 1], params)[0], generator)
        tokens.append(y)
        if y in stop_ids:
            break  # a stop token ends the walk (the engine's finish check sees it)
        nxt = next((c for c in children[node] if tree.tokens[c] == y), None)
        if nxt is None:
            break  # y is the bonus token
        path.append(nxt)
        node = nxt
    return WalkResult(tokens, path)


def commit_moves(accepted_nodes: list[int], prefix_len: int) -> tuple[list[int], list[int]]:
    """KV compaction for an accepted path: copy token index ``L + a_j`` to ``L + j`` (ascending j).

    Since a_j >= j and a_j increases with j, no source is overwritten before it is read.
    """
    src = [prefix_len + a for a in accepted_nodes]
    dst = [prefix_len + j for j in range(len(accepted_nodes))]
    return src, dst
