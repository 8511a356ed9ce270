"""Speed–quality frontiers across methods: which method keeps the most quality at a given cost (issue 30).

``run_frontier(FrontierSpec(("nova", "fastvar", "ldpruning", "stagevar")))`` (CLI: ``varscope frontier``) sweeps
each method's declared cost knob(s) (:mod:`var_core.accel.cost_knobs`) and evaluates every chosen point as a full
arm with :class:`sweeps.evaluate.SweepEvaluator` — the sensitivity machinery: one baseline per results folder,
the same samples (seeds) for every point, paired (interleaved) timing, bootstrap CIs, ``varscope.arm/1`` records
under ``arms/`` that a re-run (or a frontier with other methods, or a ``sensitivity`` run pointed at the same
folder) reuses by config hash.

**The grid spans the same cost range for every method.** The candidates of each method are first costed by
their analytic FLOPs on a few samples (``calibration_samples``; cached in ``frontier_calibration.json``); the
common range is where every method's candidates overlap (or ``cost_range``); per method the candidates nearest
to ``points`` evenly spaced FLOPs-ratio targets over that range are evaluated, plus the published operating
point (the preset's own setting), which is highlighted.

Outputs (:mod:`sweeps.frontier_stats` for the statistics): ``frontier_points.csv`` (every point: cost and
quality with CIs, Pareto flags), ``matched_cost.csv`` (each method's quality interpolated at common cost levels of
the FLOPs ratio and of the measured speedup, value and 95 % bootstrap CI), ``matched_tests.csv`` (paired t-tests
between every two methods per level, Holm-corrected), ``frontier.md`` (the tables, the dominance summary, the area
under each frontier over the common range with its CI), ``frontier.png`` and ``frontier.json``.
Cost axes: FLOPs ratio, measured speedup and the peak-memory ratio (the profiler probe's peak bytes per batch:
analytic on a CPU, measured on CUDA; records written before the evaluator kept it have no memory axis).
"""

from __future__ import annotations

import dataclasses
import math
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import numpy as np

from var_core.errors import UserError

from .evaluate import METRICS, EvalSettings, SweepEvaluator

__all__ = ["FrontierSpec", "DEFAULT_METHODS", "QUALITY_METRICS", "run_frontier", "select_grid", "frame_points",
           "default_levels", "default_out_dir", "FrontierError"]

DEFAULT_METHODS = ("nova", "fastvar", "ldpruning", "stagevar")
QUALITY_METRICS = ("ssim", "psnr", "ms_ssim", "token_agreement", "class_acc_delta", "class_prob_delta")
AXES = ("flops_ratio", "speedup", "memory_ratio")  # memory: peak bytes per batch (analytic on a CPU)


class FrontierError(UserError, ValueError):
    """A frontier that cannot run (unknown method or metric, ranges that do not overlap)."""


@dataclass(frozen=True)
class FrontierSpec:
    methods: tuple[str, ...] = DEFAULT_METHODS
    points: int = 4  # grid points per method over the common cost range (the published point comes on top)
    cost_range: tuple[float, float] | None = None  # FLOPs-ratio range the grid targets (None: the common range)
    flops_levels: tuple[float, ...] = ()  # matched FLOPs-ratio levels (default: 3 inside the common range)
    speedup_levels: tuple[float, ...] = ()  # matched speedup levels (default: 3 inside the common range)
    metrics: tuple[str, ...] = ("ssim", "psnr")
    calibration_samples: int = 2
    n_boot: int = 2000
    eval: EvalSettings = field(default_factory=EvalSettings)
    out: str | None = None
    wandb: str = "disabled"

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


