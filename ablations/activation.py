"""``activation``: from which scale acceleration starts (NOVA Table 5).

Base: ``nova``; every arm keeps its adaptive dual-linkage ratios ("all methods adopt the adaptive dual-linkage ratio
function to determine reduction ratio at each scale"). NOVA compares its adaptive start with fixed acceleration
scales, naming the early **6th-scale** arm (aggressive speedup, quality loss) and the delayed **10th-scale** arm
(quality kept, less speedup); the fixed arms here are every start from the 6th to the 10th scale, counted from the
first scale (1-indexed, NOVA's numbering, like its t_est = 5; arm ``fixed@6th`` accelerates scales 6, 7, … i.e.
0-indexed 5 onward), against NOVA's entropy inflection and — beyond the paper — ToProVAR's low-entropy ratio
(``low_entropy_ratio``) and any other adaptive rule registered in the activation registry. A start beyond a model's
schedule accelerates nothing (on a 7-scale model ``fixed@8th`` … ``fixed@10th`` equal the baseline).
"""

from __future__ import annotations

from var_core.accel.registry import REGISTRIES

from .base import Arm, FamilyContext, baseline_arm, compose, family, swap

FIXED_STARTS = (6, 7, 8, 9, 10)  # 1-indexed scale numbers (NOVA Table 5: "6-th scale" ... "10-th scale")


def fixed_arm_name(number: int) -> str:
    return f"fixed@{number}th"


@family("activation", "fixed starts at the 6th … 10th scale vs NOVA's adaptive inflection (+ ToProVAR's rule)",
        table="NOVA Table 5")
def activation_family(ctx: FamilyContext) -> list[Arm]:
    base = "nova"
    arms = [baseline_arm()]
    for number in FIXED_STARTS:
        arms.append(swap(base, "activation", "fixed", arm_name=fixed_arm_name(number), start_scale=number - 1,
                         description=f"nova, acceleration fixed from the {number}th scale (1-indexed) for every "
                                     f"sample"))
    arms.append(compose(base, "entropy_inflection", role="base",
                        description="nova itself: NOVA's adaptive start (inflection of the scale-entropy growth)"))
    for name in REGISTRIES["activation"].names():
        if name not in ("never", "fixed", "entropy_inflection"):
            arms.append(swap(base, "activation", name, arm_name=name,
                             description=f"nova with the {name} activation (beyond the paper)"))
    return arms
