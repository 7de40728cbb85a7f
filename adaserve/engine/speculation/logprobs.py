"""Log-probabilities of emitted tokens (OpenAI's ``logprobs`` / ``top_logprobs``), from the target's own rows.

Verification has the target's logits at every tree node, and every emitted token was drawn at a node of the
accepted path (token i at path node i, the bonus at the last), so a speculative request reports, per token, the
row plain decoding would have computed at that token's context: the same numbers, speculated or not.

Which distribution: vLLM's default (``logprobs_mode = "raw_logprobs"``): the log-softmax of the model's logits
after the structured-output mask (vLLM applies its grammar bitmask before the sampler reads them) and before any
logits processor, penalty, temperature, top-k or top-p. A greedy token is therefore the top-1 of its row (ties
aside); a sampled one is reported with its raw log-probability, as vLLM reports it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

MAX_TOP_LOGPROBS = 20  # OpenAI's and vLLM's default limit
# what a token the grammar refuses (-inf) is reported as: JSON has no infinity, and vLLM reports -9999.0 too
FLOOR = -9999.0


@dataclass(frozen=True)
class TokenLogprob:
    token: int
    logprob: float
    top: list[tuple[int, float]]  # the ``k`` most likely tokens of the row, most likely first


def token_logprobs(logits: torch.Tensor, nodes: Sequence[int], tokens: Sequence[int], top: int) -> list[TokenLogprob]:
    """logits [M, V]: the (grammar-masked) target rows of a walk's tree; ``tokens[i]`` was drawn at ``nodes[i]``.
    Per token its log-probability and the ``top`` most likely of its row (one copy to the host)."""
    if not tokens:
        return []
    rows = torch.log_softmax(logits[torch.as_tensor(list(nodes), device=logits.device)].to(torch.float32), dim=-1)
    chosen = rows.gather(1, torch.as_tensor(list(tokens), device=rows.device)[:, None])[:, 0]
    k = min(top, rows.shape[-1])
    best = torch.topk(rows, k, dim=-1) if k else None
    values = torch.cat([chosen[:, None], *([best.values] if best else [])], 1).clamp(min=FLOOR)
    host = torch.cat([values, *([best.indices.to(torch.float32)] if best else [])], 1).cpu()
    out = []
    for i, t in enumerate(tokens):
        vals = host[i, 1 : 1 + k].tolist()
        ids = [int(x) for x in host[i, 1 + k :].tolist()]
        out.append(TokenLogprob(int(t), float(host[i, 0]), list(zip(ids, vals, strict=True))))
    return out
