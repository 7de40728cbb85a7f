"""Greedy output with speculation against plain decoding on a batch of the default model's requests (losslessness).

The first ``requests`` chat and coding prompts (half each, their last 256 tokens) arrive together and are decoded
greedily by ``incremental`` and by each speculative policy; a request "parts" where its tokens differ from plain
decoding's. One loop for the CI test (tests/engine/test_smollm2.py) and the script that reports it
(scripts/lossless-batch.py, also on a GPU: scripts/gpu-checklist.sh).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from adaserve.bench.workload import chat_prompts, humaneval_prompts
from adaserve.engine.build import build_engine
from adaserve.engine.loading.catalog import ModelPair
from adaserve.engine.loading.chat import instruction_ids
from adaserve.engine.loading.loader import load_tokenizer
from adaserve.engine.request import Request
from adaserve.engine.speculation.sampling import SamplingParams

PROMPT_TOKENS = 256  # each prompt's last tokens


@dataclass(frozen=True)
class BatchOutcome:
    outputs: dict[str, list[list[int]]]  # policy -> each request's tokens
    accepted: dict[str, int]  # policy -> draft tokens accepted over the batch

    def parted(self) -> dict[str, list[int]]:
        """Per speculative policy, the requests whose tokens differ from plain decoding's."""
        plain = self.outputs["incremental"]
        return {p: [i for i, (a, b) in enumerate(zip(out, plain, strict=True)) if a != b]
                for p, out in self.outputs.items() if p != "incremental"}


def batch_prompts(pair: ModelPair, requests: int) -> list[list[int]]:
    """Half chat, half coding prompts, chat-templated, their last ``PROMPT_TOKENS`` tokens."""
    tok = load_tokenizer(pair.target)
    half = requests // 2
    texts = [*chat_prompts()[:half], *humaneval_prompts()[: requests - half]]
    return [instruction_ids(tok, t)[-PROMPT_TOKENS:] for t in texts]


def decode_batch(pair: ModelPair, prompts: Sequence[list[int]], policies: Sequence[str], *, weights: str,
                 tokens: int, device: str = "cpu") -> BatchOutcome:
    """Every prompt arriving at once (batched, as a server runs them), decoded greedily by ``incremental`` and each
    of ``policies``, ``tokens`` each, budget 64."""
    outputs: dict[str, list[list[int]]] = {}
    accepted: dict[str, int] = {}
    for policy in ("incremental", *policies):
        built = build_engine(target=pair.target, draft=None if policy == "incremental" else pair.draft,
                             device=device, policy=policy, budget=64, profile=False, progress=False, weights=weights)
        reqs = [Request(f"r{i}", list(ids), SamplingParams(max_tokens=tokens)) for i, ids in enumerate(prompts)]
        built.engine.run([(0.0, r) for r in reqs])
        outputs[policy] = [r.output_ids for r in reqs]
        accepted[policy] = sum(sum(r.metrics.accepted_per_step) for r in reqs)
    return BatchOutcome(outputs, accepted)
