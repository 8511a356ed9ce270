"""``cache``: what pruned tokens receive (NOVA Table 7).

Base: ``nova``. Arms: FastVAR's static token cache (branch outputs of one earlier scale, resampled), NOVA's residual
cache reuse (the same block's residual at the previous scale) and identity (pruned slots get no update).
"""

from __future__ import annotations

from .base import Arm, FamilyContext, baseline_arm, family, swap

RESTORERS = ("static_cache", "residual_reuse", "identity")


@family("cache", "static token cache vs residual reuse vs identity (NOVA Table 7)")
def cache_family(ctx: FamilyContext) -> list[Arm]:
    arms = [baseline_arm()]
    for name in RESTORERS:
        arms.append(swap("nova", "restorer", name, role="base" if name == "residual_reuse" else "arm"))
    return arms
