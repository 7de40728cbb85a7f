"""Greedy answers of the default model served as float, int8 and int4 (issue 35): does a quantized path keep
the model's answers? Incremental decoding, one thread, a few chat questions; prints JSON.

    python scripts/weights-answers.py [--json OUT] [--native] [--llama-completion PATH]

int8 and int4 run on torch's kernels (``ADASERVE_NATIVE_KERNELS=off``, bfloat16 activations); ``--native``: also on
the integer kernels (``=on``, int8 activations; what ``auto`` serves where they build);
``--llama-completion``: llama.cpp's ``llama-completion`` binary, asked the same prompts (the chat template
applied here, greedy, one thread) on the shipped GGUF, for llama.cpp's answers beside ours.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
from pathlib import Path

import torch

from adaserve.engine.build import build_engine
from adaserve.engine.loading.catalog import resolve, smollm2_gguf
from adaserve.engine.loading.chat import instruction_ids
from adaserve.engine.loading.loader import load_tokenizer
from adaserve.engine.request import Request
from adaserve.engine.speculation.sampling import SamplingParams

QUESTIONS = ("What is the capital of France?", "Name three primary colors.", "What is 12 times 12?",
             "Write a Python function that reverses a string.")


def answers(weights: str, max_tokens: int = 32) -> list[str]:
    pair = resolve("smollm2-135m-instruct", with_draft=False, progress=False, weights=weights)
    tok = load_tokenizer(pair.target)
    eng = build_engine(target=pair.target, draft=None, policy="incremental", budget=16, profile=False,
                       progress=False, weights=weights).engine
    out = []
    for i, q in enumerate(QUESTIONS):
        r = Request(f"q{i}", instruction_ids(tok, q), SamplingParams(max_tokens=max_tokens))
        eng.add_request(r)
        while eng.has_work:
            eng.step()
        out.append(tok.decode(r.output_ids))
    return out


def llama_answers(binary: Path, max_tokens: int = 32) -> list[str]:
    """llama.cpp's greedy answers on the shipped GGUF, from the same templated prompt text."""
    pair = resolve("smollm2-135m-instruct", with_draft=False, progress=False)
    tok = load_tokenizer(pair.target)
    out = []
    for q in QUESTIONS:
        prompt = tok.decode(instruction_ids(tok, q))
        run = subprocess.run([str(binary), "-m", str(smollm2_gguf()), "-p", prompt, "-n", str(max_tokens), "--temp",
                              "0", "-t", "1", "-no-cnv", "--no-warmup", "--no-display-prompt"],
                             capture_output=True, text=True, check=True, timeout=300)
        out.append(run.stdout.strip())
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--json", type=Path)
    p.add_argument("--native", action="store_true", help="int8 and int4 on the integer kernels too")
    p.add_argument("--llama-completion", type=Path, help="llama.cpp's llama-completion binary")
    args = p.parse_args()
    torch.set_num_threads(1)
    os.environ["ADASERVE_NATIVE_KERNELS"] = "off"  # torch's kernels first, whatever auto picks (read at load)
    served = {w: dict(zip(QUESTIONS, answers(w), strict=True)) for w in ("float", "int8", "int4")}
    if args.native:
        os.environ["ADASERVE_NATIVE_KERNELS"] = "on"  # read at each layer's load (native_kernels.chosen)
        for w in ("int8", "int4"):
            served[f"{w}, integer kernels"] = dict(zip(QUESTIONS, answers(w), strict=True))
    if args.llama_completion:
        served["llama.cpp, Q4_1 as is"] = dict(zip(QUESTIONS, llama_answers(args.llama_completion), strict=True))
    report = {"model": "smollm2-135m-instruct", "policy": "incremental", "threads": 1, "torch": torch.__version__,
              "answers": served}
    text = json.dumps(report, indent=2, ensure_ascii=False)
    if args.json:
        args.json.write_text(text + "\n")
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
