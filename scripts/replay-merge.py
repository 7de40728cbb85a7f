"""Merge a new ``adaserve replay run`` result into a committed figure file: the figure's rows of the systems the new
run holds are renamed (kept, with what they were), the new cells join, points are recomputed, the run is listed in
the file's ``runs``, and the PNG is redrawn from the rows whose names carry no parenthesis (the current systems).

    PYTHONPATH=. .venv/bin/python scripts/replay-merge.py FIGURE.json NEW.json --rename " (f867793, no SLO floor)" \\
        --what "adaserve+ours rerun on ... (commit X)" --command "adaserve replay run ..." [--plot FIGURE.png]

Both files must come from the same pool (its sha256, or a re-recording alike: same_recording) and the same
settings; the merge refuses otherwise.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from adaserve.bench.replay_sweep import aggregate, plot_points, x_of


def same_recording(a: dict, b: dict) -> bool:
    """Two pool files recorded alike: the same model, source trace (by its sha256, not its file name), prompts
    drawn, output length, and the same per-class agreement summary (a re-recording's draft probabilities may
    differ in low digits, so the files' own sha256 may too)."""
    keys = ("model", "trace_sha256", "per_class", "output_tokens", "seed", "greedy")
    return all(a["meta"].get(k) == b["meta"].get(k) for k in keys) and a["summary"] == b["summary"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("figure", type=Path)
    ap.add_argument("new", type=Path)
    ap.add_argument("--rename", required=True, help="suffix for the figure's old rows of the new run's systems")
    ap.add_argument("--what", required=True, help="what the new run is, for the file's runs list")
    ap.add_argument("--command", required=True, help="the command that made the new run")
    ap.add_argument("--plot", type=Path)
    a = ap.parse_args()
    fig, new = json.loads(a.figure.read_text()), json.loads(a.new.read_text())
    if fig["pool"]["sha256"] != new["pool"]["sha256"] and not same_recording(fig["pool"], new["pool"]):
        raise SystemExit("the two runs replay different agreement pools")
    for key in ("device_profile", "baseline_tpot_ms", "max_batch", "prefill_chunk", "prompt_lengths"):
        if fig["settings"].get(key) != new["settings"].get(key):
            raise SystemExit(f"settings differ in {key}: {fig['settings'].get(key)} vs {new['settings'].get(key)}")
    systems = {c["system"] for c in new["cells"]}
    renamed = {s + a.rename for s in systems}
    if renamed & {c["system"] for c in fig["cells"]}:
        raise SystemExit(f"rows named {sorted(renamed)} exist already: choose another --rename")
    for c in fig["cells"]:
        if c["system"] in systems:
            c["system"] += a.rename
    fig["cells"] += new["cells"]
    order = list(dict.fromkeys(c["system"] for c in fig["cells"]))
    fig["cells"].sort(key=lambda c: (x_of(c["trace"], c["rate_rps"]), c["trace"], order.index(c["system"]), c["seed"]))
    fig["points"] = sorted(aggregate(fig["cells"]), key=lambda p: (p["axis"], p["x"], order.index(p["system"])))
    fig.setdefault("runs", []).append({"what": a.what, "command": a.command, "sweep_wall_s": new["sweep_wall_s"],
                                       "cells": len(new["cells"]), "settings": new["settings"], "pool": new["pool"]})
    a.figure.write_text(json.dumps(fig, indent=1))
    if a.plot:
        plot_points([p for p in fig["points"] if "(" not in p["system"]], a.plot)


if __name__ == "__main__":
    main()