def check_spec(spec: FrontierSpec) -> None:
    """Method and metric names, counts and ranges, before anything is loaded."""
    from var_core.accel.cost_knobs import cost_knobs
    from var_core.accel.presets import PRESETS
    from var_core.errors import did_you_mean

    if len(spec.methods) < 2:
        raise FrontierError(f"a frontier compares methods: give at least two (--methods {' '.join(DEFAULT_METHODS)})")
    if len(set(spec.methods)) != len(spec.methods):
        raise FrontierError(f"--methods names a method twice: {' '.join(spec.methods)}")
    for m in spec.methods:
        if m not in PRESETS:
            raise FrontierError(f"unknown method {m!r}.{did_you_mean(m, PRESETS)}")
        cost_knobs(m)
    for m in spec.metrics:
        if m not in QUALITY_METRICS:
            raise FrontierError(f"--metrics {m}: not a per-sample quality metric.{did_you_mean(m, QUALITY_METRICS)} "
                                f"Metrics: {', '.join(QUALITY_METRICS)}")
    if spec.points < 2:
        raise FrontierError(f"--points must be at least 2 (a frontier needs a line), got {spec.points}")
    if spec.cost_range is not None and not 0 < spec.cost_range[0] < spec.cost_range[1]:
        raise FrontierError(f"--cost-range LO HI needs 0 < LO < HI, got {spec.cost_range}")
    if spec.n_boot < 100:
        raise FrontierError(f"--bootstrap must be at least 100 replicates, got {spec.n_boot}")


def default_out_dir(spec: FrontierSpec, model: str) -> Path:
    """One folder per model and sample set (methods not in the name: a later frontier reuses the arms)."""
    from .evaluate import launch_tag

    return (Path("results") / "frontier" /
            f"{model.replace(':', '-')}_n{spec.eval.samples}_seed{spec.eval.seed}{launch_tag(spec.eval, model)}")


# ----- grid ----------------------------------------------------------------------------------------------------
def select_grid(costs: list[float], lo: float, hi: float, k: int) -> list[int]:
    """Indices of the candidates nearest to ``k`` evenly spaced targets over ``[lo, hi]`` (each used once; the
    nearest still unused one when two targets share a nearest), sorted by cost."""
    chosen: list[int] = []
    for target in np.linspace(lo, hi, k):
        order = sorted(range(len(costs)), key=lambda i: (abs(costs[i] - target), i))
        pick = next((i for i in order if i not in chosen), None)
        if pick is not None:
            chosen.append(pick)
    return sorted(chosen, key=lambda i: costs[i])


def _calibrate(evaluator: SweepEvaluator, policies: dict[str, object], samples: int, log) -> dict[str, float]:
    """FLOPs ratio of each policy (config hash -> ratio) on the first ``samples`` samples; cached in the folder."""
    import json

    import torch

    from profilers.flops import count_flops
    from var_core.accel.policy import AccelPolicy
    from var_core.engine import generate
    from var_core.eval.records import write_json_atomic

    path = evaluator.out_dir / "frontier_calibration.json"
    key = f"{evaluator.model}|{evaluator.conditions.content_hash()}|{samples}"
    cache: dict = {}
    if path.is_file():
        try:
            cache = json.loads(path.read_text())
        except ValueError:
            cache = {}
    table = cache.setdefault(key, {})
    todo = {h: p for h, p in policies.items() if h not in table}
    if todo:
        log(f"calibration: analytic FLOPs of {len(todo)} candidate settings on {samples} samples")
        n = min(samples, len(evaluator.conditions))
        inputs = evaluator.conditions.inputs(range(n), device=getattr(evaluator.adapter, "device", None))
        seeds = evaluator.conditions.seeds[:n]

        def flops(policy) -> float:
            with torch.inference_mode():
                result = generate(evaluator.adapter, inputs, seeds=seeds,
                                  policy=None if policy is None else AccelPolicy(policy), sampling=evaluator.sampling)
            return float(count_flops(evaluator.adapter, result, batch_size=n).total)

        base = table.get("baseline") or flops(None)
        table["baseline"] = base
        for h, policy in todo.items():
            table[h] = flops(policy) / base
        evaluator.out_dir.mkdir(parents=True, exist_ok=True)
        write_json_atomic(path, cache)
    return {h: table[h] for h in policies}


