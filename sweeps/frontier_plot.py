"""``frontier.png``: one panel per (quality metric, cost axis), every method's points with both CIs, its line,
the Pareto-optimal points ringed, the published operating points as stars, the common range shaded and the
matched levels dotted."""

from __future__ import annotations

import math
from pathlib import Path

__all__ = ["plot_frontier"]


def plot_frontier(points, analyses: dict, path: Path, *, model: str = "", samples: int | None = None) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np
    import seaborn as sns

    from .evaluate import METRICS
    from .frontier_report import AXIS_LABEL

    metrics = list(dict.fromkeys(points["metric"]))
    axes_names = list(dict.fromkeys(points["axis"]))
    methods = list(dict.fromkeys(points["method"]))
    sns.set_theme(style="whitegrid", context="notebook")
    palette = dict(zip(methods, sns.color_palette("deep", len(methods))))
    fig, axes = plt.subplots(len(metrics), len(axes_names), figsize=(5.2 * len(axes_names), 3.9 * len(metrics)),
                             squeeze=False)
    for r, metric in enumerate(metrics):
        for c, axis in enumerate(axes_names):
            ax = axes[r][c]
            d = points[(points["metric"] == metric) & (points["axis"] == axis)]
            info = analyses.get(f"{metric}|{axis}") or {}
            rng = info.get("common_range")
            if rng:
                ax.axvspan(rng[0], rng[1], color="grey", alpha=0.08, lw=0)
            for level in ((info.get("table") or {}).get("levels") or []):
                ax.axvline(level, color="grey", ls=":", lw=1)
            for m in methods:
                dm = d[d["method"] == m].sort_values("cost")
                if dm.empty:
                    continue
                x, y = dm["cost"].to_numpy(float), dm["quality"].to_numpy(float)
                color = palette[m]
                ax.plot(x, y, "-o", color=color, label=m, ms=5, lw=1.5)

                def err(lo, hi, v):
                    lo, hi = np.asarray(lo, float), np.asarray(hi, float)
                    ok = np.isfinite(lo) & np.isfinite(hi)
                    e = np.zeros((2, len(v)))
                    e[0, ok], e[1, ok] = np.abs(v[ok] - lo[ok]), np.abs(hi[ok] - v[ok])
                    return e

                ax.errorbar(x, y, xerr=err(dm["cost_low"], dm["cost_high"], x),
                            yerr=err(dm["quality_low"], dm["quality_high"], y), fmt="none", ecolor=color, alpha=0.55,
                            capsize=2, lw=1)
                par = dm["pareto"].to_numpy(bool)
                if par.any():
                    ax.scatter(x[par], y[par], s=130, facecolors="none", edgecolors="black", lw=1.3, zorder=5)
                pub = dm["published"].to_numpy(bool)
                if pub.any():
                    ax.scatter(x[pub], y[pub], marker="*", s=260, color=color, edgecolors="black", lw=0.8, zorder=6)
            ax.set_xlabel(AXIS_LABEL.get(axis, axis) + (" (lower = cheaper)" if axis != "speedup" else ""))
            ax.set_ylabel(METRICS[metric].label if metric in METRICS else metric)
            if axis != "speedup":
                ax.invert_xaxis()  # cheaper to the right on both axes
            if r == 0 and c == 0:
                ax.legend(fontsize=8, loc="best")
    title = f"speed–quality frontier — {model}" + (f", {samples} paired samples/point" if samples else "")
    fig.suptitle(title + "\n(bars: 95 % CI; ringed: Pareto-optimal; star: published setting; shaded: common range; "
                 "dotted: matched levels)", fontsize=10)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def _finite(v) -> bool:
    return v is not None and isinstance(v, (int, float)) and math.isfinite(v)
