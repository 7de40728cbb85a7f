"""A model, its KV cache and its attention backend: one ragged forward per call."""

from __future__ import annotations

import torch

from adaserve.engine.attention import make_backend
from adaserve.engine.batch import Segment, build_layout
from adaserve.engine.config import EngineConfig
from adaserve.engine.kv_cache import PagedKVCache
from adaserve.engine.model import CausalLM


class ModelRunner:
    def __init__(self, model: CausalLM, cfg: EngineConfig | None = None) -> None:
        cfg = cfg or EngineConfig()  # reads cfg.attention and cfg.kv
        self.model = model
        self.device = model.lm_head.weight.device
        self.dtype = model.lm_head.weight.dtype
        self.cache = PagedKVCache(model.cfg, cfg.kv, dtype=self.dtype, device=self.device)
        self.backend = make_backend(cfg.attention, model.cfg, self.device)

    @property
    def vocab_size(self) -> int:
        return self.model.cfg.vocab_size

    def forward(self, segments: list[Segment], *, all_logits: list[bool]) -> list[torch.Tensor]:
        """Run every segment's new tokens in one forward.

        Returns, per segment, logits ``[num_new, V]`` when ``all_logits[i]`` else ``[1, V]`` (its
        last new token: enough for a prefill chunk).
        """
        for s in segments:
            self.cache.ensure(s.seq, s.kv_len)
        layout = build_layout(segments, page_size=self.cache.page_size, device=self.device)
        rows: list[int] = []
        counts: list[int] = []
        for i, want in enumerate(all_logits):
            lo, hi = layout.qo_indptr[i], layout.qo_indptr[i + 1]
            picked = range(lo, hi) if want else range(hi - 1, hi)
            rows.extend(picked)
            counts.append(len(picked))
        self.backend.plan(layout, self.cache)
        logits = self.model(layout.input_ids, layout.positions, backend=self.backend, cache=self.cache,
                            logits_rows=torch.tensor(rows, device=self.device))
        return list(torch.split(logits, counts))
