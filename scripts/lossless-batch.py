"""Greedy output with speculation against plain decoding on a batch of the default model's requests (losslessness).

The first ``--requests`` chat and coding prompts (half each, their last 256 tokens) arrive together and are
decoded greedily, ``--tokens`` each, by ``incremental`` and by each speculative policy; a request "parts" where
its tokens differ from plain decoding's. Prints JSON.

    PYTHONPATH=. python scripts/lossless-batch.py --weights int4 --kernels torch
"""

from __future__ import annotations

import argparse
import json
import os

import torch


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--weights", default="int4", choices=["float", "int8", "int4"])
    ap.add_argument("--kernels", default="torch", choices=["torch", "native"])
    ap.add_argument("--requests", type=int, default=16)
    ap.add_argument("--tokens", type=int, default=48)
    ap.add_argument("--policies", default="chain:4,adaserve")
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    os.environ["ADASERVE_NATIVE_KERNELS"] = "on" if args.kernels == "native" else "off"  # read at load
    from adaserve.bench.engine_only import host_cpu, source_version
    from adaserve.bench.workload import chat_prompts, humaneval_prompts
    from adaserve.engine.build import build_engine
    from adaserve.engine.loading.catalog import DEFAULT_MODEL, resolve
    from adaserve.engine.loading.chat import instruction_ids
    from adaserve.engine.loading.loader import load_tokenizer
    from adaserve.engine.request import Request
    from adaserve.engine.speculation.sampling import SamplingParams

    torch.set_num_threads(args.threads)
    pair = resolve(DEFAULT_MODEL, progress=False, weights=args.weights)
    tok = load_tokenizer(pair.target)
    half = args.requests // 2
    texts = [*chat_prompts()[:half], *humaneval_prompts()[: args.requests - half]]
    prompts = [instruction_ids(tok, t)[-256:] for t in texts]
    outputs: dict[str, list[list[int]]] = {}
    accepted: dict[str, int] = {}
    for policy in ("incremental", *args.policies.split(",")):
        built = build_engine(target=pair.target, draft=None if policy == "incremental" else pair.draft,
                             policy=policy, budget=64, profile=False, progress=False, weights=args.weights)
        reqs = [Request(f"r{i}", ids, SamplingParams(max_tokens=args.tokens)) for i, ids in enumerate(prompts)]
        built.engine.run([(0.0, r) for r in reqs])
        outputs[policy] = [r.output_ids for r in reqs]
        accepted[policy] = sum(sum(r.metrics.accepted_per_step) for r in reqs)
    parted = {p: [i for i, (a, b) in enumerate(zip(outputs[p], outputs["incremental"], strict=True)) if a != b]
              for p in outputs if p != "incremental"}
    print(json.dumps({
        "benchmark": "lossless-batch", "source": source_version(), "cpu": host_cpu(), "model": DEFAULT_MODEL,
        "weights": args.weights, "kernels": args.kernels, "threads": args.threads, "requests": args.requests,
        "tokens": args.tokens, "accepted_tokens": accepted, "parted": parted,
        "parted_count": {p: len(v) for p, v in parted.items()},
    }, indent=2))


if __name__ == "__main__":
    main()
