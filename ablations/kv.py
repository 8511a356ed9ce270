"""``kv``: the KV-cache policy at 100 / 50 / 25 / 10 % budget — ScaleKV vs HACK vs a recency window, layer vs head
granularity, and ScaleKV on top of a token-pruning method (issue 29).

Base: ``scalekv`` (ScaleKV at the paper's 10 % budget, per-head positions). Arms: each KV policy (``keep_recent``,
``scalekv``, ``hack``) at every budget of :data:`BUDGETS` (100 % keeps every key: the policy's overhead alone);
ScaleKV with one set of positions per block (``granularity=layer``) at 10 %; ScaleKV with every block the same
budget (``selection=uniform``: no drafter/refiner split) at 10 %; and ``fastvar+scalekv`` — FastVAR's token pruning
with ScaleKV's cache on top, one arm (the seams are independent). The table's ``KV MiB/img`` / ``KV-bytes ratio``
columns are measured from the cache's tensors (the largest cache carried from one scale to a later one).
"""

from __future__ import annotations

from .base import Arm, FamilyContext, baseline_arm, compose, family

BUDGETS = (1.0, 0.5, 0.25, 0.1)
METHODS = ("keep_recent", "scalekv", "hack")
PAPER_BUDGET = 0.1


def _pct(budget: float) -> str:
    return f"{budget:.0%}"


@family("kv", "KV-cache policies at 100/50/25/10 % budget: ScaleKV vs HACK vs keep-recent, layer vs head, "
        "fastvar+scalekv", table="ScaleKV Table 1 (10 % budget), HACK")
def kv_family(ctx: FamilyContext) -> list[Arm]:
    arms: list[Arm] = [baseline_arm()]
    for method in METHODS:
        for budget in BUDGETS:
            role = "base" if (method == "scalekv" and budget == PAPER_BUDGET) else "arm"
            arms.append(compose("baseline", f"{method}@{_pct(budget)}", ("kv", method, {"budget": budget}),
                                role=role, description=f"KV policy {method}, {_pct(budget)} of the dense KV length "
                                                       f"kept after each scale"))
    arms.append(compose("baseline", f"scalekv@{_pct(PAPER_BUDGET)},layer",
                        ("kv", "scalekv", {"budget": PAPER_BUDGET, "granularity": "layer"}),
                        description="ScaleKV with one set of kept positions per block (scores summed over heads)"))
    arms.append(compose("baseline", f"scalekv@{_pct(PAPER_BUDGET)},uniform",
                        ("kv", "scalekv", {"budget": PAPER_BUDGET, "selection": "uniform"}),
                        description="ScaleKV without the drafter/refiner split (every block the same budget)"))
    arms.append(compose("fastvar", "fastvar+scalekv", ("kv", "scalekv", {"budget": PAPER_BUDGET}),
                        description="FastVAR's token pruning with ScaleKV's 10 % KV cache on top (one arm)"))
    return arms
