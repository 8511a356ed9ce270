"""``linkage``: how the reduction ratio varies over scales and layers (NOVA Table 6).

Base: ``nova``; every arm keeps NOVA's adaptive activation. NOVA Table 6 has "two no-linkage and three
single-linkage variants" besides dual linkage, with † marking variants whose scale-level ratios are fixed
following FastVAR and ‡ following SparseVAR:

* ``no-linkage†`` / ``no-linkage‡`` — a fixed ratio table on the last scales (``fixed_table``), no layer term;
* ``layer-only†`` / ``layer-only‡`` — the layer-linkage adjustment around those fixed scale-level ratios;
* ``scale-only`` — the scale-linkage ratio, the same for every layer;
* ``dual`` — both (NOVA's own).

FastVAR's table is its **real** one, FOUND(code, specs/methods.md errata 7): on Infinity-1024 scales 32 and 40
lose 40 % / 50 % of their tokens and 48 and 64 are not generated (100 %), i.e. ``(0.4, 0.5, 1.0, 1.0)`` on the
last four scales (by position from the end on other schedules; a 1.0 scale is skipped once every sample of the
batch is accelerated). SparseVAR's table (its code is unreleased) is read from the ``sparsevar`` preset.

Matched operating points (issue 28): a layer-only arm is its no-linkage arm with the ``fixed_table`` schedule
replaced by ``layer_linkage`` carrying the SAME table as its per-scale base (``scale_ratios``): the same scales are
pruned (the table's < 1 entries) and the same scales are left out (its 1.0 entries), and each pruned scale's
ratio moves only by the layer term, ``|Δr| ≤ λ/4`` (the sigmoid's slope is at most 1/4), so the two arms differ
in one thing, the layer linkage. (Until issue 28 the layer-only arms used the mean of the table on every
accelerated scale: FLOPs 0.586 vs the no-linkage arm's 0.631 on a 4-sample testbed run.) The other knobs of the
layer linkage (λ, first-block reference, ratio meaning) are NOVA's own dual-linkage settings.

Analysis: the per-layer logit-lens entropy maps of NOVA Fig. 4(c) (as in the ``scorer`` family).
"""

from __future__ import annotations

import dataclasses

from var_core.accel.policy import component_config
from var_core.accel.presets import get_preset
from var_core.accel.registry import REGISTRIES

from .base import Arm, FamilyContext, baseline_arm, compose, family
from .scorer import layer_entropy_analysis  # NOVA Fig. 4(c), the layer-level analysis behind the layer linkage

# FastVAR's released Infinity-1024 table {32: 0.4, 40: 0.5, 48: 1.0, 64: 1.0}, aligned to the last four scales
FASTVAR_TABLE = (0.4, 0.5, 1.0, 1.0)
SPARSEVAR_FALLBACK = (0.5, 0.5)
TABLE_OPTIONS = ("scale_ratios", "base_ratios", "ratios", "r_table")
MARKS = {"fastvar": "†", "sparsevar": "‡"}


def sparsevar_table() -> tuple[float, ...]:
    try:
        schedule = get_preset("sparsevar").schedule
        if schedule.component_name == "fixed_table" and not getattr(schedule, "widths", ()):
            return tuple(schedule.ratios)
    except Exception:  # noqa: BLE001 - the documented table
        pass
    return SPARSEVAR_FALLBACK


def table_of(source: str) -> tuple[float, ...]:
    return FASTVAR_TABLE if source == "fastvar" else sparsevar_table()


def no_linkage_arm(source: str) -> Arm:
    table = table_of(source)
    name = f"no-linkage{MARKS[source]}"
    return compose("nova", name, ("schedule", "fixed_table", {"ratios": table}),
                   description=f"nova with {source}'s fixed ratio table {table} on the last scales (no linkage; "
                               f"1.0 = scale not generated)")


def _table_option() -> str | None:
    try:
        cls = REGISTRIES["schedule"].get("layer_linkage")
    except Exception:  # noqa: BLE001 - not registered: the arm reports it
        return None
    names = {f.name for f in dataclasses.fields(cls.Config)}
    return next((n for n in TABLE_OPTIONS if n in names), None)


def nova_params(schedule: str, lam_from: str) -> dict:
    """NOVA's own dual-linkage settings for the knobs ``schedule`` shares with it (tau, direction, ratio_is, …;
    its ``lam`` from dual linkage's ``lam_from``), so a single-linkage arm changes only the linkage."""
    try:
        nova = get_preset("nova").schedule
        cls = REGISTRIES["schedule"].get(schedule)
    except Exception:  # noqa: BLE001 - the arm reports what is missing
        return {}
    shared = {f.name: getattr(nova, f.name) for f in dataclasses.fields(nova)}
    own = {f.name for f in dataclasses.fields(cls.Config)}
    params = {k: v for k, v in shared.items() if k in own}
    if "lam" in own and lam_from in shared:
        params["lam"] = shared[lam_from]
    try:
        component_config("schedule", schedule, **params)
    except Exception:  # noqa: BLE001 - keep the component's defaults
        return {}
    defaults = cls.Config()
    return {k: v for k, v in params.items() if getattr(defaults, k) != v}


def layer_only_arm(source: str) -> Arm:
    """``no_linkage_arm(source)`` with the layer linkage around the same per-scale table (``scale_ratios``)."""
    table = table_of(source)
    name = f"layer-only{MARKS[source]}"
    option = _table_option()
    if option is None:
        return Arm(name, None, f"nova, layer linkage around {source}'s fixed scale ratios {table}", error=(
            f"the schedule 'layer_linkage' has no per-scale base table (an option named one of {TABLE_OPTIONS}): "
            f"the layer-only arm cannot match the no-linkage arm's scales"))
    params = nova_params("layer_linkage", "layer_lam")
    return compose("nova", name, ("schedule", "layer_linkage", {**params, option: table}),
                   description=f"nova, layer linkage around {source}'s fixed scale ratios {table} (the no-linkage "
                               f"arm's table and scales; only the layer term differs)")


def _variant(which: str) -> Arm:
    """The scale-only arm (a registered ``scale_linkage`` schedule)."""
    label = f"{which}-only"
    if f"{which}_linkage" not in REGISTRIES["schedule"].names():
        return Arm(label, None, f"{which}-linkage only", error=(
            f"no {which}-only linkage here: register a schedule '{which}_linkage' (registered schedules: "
            f"{', '.join(REGISTRIES['schedule'].names())})"))
    params = nova_params(f"{which}_linkage", f"{which}_lam")
    return compose("nova", label, ("schedule", f"{which}_linkage", params),
                   description=f"nova with the {which} linkage only (NOVA's own settings)")


@family("linkage", "no linkage (FastVAR† / SparseVAR‡ tables) vs layer-only†/‡ vs scale-only vs dual",
        table="NOVA Table 6", analysis=layer_entropy_analysis)
def linkage_family(ctx: FamilyContext) -> list[Arm]:
    return [baseline_arm(), no_linkage_arm("fastvar"), no_linkage_arm("sparsevar"), _variant("scale"),
            layer_only_arm("fastvar"), layer_only_arm("sparsevar"),
            compose("nova", "dual", role="base", description="nova itself: dual linkage")]
