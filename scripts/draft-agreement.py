"""Top-1 agreement of drafts with their target's greedy token, teacher-forced, on standard-library source files.

For each draft: the share of positions where its argmax equals the target's over the first ``--tokens`` tokens of
``--files`` held-out files of this interpreter's standard library (held out as the demo pair's training held
them out: SHA-1 of the relative path = 0 mod 20), float32, Hugging Face transformers. Prints JSON.

    python scripts/draft-agreement.py --target models/demo/target --draft models/demo/draft
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import sysconfig
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer


def held_out_files(count: int) -> list[Path]:
    root = sysconfig.get_paths()["stdlib"]
    files = sorted(Path(root).glob("*.py"))
    return [f for f in files
            if int(hashlib.sha1(os.path.relpath(f, root).encode()).hexdigest(), 16) % 20 == 0][:count]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--target", required=True)
    ap.add_argument("--draft", action="append", required=True, help="a draft directory (repeat for several)")
    ap.add_argument("--files", type=int, default=12)
    ap.add_argument("--tokens", type=int, default=256)
    args = ap.parse_args()
    torch.set_num_threads(2)
    tok = AutoTokenizer.from_pretrained(args.target)
    files = held_out_files(args.files)
    ids = [torch.tensor([tok(f.read_text(errors="replace")[:20000])["input_ids"][: args.tokens]]) for f in files]
    with torch.no_grad():
        target = AutoModelForCausalLM.from_pretrained(args.target, dtype=torch.float32).eval()
        want = [target(x).logits.argmax(-1) for x in ids]
        out = {}
        for d in args.draft:
            draft = AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32).eval()
            got = [draft(x).logits.argmax(-1) for x in ids]
            out[d] = {"agreement": sum(int((a == b).sum()) for a, b in zip(want, got, strict=True))
                      / sum(a.numel() for a in want), "layers": draft.config.num_hidden_layers,
                      "hidden_size": draft.config.hidden_size}
    print(json.dumps({"target": args.target, "files": [f.name for f in files], "tokens_per_file": args.tokens,
                      "positions": sum(a.numel() for a in want), "torch": torch.__version__, "drafts": out}, indent=2))


if __name__ == "__main__":
    main()
