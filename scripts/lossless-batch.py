"""Greedy output with speculation against plain decoding on a batch of the default model's requests (losslessness).

The first ``--requests`` chat and coding prompts (half each, their last 256 tokens) arrive together and are
decoded greedily, ``--tokens`` each, by ``incremental`` and by each speculative policy; a request "parts" where
its tokens differ from plain decoding's (adaserve/bench/lossless_batch.py, the loop CI's test runs too). Prints
JSON. ``--kernels`` picks a CPU's kernel family; ``--device cuda`` runs the same batch on a GPU (its kernels and
attention backend, in the model's dtype: scripts/gpu-checklist.sh).

    PYTHONPATH=. python scripts/lossless-batch.py --weights int4 --kernels torch
    PYTHONPATH=. python scripts/lossless-batch.py --weights int4 --device cuda
"""

from __future__ import annotations

import argparse
import json
import os

import torch


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--weights", default="int4", choices=["float", "int8", "int4"])
    ap.add_argument("--kernels", default="native", choices=["torch", "native"], help="on a CPU")
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    ap.add_argument("--requests", type=int, default=16)
    ap.add_argument("--tokens", type=int, default=48)
    ap.add_argument("--policies", default="chain:4,adaserve")
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    os.environ["ADASERVE_NATIVE_KERNELS"] = "on" if args.kernels == "native" else "off"  # read at load
    from adaserve.bench.engine_only import host_cpu, source_version
    from adaserve.bench.lossless_batch import batch_prompts, decode_batch
    from adaserve.engine.loading.catalog import DEFAULT_MODEL, resolve

    torch.set_num_threads(args.threads)
    pair = resolve(DEFAULT_MODEL, progress=False, weights=args.weights)
    outcome = decode_batch(pair, batch_prompts(pair, args.requests), args.policies.split(","), weights=args.weights,
                           tokens=args.tokens, device=args.device)
    parted = outcome.parted()
    print(json.dumps({
        "benchmark": "lossless-batch", "source": source_version(), "cpu": host_cpu(), "model": DEFAULT_MODEL,
        "device": torch.cuda.get_device_name() if args.device == "cuda" else "cpu",
        "weights": args.weights, "kernels": args.kernels if args.device == "cpu" else "cuda", "threads": args.threads,
        "requests": args.requests, "tokens": args.tokens, "accepted_tokens": outcome.accepted, "parted": parted,
        "parted_count": {p: len(v) for p, v in parted.items()},
    }, indent=2))


if __name__ == "__main__":
    main()
