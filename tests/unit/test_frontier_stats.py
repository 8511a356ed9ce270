"""Matched-cost interpolation, the paired test, Holm, area and Pareto of sweeps.frontier_stats on a hand-made example.

Two methods, four paired samples, every baseline share 1.0:
A: cost 0.4, quality (0.50, 0.60, 0.70, 0.80); cost 0.8, quality (0.90, 0.80, 0.95, 0.85)
B: cost 0.3, quality (0.55, 0.65, 0.60, 0.70); cost 0.7, quality (0.70, 0.80, 0.75, 0.85)
At FLOPs ratio 0.5, A is 1/4 of the way from 0.4 to 0.8 and B half-way from 0.3 to 0.7, so per sample
A = 0.75·q1 + 0.25·q2 = (0.600, 0.650, 0.7625, 0.8125) and B = 0.5·q1 + 0.5·q2 = (0.625, 0.725, 0.675, 0.775).
"""

from __future__ import annotations

import math

import numpy as np
import pytest
from scipy import stats

from sweeps.frontier_stats import (FramePoint, area_grid, bootstrap_levels, holm, interpolate, matched_cost_table,
                                   paired_t, pareto_mask, per_sample_at)

ONE = np.ones(4)


def _pt(method, cost, q):
    return FramePoint(method, f"{method}@{cost}", np.array(q, dtype=float), np.full(4, float(cost)), ONE.copy())


A = [_pt("A", 0.4, [0.50, 0.60, 0.70, 0.80]), _pt("A", 0.8, [0.90, 0.80, 0.95, 0.85])]
B = [_pt("B", 0.3, [0.55, 0.65, 0.60, 0.70]), _pt("B", 0.7, [0.70, 0.80, 0.75, 0.85])]
HAND_A = [0.600, 0.650, 0.7625, 0.8125]
HAND_B = [0.625, 0.725, 0.675, 0.775]


def test_interpolation_by_hand():
    assert per_sample_at(A, "flops_ratio", 0.5) == pytest.approx(HAND_A)
    assert per_sample_at(B, "flops_ratio", 0.5) == pytest.approx(HAND_B)
    assert interpolate([0.4, 0.8], [0.65, 0.875], 0.5) == pytest.approx(0.70625)
    # the end points are in range, beyond them nothing is extrapolated
    assert interpolate([0.4, 0.8], [0.65, 0.875], 0.8) == pytest.approx(0.875)
    assert math.isnan(interpolate([0.4, 0.8], [0.65, 0.875], 0.9))
    assert per_sample_at(A, "flops_ratio", 0.35) is None
    # two points at one cost are averaged: (0.2 + 0.4) / 2 at 0.5, then half-way to 1.0 at 1.0
    assert interpolate([0.5, 0.5, 1.0], [0.2, 0.4, 1.0], 0.75) == pytest.approx(0.5 * 0.3 + 0.5 * 1.0)
    # costs given unsorted
    assert interpolate([0.8, 0.4], [0.875, 0.65], 0.6) == pytest.approx(0.7625)


def test_speedup_axis_is_base_over_arm():
    # arm shares 0.5 of base 1.0: speedup 2; a second point at speedup 4, quality half-way at speedup 3
    p1 = FramePoint("S", "a", np.array([1.0, 1.0]), np.array([0.5, 0.5]), np.ones(2))
    p2 = FramePoint("S", "b", np.array([0.0, 0.0]), np.array([0.25, 0.25]), np.ones(2))
    assert per_sample_at([p1, p2], "speedup", 3.0) == pytest.approx([0.5, 0.5])


def test_paired_t_matches_scipy_ttest_rel():
    t, p = paired_t(np.array(HAND_A) - np.array(HAND_B))
    ref = stats.ttest_rel(HAND_A, HAND_B)
    assert t == pytest.approx(ref.statistic)
    assert p == pytest.approx(ref.pvalue)


def test_holm_by_hand():
    # sorted 0.01·3 = 0.03, 0.03·2 = 0.06, 0.04·1 = 0.04 -> raised to the running max 0.06
    assert holm([0.01, 0.04, 0.03]) == pytest.approx([0.03, 0.06, 0.06])
    adjusted = holm([0.2, math.nan, 0.01])
    assert adjusted[0] == pytest.approx(0.2) and math.isnan(adjusted[1]) and adjusted[2] == pytest.approx(0.02)


def test_matched_cost_table_cells_tests_and_area():
    table = matched_cost_table({"A": A, "B": B}, "flops_ratio", [0.5, 0.6], n_boot=200, seed=3, area=(0.4, 0.7))
    cell = {(c["method"], c["level"]): c for c in table["cells"]}
    assert cell[("A", 0.5)]["value"] == pytest.approx(0.70625)
    assert cell[("B", 0.5)]["value"] == pytest.approx(0.7)
    assert cell[("A", 0.5)]["low"] <= 0.70625 <= cell[("A", 0.5)]["high"]
    test = next(t for t in table["tests"] if t["level"] == 0.5)
    ref = stats.ttest_rel(HAND_A, HAND_B)
    assert test["diff"] == pytest.approx(0.00625) and test["p"] == pytest.approx(ref.pvalue)
    # two tests (one pair x two levels): Holm multiplies the smaller p by 2
    ps = sorted(t["p"] for t in table["tests"])
    assert min(t["p_holm"] for t in table["tests"]) == pytest.approx(min(1.0, 2 * ps[0]))
    # area over [0.4, 0.7]: A is linear from 0.65 (0.4) to 0.81875 (0.7), mean 0.734375
    assert table["areas"]["A"]["value"] == pytest.approx((0.65 + 0.81875) / 2)
    assert area_grid([0.4, 0.8], [0.65, 0.875], 0.5, 0.7) == pytest.approx((0.70625 + 0.81875) / 2)


def test_bootstrap_replicates_are_paired_and_recompute_costs():
    """A second implementation: draw the same indices, recompute each point's mean and ratio-of-sums cost, np.interp."""
    rng_a = [FramePoint("A", "x", np.array([0.5, 0.6, 0.7, 0.8]), np.array([0.3, 0.5, 0.4, 0.4]), ONE.copy()),
             FramePoint("A", "y", np.array([0.9, 0.8, 0.95, 0.85]), np.array([0.9, 0.7, 0.8, 0.8]), ONE.copy())]
    boot = bootstrap_levels({"A": rng_a, "B": B}, "flops_ratio", [0.55], n_boot=50, seed=7)
    idx = np.random.default_rng(7).integers(0, 4, size=(50, 4))
    for b in range(50):
        i = idx[b]
        c = [p.arm_cost[i].sum() / p.base_cost[i].sum() for p in rng_a]
        q = [p.quality[i].mean() for p in rng_a]
        want = np.interp(0.55, c, q) if c[0] <= 0.55 <= c[1] else math.nan
        got = boot["A"]["levels"][b, 0]
        assert (math.isnan(want) and math.isnan(got)) or got == pytest.approx(want)


def test_pareto_by_hand():
    assert pareto_mask([0.3, 0.4, 0.5, 0.6], [0.5, 0.7, 0.6, 0.8]) == [True, True, False, True]
    # speedup: higher is cheaper; (2.0, 0.7) dominates (1.5, 0.6)
    assert pareto_mask([1.5, 2.0, 3.0], [0.6, 0.7, 0.5], cost_lower_better=False) == [False, True, True]
