"""``activation``: from which scale acceleration starts (NOVA Table 5).

Base: ``nova``. Arms: acceleration fixed from each of the last four scales (``fixed``, ``start_scale`` −4 … −1,
counted from the end so the family fits any schedule) against the adaptive rules registered in the activation
registry (NOVA's entropy inflection and, when registered, ToProVAR's low-entropy ratio). ``never`` is the baseline.
"""

from __future__ import annotations

from var_core.accel.registry import REGISTRIES

from .base import Arm, FamilyContext, baseline_arm, family, swap

FIXED_STARTS = (-4, -3, -2, -1)


@family("activation", "fixed activation at several scales vs adaptive (NOVA Table 5)")
def activation_family(ctx: FamilyContext) -> list[Arm]:
    base = "nova"
    arms = [baseline_arm()]
    for start in FIXED_STARTS:
        arms.append(swap(base, "activation", "fixed", arm_name=f"fixed@{start}", start_scale=start,
                         description=f"nova, acceleration from scale {start} (0-indexed from the end) for every sample"))
    adaptive = [n for n in REGISTRIES["activation"].names() if n not in ("never", "fixed")]
    for name in ["entropy_inflection"] + [n for n in adaptive if n != "entropy_inflection"]:
        arms.append(swap(base, "activation", name, role="base" if name == "entropy_inflection" else "arm"))
    return arms
