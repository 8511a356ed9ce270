"""``frontier``: every declared cost-knob setting of NOVA, FastVAR, LD-Pruning and StageVAR as arms (issue 30).

The ablation-family form of ``varscope frontier``: the arms are the whole candidate grids of
:mod:`var_core.accel.cost_knobs` (no calibration step: the runner evaluates them all, resumable, with its
interleaved timing), named ``<method>@<knob>=<value>``. The analysis turns the records into the same matched-cost
tables, paired tests, areas and plot as the command (:func:`sweeps.frontier.analyse_points`), under
``<out>/analysis/``. ``varscope frontier`` is the cheaper route: it evaluates only the points that cover the common
cost range.
"""

from __future__ import annotations

import json
from pathlib import Path

from .base import AnalysisContext, Arm, FamilyContext, baseline_arm, compose, family

METHODS = ("nova", "fastvar", "ldpruning", "stagevar")


def frontier_arms(methods: tuple[str, ...] = METHODS) -> list[Arm]:
    from var_core.accel.cost_knobs import cost_knobs, point_label

    arms = [baseline_arm()]
    for method in methods:
        knobs = cost_knobs(method)
        for values in knobs.candidates():
            edits: dict[str, dict] = {}
            for path, value in zip(knobs.fields, values):
                kind, option = path.split(".", 1)
                edits.setdefault(kind, {})[option] = value
            label = f"{method}@{point_label(knobs.fields, values)}"
            arms.append(compose(method, label, *[(k, None, v) for k, v in edits.items()],
                                description=f"{method} at {point_label(knobs.fields, values)}"
                                            + (" (published)" if values == knobs.published else "")))
    return arms


def frontier_analysis(ctx: AnalysisContext) -> dict:
    """Matched-cost tables, paired tests, areas and the frontier plot from the arms' records."""
    from sweeps.frontier import analyse_points
    from sweeps.frontier_report import AXIS_LABEL, dominance_lines
    from var_core.accel.cost_knobs import cost_knobs, point_label
    from var_core.eval.records import record_paths

    def load(name):
        path = Path(record_paths(ctx.out_dir, name)[0])
        return json.loads(path.read_text()) if path.is_file() else None

    base = load("baseline")
    chosen = []
    for arm in ctx.arms:
        if "@" not in arm.name:
            continue
        record = load(arm.name)
        if record is None:
            continue
        method, label = arm.name.split("@", 1)
        knobs = cost_knobs(method)
        chosen.append({"method": method, "label": label, "record": record,
                       "published": label == point_label(knobs.fields, knobs.published)})
    if base is None or len({c["method"] for c in chosen}) < 2:
        return {"error": "the frontier needs the baseline and at least two methods' records"}
    folder = ctx.analysis_dir
    analyses, png = analyse_points(chosen, base, ("ssim", "psnr"), folder, model=str(base.get("model", "")),
                                   samples=len(base["metrics"]["index"]), log=ctx.log)
    lines = ["# frontier family: dominance at matched cost", ""]
    for a in analyses.values():
        if a["table"]:
            lines += [f"## {a['metric']} at matched {AXIS_LABEL[a['axis']]}", ""]
            lines += dominance_lines(a["table"], a["axis"], a["metric"]) + [""]
    (folder / "frontier.md").write_text("\n".join(lines))
    return {"plot": str(png) if png else None, "summary": str(folder / "frontier.md")}


@family("frontier", "every declared cost-knob setting of nova / fastvar / ldpruning / stagevar: speed-quality "
                    "frontiers at matched cost", analysis=frontier_analysis, samples=16)
def frontier_family(ctx: FamilyContext) -> list[Arm]:
    """The four methods' whole candidate grids (var_core/accel/cost_knobs.py) against one baseline."""
    return frontier_arms()
