"""Logits processors: ``logit_bias``, ``min_tokens`` and the repetition, frequency and presence penalties.

They change the target's distribution, so speculative decoding stays lossless only if verification draws, at
every tree node, from the logits plain decoding would have drawn from at that node's context. The output so far
at node v is the request's output before the tree plus the tokens on the path from the root to v (the root
itself is the last token already emitted, or the prompt's last). ``process_tree_logits`` applies every processor
to each node's row with that node's own output so far; the engine applies it to the verification logits of
every walk, plain decoding (a tree of one root) included, so the two see the same rows.

Order and formulas are vLLM's (its V1 sampler): logit bias and min_tokens first, then the penalties, in float32,
before temperature, top-k and top-p (sampling.processed_probs):

- ``logit_bias``: the bias is added to the token's logit.
- ``min_tokens``: while fewer than ``min_tokens`` tokens are out, the stop tokens (end-of-sequence unless
  ``ignore_eos``, and ``stop_token_ids``) get -inf.
- ``repetition_penalty`` r, on every token seen in the prompt or the output: a positive logit is divided by r,
  any other multiplied by r.
- ``frequency_penalty`` f and ``presence_penalty`` p, on the output only: the logit loses f times the token's
  count and p once if it occurred at all.

The draft is not processed: its proposals only decide how many draws one forward confirms, never what is drawn.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from adaserve.engine.model.tree import TokenTree
from adaserve.engine.speculation.sampling import SamplingParams


def path_tokens(tree: TokenTree) -> list[list[int]]:
    """Per node, the tokens on its path from the root, the root excluded (node 0's path is empty)."""
    paths: list[list[int]] = [[]]
    tokens, parents = tree.tokens.tolist(), tree.parents.tolist()
    for v in range(1, tree.size):
        paths.append([*paths[parents[v]], tokens[v]])
    return paths


def process_tree_logits(logits: torch.Tensor, tree: TokenTree, params: SamplingParams, *, prompt_ids: Sequence[int],
                        output_ids: Sequence[int], emitted: int, stop_ids: frozenset[int]) -> torch.Tensor:
    """logits [M, V] at the nodes of ``tree`` -> the processed logits (float32), or ``logits`` itself when the
    request has no processor.

    ``output_ids``: the output before the tree, the penalties' history (a continuation's earlier tokens
    included); ``emitted``: how many tokens count towards ``min_tokens`` before the tree (this request's own);
    ``prompt_ids``: the prompt, which only the repetition penalty reads; ``stop_ids``: what ``min_tokens``
    holds back.
    """
    if not params.processes_logits:
        return logits
    m, vocab = logits.shape
    x = logits.to(torch.float32, copy=True)
    dev = x.device
    if params.logit_bias:
        ids = torch.tensor([t for t, _ in params.logit_bias], dtype=torch.int64, device=dev)
        bias = torch.tensor([b for _, b in params.logit_bias], dtype=torch.float32, device=dev)
        x.index_add_(1, ids, bias.expand(m, -1))
    stops = sorted(t for t in stop_ids if 0 <= t < vocab)
    if params.min_tokens and stops:
        short = [v for v, d in enumerate(tree.depths().tolist()) if emitted + d < params.min_tokens]
        if short:
            rows = torch.tensor(short, dtype=torch.int64, device=dev)
            cols = torch.tensor(stops, dtype=torch.int64, device=dev)
            x[rows[:, None], cols[None, :]] = float("-inf")
    if params.presence_penalty or params.frequency_penalty or params.repetition_penalty != 1.0:
        x = _penalize(x, tree, params, prompt_ids=prompt_ids, output_ids=output_ids)
    return x


def _penalize(x: torch.Tensor, tree: TokenTree, params: SamplingParams, *, prompt_ids: Sequence[int],
              output_ids: Sequence[int]) -> torch.Tensor:
    m, vocab = x.shape
    dev = x.device
    counts = torch.zeros(m, vocab, dtype=torch.float32, device=dev)
    if output_ids:
        counts += torch.bincount(torch.tensor(list(output_ids), dtype=torch.int64, device=dev),
                                 minlength=vocab)[:vocab].to(torch.float32)
    paths = path_tokens(tree)
    rows = [v for v, p in enumerate(paths) for _ in p]
    if rows:
        cols = [t for p in paths for t in p]
        counts.index_put_((torch.tensor(rows, device=dev), torch.tensor(cols, device=dev)),
                          torch.ones(len(rows), dtype=torch.float32, device=dev), accumulate=True)
    out_mask = counts > 0
    if params.repetition_penalty != 1.0:
        in_prompt = torch.zeros(vocab, dtype=torch.bool, device=dev)
        if prompt_ids:
            in_prompt[torch.tensor(list(prompt_ids), dtype=torch.int64, device=dev)] = True
        seen = out_mask | in_prompt[None, :]
        r = params.repetition_penalty
        x = torch.where(seen, torch.where(x > 0, x / r, x * r), x)
    if params.frequency_penalty:
        x = x - params.frequency_penalty * counts
    if params.presence_penalty:
        x = x - params.presence_penalty * out_mask.to(torch.float32)
    return x
