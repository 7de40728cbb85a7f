"""Wall-clock bench runs of several seeds side by side: is a system level with the best other, seed by seed?

    python scripts/wall-clock-table.py --system adaserve+ours FILE [FILE ...] [--json OUT]

Each FILE is one ``adaserve bench --json`` result (one seed, the same policies and rates). Per rate: every
policy's SLO attainment in each file, and the system's gap to the best other policy of the same file (the same
run, so the same machine state for both), with the gaps' mean, min and max over the files; then the system's mean
TPOT over each other policy's, per file, and its mean gap to each other policy. A gap inside the spread of the
gaps is a tie; and the best of several equal systems' noisy cells is above each of them on average, so the gap to
the best other leans negative even between equals (the per-policy gaps do not). Prints a markdown table
and a JSON summary (also written to ``--json``).
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path


def cells(doc: dict) -> dict[tuple[float, str], dict]:
    return {(float(r["rate_rps"]), r["policy"]): r for r in doc["results"]}


def summary(docs: list[dict], system: str) -> dict:
    per_file = [cells(d) for d in docs]
    rates = sorted({rate for c in per_file for rate, _ in c})
    policies = sorted({p for c in per_file for _, p in c}, key=lambda p: (p != system, p))
    rows = []
    for rate in rates:
        att = {p: [c[(rate, p)]["slo_attainment"] if (rate, p) in c else None for c in per_file] for p in policies}
        gaps, best_names, tpot_ratio, vs = [], [], {}, {}
        for c in per_file:
            mine = c.get((rate, system))
            others = [r for (x, p), r in c.items() if x == rate and p != system]
            if mine is None or not others:
                continue
            best = max(others, key=lambda r: r["slo_attainment"])
            gaps.append(mine["slo_attainment"] - best["slo_attainment"])
            best_names.append(best["policy"])
            for r in others:
                vs.setdefault(r["policy"], []).append(mine["slo_attainment"] - r["slo_attainment"])
                if r["mean_tpot_ms"] and mine["mean_tpot_ms"]:
                    tpot_ratio.setdefault(r["policy"], []).append(mine["mean_tpot_ms"] / r["mean_tpot_ms"])
        rows.append({
            "rate_rps": rate,
            "attainment": att,
            "gap_to_best_other": gaps,
            "best_other": best_names,
            "gap_mean": statistics.fmean(gaps) if gaps else None,
            "gap_min": min(gaps, default=None),
            "gap_max": max(gaps, default=None),
            "gap_mean_vs": {p: statistics.fmean(v) for p, v in vs.items()},
            "tpot_ratio_vs": {p: [round(x, 3) for x in v] for p, v in tpot_ratio.items()},
        })
    return {"system": system, "files": len(docs), "policies": policies, "rates": rows}


def markdown(s: dict) -> str:
    head = ["rate (req/s)", *s["policies"], f"{s['system']} - best other: per file; mean [min, max]"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for row in s["rates"]:
        att = [" / ".join("-" if v is None else f"{v:.3f}" for v in row["attainment"][p]) for p in s["policies"]]
        g = row["gap_to_best_other"]
        gap = (" / ".join(f"{x:+.3f}" for x in g) + f"; {row['gap_mean']:+.3f} [{row['gap_min']:+.3f}, "
               f"{row['gap_max']:+.3f}]") if g else "-"
        lines.append(f"| {row['rate_rps']:g} | " + " | ".join(att) + f" | {gap} |")
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("files", nargs="+", type=Path)
    p.add_argument("--system", default="adaserve+ours")
    p.add_argument("--json", type=Path)
    a = p.parse_args()
    s = summary([json.loads(f.read_text()) for f in a.files], a.system)
    s["inputs"] = [str(f) for f in a.files]
    print(markdown(s))
    if a.json is not None:
        a.json.write_text(json.dumps(s, indent=1) + "\n")


if __name__ == "__main__":
    main()
