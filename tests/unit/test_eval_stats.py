"""var_core.eval.stats: bootstrap CIs cover the truth, degenerate inputs, paired tests and ratios."""

from __future__ import annotations

import math

import numpy as np
import pytest

from var_core.eval.stats import (Summary, bootstrap_ci, format_summary, holm_adjust, paired_bootstrap_ratio,
                                 paired_wilcoxon)


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


def test_holm_adjust_hand_worked():
    # sorted 0.005, 0.01, 0.03, 0.04 -> x4, x3, x2, x1 = 0.02, 0.03, 0.06, 0.04 -> running max 0.02, 0.03, 0.06, 0.06
    assert holm_adjust([0.01, 0.04, 0.03, 0.005]) == pytest.approx([0.03, 0.06, 0.06, 0.02])
    # missing tests are not in the family (m = 2) and stay NaN; adjusted values are capped at 1
    out = holm_adjust([0.5, None, 0.4, float("nan")])
    assert out[[0, 2]] == pytest.approx([0.8, 0.8]) and np.isnan(out[1]) and np.isnan(out[3])
    assert holm_adjust([0.6, 0.7]) == pytest.approx([1.0, 1.0])
    assert holm_adjust([]).size == 0


def test_summary_from_json_nulls():
    # NaN is written to JSON as null: a reused record must still format
    assert format_summary({"mean": None, "low": None, "high": None, "n": 0, "level": 0.95, "method": "x"}) == "n/a"
    assert format_summary({"mean": 1.5, "low": None, "high": None, "n": 4, "level": 0.95, "method": "x"}, 2) == "1.50"


def _record(arm, role, per_sample, tests=None, summary=None):
    return {
        "arm": arm, "role": role, "changes": "", "description": arm, "config_hash": f"h{arm}", "family": "scorer",
        "model": {"name": "testbed"}, "sampling": {"cfg": 1.5, "top_k": 100, "top_p": 0.95},
        "environment": {"device_name": "cpu", "device": "cpu", "threads": 1, "dtype": "float32", "git": {}},
        "samples": {"n": 4, "base_seed": 0, "hash": "abc"},
        "timing": {"batch_size": 4, "warmup_generations": 1, "batches": [{"size": 4}]},
        "summary": {"ms_per_image": {"mean": 10.0, "low": 9.0, "high": 11.0, "n": 1, "level": 0.95,
                                     "method": "BCa"}, **(summary or {})},
        "metrics": {"per_sample": per_sample, "wilcoxon_vs_baseline": tests or {}, "unavailable": {}},
    }


def _test(p):
    return {"statistic": 1.0, "p_value": p, "n": 4, "n_nonzero": 4, "median_difference": 0.1}


def test_report_table_shows_psnr_differing_identical_and_holm(tmp_path):
    pd = pytest.importorskip("pandas")
    from ablations.report import write_table

    speedup = {"speedup": {"mean": 1.2, "low": 1.1, "high": 1.3, "n": 1, "level": 0.95, "method": "BCa"}}
    records = [
        _record("baseline", "baseline", {}),
        # no psnr_differing in the summary (a record from before): the table computes it from the per-sample PSNR
        _record("a", "arm", {"psnr": [100.0, 100.0, 30.0, 40.0], "identical": [1.0, 1.0, 0.0, 0.0]},
                {"class_prob": _test(0.01), "entropy_mean": _test(0.04)},
                dict(speedup, identical={"mean": 0.5, "low": 0.0, "high": 1.0, "n": 4, "level": 0.95, "method": "x"},
                     psnr={"mean": 67.5, "low": 30.0, "high": 100.0, "n": 4, "level": 0.95, "method": "BCa"})),
        _record("b", "arm", {"psnr": [100.0] * 4, "identical": [1.0] * 4},
                {"class_prob": _test(0.03), "entropy_mean": _test(0.005)},
                dict(speedup, identical={"mean": 1.0, "low": 1.0, "high": 1.0, "n": 4, "level": 0.95, "method": "x"})),
    ]
    write_table(tmp_path, records, [])
    md = (tmp_path / "table.md").read_text().splitlines()
    header = next(line for line in md if line.startswith("| arm | n |"))
    cols = [c.strip() for c in header.strip("|").split("|")]
    assert "PSNR dB (differing)" in cols and "identical" in cols and "PSNR dB (capped mean)" not in cols
    rows = {line.split("|")[1].strip(): [c.strip() for c in line.strip("|").split("|")] for line in md
            if line.startswith(("| a |", "| b |")) and line.count("|") == header.count("|")}
    i_psnr, i_ident = cols.index("PSNR dB (differing)"), cols.index("identical")
    assert rows["a"][i_psnr].startswith("35.00") and rows["a"][i_ident] == "2/4"  # mean of 30 and 40 dB
    assert rows["b"][i_psnr] == "all identical" and rows["b"][i_ident] == "4/4"
    assert any("PSNR dB (differing)" in line and "capped at 100 dB" in line for line in md)
    # Wilcoxon table: raw p beside Holm over the 4 tests (hand-worked: 0.03, 0.06, 0.06, 0.02)
    assert any("Holm-Bonferroni adjusted over the family of all 4 tests" in line for line in md)
    assert "| arm | metric | n | non-zero | median diff | p | p (Holm) |" in md
    tests = {tuple(c.strip() for c in line.strip("|").split("|")[:2]): line.strip("|").split("|")[-1].strip()
             for line in md if line.count("|") == 8 and ("class_prob" in line or "entropy_mean" in line)}
    assert tests == {("a", "class_prob"): "0.03", ("a", "entropy_mean"): "0.06", ("b", "class_prob"): "0.06",
                     ("b", "entropy_mean"): "0.02"}
    frame = pd.read_csv(tmp_path / "table.csv").set_index("arm")
    assert frame.loc["a", "wilcoxon_p_class_prob"] == pytest.approx(0.01)
    assert frame.loc["a", "wilcoxon_p_holm_class_prob"] == pytest.approx(0.03)
    assert frame.loc["b", "wilcoxon_p_holm_entropy_mean"] == pytest.approx(0.02)
    assert frame.loc["a", "psnr_differing"] == pytest.approx(35.0) and frame.loc["a", "psnr_differing_n"] == 2
    # 10 log10(1 / mean MSE), MSE 1e-3, 1e-4, 0, 0 -> 10 log10(4 / 1.1e-3) = 35.6067 dB
    assert frame.loc["a", "psnr_mean_mse"] == pytest.approx(35.6067, abs=1e-4)
    assert frame.loc["a", "psnr"] == pytest.approx(67.5)  # the old key is still in the CSV
    assert frame.loc["b", "psnr_mean_mse"] == pytest.approx(100.0) and frame.loc["b", "psnr_differing_n"] == 0


