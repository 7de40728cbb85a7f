"""Sampling settings and the target distribution they define.

Every emitted token is one draw from the *target's* processed distribution at that token's context,
made with the request's own generator and one uniform per token (inverse CDF). A speculative
request therefore consumes its random stream exactly as plain decoding would: with the same seed,
outputs match plain sampling token for token, not only in distribution.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from adaserve.engine.speculation.grammar import GrammarSpec


@dataclass(frozen=True)
class SamplingParams:
    max_tokens: int = 64
    temperature: float = 0.0  # 0 means greedy (argmax)
    top_p: float = 1.0
    top_k: int = 0  # 0 means no top-k cut
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    # logits processors (logits_processors.py), applied before temperature, top-k and top-p, at every tree node
    # with that node's own path as output so far: the processed distribution is the target's, speculated or not
    min_tokens: int = 0  # stop tokens (end-of-sequence and stop_token_ids) are masked until this many are out
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, bias added to its logit)
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    # structured output (grammar.py): the target's rows masked at every tree node by the grammar after its path
    grammar: GrammarSpec | None = None
    # log-probabilities of the emitted tokens (logprobs.py): None for none, k >= 0 for the token's and the top k
    logprobs: int | None = None

    def __post_init__(self) -> None:
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {self.max_tokens}")
        if not self.temperature >= 0.0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0, got {self.top_k}")
        if any(not s for s in self.stop):
            raise ValueError("stop strings must be non-empty")
        if not 0 <= self.min_tokens <= self.max_tokens:
            raise ValueError(f"min_tokens must be in [0, max_tokens={self.max_tokens}], got {self.min_tokens}")
        if not all(math.isfinite(x) for x in (self.presence_penalty, self.frequency_penalty, self.repetition_penalty)):
            raise ValueError("penalties must be finite")
        if not self.repetition_penalty > 0.0:
            raise ValueError(f"repetition_penalty must be > 0, got {self.repetition_penalty}")
        if any(t < 0 or not math.isfinite(b) for t, b in self.logit_bias):
            raise ValueError("logit_bias: token ids must be >= 0 and biases finite")
        if self.logprobs is not None and not 0 <= self.logprobs <= 20:
            raise ValueError(f"logprobs must be in [0, 20], got {self.logprobs}")
        if self.grammar is not None and self.min_tokens:
            # a grammar that can only end where min_tokens holds the end back would leave no token to draw
            raise ValueError("min_tokens: cannot be combined with structured output")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def processes_logits(self) -> bool:
        """Whether any logits processor changes the model's logits (logits_processors.py)."""
        return bool(self.min_tokens or self.logit_bias or self.presence_penalty or self.frequency_penalty
                    or self.repetition_penalty != 1.0)


def processed_probs(logits: torch.Tensor, p: SamplingParams) -> torch.Tensor:
    """logits [N, V] -> probabilities [N, V] after temperature, top-k and top-p (float64 for exact CDFs)."""
    x = logits.double()
    # shift by the max first (softmax is unchanged by it): x / T overflows float64 for a tiny T, and the NaN
    # probabilities that followed drew the vocabulary's last token; shifted, the max stays 0 and the rest -> -inf
    x = (x - x.max(dim=-1, keepdim=True).values) / p.temperature
    if p.top_k and p.top_k < x.shape[-1]:
        kth = torch.topk(x, p.top_k, dim=-1).values[..., -1:]
        x = x.masked_fill(x < kth, float("-inf"))
    probs = torch.softmax(x, dim=-1)
    if p.top_p < 1.0:
        # keep the smallest set of most likely tokens whose mass reaches top_p
        sorted_p, order = probs.sort(dim=-1, descending=True)
        mass_before = sorted_p.cumsum(-1) - sorted_p
        sorted_p = sorted_p.masked_fill(mass_before >= p.top_p, 0.0)
        probs = torch.zeros_like(probs).scatter(-1, order, sorted_p)
        probs = probs / probs.sum(-1, keepdim=True)
    return probs


def make_generator(seed: int | None) -> torch.Generator:
    g = torch.Generator(device="cpu")
    if seed is None:
        g.seed()
    else:
        g.manual_seed(seed)
    return g


def skip_draws(generator: torch.Generator, tokens: int) -> None:
    """Advance a request's random stream past ``tokens`` emitted tokens (one float64 uniform each, the
    invariant above), so a request resumed after them draws, at every later position, the uniform an
    unbroken run would have: with the same seed, the same tokens (greedy requests draw nothing)."""
    if tokens > 0:
        torch.rand(tokens, generator=generator, dtype=torch.float64)


def draw_rows(probs: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """Inverse-CDF draws, one per row: probs [R, V], uniforms u [R] in [0, 1) -> token ids [R] (int64).

    Row r returns the first token whose cumulative mass exceeds u[r] * total (float64); a draw landing
    past the last token (u * total rounding up to the total) falls back to the last token with mass.
    """
    cdf = probs.double().cumsum(-1)
    idx = torch.searchsorted(cdf, (u.double() * cdf[:, -1])[:, None], right=True)[:, 0]
    idx = idx.clamp(max=probs.shape[-1] - 1)
    # cdf[idx] > target >= cdf[idx - 1] means probs[idx] > 0, except past the end: there, step back to
    # the largest j <= idx with probs[j] > 0
    empty = probs.gather(1, idx[:, None])[:, 0] <= 0
    if bool(empty.any()):
        ar = torch.arange(probs.shape[-1], device=probs.device)
        last_with_mass = torch.cummax(torch.where(probs[empty] > 0, ar, -1), dim=-1).values
        idx[empty] = last_with_mass.gather(1, idx[empty][:, None])[:, 0]
    return idx