def _candidates(method: str, family: str | None):
    from var_core.accel.cost_knobs import cost_knobs, point_label
    from var_core.accel.presets import get_preset

    from .spaces import apply_values

    knobs = cost_knobs(method, family)
    base = get_preset(method)
    out = []
    for values in knobs.candidates():
        label = point_label(knobs.fields, values)
        try:
            policy = apply_values(base, dict(zip(knobs.fields, values)), name=f"{method}/{label}")
        except (ValueError, TypeError, KeyError) as exc:
            raise FrontierError(f"{method}: the declared grid point {label} does not apply ({exc}); fix "
                                f"var_core/accel/cost_knobs.py") from None
        out.append({"method": method, "label": label, "values": values, "policy": policy,
                    "published": values == knobs.published, "fields": knobs.fields})
    return knobs, out


# ----- records -> paired per-sample arrays ----------------------------------------------------------------------
def _per_sample_shares(record: dict, key: str, batches_key: str = "batches") -> np.ndarray:
    """Each sample's share of its batch's ``key`` (FLOPs or seconds), in the record's sample order."""
    batches = record["timing"][batches_key]
    out = []
    for index in record["metrics"]["index"]:
        batch = next(b for b in batches if b["first_index"] <= index < b["first_index"] + b["size"])
        value = batch.get(key)
        if value is None and key == "flops" and record["timing"].get("flops_per_image") is not None:
            out.append(float(record["timing"]["flops_per_image"]))  # a runner record: FLOPs per image only
            continue
        out.append(math.nan if value is None else float(value) / batch["size"])
    return np.array(out)


def _quality(record: dict, base: dict, metric: str) -> np.ndarray:
    ps, bps = record["metrics"]["per_sample"], base["metrics"]["per_sample"]
    if metric in ("class_acc_delta", "class_prob_delta"):
        name = "class_correct" if metric == "class_acc_delta" else "class_prob"
        scale = 100.0 if metric == "class_acc_delta" else 1.0
        a, b = ps.get(name), bps.get(name)
        if a is None or b is None:
            return np.full(len(record["metrics"]["index"]), np.nan)
        return np.array([math.nan if x is None or y is None else scale * (x - y) for x, y in zip(a, b)], dtype=float)
    values = ps.get(metric)
    if values is None:
        return np.full(len(record["metrics"]["index"]), np.nan)
    return np.array([math.nan if v is None else float(v) for v in values], dtype=float)


def frame_points(points: list[dict], base: dict, metric: str, axis: str):
    """``{method: [FramePoint]}`` for one metric and cost axis from the points' records (samples with a missing
    value at any point are left out of every point: the pairing holds)."""
    from .frontier_stats import FramePoint

    quality = {id(p): _quality(p["record"], base, metric) for p in points}
    ok = np.all([np.isfinite(q) for q in quality.values()], axis=0)
    out: dict[str, list] = {}
    for p in points:
        rec = p["record"]
        if axis == "flops_ratio":
            arm, ref = _per_sample_shares(rec, "flops"), _per_sample_shares(base, "flops")
        elif axis == "memory_ratio":  # ratio of the batches' summed peaks
            arm, ref = _per_sample_shares(rec, "peak_memory_bytes"), _per_sample_shares(base, "peak_memory_bytes")
        else:
            arm = _per_sample_shares(rec, "seconds")
            ref = (_per_sample_shares(rec, "seconds", "reference_batches") if rec["timing"].get("reference_batches")
                   else _per_sample_shares(base, "seconds"))
        out.setdefault(p["method"], []).append(FramePoint(p["method"], p["label"], quality[id(p)][ok], arm[ok],
                                                          ref[ok], p["published"]))
    return out, int(ok.sum())


def default_levels(lo: float, hi: float, axis: str) -> tuple[float, ...]:
    """Three levels inside ``[lo, hi]`` (at 1/6, 1/2, 5/6 of it), rounded (2 decimals; 0.1 for speedups > 2)."""
    raw = [lo + (hi - lo) * f for f in (1 / 6, 1 / 2, 5 / 6)]
    digits = 1 if axis == "speedup" and lo > 2 else 2
    levels = sorted({round(v, digits) for v in raw if lo <= round(v, digits) <= hi})
    return tuple(levels) if levels else (round((lo + hi) / 2, 4),)


