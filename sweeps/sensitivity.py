"""One knob over a grid of values, everything else at the method's preset: the papers' sensitivity figures.

``run_sensitivity(SensitivitySpec("tau", (0.6, 0.7, 0.8, 0.9), method="nova"))`` (CLI:
``python -m studies.sensitivity tau --values 0.6 0.7 0.8 0.9 --method nova``) evaluates each grid point against the
baseline with :class:`sweeps.evaluate.SweepEvaluator` (same seeds for every point; the baseline is generated once and
cached in the output folder) and writes:

* ``sensitivity.csv`` — long format: one row per (value, metric) with the mean, the 95 % bootstrap interval
  (``low``/``high``; per-sample BCa/percentile for quality metrics, paired-by-batch for speedup and FLOPs ratio,
  subsets/bootstrap for FID/KID-proxy) and ``n``;
* ``sensitivity.json`` — the spec, the field (paths, preset default, documentation, search space), the baseline's
  summary, the rows, the evaluation settings and the environment;
* ``sensitivity.png`` — a seaborn line plot per metric (speedup, FLOPs ratio, PSNR, SSIM, class accuracy,
  FID-proxy … whichever apply to the model) with the CI band, the preset's default marked by a dotted line;
* ``arms/*.json`` — one ``varscope.arm/1`` record per grid point (re-running the same command reuses them).

The field is named as in :mod:`sweeps.spaces` (dotted path, alias, ``+``-tie); values are parsed into the knob's
type and validated against its declared range before the model is loaded.
"""

from __future__ import annotations

import dataclasses
import math
import time
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from var_core.errors import UserError, did_you_mean
from var_core.accel.knobs import coerce

from .evaluate import METRICS, EvalSettings, SweepEvaluator, metric_value
from .spaces import SpaceError, apply_overrides, apply_values, knob_infos, resolve_field

__all__ = ["SensitivitySpec", "DEFAULT_METRICS", "resolve_grid", "run_sensitivity", "plot_sensitivity",
           "SensitivityError", "default_method_for"]

DEFAULT_METRICS = ("speedup", "flops_ratio", "psnr", "ssim", "class_acc", "fid_proxy")
DEFAULT_METHOD = "nova"


class SensitivityError(UserError, ValueError):
    """A grid that cannot run (unknown field, bad value, unmeasurable metric)."""


@dataclass(frozen=True)
class SensitivitySpec:
    param: str
    values: tuple = ()
    method: str | None = None  # None: nova if it has the field, else the one preset that has it
    overrides: tuple[str, ...] = ()
    metrics: tuple[str, ...] = DEFAULT_METRICS
    eval: EvalSettings = field(default_factory=EvalSettings)
    out: str | None = None
    wandb: str = "offline"
    wandb_project: str = "varscope-sweeps"

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


def default_method_for(param: str) -> str:
    """``nova`` if it has the field, else the unique preset that has it, variants ``<preset>_…`` not counted
    (error otherwise)."""
    from var_core.accel.presets import PRESETS, get_preset

    name = param.split("=", 1)[0]
    having = []
    for preset in PRESETS:
        try:
            resolve_field(name, get_preset(preset))
            having.append(preset)
        except SpaceError:
            continue
    # a preset's variants ("ldpruning_skip" of "ldpruning") share its knobs: the base preset is meant
    having = [p for p in having if not any(p.startswith(q + "_") for q in having)]
    if DEFAULT_METHOD in having:
        return DEFAULT_METHOD
    if len(having) == 1:
        return having[0]
    if not having:
        from .spaces import ALIASES

        known = sorted({p for preset in PRESETS for p in knob_infos(get_preset(preset))})
        known += sorted({p.rsplit(".", 1)[-1] for p in known} | set(ALIASES))
        raise SensitivityError(f"no method preset has a knob {name!r}.{did_you_mean(name, known, cutoff=0.6)} "
                               f"(presets: {', '.join(PRESETS)}; python -m studies.sweep METHOD --list lists a "
                               f"method's knobs)")
    raise SensitivityError(f"{name!r} is a knob of several methods ({', '.join(having)}): pass --method")


def _hints(cls) -> dict:
    try:
        return typing.get_type_hints(cls)
    except Exception:  # noqa: BLE001
        return {f.name: f.type for f in dataclasses.fields(cls)}


