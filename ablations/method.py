"""``method``: every method preset side by side (each with its paper defaults), against the plain model."""

from __future__ import annotations

from var_core.accel.presets import OTHER_READINGS, PRESETS

from .base import Arm, FamilyContext, baseline_arm, family, preset_arm


@family("method", "all method presets side by side",
        table="the main comparisons (NOVA Table 1, ToProVAR Table 1, LD-Pruning Table 2)")
def method_family(ctx: FamilyContext) -> list[Arm]:
    """Each method once, at its authors' setting: the other readings of a method (``OTHER_READINGS``: our earlier
    readings, third-party code) are compared with it in the ``options`` family instead."""
    return [baseline_arm()] + [preset_arm(name) for name in PRESETS
                               if name != "baseline" and name not in OTHER_READINGS]