# ----- the study -----------------------------------------------------------------------------------------------
def run_frontier(spec: FrontierSpec, log: Callable[[str], None] = print,
                 evaluator: SweepEvaluator | None = None) -> dict:
    """Calibrate, evaluate every chosen point, write the tables and the plot; return ``frontier.json``'s content."""
    from var_core.eval.records import write_json_atomic

    from .frontier_stats import common_range

    started = time.perf_counter()
    check_spec(spec)
    if evaluator is None:
        from ablations.runner import resolve_model

        model, _, _ = resolve_model(spec.eval.model, spec.eval.weights)
        out_dir = Path(spec.out) if spec.out else default_out_dir(spec, model)
        evaluator = SweepEvaluator(spec.eval, out_dir, log=log, family="frontier")
    out_dir = evaluator.out_dir
    out_dir.mkdir(parents=True, exist_ok=True)
    family = getattr(evaluator.adapter, "family", None)
    candidates = {}
    for m in spec.methods:
        candidates[m] = _candidates(m, family)[1]
    policies = {c["policy"].config_hash(): c["policy"] for m in spec.methods for c in candidates[m]}
    costs = _calibrate(evaluator, policies, spec.calibration_samples, log)
    for m in spec.methods:
        for c in candidates[m]:
            c["calibrated_flops_ratio"] = costs[c["policy"].config_hash()]
    spans = {m: (min(c["calibrated_flops_ratio"] for c in candidates[m]),
                 max(c["calibrated_flops_ratio"] for c in candidates[m])) for m in spec.methods}
    target = spec.cost_range or common_range(spans.values())
    if target is None:
        raise FrontierError("the methods' candidate grids reach no common FLOPs-ratio range ("
                            + ", ".join(f"{m} {lo:.2f}-{hi:.2f}" for m, (lo, hi) in spans.items())
                            + "); pass --cost-range LO HI or drop a method")
    log(f"frontier of {', '.join(spec.methods)} on {evaluator.model}: FLOPs-ratio range {target[0]:.3f}-"
        f"{target[1]:.3f}, {spec.points} points per method + the published one; results in {out_dir}")
    chosen: list[dict] = []
    for m in spec.methods:
        cs = candidates[m]
        picks = select_grid([c["calibrated_flops_ratio"] for c in cs], target[0], target[1], spec.points)
        picks += [i for i, c in enumerate(cs) if c["published"] and i not in picks]
        chosen += [cs[i] for i in sorted(picks, key=lambda i: cs[i]["calibrated_flops_ratio"])]
    base = evaluator.baseline()
    for i, c in enumerate(chosen, 1):
        name = f"{c['method']}@{c['label']}"
        t0 = time.perf_counter()
        c["record"] = evaluator.evaluate(
            name, c["policy"], description=f"{c['method']} with {c['label']}" + (" (published)" if c["published"]
                                                                                   else ""),
            extra={"frontier": {"method": c["method"], "fields": list(c["fields"]), "values": list(c["values"]),
                                "published": c["published"]}})
        c["arm"] = name
        s = c["record"]["summary"]
        log(f"[{i}/{len(chosen)}] {name}: FLOPs ratio {s['flops_ratio']['mean']:.3f}, speedup "
            f"{s['speedup']['mean']:.2f}, " + ", ".join(f"{m} {s[m]['mean']:.3f}" for m in spec.metrics
                                                        if m in s and s[m].get('mean') is not None)
            + f" ({time.perf_counter() - t0:.1f} s)")

    analyses, png = analyse_points(chosen, base, spec.metrics, out_dir, flops_levels=spec.flops_levels,
                                   speedup_levels=spec.speedup_levels, n_boot=spec.n_boot, seed=spec.eval.seed,
                                   model=evaluator.model, samples=len(evaluator.conditions), log=log)
    from .frontier_report import frontier_markdown

    result = {
        "schema": "varscope.frontier/1", "spec": dataclasses.replace(spec, out=str(out_dir)).to_dict(),
        "model": evaluator.model, "grid_target": list(target), "candidate_spans": spans,
        "points": [{"method": c["method"], "label": c["label"], "arm": c["arm"], "values": list(c["values"]),
                    "fields": list(c["fields"]), "published": c["published"],
                    "calibrated_flops_ratio": c["calibrated_flops_ratio"],
                    "config_hash": c["record"]["config_hash"], "reused_from": c["record"].get("reused_from")}
                   for c in chosen],
        "analyses": analyses, "baseline": base["summary"], "evaluation": evaluator.describe(),
        "environment": base.get("environment", {}), "plot": str(png) if png else None,
        "seconds": time.perf_counter() - started,
    }
    md = frontier_markdown(result)
    (out_dir / "frontier.md").write_text(md)
    result["markdown"] = str(out_dir / "frontier.md")
    write_json_atomic(out_dir / "frontier.json", result)
    return result


