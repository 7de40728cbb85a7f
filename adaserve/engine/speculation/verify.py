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

from adaserve.engine.model import native_kernels
from adaserve.engine.model.runner import joined_rows
from adaserve.engine.model.tree import TokenTree
from adaserve.engine.speculation.sampling import SamplingParams, draw_rows, processed_probs


@dataclass(frozen=True)
class WalkResult:
    tokens: list[int]  # emitted tokens: accepted draft tokens, then (unless stopped) the bonus
    accepted_nodes: list[int]  # tree indices of accepted nodes, root first: [0, a_1, ..., a_k]

    @property
    def num_accepted(self) -> int:
        """Draft tokens confirmed by the target (the bonus is not counted)."""
        return len(self.accepted_nodes) - 1


@dataclass(frozen=True)
class WalkInput:
    """One request's verification: its tree, the target's logits at every node, and how to draw."""

    tree: TokenTree
    logits: torch.Tensor  # [M, V]
    params: SamplingParams
    generator: torch.Generator
    stop_ids: frozenset[int]
    budget: int  # tokens still allowed
    # [M, 1] int64: each row's first maximum, where the forward already found it for exactly these logits (the int8
    # head's refinement: ModelRunner.last_argmax); None: a greedy draw scans the row (``first_argmax``)
    argmax: torch.Tensor | None = None


Draws = tuple[list[list[int]], list[torch.Tensor | None]]  # draw_at_nodes: tokens per node, generator states


def walk_trees(inputs: list[WalkInput], draws: Draws | None = None) -> list[WalkResult]:
    """Every request's walk; the draws are batched, the walks are host work over them.

    The token the walk would draw at node v is computed for every node up front (``draw_at_nodes``):
    greedy requests by argmax (per request, with no sync between them) and one copy to the host, sampled
    requests in one call per sampling setting. The walk visits at most one node per depth and emits one
    token per node visited, so the draw at a node of depth d uses the request's d-th uniform, exactly as
    sequential decoding draws it.

    ``draws``: ``draw_at_nodes(inputs)`` already taken (the engine times the target forward up to it:
    on a GPU its copy to the host is what waits for the forward).
    """
    drawn, uniforms_before = draws if draws is not None else draw_at_nodes(inputs)
    out = []
    for x, y, state in zip(inputs, drawn, uniforms_before, strict=True):
        res = walk(x.tree, y, stop_ids=x.stop_ids, budget=x.budget)
        if state is not None:  # consume exactly one uniform per emitted token, as plain decoding does
            x.generator.set_state(state)
            torch.rand(len(res.tokens), generator=x.generator, dtype=torch.float64)
        out.append(res)
    return out


def walk_tree(tree: TokenTree, logits: torch.Tensor, params: SamplingParams, *, generator: torch.Generator,
              stop_ids: frozenset[int], budget: int) -> WalkResult:
    """logits [M, V]: the target's logits at every tree node. ``budget``: tokens still allowed."""
    return walk_trees([WalkInput(tree, logits, params, generator, stop_ids, budget)])[0]


def walk(tree: TokenTree, drawn: list[int], *, stop_ids: frozenset[int], budget: int) -> WalkResult:
    """The walk from the root, given the token drawn at every node (pure host work)."""
    tokens: list[int] = []
    path = [0]
    if tree.size == 1:  # plain decoding's root: one draw, no child to match
        if budget > 0:
            tokens.append(drawn[0])
        return WalkResult(tokens, path)
    if tree.is_chain:  # node i's only child is i + 1: no child table to build (issue 30: 32 chains an iteration)
        toks = tree.tokens.tolist()
        node = 0
        while len(tokens) < budget:
            y = drawn[node]
            tokens.append(y)
            if y in stop_ids or node + 1 >= len(toks) or toks[node + 1] != y:
                break  # a stop token, or y is the bonus token
            node += 1
            path.append(node)
        return WalkResult(tokens, path)
    # (parent, token) -> its first child with that token, from host lists (issue 30: no per-node numpy reads)
    child: dict[tuple[int, int], int] = {}
    for i, key in enumerate(zip(tree.parents.tolist()[1:], tree.tokens.tolist()[1:], strict=True), 1):
        child.setdefault(key, i)
    node = 0
    while len(tokens) < budget:
        y = drawn[node]
        tokens.append(y)
        if y in stop_ids:
            break  # a stop token ends the walk (the engine's finish check sees it)
        nxt = child.get((node, y))
        if nxt is None:
            break  # y is the bonus token
        path.append(nxt)
        node = nxt
    return WalkResult(tokens, path)


