"""``adaserve generate``: run a JSONL batch of prompts through the engine, write one JSON line each.

Input line:  {"prompt": "..."} or {"prompt_token_ids": [...]}, optional max_tokens, temperature,
             top_p, top_k, seed, tpot_slo_ms, stop, arrival_s (offset from start).
Output line: the input's order; token_ids, text, finish_reason, and per-request metrics.
"""

from __future__ import annotations

import argparse
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from adaserve.cli.arg_types import add_weights_option
from adaserve.cli_error import CliError
from adaserve.engine.speculation.sampling import SamplingParams

INPUT_FIELDS = {"prompt", "prompt_token_ids", "max_tokens", "temperature", "top_p", "top_k", "seed",
                "tpot_slo_ms", "stop", "arrival_s", "id"}


def add_parser(sub: Any) -> None:
    p = sub.add_parser("generate", help="generate completions for a JSONL file of prompts")
    p.add_argument("--target", default="smollm2-135m-instruct",
                   help="smollm2-135m-instruct (default, brings its draft), demo-tiny, a .gguf file or a directory")
    p.add_argument("--draft", action="append",
                   help="draft model, same forms (or smollm2-draft, smollm2-draft-small); speculative policies need "
                        "one. Repeat it for several drafts: each request's draft is then chosen per slot by the "
                        "policy's selector (POLICY@ucb|eps|length|dN; spin = chain:4@ucb)")
    p.add_argument("--input", required=True, type=Path, help="JSONL prompts")
    p.add_argument("--output", required=True, type=Path, help="JSONL results, in input order")
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    p.add_argument("--policy", default="adaserve",
                   help="adaserve (default), incremental, chain:K, specinfer, smartspec, equal-greedy, global-greedy, "
                        "spin, spin-eps, spin-length; POLICY@SELECTOR with several drafts")
    p.add_argument("--budget", type=int, help="tokens per verification (default: the profiled budget)")
    p.add_argument("--reprofile", action="store_true", help="ignore the cached device profile")
    p.add_argument("--attention", default="auto", choices=["auto", "torch", "flashinfer"])
    p.add_argument("--kv-memory-mb", type=int, default=256, help="KV cache memory per model")
    p.add_argument("--tensor-parallel-size", type=int, default=1, metavar="N",
                   help="shard the target over N ranks, one process per device (CPU: gloo; the draft stays whole)")
    add_weights_option(p)
    p.set_defaults(func=run)


@dataclass(frozen=True)
class PromptLine:
    prompt: str | None
    prompt_token_ids: list[int] | None
    params: SamplingParams
    tpot_slo_ms: float | None
    arrival_s: float


def parse_line(raw: str, lineno: int) -> PromptLine:
    where = f"input line {lineno}"
    try:
        obj = json.loads(raw)
    except json.JSONDecodeError as e:
        raise CliError(f"{where}: not valid JSON ({e.msg})") from None
    if not isinstance(obj, dict):
        raise CliError(f"{where}: expected a JSON object")
    unknown = set(obj) - INPUT_FIELDS
    if unknown:
        raise CliError(f"{where}: unknown field(s) {sorted(unknown)}")
    prompt, ids = obj.get("prompt"), obj.get("prompt_token_ids")
    if (prompt is None) == (ids is None):
        raise CliError(f"{where}: give exactly one of 'prompt' or 'prompt_token_ids'")
    if prompt is not None and (not isinstance(prompt, str) or not prompt):
        raise CliError(f"{where}: 'prompt' must be a non-empty string")
    if ids is not None and (not isinstance(ids, list) or not ids or not all(isinstance(t, int) for t in ids)):
        raise CliError(f"{where}: 'prompt_token_ids' must be a non-empty list of integers")
    stop = obj.get("stop") or ()
    stop = (stop,) if isinstance(stop, str) else tuple(stop)
    try:
        params = SamplingParams(
            max_tokens=int(obj.get("max_tokens", 64)),
            temperature=float(obj.get("temperature", 0.0)),
            top_p=float(obj.get("top_p", 1.0)),
            top_k=int(obj.get("top_k", 0)),
            seed=None if obj.get("seed") is None else int(obj["seed"]),
            stop=stop,
        )
        slo = obj.get("tpot_slo_ms")
        tpot = None if slo is None else float(slo)
        if tpot is not None and tpot <= 0:
            raise ValueError("tpot_slo_ms must be positive")
        arrival = float(obj.get("arrival_s", 0.0))
    except (TypeError, ValueError) as e:
        raise CliError(f"{where}: {e}") from None
    return PromptLine(prompt, ids, params, tpot, arrival)


def read_input(path: Path) -> list[PromptLine]:
    try:
        text = path.read_text()
    except (OSError, UnicodeDecodeError) as e:
        raise CliError(f"cannot read input {path}: {e}") from None
    lines = [(i + 1, ln) for i, ln in enumerate(text.splitlines()) if ln.strip()]
    if not lines:
        raise CliError(f"input {path} has no prompts")
    return [parse_line(ln, i) for i, ln in lines]


def run(args: argparse.Namespace) -> int:
    from adaserve.engine.build import EngineBuildError, build_engine
    from adaserve.engine.loading.catalog import ModelNotFoundError, resolve_drafts
    from adaserve.engine.request import Request
    from adaserve.worker.detok import truncate_at_stop

    lines = read_input(args.input)
    try:
        pair, extra = resolve_drafts(args.target, args.draft or (), weights=args.weights)
    except ModelNotFoundError as e:
        raise CliError(str(e)) from None
    try:
        built = build_engine(target=pair.target, draft=pair.draft, extra_drafts=extra, device=args.device,
                             policy=args.policy,
                             budget=args.budget, attention=args.attention, kv_memory_mb=args.kv_memory_mb,
                             force_profile=args.reprofile, weights=args.weights,
                             tensor_parallel_size=args.tensor_parallel_size)
    except EngineBuildError as e:
        raise CliError(str(e)) from None
    tok = built.tokenizer
    requests = []
    for i, line in enumerate(lines):
        if line.prompt is not None:
            if tok is None:
                raise CliError(f"input line {i + 1}: text prompt given but {args.target} has no tokenizer")
            ids = tok.encode(line.prompt, add_special_tokens=True)
        else:
            ids = line.prompt_token_ids
        req = Request(str(i), list(ids), line.params, tpot_slo_ms=line.tpot_slo_ms)
        requests.append((line.arrival_s, req))
    try:
        for _, req in requests:
            built.engine.check_request(req)
    except ValueError as e:
        raise CliError(str(e)) from None
    try:
        built.engine.run(requests)
    finally:
        built.engine.target.close()  # a tensor-parallel target stops its other ranks
    args.output.parent.mkdir(parents=True, exist_ok=True)
    with args.output.open("w") as out:
        for _, req in requests:
            text = None
            reason = req.finish_reason
            if tok is not None:
                text = tok.decode(req.output_ids, skip_special_tokens=True)
                text, hit = truncate_at_stop(text, req.params.stop)
                reason = "stop" if hit else reason
            row = {"token_ids": req.output_ids, "text": text, "finish_reason": reason,
                   "tpot_slo_ms": req.tpot_slo_ms, **req.metrics.to_dict()}
            if req.metrics.drafts_per_step:  # several drafts: which one speculated for each verification
                row["drafts_per_step"] = req.metrics.drafts_per_step
            out.write(json.dumps(row) + "\n")
    return 0
