"""The statistics of a speed–quality frontier (issue 30): matched-cost interpolation, paired tests, area, Pareto.

Inputs are *paired* per-sample arrays: every point of every method was generated on the same samples (same seeds)
as one baseline, so sample ``i`` of any point can be compared with sample ``i`` of any other. A point is
:class:`FramePoint`: per-sample quality ``q[i]`` and per-sample cost shares of the arm and of the baseline
(``arm[i]``, ``base[i]``: a batch's FLOPs or seconds divided by its size) — the point's cost is
``sum(arm) / sum(base)`` (FLOPs ratio) or ``sum(base) / sum(arm)`` (speedup), the same ratio-of-sums the records'
paired-by-batch summaries use.

* **Interpolation** — a method's quality at cost level ``c`` is read off the straight line between its two points
  whose costs bracket ``c`` (points sorted by cost; points at the same cost averaged; no extrapolation: NaN
  outside the method's measured range). Linear interpolation is a weighted mean, so the per-sample interpolated
  qualities ``w·q_j[i] + (1−w)·q_{j+1}[i]`` average to the interpolated mean: they are what the paired test uses.
* **Confidence intervals** — percentile bootstrap over samples: each replicate draws sample indices once (the same
  draw for every point of every method, which keeps the pairing), recomputes every point's mean quality *and* its
  cost from the drawn samples, and interpolates again.
* **Paired test between two methods at a level** — a paired t-test on the per-sample interpolated differences
  (weights from the point estimates of the costs), Holm-corrected over every (pair, level) of one metric and axis.
* **Area** — the mean interpolated quality over the common cost range (trapezoid over a fine grid / width), with
  the same bootstrap.
* **Pareto** — a point is Pareto-optimal when no other point is at least as cheap and at least as good, and
  strictly better in one.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Iterable, Sequence

import numpy as np

__all__ = ["FramePoint", "point_cost", "interpolate", "interpolation_weights", "per_sample_at", "paired_t",
           "holm", "bootstrap_levels", "area_grid", "pareto_mask", "common_range", "matched_cost_table"]


@dataclass
class FramePoint:
    """One frontier point: method, label, per-sample quality and per-sample cost shares (arm, baseline)."""

    method: str
    label: str
    quality: np.ndarray  # [n]
    arm_cost: np.ndarray  # [n] share of the arm's batch cost per sample
    base_cost: np.ndarray  # [n] share of the baseline's batch cost per sample
    published: bool = False


def point_cost(arm: np.ndarray, base: np.ndarray, axis_kind: str) -> np.ndarray | float:
    """``flops_ratio`` / ``latency_ratio``: arm over baseline; ``speedup``: baseline over arm (sums over the last
    axis)."""
    a, b = np.sum(arm, axis=-1), np.sum(base, axis=-1)
    return b / a if axis_kind == "speedup" else a / b


def _sorted_unique(costs: np.ndarray, values: np.ndarray):
    order = np.argsort(costs, kind="stable")
    c, v = costs[order], values[order]
    uniq, inverse = np.unique(c, return_inverse=True)
    if len(uniq) == len(c):
        return c, v
    sums = np.zeros((len(uniq),) + v.shape[1:])
    np.add.at(sums, inverse, v)
    counts = np.bincount(inverse, minlength=len(uniq)).reshape((-1,) + (1,) * (v.ndim - 1))
    return uniq, sums / counts


def _interp(x: np.ndarray, xs: np.ndarray, ys: np.ndarray) -> np.ndarray:
    """``np.interp`` with NaN outside ``[xs[0], xs[-1]]`` (``xs`` strictly increasing)."""
    if len(xs) == 1:
        return np.where(np.isclose(x, xs[0]), ys[0], np.nan)
    return np.interp(x, xs, ys, left=np.nan, right=np.nan)


def interpolation_weights(costs: Sequence[float], level: float) -> dict[int, float] | None:
    """``{point index: weight}`` of linear interpolation at ``level`` over points at ``costs`` (None outside the
    range). Points sharing a cost split that cost's weight equally."""
    costs = np.asarray(costs, dtype=float)
    if len(costs) == 0 or not np.isfinite(level) or level < costs.min() - 1e-12 or level > costs.max() + 1e-12:
        return None
    uniq = np.unique(costs)
    if len(uniq) == 1:
        members = np.flatnonzero(costs == uniq[0])
        return {int(i): 1.0 / len(members) for i in members}
    k = int(np.clip(np.searchsorted(uniq, level, side="right") - 1, 0, len(uniq) - 2))
    lo, hi = uniq[k], uniq[k + 1]
    w_hi = float((level - lo) / (hi - lo))
    weights: dict[int, float] = {}
    for cost, w in ((lo, 1.0 - w_hi), (hi, w_hi)):
        members = np.flatnonzero(costs == cost)
        for i in members:
            weights[int(i)] = weights.get(int(i), 0.0) + w / len(members)
    return weights


