"""Wall-clock bench runs of several seeds side by side: is a system level with the best other, seed by seed?

    python scripts/wall-clock-table.py --system adaserve+ours FILE [FILE ...] [--json OUT]

Each FILE is one ``adaserve bench --json`` result (one seed, the same policies and rates). Per rate: every
policy's SLO attainment in each file, and the system's gap to the best other policy of the same file (the same
run, so the same machine state for both), with the gaps' mean, min and max over the files; then the system's mean
TPOT over each other policy's, per file, and its mean gap to each other policy with that mean's 95% interval
(Student's t over the files' paired gaps) and how many files put it ahead and behind. A gap inside the spread of the
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
            "gap_vs": {p: [round(x, 4) for x in v] for p, v in vs.items()},
            "gap_ci95_vs": {p: ci95(v) for p, v in vs.items()},
            "tpot_ratio_vs": {p: [round(x, 3) for x in v] for p, v in tpot_ratio.items()},
        })
    return {"system": system, "files": len(docs), "policies": policies, "rates": rows}


# two-sided 95% quantiles of Student's t by degrees of freedom (1-30); beyond, the normal's 1.96
T975 = (12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228, 2.201, 2.179, 2.160, 2.145, 2.131,
        2.120, 2.110, 2.101, 2.093, 2.086, 2.080, 2.074, 2.069, 2.064, 2.060, 2.056, 2.052, 2.048, 2.045, 2.042)


def ci95(gaps: list[float]) -> list[float] | None:
    """The 95% interval of the mean of paired gaps (one per file: the same arrivals, back to back), by Student's
    t; None for fewer than two files. An interval that holds 0 is a tie at this many seeds."""
    if len(gaps) < 2:
        return None
    m, half = statistics.fmean(gaps), statistics.stdev(gaps) / len(gaps) ** 0.5
    t = T975[len(gaps) - 2] if len(gaps) - 1 <= len(T975) else 1.96
    return [round(m - t * half, 4), round(m + t * half, 4)]


def markdown(s: dict) -> str:
    head = ["rate (req/s)", *s["policies"], f"{s['system']} - best other: per file; mean [min, max]"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for row in s["rates"]:
        att = [" / ".join("-" if v is None else f"{v:.3f}" for v in row["attainment"][p]) for p in s["policies"]]
        g = row["gap_to_best_other"]
        gap = (" / ".join(f"{x:+.3f}" for x in g) + f"; {row['gap_mean']:+.3f} [{row['gap_min']:+.3f}, "
               f"{row['gap_max']:+.3f}]") if g else "-"
        lines.append(f"| {row['rate_rps']:g} | " + " | ".join(att) + f" | {gap} |")
    others = [p for p in s["policies"] if p != s["system"]]
    lines += ["", f"| rate (req/s) | {s['system']} - other: mean gap [95% interval], files ahead / behind |",
              "|---|---|"]
    for row in s["rates"]:
        cells = []
        for p in others:
            g, ci = row["gap_vs"].get(p, []), row["gap_ci95_vs"].get(p)
            if g:
                interval = f" [{ci[0]:+.3f}, {ci[1]:+.3f}]" if ci else ""
                ahead, behind = sum(x > 0 for x in g), sum(x < 0 for x in g)
                cells.append(f"{p} {statistics.fmean(g):+.3f}{interval}, {ahead} / {behind}")
        lines.append(f"| {row['rate_rps']:g} | " + "; ".join(cells) + " |")
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
