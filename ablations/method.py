"""``method``: every method preset side by side (each with its paper defaults), against the plain model."""

from __future__ import annotations

from var_core.accel.presets import PRESETS

from .base import Arm, FamilyContext, baseline_arm, family, preset_arm


@family("method", "all method presets side by side",
        table="the main comparisons (NOVA Table 1, ToProVAR Table 1, LD-Pruning Table 2)")
def method_family(ctx: FamilyContext) -> list[Arm]:
    return [baseline_arm()] + [preset_arm(name) for name in PRESETS if name != "baseline"]
