"""``frontier.md``: the matched-cost tables (value [95 % CI]), the paired tests and the dominance summary."""

from __future__ import annotations

import math

__all__ = ["frontier_markdown", "dominance_lines", "fmt_ci"]

AXIS_LABEL = {"flops_ratio": "FLOPs ratio", "speedup": "measured speedup", "memory_ratio": "peak-memory ratio"}


def fmt_ci(value, low, high, digits: int = 3) -> str:
    if value is None or not math.isfinite(value):
        return "—"
    if low is None or high is None or not (math.isfinite(low) and math.isfinite(high)):
        return f"{value:.{digits}f}"
    return f"{value:.{digits}f} [{low:.{digits}f}, {high:.{digits}f}]"


def _level(axis: str, level: float) -> str:
    return f"{level:g}×" if axis == "speedup" else f"{level:g}"


def dominance_lines(table: dict, axis: str, metric: str) -> list[str]:
    """One line per level: the best method, whom it beats after Holm, whom it cannot be told from."""
    lines = []
    for w in table["winners"]:
        at = f"{AXIS_LABEL[axis]} {_level(axis, w['level'])}"
        if w["best"] is None:
            lines.append(f"- at {at}: no method covers this level")
            continue
        text = f"- at {at}: **{w['best']}** has the best {metric}"
        if w.get("dominates"):
            text += f", significantly above every other method ({', '.join(w['beats'])})"
        else:
            if w["beats"]:
                text += f"; significantly above {', '.join(w['beats'])}"
            if w["ties"]:
                text += f"; not separable from {', '.join(w['ties'])} (Holm-adjusted p ≥ {table['alpha']:g})"
        lines.append(text)
    return lines


def frontier_markdown(result: dict) -> str:
    ev = result["evaluation"]
    out = [f"# Speed–quality frontier: {', '.join(result['spec']['methods'])} on {result['model']}", "",
           f"{ev['samples']['n']} paired samples per point (seed {ev['samples']['base_seed']}), device "
           f"{ev['device']}, {ev['threads']} thread(s), timing repeats {ev['settings']['timing_repeats']} "
           f"(interleaved with the baseline). Grid targeted the FLOPs-ratio range "
           f"{result['grid_target'][0]:.3f}–{result['grid_target'][1]:.3f}. Cells: value [95 % bootstrap CI] "
           f"(percentile, resampling samples jointly for every method and re-interpolating each replicate); tests: "
           f"paired t-test on the per-sample interpolated differences, Holm over all pairs × levels of a table.", ""]
    out += ["## Points", "", "| method | point | FLOPs ratio (calibrated) | published |", "|---|---|---|---|"]
    for p in result["points"]:
        out.append(f"| {p['method']} | {p['label']} | {p['calibrated_flops_ratio']:.3f} | "
                   f"{'yes' if p['published'] else ''} |")
    for key, a in result["analyses"].items():
        table, axis, metric = a["table"], a["axis"], a["metric"]
        out += ["", f"## {metric} at matched {AXIS_LABEL[axis]}", ""]
        if table is None:
            out.append(f"The methods' measured {AXIS_LABEL[axis]} ranges do not overlap: no matched levels.")
            continue
        rng = a["common_range"]
        levels = table["levels"]
        out.append(f"Common measured range {rng[0]:.3f}–{rng[1]:.3f}; n = {a['n']} samples; "
                   f"{'higher' if a['higher_better'] else 'lower'} is better.")
        out += ["", "| method | " + " | ".join(f"{AXIS_LABEL[axis]} {_level(axis, lv)}" for lv in levels)
                + " | area (mean over the common range) |", "|---" * (len(levels) + 2) + "|"]
        for m in result["spec"]["methods"]:
            cells = {c["level"]: c for c in table["cells"] if c["method"] == m}
            ar = table["areas"].get(m, {})
            out.append(f"| {m} | " + " | ".join(fmt_ci(cells[lv]["value"], cells[lv]["low"], cells[lv]["high"])
                                                for lv in levels)
                       + f" | {fmt_ci(ar.get('value'), ar.get('low'), ar.get('high'))} |")
        out += ["", "Dominance:"] + dominance_lines(table, axis, metric)
        out += ["", "<details><summary>paired tests</summary>", "",
                "| level | A − B | difference [95 % CI] | p | p (Holm) |", "|---|---|---|---|---|"]
        for t in table["tests"]:
            out.append(f"| {_level(axis, t['level'])} | {t['a']} − {t['b']} | "
                       f"{fmt_ci(t['diff'], t['low'], t['high'], 4)} | {t['p']:.3g} | {t['p_holm']:.3g}"
                       f"{' *' if t['significant'] else ''} |")
        out += ["", "</details>"]
    return "\n".join(out) + "\n"
