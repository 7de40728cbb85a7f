"""Peak resident memory of one rank while it loads its tensor-parallel shard (issue 31), on a CPU.

Builds a random Llama checkpoint (about 420 MB of fp32 weights, one safetensors file) unless given one
(``--model``: a directory or a model reference such as ``smollm2-135m-instruct``, the default model, converted
to float32 as ``adaserve`` does), then, for each TP size, loads every rank's shard in a fresh process and reads
the process's memory from ``/proc/self/status`` before and after: ``VmRSS`` (resident now), ``VmHWM`` (the
peak resident, which catches a transient copy), ``RssAnon`` / ``RssFile`` (private memory / mapped file
pages). Prints JSON.

``--modes views own`` also measures each rank with its shard copied out of the map afterwards (``own``).
Without ``--group`` the ranks load one after another and join no process group (loading needs none). With
``--group`` a size's ranks start together and join one gloo group, as a worker's ranks do, so they load at the
same time on the same host.

    PYTHONPATH=. python scripts/tp-load-memory.py [--model DIR|REF] [--sizes 1 2 4] [--group] [--out FILE]
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

def status_mb(field):  # VmHWM: peak RSS (unlike ru_maxrss, not inherited over fork); VmRSS, RssAnon, RssFile: now
    line = next(ln for ln in open("/proc/self/status") if ln.startswith(field + ":"))
    return int(line.split()[1]) / 1024

torch.set_num_threads(1)
from adaserve.engine.loading.loader import load_model
from adaserve.engine.model import parallel
path, rank, size, port, mode = Path(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]), sys.argv[5]
if port:  # a gloo group of `size` ranks, as the worker's (engine/ranks.py)
    tp = parallel.init_rank(rank, size, port=port, device=torch.device("cpu"), timeout_s=600)
else:
    tp = parallel.TensorParallel(rank, size)
before, hwm_before = status_mb("VmRSS"), status_mb("VmHWM")
anon_before, file_before = status_mb("RssAnon"), status_mb("RssFile")
model = load_model(path, device=torch.device("cpu"), tp=tp)
if mode == "own":  # the shard copied out of the file's map, as a rank copying it to its device would hold it
    from adaserve.engine.loading.loader import own_memory
    own_memory(model)
after, peak = status_mb("VmRSS"), status_mb("VmHWM")
anon_loaded, file_loaded = status_mb("RssAnon"), status_mb("RssFile")
for p in model.parameters():  # a tensor read whole may still be file pages not yet faulted in: touch it
    float(p.detach().float().sum())
touched = status_mb("VmHWM")
anon, file = status_mb("RssAnon"), status_mb("RssFile")
params = sum(p.numel() * p.element_size() for p in model.parameters())
if port:
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()
print(json.dumps({"rank": rank, "size": size, "mode": mode, "rss_before_mb": hwm_before, "vmrss_before_mb": before,
                  "rss_peak_mb": peak, "vmrss_after_mb": after, "rss_peak_touched_mb": touched,
                  "rss_anon_before_mb": anon_before, "rss_file_before_mb": file_before,
                  "rss_anon_loaded_mb": anon_loaded, "rss_file_loaded_mb": file_loaded,
                  "rss_anon_mb": anon, "rss_file_mb": file, "held_mb": params / 2**20,
                  "views_of_the_file": sum(not p.is_contiguous() or p.untyped_storage().nbytes() > p.nbytes
                                           for p in model.parameters()),
                  "dtype": str(next(model.parameters()).dtype), "threads": torch.get_num_threads()}))
"""


def resolve(model: str | None) -> Path:
    if model is None:
        from tests.models import make_checkpoint

        return make_checkpoint(Path(tempfile.mkdtemp()) / "llama-420mb", "llama", vocab_size=8192, hidden_size=1024,
                               intermediate_size=4096, num_hidden_layers=6, num_attention_heads=8,
                               num_key_value_heads=4)
    if Path(model).is_dir():
        return Path(model)
    from adaserve.engine.loading.catalog import model_dir

    return model_dir(model, progress=False, weights="float")


def run_size(model: Path, size: int, group: bool, mode: str) -> list[dict]:
    env = {**os.environ, "ADASERVE_FEW_ROW_KERNELS": "off"}
    if not group:
        outs = [subprocess.run([sys.executable, "-c", CHILD, str(model), str(r), str(size), "0", mode], check=True,
                               capture_output=True, text=True, env=env).stdout for r in range(size)]
    else:
        from adaserve.engine.model.parallel import free_port

        port = free_port() if size > 1 else 0
        procs = [subprocess.Popen([sys.executable, "-c", CHILD, str(model), str(r), str(size), str(port), mode],
                                  stdout=subprocess.PIPE, text=True, env=env) for r in range(size)]
        outs = [p.communicate()[0] for p in procs]
        if any(p.returncode for p in procs):
            raise SystemExit(f"a rank of size {size} failed: {[p.returncode for p in procs]}")
    rows = []
    for out in outs:
        row = json.loads(out.strip().splitlines()[-1])
        row["load_peak_mb"] = row["rss_peak_mb"] - row["rss_before_mb"]
        row["peak_with_weights_resident_mb"] = row["rss_peak_touched_mb"] - row["rss_before_mb"]
        rows.append(row)
        print(json.dumps(row), file=sys.stderr)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", help="a model directory or reference (default: a random 424 MB Llama)")
    ap.add_argument("--sizes", type=int, nargs="+", default=[1, 2, 4])
    ap.add_argument("--group", action="store_true", help="a size's ranks load together in one gloo group")
    ap.add_argument("--modes", nargs="+", choices=["views", "own"], default=["views"],
                    help="views: the loader as it is (CPU tensors stay views of the file's map); own: then copied "
                         "out of the map (own_memory), as a rank holding its shard in its own memory would")
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    model = resolve(args.model)
    file_mb = sum(f.stat().st_size for f in model.glob("*.safetensors")) / 2**20
    rows = [row for mode in args.modes for size in args.sizes for row in run_size(model, size, args.group, mode)]
    doc = {"model": args.model or "random llama", "checkpoint_mb": file_mb, "device": "cpu",
           "weights": "float (as stored)", "group": "gloo, ranks loading together" if args.group else "none",
           "command": "PYTHONPATH=. python scripts/tp-load-memory.py " + " ".join(sys.argv[1:]), "ranks": rows,
           "note": "rss_before_mb / rss_peak_mb: VmHWM (peak RSS) before and after load_model, so load_peak_mb is "
                   "the peak RSS growth during load; vmrss_before_mb / vmrss_after_mb: VmRSS before and after; "
                   "peak_with_weights_resident_mb: the peak growth after touching every parameter (a tensor "
                   "safetensors reads whole can stay as unfaulted file pages of the mmap, so RSS alone "
                   "under-counts it); held_mb: the rank's parameters (embedding and LM head replicated); "
                   "rss_anon_mb / rss_file_mb: private memory and mapped file pages once touched (file pages are "
                   "the page cache's, mapped around each slice read, shared between ranks and reclaimable)"}
    text = json.dumps(doc, indent=1)
    if args.out:
        args.out.write_text(text + "\n")
    print(text)


if __name__ == "__main__":
    main()
