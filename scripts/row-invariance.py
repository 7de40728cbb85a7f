"""Is a verified row the same function as that row decoded alone? (losslessness, issues 30 and 35)

Greedy speculation is lossless only if the target computes a token's logits the same way whether it decodes it
alone (one row) or verifies it with the tree behind it (several rows). This script checks it on the default
model: it prefills a chat prompt, then runs the prompt's last token once alone and once followed by four more
tokens, and compares row 0 of every module's output, in the order the modules finish, reporting the first that
differs and whether its input already did. Then it decodes the prompt greedily with and without speculation.
Prints JSON.

    PYTHONPATH=. python scripts/row-invariance.py --weights int4 --kernels torch
    PYTHONPATH=. python scripts/row-invariance.py --weights int4 --kernels native   # ADASERVE_NATIVE_KERNELS=on
"""

from __future__ import annotations

import argparse
import json
import os
from typing import Any

import torch


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--weights", default="int4", choices=["float", "int8", "int4"])
    ap.add_argument("--kernels", default="torch", choices=["torch", "native"])
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--prompt", default="What is the capital of France?")
    ap.add_argument("--tokens", type=int, default=24, help="greedy tokens per policy")
    args = ap.parse_args()
    os.environ["ADASERVE_NATIVE_KERNELS"] = "on" if args.kernels == "native" else "off"  # read at load
    from adaserve.bench.engine_only import host_cpu, source_version
    from adaserve.engine.build import build_engine
    from adaserve.engine.loading.catalog import resolve
    from adaserve.engine.loading.chat import instruction_ids
    from adaserve.engine.loading.loader import load_tokenizer
    from adaserve.engine.model.batch import Segment
    from adaserve.engine.model.kv_cache import SequenceKV
    from adaserve.engine.model.tree import TokenTree
    from adaserve.engine.request import Request
    from adaserve.engine.speculation.sampling import SamplingParams

    torch.set_num_threads(args.threads)
    pair = resolve("smollm2-135m-instruct", progress=False, weights=args.weights)
    tok = load_tokenizer(pair.target)
    ids = instruction_ids(tok, args.prompt)

    def engine(policy: str) -> Any:
        return build_engine(target=pair.target, draft=None if policy == "incremental" else pair.draft,
                            policy=policy, budget=64, profile=False, progress=False, weights=args.weights).engine

    runner = engine("incremental").target
    rows: dict[str, tuple[torch.Tensor, torch.Tensor | None]] = {}
    order: list[str] = []

    def record(name: str) -> Any:
        def hook(_: torch.nn.Module, inputs: tuple[Any, ...], out: Any) -> None:
            o = out[0] if isinstance(out, tuple) else out
            x = inputs[0] if inputs and isinstance(inputs[0], torch.Tensor) else None
            if isinstance(o, torch.Tensor) and name not in rows:
                rows[name] = (o.reshape(-1, o.shape[-1])[0].clone(),
                              None if x is None else x.reshape(-1, x.shape[-1])[0].clone())
                order.append(name)
        return hook

    for name, module in runner.model.named_modules():
        if name:
            module.register_forward_hook(record(name))
    runs = []
    for extra in ([], [100, 200, 300, 400]):  # the last prompt token alone, then as the root of a 5-token chain
        seq = SequenceKV()
        runner.forward([Segment(seq, 0, TokenTree.chain(ids[:-1]))], all_logits=[False])
        runner.cache.truncate(seq, len(ids) - 1)
        rows.clear()
        order.clear()
        logits = runner.forward([Segment(seq, len(ids) - 1, TokenTree.chain([ids[-1], *extra]))], all_logits=[True])
        runs.append((logits[0][0].clone(), dict(rows), list(order)))
        runner.cache.release(seq)
    (alone, alone_rows, names), (verified, verified_rows, _) = runs
    first = None
    for name in names:
        (out_a, in_a), (out_v, in_v) = alone_rows[name], verified_rows[name]
        if not torch.equal(out_a, out_v):
            first = {"module": name, "type": type(runner.model.get_submodule(name)).__name__,
                     "input_equal": None if in_a is None else torch.equal(in_a, in_v),
                     "output_max_diff": float((out_a - out_v).abs().max()),
                     "input_max_diff": None if in_a is None else float((in_a - in_v).abs().max())}
            break
    answers = {}
    for policy in ("incremental", "adaserve", "chain:4"):
        req = Request("q", ids, SamplingParams(max_tokens=args.tokens))
        eng = engine(policy)
        eng.add_request(req)
        while eng.has_work:
            eng.step()
        answers[policy] = tok.decode(req.output_ids)
    print(json.dumps({
        "benchmark": "row-invariance", "source": source_version(), "cpu": host_cpu(), "weights": args.weights,
        "kernels": args.kernels, "threads": args.threads, "prompt": args.prompt,
        "logits_row0_equal": torch.equal(alone, verified),
        "logits_row0_max_diff": float((alone - verified).abs().max()),
        "first_differing_module": first,
        "greedy_answers": answers,
        "speculation_equals_incremental": all(a == answers["incremental"] for a in answers.values()),
    }, indent=2, ensure_ascii=False))


if __name__ == "__main__":
    main()
