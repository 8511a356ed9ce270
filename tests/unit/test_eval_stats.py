"""var_core.eval.stats: bootstrap CIs cover the truth, degenerate inputs, paired tests and ratios."""

from __future__ import annotations

import math

import numpy as np
import pytest

from var_core.eval.stats import (Summary, bootstrap_ci, format_summary, paired_bootstrap_ratio, paired_wilcoxon)


@pytest.mark.parametrize("dist", ["normal", "exponential"])
def test_bootstrap_ci_covers_the_true_mean(dist):
    rng = np.random.default_rng(123)
    truth = 2.0
    covered = 0
    trials = 100
    for t in range(trials):
        if dist == "normal":
            data = rng.normal(truth, 1.5, size=64)
        else:
            data = rng.exponential(truth, size=64)
        s = bootstrap_ci(data, seed=t, n_resamples=1000)
        assert s.n == 64 and s.low <= s.mean <= s.high
        covered += s.low <= truth <= s.high
    assert covered >= 90, f"95% CI covered the true mean in only {covered}/{trials} synthetic datasets"


def test_bootstrap_is_seeded_and_reports_n():
    data = np.random.default_rng(0).normal(size=30)
    a, b = bootstrap_ci(data, seed=7), bootstrap_ci(data, seed=7)
    assert a == b
    assert bootstrap_ci(data, seed=8) != a
    assert a.n == 30 and a.method == "BCa"
    assert bootstrap_ci(data[:5]).method == "percentile"


def test_bootstrap_degenerate_inputs():
    assert math.isnan(bootstrap_ci([]).mean) and bootstrap_ci([]).n == 0
    one = bootstrap_ci([3.0])
    assert (one.mean, one.low, one.high, one.n) == (3.0, 3.0, 3.0, 1)
    const = bootstrap_ci([1.0] * 10)
    assert (const.low, const.high) == (1.0, 1.0)
    with_missing = bootstrap_ci([1.0, None, float("nan"), 2.0, 3.0])
    assert with_missing.n == 3 and with_missing.mean == pytest.approx(2.0)


def test_paired_wilcoxon():
    base = np.random.default_rng(1).normal(size=40)
    same = paired_wilcoxon(base, base)
    assert same.p_value == 1.0 and same.n_nonzero == 0 and same.n == 40
    shifted = paired_wilcoxon(base + 0.5 + 0.01 * np.arange(40), base)
    assert shifted.p_value < 1e-6 and shifted.median_difference > 0
    with pytest.raises(ValueError):
        paired_wilcoxon([1, 2], [1, 2, 3])


def test_paired_bootstrap_ratio():
    base = np.array([2.0, 2.2, 1.9, 2.1, 2.05, 1.95, 2.0, 2.1, 2.0, 1.98, 2.02, 2.01])
    arm = base / 2
    s = paired_bootstrap_ratio(base, arm)
    assert s.mean == pytest.approx(2.0)
    assert s.low == pytest.approx(2.0) and s.high == pytest.approx(2.0)  # exact 2x on every pair
    noisy = paired_bootstrap_ratio(base, arm * np.linspace(0.9, 1.1, len(arm)))
    assert noisy.low < noisy.mean < noisy.high and noisy.n == len(base)


def test_format_summary():
    assert format_summary(None) == "n/a"
    assert format_summary(Summary(1.23456, 1.1, 1.3, 10), 2) == "1.23 [1.10, 1.30]"
    assert "n=10" in format_summary(Summary(1.0, 0.5, 1.5, 10).to_dict(), show_n=True)
    assert format_summary(Summary(float("nan"), float("nan"), float("nan"), 0)) == "n/a"