def resolve_grid(spec: SensitivitySpec):
    """``(method, base policy, paths, typed values, info of the first path)``; validates every grid point."""
    from var_core.accel.presets import get_preset

    method = spec.method or default_method_for(spec.param)
    try:
        base = apply_overrides(get_preset(method), spec.overrides)
    except KeyError as exc:
        raise SensitivityError(exc.args[0]) from None
    except SpaceError as exc:
        raise SensitivityError(str(exc)) from None
    try:
        paths = resolve_field(spec.param, base)
    except SpaceError as exc:
        raise SensitivityError(str(exc)) from None
    info = knob_infos(base)[paths[0]]
    if not spec.values:
        raise SensitivityError(f"give grid values for {spec.param} (--values ...); its search space is "
                               f"{info.search}")
    values = []
    for v in spec.values:
        try:
            value = coerce(info.field, v, _hints(info.owner)) if isinstance(v, str) else v
        except (ValueError, TypeError) as exc:
            sep = " (separate the values with spaces: --values 0.5 0.7)" if isinstance(v, str) and "," in v else ""
            raise SensitivityError(f"--values {v}: {exc}{sep}") from None
        try:
            apply_values(base, {p: value for p in paths})
        except (ValueError, TypeError) as exc:
            raise SensitivityError(f"{spec.param}={value!r}: {exc}") from None
        values.append(value)
    if len(set(map(repr, values))) != len(values):
        raise SensitivityError(f"duplicate grid values {values}")
    return method, base, paths, values, info


def _slug(text: str) -> str:
    from var_core.eval.records import arm_slug

    return arm_slug(text.replace("+", "_and_"))


def default_out_dir(spec: SensitivitySpec, method: str, model: str) -> Path:
    from sweeps.evaluate import launch_tag

    return (Path("results") / "sensitivity" /
            f"{method}_{_slug(spec.param)}_{model.replace(':', '-')}_n{spec.eval.samples}_seed{spec.eval.seed}"
            f"{launch_tag(spec.eval, model)}")  # device and precision (empty on a CPU in fp32)


def run_sensitivity(spec: SensitivitySpec, log: Callable[[str], None] = print,
                    evaluator: SweepEvaluator | None = None) -> dict:
    """Evaluate every grid point; write CSV, JSON and PNG; return the JSON content."""
    import pandas as pd

    from var_core.eval.records import write_json_atomic

    started = time.perf_counter()
    method, base, paths, values, info = resolve_grid(spec)
    unknown = [m for m in spec.metrics if m not in METRICS]
    if unknown:
        raise SensitivityError(f"unknown metric(s) {unknown}; metrics: {', '.join(METRICS)}")
    if evaluator is None:
        from ablations.runner import resolve_model

        model, _, _ = resolve_model(spec.eval.model, spec.eval.weights)
        out_dir = Path(spec.out) if spec.out else default_out_dir(spec, method, model)
        evaluator = SweepEvaluator(spec.eval, out_dir, log=log, family=f"sensitivity-{method}")
    out_dir = evaluator.out_dir
    out_dir.mkdir(parents=True, exist_ok=True)
    for note in evaluator.notes:
        log(f"note: {note}")
    metrics = [m for m in spec.metrics if evaluator.available(m) is None]
    skipped = {m: evaluator.available(m) for m in spec.metrics if m not in metrics}
    for m, reason in skipped.items():
        log(f"{m}: n/a ({reason})")
    unread = evaluator.unread_fields(base, paths)
    warnings = [f"{p} was not read by any component in a 2-sample probe generation of the {method} preset "
                f"(the grid may change nothing)" for p in unread]
    for w in warnings:
        log(f"warning: {w}")
    field_name = "+".join(paths)
    log(f"sensitivity of {method} to {spec.param} ({field_name}; preset default {info.value!r}) over {values}: "
        f"{len(evaluator.conditions)} samples per point on {evaluator.model}; results in {out_dir}")
    baseline = evaluator.baseline()
    rows, points = [], []
    for i, value in enumerate(values, 1):
        policy = apply_values(base, {p: value for p in paths}, name=f"{method}/{spec.param}={value}")
        name = f"{_slug(spec.param)}={value}"
        t0 = time.perf_counter()
        record = evaluator.evaluate(name, policy, description=f"{method} with {field_name}={value}",
                                    extra={"sensitivity": {"param": spec.param, "paths": paths, "value": value}})
        summary = record["summary"]
        points.append({"value": value, "record": f"arms/{_slug(name)}.json", "config_hash": record["config_hash"],
                       "reused_from": record.get("reused_from")})
        for m in metrics:
            s = summary.get(m)
            if s is None:
                continue
            rows.append({"param": spec.param, "field": field_name, "value": value, "metric": m,
                         "label": METRICS[m].label, "mean": s.get("mean"), "low": s.get("low"), "high": s.get("high"),
                         "n": s.get("n"), "ci_method": s.get("method"), "is_default": value == info.value,
                         "config_hash": record["config_hash"]})
        shown = ", ".join(f"{m} {metric_value(summary, m):.3f}" for m in metrics if m in summary)
        log(f"[{i}/{len(values)}] {spec.param}={value}: {shown} ({time.perf_counter() - t0:.1f} s)")
    frame = pd.DataFrame(rows)
    csv_path = out_dir / "sensitivity.csv"
    frame.to_csv(csv_path, index=False)
    png_path = plot_sensitivity(frame, out_dir / "sensitivity.png", param=spec.param, method=method,
                                default=info.value, log_x=bool(info.search and info.search.log),
                                baseline=baseline["summary"], model=evaluator.model,
                                samples=len(evaluator.conditions)) if not frame.empty else None
    result = {
        "schema": "varscope.sensitivity/1", "spec": dataclasses.replace(spec, out=str(out_dir), method=method)
        .to_dict(), "method": method,
        "field": {"name": spec.param, "paths": paths, "default": info.value, "doc": info.doc,
                  "search": dataclasses.asdict(info.search) if info.search else None, "component": info.component},
        "values": values, "metrics": metrics, "unavailable": skipped, "warnings": warnings,
        "baseline": baseline["summary"], "points": points, "rows": frame.to_dict(orient="records"),
        "evaluation": evaluator.describe(), "environment": baseline.get("environment", {}),
        "csv": str(csv_path), "plot": str(png_path) if png_path else None,
        "seconds": time.perf_counter() - started,
    }
    if spec.wandb != "disabled" and png_path is not None:
        try:
            result["wandb"] = _log_wandb(spec, method, out_dir, frame, png_path, result)
        except Exception as exc:  # noqa: BLE001 - a mirror only
            result["wandb_error"] = f"{type(exc).__name__}: {exc}"
    write_json_atomic(out_dir / "sensitivity.json", result)
    return result


