"""``cache``: what pruned tokens receive — NOVA's residual cache reuse vs FastVAR's static token cache (NOVA Table 7).

Base: ``nova``. NOVA compares its dynamic residual cache reuse (the same block's residual at the previous scale) with
FastVAR's static token caching ("*": branch outputs cached at one predetermined scale, resampled), and "for a fair
comparison across cache scales, t_est is adjusted accordingly for both methods". So the family is a grid over
``T_EST_VALUES``: for each t_est, both restorers under NOVA's adaptive activation with that t_est, and the static
cache taken at the **last scale before the earliest possible activation** — FastVAR's K−N rule (the last scale
before the pruned ones) applied to the adaptive start: with ``first_accelerated='after'`` the inflection test first
runs at the end of scale t_est+1 (1-indexed), so the earliest accelerated scale is 0-indexed t_est+1 and the cache
scale 0-indexed t_est ('at': one earlier). Every sample therefore finds the cache when it starts pruning (a
restorer that finds none raises). Beyond the paper: ``identity`` (pruned slots get no update) at NOVA's t_est.
Arms are named ``<restorer>@t_est=<t_est>``.
"""

from __future__ import annotations

import dataclasses

from var_core.accel.presets import get_preset

from .base import Arm, FamilyContext, baseline_arm, compose, family

T_EST_VALUES = (4, 5, 6)
NOVA_T_EST = 5


def earliest_accelerated(activation) -> int | None:
    """0-indexed earliest scale NOVA's entropy-inflection activation can accelerate (None: not that activation)."""
    if activation.component_name != "entropy_inflection":
        return None
    return activation.t_est + (0 if getattr(activation, "first_accelerated", "after") == "at" else 1)


def paired_cache_scale(activation) -> int | None:
    """The static cache scale paired with an activation: the last scale before its earliest accelerated one."""
    first = earliest_accelerated(activation)
    return None if first is None else max(0, first - 1)


def arm_name(restorer: str, t_est: int) -> str:
    return f"{restorer}@t_est={t_est}"


@family("cache", "NOVA's residual reuse vs FastVAR's static cache (paired with t_est) at t_est 4/5/6 (+ identity)",
        table="NOVA Table 7")
def cache_family(ctx: FamilyContext) -> list[Arm]:
    arms = [baseline_arm()]
    activation = get_preset("nova").activation
    for t_est in T_EST_VALUES:
        timing = [("activation", None, {"t_est": t_est})] if t_est != activation.t_est else []
        arms.append(compose("nova", arm_name("residual_reuse", t_est), *timing,
                            role="base" if t_est == NOVA_T_EST else "arm",
                            description=f"nova (residual cache reuse), t_est = {t_est}"))
        cache_scale = paired_cache_scale(dataclasses.replace(activation, t_est=t_est))
        arms.append(compose("nova", arm_name("static_cache", t_est), *timing,
                            ("restorer", "static_cache", {"cache_scale": cache_scale}),
                            description=f"nova with FastVAR's static token cache taken at scale {cache_scale} "
                                        f"(0-indexed: the last before the earliest activation), t_est = {t_est}"))
    arms.append(compose("nova", arm_name("identity", NOVA_T_EST),
                        *([("activation", None, {"t_est": NOVA_T_EST})] if activation.t_est != NOVA_T_EST else []),
                        ("restorer", "identity", {}),
                        description="nova with pruned slots left unchanged (identity; beyond the paper)"))
    return arms