def draw_at_nodes(inputs: list[WalkInput]) -> Draws:
    """Per request, the token drawn at each node, and (sampled requests) its generator state before.

    Greedy: argmax. Sampled: node v of depth d takes the request's uniform u_d (drawn here, d = 0 ..
    max depth; ``walk_trees`` rewinds the generator and consumes only the ones the walk used) and
    returns the inverse-CDF draw of u_d from the processed distribution at v (``sampling.draw_rows``).
    Every draw is queued on the device without a sync, and all of them reach the host in one copy.
    """
    states: list[torch.Tensor | None] = [None] * len(inputs)
    order: list[int] = []  # requests in the order their draws are concatenated
    parts: list[torch.Tensor] = []
    greedy = [i for i, x in enumerate(inputs) if x.params.greedy]
    if greedy:
        known = [inputs[i].argmax for i in greedy]
        if all(a is not None for a in known):  # the head's own draws (no second pass over the vocabulary)
            parts.append(joined_rows(known).view(-1))  # type: ignore[arg-type]
        else:  # one argmax over every greedy request's rows (no copy of the logits)
            parts.append(first_argmax(joined_rows([inputs[i].logits for i in greedy])))
        order += greedy
    by_setting: dict[tuple[float, int, float], list[int]] = {}
    for i, x in enumerate(inputs):
        if not x.params.greedy:
            by_setting.setdefault((x.params.temperature, x.params.top_k, x.params.top_p), []).append(i)
    for members in by_setting.values():
        us = []
        for i in members:
            x = inputs[i]
            depth = x.tree.depths()
            states[i] = x.generator.get_state()
            u = torch.rand(int(depth.max()) + 1, generator=x.generator, dtype=torch.float64)
            us.append(u[torch.tensor(depth)])  # the uniform each node would use
        probs = processed_probs(joined_rows([inputs[i].logits for i in members]), inputs[members[0]].params)
        parts.append(draw_rows(probs, torch.cat(us).to(probs.device, non_blocking=True)))
        order += members
    # the one copy back (one part, the greedy requests' or one setting's: no cat)
    ys = (parts[0] if len(parts) == 1 else torch.cat(parts)).tolist() if parts else []
    drawn: list[list[int]] = [[] for _ in inputs]
    at = 0
    for i in order:
        m = inputs[i].tree.size
        drawn[i], at = ys[at : at + m], at + m
    return drawn, states


# ``first_argmax`` on a CPU: rows are cut into blocks of ARGMAX_BLOCK logits once there are at least
# ARGMAX_BLOCKED_MIN logits. Below that its ten ops cost what they save: right after the target's forward each
# op runs cold, and in the engine 32 rows of 4096 took ~0.35 ms either way (0.11 ms against 0.34 when warm)
ARGMAX_BLOCK = 64
ARGMAX_BLOCKED_MIN = 1 << 18


