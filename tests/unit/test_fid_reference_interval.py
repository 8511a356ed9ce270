"""FID vs reference statistics has a confidence interval: a bootstrap over the generated samples against the fixed
reference mu / sigma (issue 26), equal to resampling the feature rows and computing the Fréchet distance with
scipy's matrix square root, percentile interval shifted by the bootstrap bias."""

from __future__ import annotations

import numpy as np
import pytest
from scipy import linalg

from var_core.eval.reference import reference_fid_interval


def _fid_by_rows(rows: np.ndarray, mu_r: np.ndarray, sigma_r: np.ndarray) -> float:
    """The textbook formula on the resampled rows themselves (pytorch-fid's form, scipy's sqrtm)."""
    mu, sigma = rows.mean(0), np.cov(rows, rowvar=False)
    covmean = linalg.sqrtm(sigma @ sigma_r).real
    return float(((mu - mu_r) ** 2).sum() + np.trace(sigma) + np.trace(sigma_r) - 2 * np.trace(covmean))


def test_the_interval_is_the_bias_shifted_percentile_bootstrap_of_the_rows():
    rng = np.random.default_rng(3)
    feats = rng.normal(size=(40, 3)) * [1.0, 2.0, 0.5] + [0.3, 0.0, -1.0]
    mu_r = np.array([0.0, 0.5, -0.5])
    sigma_r = np.array([[1.0, 0.2, 0.0], [0.2, 3.0, 0.4], [0.0, 0.4, 0.5]])
    low, high, resamples = reference_fid_interval(feats, mu_r, sigma_r, n_resamples=120, seed=5)
    draws = np.random.default_rng(5)
    values = [_fid_by_rows(feats[draws.integers(0, 40, 40)], mu_r, sigma_r) for _ in range(120)]
    point = _fid_by_rows(feats, mu_r, sigma_r)
    bias = np.mean(values) - point
    want_low, want_high = np.quantile(values, [0.025, 0.975]) - bias
    assert resamples == 120
    assert low == pytest.approx(max(0.0, want_low), rel=1e-7) and high == pytest.approx(want_high, rel=1e-7)
    assert low < point < high


def test_the_study_record_entry_carries_the_interval_and_says_what_it_covers():
    from tests.unit.test_fid_reference import _identity_reference

    rng = np.random.default_rng(0)
    feats = rng.normal(size=(30, 4))
    import torch

    ref = _identity_reference(np.zeros(4), np.eye(4))
    entry = ref.arm_metrics(torch.from_numpy(feats).float())[0]["fid_ref"]
    assert entry["low"] is not None and entry["low"] <= entry["mean"] <= entry["high"] and entry["level"] == 0.95
    assert "fixed reference statistics" in entry["method"] and "200 resamples" in entry["method"]