def analyse_points(chosen: list[dict], base: dict, metrics, out_dir: Path, *, flops_levels=(), speedup_levels=(),
                   n_boot: int = 2000, seed: int = 0, model: str = "", samples: int | None = None,
                   log: Callable[[str], None] = print) -> tuple[dict, Path | None]:
    """Matched-cost tables, Pareto flags, CSVs and the plot from evaluated points (``chosen``: dicts with
    ``method``, ``label``, ``published`` and the arm's ``record``; ``base``: the baseline record)."""
    import pandas as pd

    from .frontier_plot import plot_frontier
    from .frontier_stats import common_range, matched_cost_table, pareto_mask, point_cost

    rows, tables, tests = [], [], []
    analyses: dict[str, dict] = {}
    for metric in metrics:
        higher = METRICS[metric].direction == "maximize" if metric in METRICS else True
        for axis in AXES:
            methods, n_used = frame_points(chosen, base, metric, axis)
            if n_used < 2:
                log(f"{metric}: n/a (fewer than 2 samples have it at every point)")
                break
            measured = {m: [float(point_cost(p.arm_cost, p.base_cost, axis)) for p in pts]
                        for m, pts in methods.items()}
            if not all(np.isfinite(c) for v in measured.values() for c in v):
                log(f"{metric} vs {axis}: n/a (a record has no {axis} source: older records carry no peak memory)")
                continue
            rng = common_range((min(v), max(v)) for v in measured.values())
            given = flops_levels if axis == "flops_ratio" else speedup_levels
            levels = tuple(given) or (default_levels(*rng, axis) if rng else ())
            table = matched_cost_table(methods, axis, levels, higher_better=higher, n_boot=n_boot,
                                       seed=seed, area=rng) if levels else None
            flat = [(m, p, c) for m, pts in methods.items() for p, c in zip(pts, measured[m])]
            mask = pareto_mask([c for _, _, c in flat], [float(p.quality.mean()) for _, p, _ in flat],
                               cost_lower_better=axis != "speedup", quality_higher_better=higher)
            for (m, p, c), par in zip(flat, mask):
                rec = next(x for x in chosen if x["method"] == m and x["label"] == p.label)["record"]["summary"]
                q = rec.get(metric) or {}
                cs = rec.get(axis) or {}
                rows.append({"metric": metric, "axis": axis, "method": m, "point": p.label, "cost": c,
                             "cost_low": cs.get("low"), "cost_high": cs.get("high"), "quality": float(p.quality.mean()),
                             "quality_low": q.get("low"), "quality_high": q.get("high"), "n": n_used,
                             "pareto": bool(par), "published": p.published})
            analyses[f"{metric}|{axis}"] = {"metric": metric, "axis": axis, "common_range": rng, "n": n_used,
                                            "higher_better": higher, "table": table}
            if table:
                for cell in table["cells"]:
                    tables.append({"metric": metric, "axis": axis, **cell})
                for t in table["tests"]:
                    tests.append({"metric": metric, "axis": axis, **t})
    points = pd.DataFrame(rows)
    points.to_csv(out_dir / "frontier_points.csv", index=False)
    pd.DataFrame(tables).to_csv(out_dir / "matched_cost.csv", index=False)
    pd.DataFrame(tests).to_csv(out_dir / "matched_tests.csv", index=False)
    png = plot_frontier(points, analyses, out_dir / "frontier.png", model=model,
                        samples=samples) if not points.empty else None
    return analyses, png