def first_argmax(rows: torch.Tensor, *, blocked_min: int | None = None) -> torch.Tensor:
    """[n, V] -> [n] int64: each row's ``argmax``, its first maximum (a NaN counting as the maximum), bit for bit.

    On a CPU, float32 rows go to the integer kernels' ``first_argmax`` (native/picks.c: a vectorised max, then
    the first index that holds it; comparisons only) where they load and are not ``off``. Otherwise, and on
    another device: on a CPU ``max(-1).indices`` is argmax's index at ~0.6 of its cost, and both track the index
    in a scalar loop (~4 ns a logit on an AVX2 core: 0.7 ms for a 160-node verification of a 4096-token
    vocabulary, issue 30).
    Many rows take two steps instead, the long one vectorised: with the rows cut into blocks of ARGMAX_BLOCK,

        j  = the first block whose ``amax`` is the greatest      (amax propagates NaN: the first block with one)
        i  = the first maximum within block j                    (max(-1) over ARGMAX_BLOCK logits)

    and j * ARGMAX_BLOCK + i is the row's first maximum: no block before j holds a value equal to it (nor a NaN).
    ``blocked_min``: the fewest logits that take the two steps (a caller whose rows are not cold may go lower;
    default ARGMAX_BLOCKED_MIN, read at each call).
    """
    if rows.device.type != "cpu":
        return rows.argmax(-1)
    # the integer kernels' scan, where they load: one call, a third of the blocked steps' time at 32 requests
    kernels = native_kernels.chosen() if rows.dtype == torch.float32 and rows.is_contiguous() else None
    if kernels is not None:
        return kernels.first_argmax(rows)
    n, v = rows.shape
    least = ARGMAX_BLOCKED_MIN if blocked_min is None else blocked_min
    if rows.numel() < least or v % ARGMAX_BLOCK or not rows.is_contiguous():
        return rows.max(-1).indices
    blocks = rows.view(n, v // ARGMAX_BLOCK, ARGMAX_BLOCK)
    j = blocks.amax(-1).max(-1).indices
    inner = blocks.gather(1, j.view(n, 1, 1).expand(n, 1, ARGMAX_BLOCK)).view(n, ARGMAX_BLOCK).max(-1).indices
    return j * ARGMAX_BLOCK + inner


# ``top_k_indices`` on a CPU takes its blocked path from this many logits: below it (a lone request's two rows of
# a 4096-token vocabulary) its nine ops cost more than torch.topk's one scalar pass
TOPK_BLOCKED_MIN = 1 << 15


def top_k_indices(rows: torch.Tensor, k: int, *, blocked_min: int | None = None) -> torch.Tensor:
    """[..., V] -> [..., k] int64: the indices of each row's ``k`` greatest logits, greatest first, as
    ``torch.topk(rows, k).indices`` gives them (the same values; which of several equal logits is taken at the
    k-th place is unspecified in both).

    On a CPU ``torch.topk`` walks each row in a scalar loop (3.9 ms for the 64 frontier rows of a 49,152-token
    vocabulary at 32 requests, issue 30). Many rows take a vectorised pass instead, with the rows cut into
    blocks of ARGMAX_BLOCK logits:

        J = the k blocks with the greatest ``amax``
        top k of the row = top k of the k * ARGMAX_BLOCK logits of J

    exact because every one of the row's top k lies in a block whose maximum is at least its value: a block
    outside J has k blocks of J at least as great, so anything it holds is matched by as great a logit in J.
    A NaN propagates through ``amax`` and counts as the greatest in ``topk``, as in ``torch.topk``.
    ``blocked_min``: the fewest logits that take the blocked pass (default TOPK_BLOCKED_MIN, read at each call).
    """
    *lead, v = rows.shape
    least = TOPK_BLOCKED_MIN if blocked_min is None else blocked_min
    if (rows.device.type != "cpu" or rows.numel() < least or v % ARGMAX_BLOCK or k > v // ARGMAX_BLOCK
            or not rows.is_contiguous()):
        return torch.topk(rows, k, dim=-1).indices
    blocks = rows.view(-1, v // ARGMAX_BLOCK, ARGMAX_BLOCK)
    n = blocks.shape[0]
    best = blocks.amax(-1).topk(k, dim=-1).indices  # [n, k] block numbers
    inner = blocks.gather(1, best[:, :, None].expand(n, k, ARGMAX_BLOCK)).view(n, k * ARGMAX_BLOCK).topk(k, dim=-1)
    # candidate c of a row is logit c % ARGMAX_BLOCK of its block best[c // ARGMAX_BLOCK]
    at = inner.indices
    return (best.gather(1, at // ARGMAX_BLOCK) * ARGMAX_BLOCK + at % ARGMAX_BLOCK).view(*lead, k)


def commit_moves(accepted_nodes: list[int], prefix_len: int) -> tuple[list[int], list[int]]:
    """KV compaction for an accepted path: copy token index ``L + a_j`` to ``L + j`` (ascending j).

    Since a_j >= j and a_j increases with j, no source is overwritten before it is read.
    """
    src = [prefix_len + a for a in accepted_nodes]
    dst = [prefix_len + j for j in range(len(accepted_nodes))]
    return src, dst