def interpolate(costs: Sequence[float], values: Sequence[float], level: float) -> float:
    """Linear interpolation of ``values`` (one per point) at cost ``level``; NaN outside the points' range."""
    weights = interpolation_weights(costs, level)
    if weights is None:
        return math.nan
    values = np.asarray(values, dtype=float)
    return float(sum(w * values[i] for i, w in weights.items()))


def per_sample_at(points: Sequence[FramePoint], axis_kind: str, level: float) -> np.ndarray | None:
    """Per-sample interpolated quality of one method's points at ``level`` (weights from the point costs)."""
    costs = [float(point_cost(p.arm_cost, p.base_cost, axis_kind)) for p in points]
    weights = interpolation_weights(costs, level)
    if weights is None:
        return None
    return sum(w * points[i].quality.astype(float) for i, w in weights.items())


def paired_t(diff: np.ndarray) -> tuple[float, float]:
    """Two-sided paired t-test of mean ``diff`` = 0: ``(t, p)`` (p = 1 when every difference is equal)."""
    from scipy import stats

    diff = np.asarray(diff, dtype=float)
    diff = diff[np.isfinite(diff)]
    n = len(diff)
    if n < 2:
        return math.nan, math.nan
    sd = diff.std(ddof=1)
    if sd == 0:
        return (math.copysign(math.inf, diff.mean()) if diff.mean() != 0 else 0.0), (0.0 if diff.mean() != 0
                                                                                     else 1.0)
    t = diff.mean() / (sd / math.sqrt(n))
    p = 2.0 * stats.t.sf(abs(t), df=n - 1)
    return float(t), float(p)


def holm(pvalues: Sequence[float]) -> list[float]:
    """Holm–Bonferroni adjusted p-values (NaN entries stay NaN and do not count)."""
    p = np.asarray(pvalues, dtype=float)
    out = np.full(p.shape, np.nan)
    ok = np.flatnonzero(np.isfinite(p))
    m = len(ok)
    running = 0.0
    for rank, i in enumerate(ok[np.argsort(p[ok], kind="stable")]):
        running = max(running, min(1.0, (m - rank) * p[i]))
        out[i] = running
    return out.tolist()


def bootstrap_levels(methods: dict[str, list[FramePoint]], axis_kind: str, levels: Sequence[float],
                     n_boot: int = 2000, seed: int = 0, area: tuple[float, float] | None = None,
                     area_points: int = 41) -> dict:
    """Bootstrap replicates of every method's interpolated quality at ``levels`` (``[B, L]`` per method) and of
    its area over ``area`` (``[B]``); the draw of sample indices is shared by all methods (paired)."""
    n = len(next(iter(methods.values()))[0].quality)
    rng = np.random.default_rng(seed)
    idx = rng.integers(0, n, size=(n_boot, n))
    grid = np.linspace(area[0], area[1], area_points) if area else None
    out: dict[str, dict] = {}
    for name, points in methods.items():
        q = np.stack([p.quality.astype(float)[idx].mean(axis=1) for p in points], axis=1)  # [B, P]
        c = np.stack([point_cost(p.arm_cost[idx], p.base_cost[idx], axis_kind) for p in points], axis=1)
        at = np.full((n_boot, len(levels)), np.nan)
        areas = np.full(n_boot, np.nan)
        lv = np.asarray(levels, dtype=float)
        for b in range(n_boot):
            xs, ys = _sorted_unique(c[b], q[b])
            at[b] = _interp(lv, xs, ys)
            if grid is not None:
                curve = _interp(grid, xs, ys)
                if np.all(np.isfinite(curve)):
                    areas[b] = float(np.trapezoid(curve, grid) / (grid[-1] - grid[0]))
        out[name] = {"levels": at, "area": areas}
    return out


def area_grid(costs: Sequence[float], values: Sequence[float], lo: float, hi: float, points: int = 41) -> float:
    """Mean interpolated value over ``[lo, hi]`` (trapezoid on ``points`` grid points; NaN if not covered)."""
    grid = np.linspace(lo, hi, points)
    curve = np.array([interpolate(costs, values, g) for g in grid])
    if not np.all(np.isfinite(curve)):
        return math.nan
    return float(np.trapezoid(curve, grid) / (hi - lo))


