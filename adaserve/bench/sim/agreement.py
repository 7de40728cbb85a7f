"""Recorded draft/target agreement: what the replay clock (replay.py) draws acceptance from.

Under greedy verification a drafted node is accepted exactly when its parent was and its token is the
target's own next token after the parent's path. Along the accepted path that path *is* the target's
output, so one teacher-forced draft forward over a request's prompt and its greedy target output says,
at every output position p:

    q[p, :W]     the draft's top-W conditional probabilities at context prompt + out[:p], best first
    choice[p]    the rank of the target's token out[p] among those W (-1: not among them)

That is everything a replay needs about the accepted path: the root's children are the draft's top-w at
row o (o tokens emitted), the child of rank ``choice[o]`` is the one the target accepts, and its own
children are row o + 1's. Nodes off the target's path can never be accepted; only their draft
probabilities matter (to beam pruning and selection), and the replay draws those from other rows of the
same recording (replay.py states the assumption).

A recording is per request (``AgreementTrace``), grouped by SLO class in an ``AgreementPool`` saved as
one ``.npz`` file with the models, prompts' source and settings it was made with.

May import: the engine. Nothing here imports the bench.
"""

from __future__ import annotations

import hashlib
import json
import zipfile
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path
from typing import Any

import numpy as np
import torch

from adaserve.engine.config import EngineConfig
from adaserve.engine.engine import Engine
from adaserve.engine.model.batch import Segment
from adaserve.engine.model.kv_cache import SequenceKV
from adaserve.engine.model.runner import ModelRunner
from adaserve.engine.model.tree import STRICT_DECREASE_EPS, TokenTree
from adaserve.engine.request import Request
from adaserve.engine.speculation.sampling import SamplingParams

RECORD_WIDTH = 4  # W: the widest expansion any replayed policy asks for (SpecInfer's 3, AdaServe's w_max 3)
FORMAT = 1


@dataclass(frozen=True, eq=False)
class AgreementTrace:
    """One request's recording: ``q`` [L, W] and ``choice`` [L] over its L output positions."""

    slo_class: str
    q: np.ndarray
    choice: np.ndarray
    prompt_sha: str = ""  # sha256 of the prompt's text: a replay of the same trace finds its own recording
    prompt_len: int = 0  # the prompt's tokens in the recording model's tokenizer (after any cut)

    def __post_init__(self) -> None:
        if self.q.ndim != 2 or self.choice.shape != (self.q.shape[0],):
            raise ValueError("an agreement trace needs q [L, W] and choice [L]")
        if self.q.shape[0] < 1:
            raise ValueError("an agreement trace needs at least one position")

    @property
    def length(self) -> int:
        return int(self.q.shape[0])

    @cached_property
    def log_q(self) -> np.ndarray:
        """log q, at most -STRICT_DECREASE_EPS so that path probabilities decrease strictly, as the engine's
        trees do (TokenTree.with_strict_decrease)."""
        return np.minimum(np.log(np.clip(self.q, 1e-30, 1.0)), -STRICT_DECREASE_EPS)

    @property
    def width(self) -> int:
        return int(self.q.shape[1])


