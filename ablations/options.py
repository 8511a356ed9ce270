"""``options``: every RECONSTRUCTED option of one method against its alternatives.

Base: the preset named by ``--method`` (default ``nova``). For every component of the method, every knob declared
with ``reconstructed=True`` whose values can be enumerated (declared ``choices``, or a categorical search space)
gets one arm per alternative value, all else fixed. The options are discovered from the knob metadata, so a newly
marked option joins the study without an edit here.

Where a method has another complete reading shipped as a preset (:data:`READINGS`, e.g. a third-party
implementation), that preset is one more arm: the whole reading against the base, beside the one-option swaps.
"""

from __future__ import annotations

import dataclasses

from var_core.accel.policy import COMPONENT_KINDS
from var_core.accel.presets import OTHER_READINGS

from .base import Arm, FamilyContext, baseline_arm, family, knob_alternatives, preset_arm, swap_option


# base method -> presets that read the same method otherwise (each one arm of the ``options`` family)
# method -> its other complete readings, both ways (var_core.accel.presets.OTHER_READINGS: e.g. sparsevar against
# the third-party code sparsevar_lvar, stagevar against our earlier stagevar_sampled)
READINGS: dict[str, tuple[str, ...]] = {}
for _reading, _method in OTHER_READINGS.items():
    READINGS[_method] = READINGS.get(_method, ()) + (_reading,)
    READINGS[_reading] = READINGS.get(_reading, ()) + (_method,)


def reconstructed_options(config) -> list[tuple[str, str, object, tuple]]:
    """``(kind, option, current value, alternatives)`` for every enumerable RECONSTRUCTED knob of a config."""
    out = []
    for kind in COMPONENT_KINDS:
        part = getattr(config, kind)
        for f in dataclasses.fields(part):
            if not f.metadata.get("reconstructed"):
                continue
            values = knob_alternatives(f)
            if values:
                out.append((kind, f.name, getattr(part, f.name), values))
    for f in dataclasses.fields(config):
        if f.metadata.get("reconstructed") and knob_alternatives(f):
            out.append(("policy", f.name, getattr(config, f.name), knob_alternatives(f)))
    return out


@family("options", "each RECONSTRUCTED option of a method (--method, default nova) against its alternatives")
def options_family(ctx: FamilyContext) -> list[Arm]:
    method = ctx.method
    base = preset_arm(method, role="base")
    arms = [baseline_arm(), base]
    if not base.ok:
        return arms
    for kind, option, current, values in reconstructed_options(base.config):
        for value in values:
            if value == current:
                continue
            arms.append(swap_option(base.config, kind, option, value))
    for reading in READINGS.get(method, ()):
        arms.append(preset_arm(reading, arm_name=f"reading={reading}"))
    return arms
