"""Spin's selectors against the best fixed draft over several seeds: one JSON summary and one plot.

    python scripts/spin-seeds.py OUT.json OUT.png RUN_seed0.json RUN_seed1.json ...

Each RUN file is an `adaserve bench` report with the selector variants (spin, spin-eps, spin-length) and
the fixed-draft variants (spin@d0, spin@d1) of one seed. Per seed and policy the summary keeps goodput,
its ratio to the best fixed draft of that seed, attainment, SLO-met tokens (goodput x the run's
simulated length) and the draft report's slots and mixed iterations; across seeds, the mean and range
of each ratio. Every setting that shaped a run stays in its RUN file.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

from adaserve.bench.draft_report import draft_regret

SELECTORS = ("spin", "spin-eps", "spin-length")


def row(r: dict[str, Any], best: float) -> dict[str, Any]:
    drafts = r.get("drafts", {})
    return {"goodput_tok_s": r["goodput_tok_s"], "vs_best_fixed": r["goodput_tok_s"] / best,
            "slo_attainment": r["slo_attainment"], "slo_met_tokens": round(r["goodput_tok_s"] * r["wall_s"]),
            "mean_tpot_ms": r["mean_tpot_ms"], "outputs_equal_reference": r["outputs_equal_reference"],
            "attainment_by_class": {c: v["slo_attainment"] for c, v in sorted(r["per_class"].items())},
            "served_by_class": drafts.get("served_by_class"),
            "slots": [a["slots"] for a in drafts.get("per_draft", [])] or None,
            "switches": drafts.get("switches"), "mixed_iterations": drafts.get("mixed_iterations"),
            "iterations": drafts.get("iterations")}


def summarise(paths: list[Path]) -> dict[str, Any]:
    seeds: dict[str, Any] = {}
    for p in paths:
        report = json.loads(p.read_text())
        by = {r["policy"]: r for r in report["results"]}
        best_fixed = next(iter(draft_regret(by).values()))["best_fixed"]  # the bench's own comparison
        best = by[best_fixed]["goodput_tok_s"]
        seed = str(report["config"]["seed"])
        seeds[seed] = {"file": str(p), "best_fixed": best_fixed,
                       "names": report["config"]["draft_names"],
                       "policies": {k: row(by[k], best) for k in by}}
    ratios = {k: [s["policies"][k]["vs_best_fixed"] for s in seeds.values() if k in s["policies"]] for k in SELECTORS}
    return {"seeds": seeds, "vs_best_fixed": {k: {"mean": sum(v) / len(v), "min": min(v), "max": max(v)}
                                              for k, v in ratios.items() if v}}


def table(summary: dict[str, Any]) -> str:
    """The summary as the markdown table docs/benchmarks.md shows."""
    lines = ["| seed | policy | goodput (tok/s) | vs best fixed | attainment | coding / chat / summ. | SLO-met tokens "
             "| mean TPOT (ms) | slots default / small | switches | iterations with both drafts |",
             "|" + "---|" * 11]
    for seed in sorted(summary["seeds"], key=int):
        for k, v in summary["seeds"][seed]["policies"].items():
            cls = v["attainment_by_class"]
            both = f"{v['mixed_iterations']} / {v['iterations']}" if v["iterations"] else "-"
            slots = " / ".join(map(str, v["slots"])) if v["slots"] else "-"
            lines.append(f"| {seed} | {k} | {v['goodput_tok_s']:.1f} | {v['vs_best_fixed']:.3f} | "
                         f"{v['slo_attainment']:.3f} | {cls['coding']:.2f} / {cls['chat']:.2f} / "
                         f"{cls['summarization']:.2f} | {v['slo_met_tokens']} | {v['mean_tpot_ms']:.2f} | "
                         f"{slots} | {v['switches'] or '-'} | {both} |")
    return "\n".join(lines)


def shares(summary: dict[str, Any]) -> str:
    """Requests served by each draft (the one that ran most of a request's verifications) per class,
    summed over the seeds, as a markdown table: ``default / small`` per class."""
    lines = ["| policy | coding | chat | summarization |", "|---|---|---|---|"]
    for k in SELECTORS:
        total: dict[str, list[int]] = {}
        for seed in summary["seeds"].values():
            names = seed["names"]
            for cls, served in (seed["policies"][k]["served_by_class"] or {}).items():
                row_ = total.setdefault(cls, [0] * len(names))
                for j, name in enumerate(names):
                    row_[j] += served.get(name, 0)
        cells = [" / ".join(map(str, total.get(c, []))) for c in ("coding", "chat", "summarization")]
        lines.append(f"| {k} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def plot(summary: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    seeds = sorted(summary["seeds"], key=int)
    fig, ax = plt.subplots(figsize=(8, 3.6))
    width = 0.8 / len(SELECTORS)
    for i, k in enumerate(SELECTORS):
        ys = [summary["seeds"][s]["policies"][k]["vs_best_fixed"] for s in seeds]
        ax.bar([j + i * width for j in range(len(seeds))], ys, width, label=k)
    ax.axhline(1.0, color="black", lw=0.8)
    ax.axhline(0.95, color="grey", lw=0.8, ls="--", label="best fixed - 5%")
    ax.set_xticks([j + width for j in range(len(seeds))], [f"seed {s}" for s in seeds])
    ax.set_ylabel("goodput / best fixed draft")
    ax.set_ylim(0.4, 1.2)
    ax.legend(ncol=4, fontsize=8, loc="upper left")
    ax.set_title("Two drafts, simulated A100x4 / 70B clock, 16 req/s, SLO scale 0.7")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv: list[str]) -> int:
    if len(argv) < 3:
        print(__doc__, file=sys.stderr)
        return 2
    summary = summarise([Path(p) for p in argv[2:]])
    Path(argv[0]).write_text(json.dumps(summary, indent=2) + "\n")
    plot(summary, Path(argv[1]))
    print(table(summary))
    print(shares(summary))
    print(json.dumps(summary["vs_best_fixed"], indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
