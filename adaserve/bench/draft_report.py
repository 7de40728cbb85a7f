"""What several drafts did in a bench run: who served whom, per class, and the selector's regret.

    served by          a request's draft = the one that ran most of its verifications
    slot regret        sum over slots of (g* - r_slot) * slot seconds, in tokens: what the run lost against
                       running every slot at the pooled goodput g* of the best draft (Spin's Eq. 6 with
                       the switch cost inside r_slot, lambda = 1)
    regret in hindsight  goodput of the best fixed-draft variant (POLICY@dN, same tree policy, same
                       workload) minus the selector variant's: the bench's own comparison
"""

from __future__ import annotations

from collections import Counter
from typing import Any

from adaserve.engine.model.runner import ModelRunner
from adaserve.engine.multi_draft import DraftPool
from adaserve.engine.request import Request
from adaserve.engine.speculation.policies import split_policy


def size_of(runner: ModelRunner) -> tuple[float, float]:
    """(parameters, KV bytes per token) of a loaded model: what the simulated price of a draft scales by."""
    cfg = runner.model.cfg
    params = float(sum(p.numel() for p in runner.model.parameters()))
    kv = 2.0 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * runner.dtype.itemsize
    return params, kv


def draft_use(requests: list[Request], classes: dict[str, str], names: list[str],
              pool: DraftPool | None) -> dict[str, Any]:
    """Per class: requests served by each draft and each draft's share of verifications; the slots."""
    served: dict[str, Counter[str]] = {}
    steps: dict[str, Counter[str]] = {}
    for r in requests:
        cls = classes[r.request_id]
        per = r.metrics.drafts_per_step or ([0] * len(r.metrics.accepted_per_step) if len(names) == 1 else [])
        if not per:
            continue
        counts = Counter(names[i] for i in per)
        served.setdefault(cls, Counter())[counts.most_common(1)[0][0]] += 1
        steps.setdefault(cls, Counter()).update(counts)
    out: dict[str, Any] = {
        "names": names,
        "served_by_class": {c: dict(v) for c, v in sorted(served.items())},
        "verification_share_by_class": {c: {k: n / sum(v.values()) for k, n in v.items()}
                                        for c, v in sorted(steps.items())},
    }
    if pool is None:
        return out
    slots = [s for _, s in pool.use.slots]
    per_arm = []
    for j, name in enumerate(names):
        mine = [s for s in slots if s.arm == j]
        tok, sec = sum(s.tokens for s in mine), sum(s.seconds for s in mine)
        per_arm.append({"draft": name, "slots": len(mine), "tokens": tok, "seconds": sec,
                        "steady_goodput": tok / sec if sec else None})
    best = max((a["steady_goodput"] or 0.0) for a in per_arm)
    regret = sum((best - s.reward) * (s.seconds + s.switch_s) for s in slots)
    out.update({"selector": pool.selector.name, "slot_iters": pool.slot_iters, "slots": len(slots),
                "switches": pool.use.switches, "switch_s": pool.use.switch_s,
                "switch_tokens": pool.use.switch_tokens,
                # iterations that ran more than one draft: every request waited for every group's forwards
                "iterations": pool.use.iterations, "mixed_iterations": pool.use.mixed_iterations,
                "per_draft": per_arm, "slot_regret_tokens": regret,
                # the draft of every slot, in the order the slots ended: where exploration went, and when
                "slot_order": "".join(str(s.arm) for s in slots)})
    return out


def draft_regret(by_label: dict[str, dict]) -> dict[str, Any]:
    """Every selector variant against the best fixed-draft variant of the same tree policy, in hindsight."""
    fixed: dict[str, list[str]] = {}
    chosen: list[str] = []
    for label in by_label:
        tree, selector = split_policy(label)
        if selector is not None and selector.startswith("d") and selector[1:].isdigit():
            fixed.setdefault(tree, []).append(label)
        elif "drafts" in by_label[label] and "selector" in by_label[label]["drafts"]:
            chosen.append(label)
    out: dict[str, Any] = {}
    for label in chosen:
        tree = split_policy(label)[0]
        if not fixed.get(tree):
            continue
        best = max(fixed[tree], key=lambda k: by_label[k]["goodput_tok_s"])
        g, g_best = by_label[label]["goodput_tok_s"], by_label[best]["goodput_tok_s"]
        out[label] = {"best_fixed": best, "best_fixed_goodput_tok_s": g_best, "goodput_tok_s": g,
                      "regret_tok_s": g_best - g, "goodput_vs_best_fixed": g / g_best if g_best else None,
                      "attainment": by_label[label]["slo_attainment"],
                      "best_fixed_attainment": by_label[best]["slo_attainment"]}
    return out
