"""A real peer in the benchmark: Hugging Face transformers serving the same arrivals.

Static batching, as a user of the library would write it: whenever the model is idle, every request
that has arrived is taken as one left-padded batch and run through ``generate`` until the longest is
done; requests arriving meanwhile wait for the next batch. A batch of one uses assisted generation
with the draft model (transformers supports it for batch size 1 only) unless ``assisted`` is off.
``cache_implementation="static"`` gives ``generate`` transformers' static KV cache. Per-token times come
from a stopping criterion that records the clock after every decoding step.
"""

from __future__ import annotations

import copy
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from adaserve.engine.request import Request


@dataclass
class _StepClock:
    """A StoppingCriteria-shaped callable that timestamps every generation step and never stops."""

    times: list[float] = field(default_factory=list)

    def __call__(self, input_ids: torch.Tensor, scores: Any, **kwargs: Any) -> torch.Tensor:
        self.times.append(time.perf_counter())
        return torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)


class HFPeer:
    def __init__(self, target: Path, draft: Path | None, *, eos_token_id: int | None, pad_token_id: int,
                 assisted: bool = True, cache_implementation: str | None = None,
                 device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32) -> None:
        """``device`` and ``dtype``: the engine's, so both sides compute on the same hardware in the same
        precision (a GPU run once left transformers on the host CPU in fp32)."""
        from transformers import AutoModelForCausalLM

        self.device = torch.device(device)
        self.model = AutoModelForCausalLM.from_pretrained(target, dtype=dtype).to(self.device).eval()
        self.draft = (AutoModelForCausalLM.from_pretrained(draft, dtype=dtype).to(self.device).eval()
                      if draft else None)
        self.eos, self.pad = eos_token_id, pad_token_id
        self.assisted, self.cache_implementation = assisted, cache_implementation

    def variant(self, *, assisted: bool, cache_implementation: str | None) -> HFPeer:
        """The same loaded models, generating another way."""
        other = copy.copy(self)
        other.assisted, other.cache_implementation = assisted, cache_implementation
        return other

    def _generate(self, batch: list[Request]) -> None:
        from transformers import StoppingCriteriaList

        width = max(len(r.prompt_ids) for r in batch)
        ids = torch.full((len(batch), width), self.pad, dtype=torch.long)
        mask = torch.zeros_like(ids)
        for i, r in enumerate(batch):  # left padding: decoder-only models continue from the right edge
            ids[i, width - len(r.prompt_ids) :] = torch.tensor(r.prompt_ids)
            mask[i, width - len(r.prompt_ids) :] = 1
        clock = _StepClock()
        kwargs: dict[str, Any] = {}
        if len(batch) == 1 and self.draft is not None and self.assisted:
            kwargs["assistant_model"] = self.draft
        if self.cache_implementation is not None:
            kwargs["cache_implementation"] = self.cache_implementation
        with torch.no_grad():
            out = self.model.generate(ids.to(self.device), attention_mask=mask.to(self.device), do_sample=False,
                                      max_new_tokens=max(r.params.max_tokens for r in batch),
                                      eos_token_id=self.eos, pad_token_id=self.pad,
                                      stopping_criteria=StoppingCriteriaList([clock]), **kwargs)
        new = out[:, width:].tolist()  # on CUDA: waits for the last step
        for r, toks in zip(batch, new, strict=True):
            toks = toks[: r.params.max_tokens]
            if self.eos is not None and self.eos in toks:
                toks = toks[: toks.index(self.eos) + 1]
                r.finish_reason = "stop"
            else:
                r.finish_reason = "length"
            r.output_ids = toks
            # with assisted generation one step can emit several tokens: spread them over the steps seen
            n = len(toks)
            stamps = clock.times[:n]
            if stamps and len(stamps) < n:
                stamps = stamps + [stamps[-1]] * (n - len(stamps))
            r.metrics.first_token_s = stamps[0] if stamps else time.perf_counter()
            r.metrics.last_token_s = stamps[-1] if stamps else r.metrics.first_token_s
            r.metrics.num_tokens = n

    def run(self, arrivals: list[tuple[float, Request]], *, max_batch: int = 64,
            on_done: Any = None) -> list[Request]:
        """Serve arrivals (offsets in seconds) in real time; returns the requests with outputs and times."""
        pending = sorted(arrivals, key=lambda a: a[0])
        start = time.perf_counter()
        while pending:
            now = time.perf_counter() - start
            ready = [a for a in pending if a[0] <= now][:max_batch]
            if not ready:
                time.sleep(min(0.05, pending[0][0] - now))
                continue
            for a in ready:
                pending.remove(a)
                a[1].metrics.arrival_s = start + a[0]
            batch = [r for _, r in ready]
            self._generate(batch)
            if on_done is not None:
                on_done(len(batch))
        return [r for _, r in arrivals]
