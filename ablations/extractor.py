"""``extractor``: the high-frequency energy extractor inside LD-Pruning's LHEP scorer.

Base: ``ldpruning``. Arms: every value of the LHEP scorer's ``extractor`` knob (haar, fft, laplacian, sobel, …),
read from the knob's declared choices so a new extractor joins the study without an edit here.
"""

from __future__ import annotations

from .base import Arm, FamilyContext, baseline_arm, component_choices, family, swap_option

FALLBACK = ("haar", "fft", "laplacian", "sobel")


@family("extractor", "haar vs fft vs laplacian vs sobel inside LD-Pruning's LHEP scorer",
        table="LD-Pruning Fig. 6 (right)")
def extractor_family(ctx: FamilyContext) -> list[Arm]:
    try:
        choices = component_choices("scorer", "lhep", "extractor") or FALLBACK
    except Exception:  # noqa: BLE001 - the scorer is not registered: the arms report it
        choices = FALLBACK
    arms = [baseline_arm()]
    for name in choices:
        arms.append(swap_option("ldpruning", "scorer", "extractor", name, arm_name=f"extractor={name}",
                                role="base" if name == "haar" else "arm"))
    return arms
