"""A request's state inside the engine, and the metrics it reports when it leaves."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

import torch

from adaserve.engine.model.kv_cache import SequenceKV
from adaserve.engine.speculation.grammar import GrammarState
from adaserve.engine.speculation.sampling import SamplingParams, make_generator
from adaserve.engine.speculation.selection import requirement_line as slo_line
from adaserve.engine.speculation.selection import slo_requirement
from adaserve.engine.stop_strings import StopStringMatcher


class Phase(enum.Enum):
    WAITING = "waiting"  # not admitted: no KV reserved yet
    PREFILL = "prefill"  # prompt partly in the target KV
    DECODE = "decode"
    FINISHED = "finished"


@dataclass
class RequestMetrics:
    arrival_s: float
    first_token_s: float | None = None
    last_token_s: float | None = None
    num_tokens: int = 0
    accepted_per_step: list[int] = field(default_factory=list)  # draft tokens accepted per verification
    verified_per_step: list[int] = field(default_factory=list)  # tree tokens sent to verification
    drafts_per_step: list[int] = field(default_factory=list)  # the draft of each verification (several drafts)
    cached_tokens: int = 0  # prompt tokens whose KV came from the prefix cache (not prefilled)

    @property
    def ttft_ms(self) -> float | None:
        return None if self.first_token_s is None else 1e3 * (self.first_token_s - self.arrival_s)

    @property
    def tpot_ms(self) -> float | None:
        """Mean time per output token after the first: (t_last - t_first) / (n - 1)."""
        if self.first_token_s is None or self.last_token_s is None or self.num_tokens < 2:
            return None
        return 1e3 * (self.last_token_s - self.first_token_s) / (self.num_tokens - 1)

    def to_dict(self) -> dict:
        acc = self.accepted_per_step
        return {
            "ttft_ms": self.ttft_ms,
            "tpot_ms": self.tpot_ms,
            "num_tokens": self.num_tokens,
            "verifications": len(acc),
            "accepted_per_step": acc,
            "mean_accepted_per_step": (sum(acc) / len(acc)) if acc else 0.0,
        }


@dataclass
class Request:
    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    tpot_slo_ms: float | None = None
    metrics: RequestMetrics = field(default_factory=lambda: RequestMetrics(arrival_s=0.0))
    output_ids: list[int] = field(default_factory=list)
    # the prompt's last tokens that an earlier worker emitted as output (a continuation): the penalties count
    # them as output (logits_processors.py)
    resumed: int = 0
    # time-to-first-token target (from arrival); the SLO prefill rule keeps prompt chunks large enough for it
    # (prefill_chunk.py); None: EngineConfig.prefill_ttft_ms
    ttft_slo_ms: float | None = None
    phase: Phase = Phase.WAITING
    finish_reason: str | None = None  # "stop" | "length" | "abort"
    target_kv: SequenceKV = field(default_factory=SequenceKV)
    draft_kv: SequenceKV = field(default_factory=SequenceKV)  # the current draft's (``draft_index``)
    draft_index: int = 0  # which of the engine's drafts speculates for it (multi_draft.py)
    other_draft_kv: dict[int, SequenceKV] = field(default_factory=dict)  # other drafts' KV, kept for a switch back
    reserved_pages: tuple[int, int] = (0, 0)  # (target, draft) pages reserved at admission
    generator: torch.Generator = field(init=False)
    stop_matcher: StopStringMatcher | None = field(default=None, init=False, repr=False)  # made on first use
    # structured output: the grammar's matcher at the output so far (Engine.start_grammar, grammar.py)
    grammar: GrammarState | None = field(default=None, init=False, repr=False)

    def __post_init__(self) -> None:
        # No checks here: Engine.check_request is where a request is validated, once.
        self.generator = make_generator(self.params.seed)

    @property
    def all_ids(self) -> list[int]:
        """Prompt and output, concatenated (a copy: O(length); the engine reads ``last_token`` / ``ids_from``)."""
        return self.prompt_ids + self.output_ids

    @property
    def last_token(self) -> int:
        return self.output_ids[-1] if self.output_ids else self.prompt_ids[-1]

    @property
    def draft_pending(self) -> int:
        """The tokens this request's draft has not seen, the root last: what its next catch-up forward feeds."""
        return len(self.prompt_ids) + len(self.output_ids) - self.draft_kv.length

    def ids_from(self, start: int) -> list[int]:
        """``all_ids[start:]`` without building ``all_ids``: O(len - start)."""
        n = len(self.prompt_ids)
        if start >= n:
            return self.output_ids[start - n :]
        return self.prompt_ids[start:] + self.output_ids

    def history(self) -> list[int]:
        """The output the penalties see: a continuation's earlier tokens, then this engine's output."""
        earlier = self.prompt_ids[len(self.prompt_ids) - self.resumed :] if self.resumed else []
        return earlier + self.output_ids

    @property
    def remaining(self) -> int:
        return self.params.max_tokens - len(self.output_ids)

    @property
    def finished(self) -> bool:
        return self.phase is Phase.FINISHED


def requirement(req: Request, *, now_s: float, t_iter_s: float, margin: float = 0.0) -> float:
    """A(r) + ``margin`` for a decoding request with a TPOT SLO (the SLO phase's target, EngineConfig.slo_margin);
    0 (nothing beyond the bonus token) when it has none."""
    first = req.metrics.first_token_s
    if req.tpot_slo_ms is None or first is None:
        return 0.0
    # TPOT counts tokens after the first, over time since the first: o_r = n - 1, l_r = now - t_first
    return margin + slo_requirement(elapsed_s=max(0.0, now_s - first), tokens_so_far=max(0, len(req.output_ids) - 1),
                                    t_iter_s=t_iter_s, tpot_slo_s=req.tpot_slo_ms / 1e3)


def requirement_line(req: Request, *, now_s: float) -> tuple[float, float]:
    """(base, rate) with A(r) = base + rate * t_iter (``requirement`` without the margin; selection.requirement_line);
    (0, 0) for a request without a TPOT SLO."""
    first = req.metrics.first_token_s
    if req.tpot_slo_ms is None or first is None:
        return 0.0, 0.0
    return slo_line(elapsed_s=max(0.0, now_s - first), tokens_so_far=max(0, len(req.output_ids) - 1),
                    tpot_slo_s=req.tpot_slo_ms / 1e3)
