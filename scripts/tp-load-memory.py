"""Peak resident memory of one rank while it loads its tensor-parallel shard (issue 31), on a CPU.

Builds a random Llama checkpoint (about 420 MB of fp32 weights, one safetensors file) unless given one,
then, for each TP size and each rank, loads that rank's shard in a fresh process (no process group is
needed to load) and reads the process's peak RSS (``VmHWM``) before and after. Prints JSON.

    PYTHONPATH=. python scripts/tp-load-memory.py [--model DIR] [--sizes 1 2 4] [--out FILE]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

CHILD = r"""
import json, sys, torch
from pathlib import Path

def status_mb(field):  # VmHWM: peak RSS (unlike ru_maxrss, not inherited over fork); RssAnon / RssFile: now
    line = next(ln for ln in open("/proc/self/status") if ln.startswith(field + ":"))
    return int(line.split()[1]) / 1024

def hwm_mb():
    return status_mb("VmHWM")

torch.set_num_threads(1)
from adaserve.engine.loading.loader import load_model
from adaserve.engine.model.parallel import TensorParallel
path, rank, size = Path(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
before = hwm_mb()
model = load_model(path, device=torch.device("cpu"), tp=TensorParallel(rank, size))
after = hwm_mb()
for p in model.parameters():  # a tensor read whole may still be file pages not yet faulted in: touch it
    float(p.float().sum())
touched = hwm_mb()
anon, file = status_mb("RssAnon"), status_mb("RssFile")
params = sum(p.numel() * p.element_size() for p in model.parameters())
print(json.dumps({"rank": rank, "size": size, "rss_before_mb": before, "rss_peak_mb": after,
                  "rss_peak_touched_mb": touched, "rss_anon_mb": anon, "rss_file_mb": file,
                  "held_mb": params / 2**20}))
"""


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", type=Path)
    ap.add_argument("--sizes", type=int, nargs="+", default=[1, 2, 4])
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    model = args.model
    if model is None:
        from tests.models import make_checkpoint

        model = make_checkpoint(Path(tempfile.mkdtemp()) / "llama-420mb", "llama", vocab_size=8192, hidden_size=1024,
                                intermediate_size=4096, num_hidden_layers=6, num_attention_heads=8,
                                num_key_value_heads=4)
    file_mb = sum(f.stat().st_size for f in model.glob("*.safetensors")) / 2**20
    rows = []
    for size in args.sizes:
        for rank in range(size):
            out = subprocess.run([sys.executable, "-c", CHILD, str(model), str(rank), str(size)], check=True,
                                 capture_output=True, text=True, env={**os.environ, "ADASERVE_FEW_ROW_KERNELS": "off"})
            row = json.loads(out.stdout.strip().splitlines()[-1])
            row["load_peak_mb"] = row["rss_peak_mb"] - row["rss_before_mb"]
            row["peak_with_weights_resident_mb"] = row["rss_peak_touched_mb"] - row["rss_before_mb"]
            rows.append(row)
            print(json.dumps(row), file=sys.stderr)
    doc = {"checkpoint_mb": file_mb, "device": "cpu", "ranks": rows,
           "note": "load_peak_mb: peak RSS growth during load_model; peak_with_weights_resident_mb: the same after "
                   "touching every parameter (a tensor safetensors reads whole can stay as unfaulted file pages "
                   "of the mmap, so RSS alone under-counts it); held_mb: the rank's parameters (embedding and "
                   "LM head replicated); rss_anon_mb / rss_file_mb: private memory and mapped file pages once "
                   "touched (file pages are the page cache's, mapped around each slice read, and reclaimable)"}
    text = json.dumps(doc, indent=1)
    if args.out:
        args.out.write_text(text + "\n")
    print(text)


if __name__ == "__main__":
    main()
