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

The layer-only arms need a layer linkage whose base ratio follows a per-scale table. When the registered
``layer_linkage`` has no such option (a field named in ``TABLE_OPTIONS``), the arm falls back, and its
description says so, to a constant base ratio — the mean of the table's pruned (< 1) ratios — on every
accelerated scale, with the table's 1.0 scales left out by ``skip_last``.

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


def _trailing_skips(table: tuple[float, ...]) -> int:
    count = 0
    for ratio in reversed(table):
        if ratio < 1.0:
            break
        count += 1
    return count


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
    table = table_of(source)
    name = f"layer-only{MARKS[source]}"
    option = _table_option()
    params = nova_params("layer_linkage", "layer_lam")
    if option is not None:
        return compose("nova", name, ("schedule", "layer_linkage", {**params, option: table}),
                       description=f"nova, layer linkage around {source}'s fixed scale ratios {table}")
    pruned = [r for r in table if 0 < r < 1]
    r_base = round(sum(pruned) / len(pruned), 6) if pruned else 0.5
    skips = _trailing_skips(table)
    edits = [("schedule", "layer_linkage", {**params, "r_base": r_base})]
    if skips:
        edits.append(("skip", "skip_last", {"count": skips}))
    return compose("nova", name, *edits, description=(
        f"nova, layer linkage around a constant base ratio {r_base:g} (APPROXIMATION: layer_linkage has no "
        f"per-scale base table, so {source}'s table {table} is replaced by the mean of its pruned ratios on every "
        f"accelerated scale" + (f", its last {skips} scale(s) left out" if skips else "") + ")"))


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