def pareto_mask(costs: Sequence[float], qualities: Sequence[float], *, cost_lower_better: bool = True,
                quality_higher_better: bool = True) -> list[bool]:
    """True for the points no other point dominates (at least as cheap and as good, strictly better in one)."""
    c = np.asarray(costs, dtype=float) * (1 if cost_lower_better else -1)
    q = np.asarray(qualities, dtype=float) * (1 if quality_higher_better else -1)
    mask = []
    for i in range(len(c)):
        if not (np.isfinite(c[i]) and np.isfinite(q[i])):
            mask.append(False)
            continue
        dominated = np.any((c <= c[i]) & (q >= q[i]) & ((c < c[i]) | (q > q[i])))
        mask.append(not bool(dominated))
    return mask


def common_range(ranges: Iterable[tuple[float, float]]) -> tuple[float, float] | None:
    """The cost interval every method's points cover (None if they do not overlap)."""
    ranges = list(ranges)
    lo, hi = max(r[0] for r in ranges), min(r[1] for r in ranges)
    return (lo, hi) if hi > lo else None


def matched_cost_table(methods: dict[str, list[FramePoint]], axis_kind: str, levels: Sequence[float], *,
                       higher_better: bool = True, n_boot: int = 2000, seed: int = 0, alpha: float = 0.05,
                       area: tuple[float, float] | None = None) -> dict:
    """Values [95 % CI] per method and level, paired tests between every two methods per level (Holm over all
    pairs and levels), per-level winners and the area under each frontier over ``area``."""
    names = list(methods)
    boot = bootstrap_levels(methods, axis_kind, levels, n_boot=n_boot, seed=seed, area=area)
    cells, tests = [], []
    point_at: dict[tuple[str, int], np.ndarray | None] = {}
    for name in names:
        for j, level in enumerate(levels):
            per = per_sample_at(methods[name], axis_kind, level)
            point_at[(name, j)] = per
            reps = boot[name]["levels"][:, j]
            finite = reps[np.isfinite(reps)]
            value = float(per.mean()) if per is not None else math.nan
            low, high = (np.percentile(finite, [2.5, 97.5]).tolist() if per is not None and len(finite) > 1
                         else (math.nan, math.nan))
            cells.append({"method": name, "level": float(level), "value": value, "low": low, "high": high,
                          "boot_coverage": float(len(finite) / len(reps))})
    for j, level in enumerate(levels):
        for a in range(len(names)):
            for b in range(a + 1, len(names)):
                qa, qb = point_at[(names[a], j)], point_at[(names[b], j)]
                if qa is None or qb is None:
                    continue
                diff = qa - qb
                t, p = paired_t(diff)
                reps = boot[names[a]]["levels"][:, j] - boot[names[b]]["levels"][:, j]
                reps = reps[np.isfinite(reps)]
                low, high = np.percentile(reps, [2.5, 97.5]).tolist() if len(reps) > 1 else (math.nan, math.nan)
                tests.append({"level": float(level), "a": names[a], "b": names[b], "diff": float(diff.mean()),
                              "low": low, "high": high, "t": t, "p": p})
    for test, adj in zip(tests, holm([t["p"] for t in tests])):
        test["p_holm"] = adj
        test["significant"] = bool(np.isfinite(adj) and adj < alpha)
    winners = []
    sign = 1.0 if higher_better else -1.0
    for level in levels:
        here = [c for c in cells if c["level"] == float(level) and np.isfinite(c["value"])]
        if not here:
            winners.append({"level": float(level), "best": None, "beats": [], "ties": []})
            continue
        best = max(here, key=lambda c: sign * c["value"])["method"]
        beats, ties = [], []
        for t in tests:
            if t["level"] != float(level) or best not in (t["a"], t["b"]):
                continue
            other = t["b"] if t["a"] == best else t["a"]
            (beats if t["significant"] else ties).append(other)
        winners.append({"level": float(level), "best": best, "beats": sorted(beats), "ties": sorted(ties),
                        "dominates": not ties and len(beats) == len(here) - 1})
    areas = {}
    if area is not None:
        for name in names:
            pts = methods[name]
            costs = [float(point_cost(p.arm_cost, p.base_cost, axis_kind)) for p in pts]
            value = area_grid(costs, [float(p.quality.mean()) for p in pts], *area)
            reps = boot[name]["area"]
            finite = reps[np.isfinite(reps)]
            low, high = np.percentile(finite, [2.5, 97.5]).tolist() if len(finite) > 1 else (math.nan, math.nan)
            areas[name] = {"value": value, "low": low, "high": high, "range": list(area),
                           "boot_coverage": float(len(finite) / len(reps))}
    return {"axis": axis_kind, "levels": [float(v) for v in levels], "cells": cells, "tests": tests,
            "winners": winners, "areas": areas, "n_boot": n_boot, "alpha": alpha,
            "test": "paired t-test on per-sample interpolated differences, Holm over all pairs x levels"}
