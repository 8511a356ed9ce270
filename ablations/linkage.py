"""``linkage``: how the reduction ratio varies over scales and layers (NOVA Table 6).

Base: ``nova``. Arms:

* no linkage — a fixed ratio table on the last scales, once with FastVAR's ratios and once with SparseVAR's (read
  from those presets' schedules, so the tables stay in one place);
* scale-only — the scale-linkage ratio, the same for every layer;
* layer-only — the layer-linkage adjustment around a constant scale ratio;
* dual — both (NOVA's own).

The scale-only / layer-only variants are found in the schedule registry: a schedule registered as
``scale_linkage`` / ``layer_linkage``, or else an option of ``dual_linkage`` whose declared choices name the
variant (e.g. ``linkage="scale"``). If neither exists the arm reports what is missing.
"""

from __future__ import annotations

import dataclasses

from var_core.accel.presets import get_preset
from var_core.accel.registry import REGISTRIES

from .base import Arm, FamilyContext, baseline_arm, family, knob_alternatives, swap, swap_option

DEFAULT_TABLES = {"fastvar": (0.4, 0.5), "sparsevar": (0.5, 0.5)}


def _ratios_of(preset: str) -> tuple[float, ...]:
    try:
        schedule = get_preset(preset).schedule
        if schedule.component_name == "fixed_table":
            return tuple(schedule.ratios)
    except Exception:  # noqa: BLE001 - fall back to the documented table
        pass
    return DEFAULT_TABLES[preset]


def _variant(which: str) -> Arm:
    """The scale-only or layer-only schedule arm."""
    label = f"{which}-only"
    names = REGISTRIES["schedule"].names()
    for candidate in (f"{which}_linkage", f"{which}_only"):
        if candidate in names:
            return swap("nova", "schedule", candidate, arm_name=label)
    if "dual_linkage" in names:
        cls = REGISTRIES["schedule"].get("dual_linkage")
        for f in dataclasses.fields(cls.Config):
            choices = knob_alternatives(f) or ()
            for value in choices:
                if isinstance(value, str) and value.lower() in (which, f"{which}_only", f"{which}-only",
                                                                f"{which}_linkage"):
                    arm = swap("nova", "schedule", "dual_linkage", arm_name=label)
                    if arm.ok:
                        return swap_option(arm.config, "schedule", f.name, value, arm_name=label)
                    return arm
    return Arm(label, None, f"{which}-linkage only", error=(
        f"no {which}-only linkage here: register a schedule '{which}_linkage' or give 'dual_linkage' an option "
        f"with the choice '{which}' (registered schedules: {', '.join(names)})"))


@family("linkage", "no linkage (FastVAR / SparseVAR tables) vs scale-only vs layer-only vs dual (NOVA Table 6)")
def linkage_family(ctx: FamilyContext) -> list[Arm]:
    arms = [baseline_arm()]
    for preset in ("fastvar", "sparsevar"):
        ratios = _ratios_of(preset)
        arms.append(swap("nova", "schedule", "fixed_table", arm_name=f"no-linkage({preset})", ratios=ratios,
                         description=f"nova with {preset}'s fixed ratio table {ratios} on the last scales"))
    arms.append(_variant("scale"))
    arms.append(_variant("layer"))
    arms.append(swap("nova", "schedule", "dual_linkage", arm_name="dual", role="base"))
    return arms