def plot_sensitivity(frame, path: Path, *, param: str, method: str, default: Any = None, log_x: bool = False,
                     baseline: dict | None = None, model: str = "", samples: int | None = None) -> Path:
    """One panel per metric: mean vs value with the 95 % CI band; the preset default dotted."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np
    import seaborn as sns

    metrics = list(dict.fromkeys(frame["metric"]))
    numeric = all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in frame["value"])
    sns.set_theme(style="whitegrid", context="notebook")
    cols = min(3, len(metrics))
    rows = math.ceil(len(metrics) / cols)
    fig, axes = plt.subplots(rows, cols, figsize=(4.3 * cols, 3.3 * rows), squeeze=False)
    palette = sns.color_palette("deep", len(metrics))
    for k, metric in enumerate(metrics):
        ax = axes[k // cols][k % cols]
        d = frame[frame["metric"] == metric].copy()
        if numeric:
            d = d.sort_values("value")
            x = d["value"].astype(float).to_numpy()
        else:
            x = np.arange(len(d))
            ax.set_xticks(x, [str(v) for v in d["value"]])
        mean = d["mean"].astype(float).to_numpy()
        low = d["low"].astype(float).to_numpy()
        high = d["high"].astype(float).to_numpy()
        sns.lineplot(x=x, y=mean, ax=ax, marker="o", color=palette[k])
        ok = np.isfinite(low) & np.isfinite(high)
        if ok.any():
            ax.fill_between(x[ok], low[ok], high[ok], color=palette[k], alpha=0.2, lw=0)
            ax.errorbar(x[ok], mean[ok], yerr=np.abs(np.array([mean[ok] - low[ok], high[ok] - mean[ok]])),
                        fmt="none", ecolor=palette[k], alpha=0.7, capsize=3, lw=1)
        if numeric and default is not None and isinstance(default, (int, float)):
            ax.axvline(float(default), color="grey", ls=":", lw=1.2)
        if baseline is not None and metric in ("speedup", "flops_ratio", "latency_ratio", "class_acc"):
            b = metric_value(baseline, metric)
            if math.isfinite(b):
                ax.axhline(b, color="black", ls="--", lw=0.8, alpha=0.6)
        if numeric and log_x:
            from matplotlib.ticker import FuncFormatter, NullFormatter

            ax.set_xscale("log")
            ax.set_xticks(x)
            ax.xaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}"))
            ax.xaxis.set_minor_formatter(NullFormatter())
            ax.tick_params(axis="x", labelsize=8)
        ax.set_title(METRICS[metric].label if metric in METRICS else metric, fontsize=10)
        ax.set_xlabel(param)
        ax.set_ylabel("")
    for k in range(len(metrics), rows * cols):
        axes[k // cols][k % cols].axis("off")
    title = f"{method}: sensitivity to {param}"
    if model:
        title += f" — {model}, {samples} samples/point, 95 % bootstrap CI"
    fig.suptitle(title + "\n(dotted: preset default; dashed: baseline)", fontsize=11)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=130)
    plt.close(fig)
    return path


def _log_wandb(spec: SensitivitySpec, method: str, out_dir: Path, frame, png: Path, result: dict) -> str | None:
    from .optuna_study import _wandb_env

    _wandb_env(out_dir)
    import wandb

    run = wandb.init(mode=spec.wandb, dir=str(out_dir), project=spec.wandb_project, group=f"sensitivity-{method}",
                     job_type="sensitivity", name=f"sensitivity-{method}-{_slug(spec.param)}",
                     config={"method": method, "param": spec.param, "values": result["values"],
                             "model": result["evaluation"]["model"], "samples": spec.eval.samples},
                     settings=wandb.Settings(silent=True, x_disable_stats=True))
    try:
        table = frame.astype(object).where(frame.notna(), None)
        run.log({"sensitivity": wandb.Table(dataframe=table), "plot": wandb.Image(str(png))})
        return str(Path(run.dir).parent) if getattr(run, "dir", None) else None
    finally:
        run.finish()