@dataclass
class AgreementPool:
    """Recordings by SLO class, and what made them (``meta``: models, source, settings)."""

    traces: dict[str, list[AgreementTrace]]
    meta: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not self.traces or any(not v for v in self.traces.values()):
            raise ValueError("an agreement pool needs at least one recording per class it names")

    def by_prompt(self) -> dict[str, AgreementTrace]:
        """Recordings by their prompt's sha256 (those that name one)."""
        return {t.prompt_sha: t for ts in self.traces.values() for t in ts if t.prompt_sha}

    def for_class(self, slo_class: str) -> list[AgreementTrace]:
        """The recordings of ``slo_class``, or of every class when none was recorded for it."""
        return self.traces.get(slo_class) or [t for ts in self.traces.values() for t in ts]

    def summary(self) -> dict[str, Any]:
        """Per class: recordings, positions, and P(target's token = the draft's rank-k choice)."""
        out: dict[str, Any] = {}
        for name, ts in sorted(self.traces.items()):
            choice = np.concatenate([t.choice for t in ts])
            width = ts[0].width
            out[name] = {"recordings": len(ts), "positions": len(choice),
                         "p_rank": [round(float(np.mean(choice == k)), 4) for k in range(width)],
                         "p_none": round(float(np.mean(choice < 0)), 4)}
        return out

    def save(self, path: Path) -> None:
        arrays: dict[str, np.ndarray] = {}
        index = []
        for name, ts in sorted(self.traces.items()):
            for i, t in enumerate(ts):
                key = f"{len(index)}"
                arrays[f"q{key}"] = t.q.astype(np.float32)
                arrays[f"c{key}"] = t.choice.astype(np.int8)
                index.append({"class": name, "i": i, "prompt_sha": t.prompt_sha, "prompt_len": t.prompt_len})
        meta = {"format": FORMAT, "index": index, "meta": self.meta}
        np.savez_compressed(path, meta=np.frombuffer(json.dumps(meta).encode(), np.uint8), **arrays)

    @classmethod
    def load(cls, path: Path) -> AgreementPool:
        traces: dict[str, list[AgreementTrace]] = {}
        try:
            with np.load(path, allow_pickle=False) as z:
                meta = json.loads(bytes(z["meta"]).decode())
                if meta.get("format") != FORMAT:
                    raise ValueError(f"{path}: agreement pool format {meta.get('format')!r}, expected {FORMAT}")
                traces = {}
                for k, entry in enumerate(meta["index"]):
                    traces.setdefault(entry["class"], []).append(
                        AgreementTrace(entry["class"], z[f"q{k}"].astype(np.float64), z[f"c{k}"].astype(np.int64),
                                       entry.get("prompt_sha", ""), entry.get("prompt_len", 0)))
        except (OSError, KeyError, ValueError, zipfile.BadZipFile) as e:  # JSONDecodeError is a ValueError
            if str(e).startswith(f"{path}: agreement pool format"):
                raise
            raise ValueError(f"{path}: not an agreement pool ({e})") from None
        return cls(traces, meta.get("meta", {}))


def agreement_of(draft_logits: torch.Tensor, target_tokens: Sequence[int], width: int) -> tuple[np.ndarray, np.ndarray]:
    """(q [L, W], choice [L]) from the draft's logits at the L contexts before each target token."""
    probs = torch.softmax(draft_logits.double(), dim=-1)
    top = torch.topk(probs, min(width, probs.shape[-1]), dim=-1)
    q = top.values.cpu().numpy()
    idx = top.indices.cpu().numpy()
    tok = np.asarray(target_tokens, np.int64)[:, None]
    hit = idx == tok
    choice = np.where(hit.any(axis=1), hit.argmax(axis=1), -1)
    return q, choice


def prompt_sha(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()


def record_agreement(target: ModelRunner, draft: ModelRunner, prompts: Sequence[tuple[str, list[int], str]], *,
                     output_tokens: int, width: int = RECORD_WIDTH, max_batch: int = 32,
                     on_progress: Callable[[int], None] | None = None) -> AgreementPool:
    """Record every (class, prompt ids, prompt sha256): the target's greedy output of ``output_tokens`` (end-of-sequence
    ignored, as the paper's fixed lengths), then one draft forward over prompt + output (the module docstring).
    """
    if output_tokens < 1:
        raise ValueError("output_tokens must be >= 1")
    eng = Engine(target, None, EngineConfig(policy="incremental", max_batch=max_batch, prefill_chunk=2048))
    reqs = [Request(f"rec-{i}", list(ids), SamplingParams(max_tokens=output_tokens, ignore_eos=True))
            for i, (_, ids, _) in enumerate(prompts)]
    done = 0
    for r in reqs:
        eng.add_request(r)

    while eng.has_work:
        for ev in eng.step():
            if ev.finished:
                done += 1
                if on_progress is not None:
                    on_progress(done)
    traces: dict[str, list[AgreementTrace]] = {}
    for (cls_name, ids, sha), r in zip(prompts, reqs, strict=True):
        out = r.output_ids
        seq = SequenceKV()
        ctx = list(ids) + out[:-1]
        try:
            logits = draft.forward([Segment(seq, 0, TokenTree.chain(ctx))], all_logits=[True])[0]
        finally:
            draft.cache.release(seq)
        q, choice = agreement_of(logits[len(ids) - 1 :], out, width)
        traces.setdefault(cls_name, []).append(AgreementTrace(cls_name, q, choice, sha, len(ids)))
    return AgreementPool(traces)
