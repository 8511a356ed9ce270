"""bootstrap_ci's BCa interval of the mean equals scipy.stats.bootstrap(method='BCa') on the same seeded draws, and
is computed in O(n) memory (scipy's own jackknife holds n x (n - 1) values: 20 GB at n = 50,000)."""

from __future__ import annotations

import tracemalloc

import numpy as np
import pytest
from scipy import stats

from var_core.eval.stats import bootstrap_ci

# a hand-made, skewed sample (BCa's acceleration and bias correction are both far from zero on it)
SAMPLE = np.array([0.2, 0.4, 0.4, 0.5, 0.9, 1.1, 1.3, 1.4, 2.0, 2.2, 2.9, 3.5, 4.8, 7.5, 12.0, 0.3, 0.6, 0.8])


@pytest.mark.parametrize("method", ["BCa", "percentile", "basic"])
def test_the_mean_interval_is_scipys(method):
    got = bootstrap_ci(SAMPLE, seed=7, n_resamples=3000, method=method)
    want = stats.bootstrap((SAMPLE,), np.mean, n_resamples=3000, method=method, rng=np.random.default_rng(7))
    assert got.mean == pytest.approx(SAMPLE.mean(), abs=1e-12)
    assert got.low == pytest.approx(want.confidence_interval.low, rel=1e-9)
    assert got.high == pytest.approx(want.confidence_interval.high, rel=1e-9)
    assert got.method == method and got.n == SAMPLE.size


def test_bca_is_not_the_percentile_interval_on_a_skewed_sample():
    """The pin above would pass with the percentile interval if BCa fell back silently: they differ here."""
    bca = bootstrap_ci(SAMPLE, seed=7, n_resamples=3000)
    pct = bootstrap_ci(SAMPLE, seed=7, n_resamples=3000, method="percentile")
    assert bca.method == "BCa" and abs(bca.high - pct.high) > 0.1


def test_the_interval_of_many_values_takes_o_n_memory():
    values = np.random.default_rng(0).exponential(size=6000)
    tracemalloc.start()
    try:
        bootstrap_ci(values, seed=1)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    # scipy's whole-array path: resamples 2000 x 6000 and a 6000 x 5999 jackknife (~0.6 GB); chunked: ~35 MB
    assert peak < 64 * 2 ** 20, peak
