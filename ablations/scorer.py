"""``scorer``: which per-token importance drives NOVA's pruning (NOVA Table 4).

Base: the ``nova`` preset (entropy-inflection activation, dual-linkage ratios, residual cache reuse); the arms swap
only the scorer: logit-lens entropy (NOVA's own), attention entropy (ToProVAR), MSE / distance to the mean
(FastVAR), LHEP high-frequency energy (LD-Pruning), and random scores (the floor any scorer must beat).
"""

from __future__ import annotations

from .base import Arm, FamilyContext, baseline_arm, family, swap

SCORERS = ("entropy", "attention", "mse", "lhep", "random")


@family("scorer", "entropy vs attention vs mse vs lhep vs random on NOVA's base (NOVA Table 4)")
def scorer_family(ctx: FamilyContext) -> list[Arm]:
    base = "nova"
    arms = [baseline_arm()]
    for name in SCORERS:
        arms.append(swap(base, "scorer", name, role="base" if name == "entropy" else "arm"))
    return arms