# ----- the interval's confidence level, pinned by computations that share no code with stats.py ------------------
def _own_paired_percentile(num, den, level, resamples=20000, seed=11):
    """A second paired bootstrap written here: resample pair indices, ratio of means, percentile interval."""
    rng = np.random.default_rng(seed)
    idx = rng.integers(0, len(num), (resamples, len(num)))
    ratios = num[idx].mean(1) / den[idx].mean(1)
    return np.quantile(ratios, [(1 - level) / 2, (1 + level) / 2])


def test_paired_speedup_interval_is_95_percent():
    # 200 paired batch times, speedup ~2 with 10 % noise per pair: BCa and percentile agree closely here
    rng = np.random.default_rng(5)
    den = rng.uniform(1.0, 2.0, 200)
    num = 2.0 * den * rng.normal(1.0, 0.1, 200)
    s = paired_bootstrap_ratio(num, den)
    assert s.level == 0.95 and s.n == 200
    ratio = num.mean() / den.mean()
    # delta method: the ratio's standard error from the linearised pairs z_i = (num_i - R den_i) / mean(den)
    se = ((num - ratio * den) / den.mean()).std(ddof=1) / np.sqrt(200)
    assert s.high - s.low == pytest.approx(2 * 1.959964 * se, rel=0.12)  # a 50 % interval is 0.34 x as wide
    low, high = _own_paired_percentile(num, den, 0.95)
    assert s.low == pytest.approx(low, abs=0.15 * (high - low))
    assert s.high == pytest.approx(high, abs=0.15 * (high - low))
    # the level is honoured when asked for: a 50 % interval is about 0.674 / 1.960 as wide
    half = paired_bootstrap_ratio(num, den, level=0.5)
    assert half.level == 0.5
    assert half.high - half.low == pytest.approx(2 * 0.674490 * se, rel=0.15)


def test_paired_speedup_interval_below_bca_count_is_95_percent():
    # 8 pairs: the percentile method; compared with the bootstrap above at 20,000 resamples
    den = np.array([1.00, 1.10, 0.95, 1.30, 1.05, 0.90, 1.20, 1.15])
    num = 2.0 * den * np.array([1.10, 0.92, 1.05, 0.97, 1.12, 0.88, 1.01, 0.95])
    s = paired_bootstrap_ratio(num, den)
    assert s.method == "percentile" and s.level == 0.95
    low, high = _own_paired_percentile(num, den, 0.95)
    assert s.low == pytest.approx(low, abs=0.1 * (high - low))
    assert s.high == pytest.approx(high, abs=0.1 * (high - low))


def test_bootstrap_ci_of_a_known_sample_is_95_percent():
    # 50 ones and 50 zeros: the bootstrap mean is Binomial(100, 0.5) / 100, whose 2.5 % and 97.5 % quantiles are
    # 40 and 60 (a 50 % interval would be [0.47, 0.53])
    s = bootstrap_ci([1.0] * 50 + [0.0] * 50)
    assert s.level == 0.95 and s.method == "BCa"
    assert s.low == pytest.approx(0.40, abs=0.011) and s.high == pytest.approx(0.60, abs=0.011)
    # percentile method (n < 10): Binomial(8, 0.5) / 8, P(X <= 0) = 1/256 < 2.5 % < P(X <= 1) = 9/256, so the
    # 95 % interval is [1/8, 7/8] (50 %: [3/8, 5/8])
    p = bootstrap_ci([1.0] * 4 + [0.0] * 4)
    assert p.method == "percentile" and (p.low, p.high) == pytest.approx((0.125, 0.875))
