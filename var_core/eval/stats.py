"""Statistics for per-sample metrics: seeded bootstrap confidence intervals and paired tests (scipy).

* :func:`bootstrap_ci` — mean (or another statistic) with a 95 % bootstrap interval over samples. BCa by
  default; the percentile method for fewer than :data:`MIN_BCA` values (BCa's jackknife is unstable there).
  Seeded, so a table is reproducible. Memory O(n): the mean's interval is scipy's, computed with chunked
  resamples and a closed-form jackknife; other statistics go to scipy in chunks. NaNs are dropped and the count that remains is reported as ``n``.
* :func:`paired_bootstrap_ratio` — ratio of means of two paired series (e.g. baseline vs arm latency per batch,
  giving a speedup and its interval).
* :func:`paired_wilcoxon` — Wilcoxon signed-rank test of an arm's per-sample metric against the baseline's on the
  same samples (same seeds). All-zero differences (an arm identical to the baseline) give ``p = 1``.
* :func:`holm_adjust` — Holm–Bonferroni adjusted p-values over a family of tests (e.g. every Wilcoxon test of one
  table), controlling the family-wise error rate; tables print them beside the raw p.

Every summary carries its sample count ``n``; tables print it next to each interval.
"""

from __future__ import annotations

import math
import warnings
from dataclasses import asdict, dataclass
from typing import Callable, Sequence

import numpy as np

__all__ = ["Summary", "WilcoxonResult", "bootstrap_ci", "paired_bootstrap_ratio", "paired_wilcoxon",
           "holm_adjust", "format_summary", "MIN_BCA"]

MIN_BCA = 10  # below this many values the percentile interval is used instead of BCa
DEFAULT_RESAMPLES = 2000


@dataclass(frozen=True)
class Summary:
    """A point estimate with a confidence interval ``[low, high]`` at ``level`` over ``n`` values."""

    mean: float
    low: float
    high: float
    n: int
    level: float = 0.95
    method: str = "BCa"

    def to_dict(self) -> dict:
        return asdict(self)

    @staticmethod
    def from_dict(data: dict) -> "Summary":
        """From :meth:`to_dict` output, also as read back from JSON (where NaN was written as ``null``)."""
        data = dict(data)
        for key in ("mean", "low", "high"):
            if data.get(key) is None:
                data[key] = math.nan
        if data.get("n") is None:
            data["n"] = 0
        # set-level metrics carry extra descriptive fields (e.g. the FID protocol); a Summary keeps the numbers
        return Summary(**{key: value for key, value in data.items() if key in Summary.__dataclass_fields__})

    @property
    def half_width(self) -> float:
        return (self.high - self.low) / 2


def _clean(values: Sequence[float] | np.ndarray) -> np.ndarray:
    arr = np.asarray([np.nan if v is None else v for v in np.asarray(values, dtype=object).ravel()], dtype=float)
    return arr[np.isfinite(arr)]


def _nan_summary(n: int, level: float, method: str) -> Summary:
    return Summary(math.nan, math.nan, math.nan, n, level, method)


def bootstrap_ci(values: Sequence[float] | np.ndarray, *, level: float = 0.95, seed: int = 0,
                 n_resamples: int = DEFAULT_RESAMPLES, statistic: Callable[[np.ndarray], float] = np.mean,
                 method: str | None = None) -> Summary:
    """``statistic`` of ``values`` with a seeded bootstrap confidence interval.

    ``method``: ``"BCa"`` / ``"percentile"`` / ``"basic"``; default BCa for ``n >= MIN_BCA``, percentile below.
    One value gives a zero-width interval; none gives NaNs (with ``n = 0``).
    """
    from scipy import stats

    data = _clean(values)
    n = int(data.size)
    method = method or ("BCa" if n >= MIN_BCA else "percentile")
    if n == 0:
        return _nan_summary(0, level, method)
    point = float(statistic(data))
    if n == 1 or float(np.ptp(data)) == 0.0:
        return Summary(point, point, point, n, level, method)

    def stat(x, axis=-1):
        return statistic(x, axis=axis)

    if statistic is np.mean and method.lower() in ("bca", "percentile", "basic"):
        low, high = _mean_interval(data, level, seed, n_resamples, method.lower())
    else:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # degenerate-distribution warnings: handled below
            # batch: resamples and BCa's jackknife in chunks of BOOTSTRAP_CHUNK values (scipy's default draws
            # all n_resamples x n at once and jackknifes n x (n - 1): n² memory)
            res = stats.bootstrap((data,), stat, n_resamples=n_resamples, confidence_level=level, method=method,
                                  vectorized=True, rng=np.random.default_rng(seed), batch=_batch(n))
        low, high = float(res.confidence_interval.low), float(res.confidence_interval.high)
    if not (math.isfinite(low) and math.isfinite(high)) and method != "percentile":
        return bootstrap_ci(data, level=level, seed=seed, n_resamples=n_resamples, statistic=statistic,
                            method="percentile")
    return Summary(point, low, high, n, level, method)


BOOTSTRAP_CHUNK = 1 << 18  # values per resampling chunk (2 MB of int64 indices): memory O(n), not O(n²)


def _batch(n: int) -> int:
    return max(1, BOOTSTRAP_CHUNK // max(n, 1))


def _mean_interval(data: np.ndarray, level: float, seed: int, n_resamples: int, method: str
                   ) -> tuple[float, float]:
    """The bootstrap interval of the mean as ``scipy.stats.bootstrap(method=...)`` computes it (Efron & Tibshirani
    1993, 14.3 and 15.4 for BCa; the same seeded draws), in O(n) memory: resamples drawn in chunks of
    :data:`BOOTSTRAP_CHUNK` values, and the jackknife of the mean in closed form, ``(sum - x_i) / (n - 1)``,
    instead of ``n`` leave-one-out copies of the data."""
    from scipy.special import ndtr, ndtri

    n = data.size
    rng = np.random.default_rng(seed)
    theta_b = np.empty(n_resamples)
    batch = _batch(n)
    for k in range(0, n_resamples, batch):  # successive draws of one generator: those of one (B, n) draw
        m = min(batch, n_resamples - k)
        theta_b[k:k + m] = data[rng.integers(0, n, (m, n))].mean(axis=-1)
    alpha = (1 - level) / 2
    if method == "bca":
        theta_hat = float(np.mean(data))
        z0 = ndtri((np.count_nonzero(theta_b < theta_hat) + np.count_nonzero(theta_b <= theta_hat))
                   / (2 * n_resamples))
        jack = (data.sum() - data) / (n - 1)
        u = (n - 1) * (jack.mean() - jack)
        a_hat = (u ** 3).sum() / n ** 3 / 6 / ((u ** 2).sum() / n ** 2) ** 1.5
        z_lo, z_hi = ndtri(alpha), -ndtri(alpha)
        q = [ndtr(z0 + (z0 + z) / (1 - a_hat * (z0 + z))) for z in (z_lo, z_hi)]
    else:
        q = [alpha, 1 - alpha]
    if not all(np.isfinite(q)):
        return math.nan, math.nan
    low, high = (float(v) for v in np.quantile(theta_b, q))
    if method == "basic":
        point = float(np.mean(data))
        low, high = 2 * point - high, 2 * point - low
    return low, high


def paired_bootstrap_ratio(numerator: Sequence[float], denominator: Sequence[float], *, level: float = 0.95,
                           seed: int = 0, n_resamples: int = DEFAULT_RESAMPLES) -> Summary:
    """``mean(numerator) / mean(denominator)`` over paired values, with a paired bootstrap interval.

    Used for speedup = baseline time / arm time with the times of the same batches (same samples) paired.
    Pairs with a missing value on either side are dropped.
    """
    from scipy import stats

    num = np.asarray([np.nan if v is None else v for v in numerator], dtype=float)
    den = np.asarray([np.nan if v is None else v for v in denominator], dtype=float)
    if num.shape != den.shape:
        raise ValueError(f"paired series differ in length: {num.shape[0]} vs {den.shape[0]}")
    keep = np.isfinite(num) & np.isfinite(den)
    num, den = num[keep], den[keep]
    n = int(num.size)
    method = "BCa" if n >= MIN_BCA else "percentile"
    if n == 0 or float(den.mean()) == 0.0:
        return _nan_summary(n, level, method)
    point = float(num.mean() / den.mean())
    if n == 1 or (np.ptp(num) == 0 and np.ptp(den) == 0):
        return Summary(point, point, point, n, level, method)

    def ratio(a, b, axis=-1):
        return np.mean(a, axis=axis) / np.mean(b, axis=axis)

    for attempt in (method, "percentile"):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            res = stats.bootstrap((num, den), ratio, paired=True, n_resamples=n_resamples, confidence_level=level,
                                  method=attempt, vectorized=True, rng=np.random.default_rng(seed), batch=_batch(n))
        low, high = float(res.confidence_interval.low), float(res.confidence_interval.high)
        if math.isfinite(low) and math.isfinite(high):
            return Summary(point, min(low, point), max(high, point), n, level, attempt)
    return Summary(point, math.nan, math.nan, n, level, method)


@dataclass(frozen=True)
class WilcoxonResult:
    statistic: float
    p_value: float
    n: int  # pairs used (both finite)
    n_nonzero: int  # pairs with a non-zero difference
    median_difference: float  # arm − baseline

    def to_dict(self) -> dict:
        return asdict(self)


def paired_wilcoxon(arm: Sequence[float], baseline: Sequence[float]) -> WilcoxonResult:
    """Two-sided Wilcoxon signed-rank test of ``arm − baseline`` on paired per-sample values."""
    from scipy import stats

    a = np.asarray([np.nan if v is None else v for v in arm], dtype=float)
    b = np.asarray([np.nan if v is None else v for v in baseline], dtype=float)
    if a.shape != b.shape:
        raise ValueError(f"paired series differ in length: {a.shape[0]} vs {b.shape[0]}")
    keep = np.isfinite(a) & np.isfinite(b)
    diff = a[keep] - b[keep]
    n = int(diff.size)
    nonzero = int(np.count_nonzero(diff))
    median = float(np.median(diff)) if n else math.nan
    if n == 0:
        return WilcoxonResult(math.nan, math.nan, 0, 0, median)
    if nonzero == 0:
        return WilcoxonResult(0.0, 1.0, n, 0, median)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        res = stats.wilcoxon(diff, zero_method="wilcox", alternative="two-sided")
    return WilcoxonResult(float(res.statistic), float(res.pvalue), n, nonzero, median)


def holm_adjust(p_values: Sequence[float | None]) -> np.ndarray:
    """Holm–Bonferroni step-down adjusted p-values, in the input order.

    With the ``m`` finite p-values sorted ascending, ``p_(1) <= ... <= p_(m)``, the adjusted value of ``p_(k)`` is
    ``max_{j <= k} min(1, (m - j + 1) p_(j))``; rejecting where the adjusted p is below ``alpha`` controls the
    family-wise error rate at ``alpha``. Missing / NaN entries are not part of the family and stay NaN.
    """
    p = np.asarray([np.nan if v is None else v for v in p_values], dtype=float)
    out = np.full(p.shape, np.nan)
    finite = np.flatnonzero(np.isfinite(p))
    m = finite.size
    if m == 0:
        return out
    order = finite[np.argsort(p[finite], kind="stable")]
    scaled = np.minimum(1.0, (m - np.arange(m)) * p[order])
    out[order] = np.maximum.accumulate(scaled)
    return out


def format_summary(summary: Summary | dict | None, digits: int = 3, show_n: bool = False) -> str:
    """``"12.3 [11.9, 12.8]"`` (``n=64`` appended with ``show_n``); ``"n/a"`` for a missing value."""
    if summary is None:
        return "n/a"
    if isinstance(summary, dict):
        summary = Summary.from_dict(summary)
    if not math.isfinite(summary.mean):
        return "n/a"
    scale = max(abs(summary.mean), abs(summary.high) if math.isfinite(summary.high) else 0.0)
    if scale >= 1000:
        fmt = "{:.0f}"
    elif 0 < scale < 10 ** (1 - digits):  # tiny values (KID, FID of near-identical sets): significant digits
        fmt = "{:.2g}"
    else:
        fmt = f"{{:.{digits}f}}"
    text = fmt.format(summary.mean)
    if math.isfinite(summary.low) and math.isfinite(summary.high) and summary.high > summary.low:
        text += f" [{fmt.format(summary.low)}, {fmt.format(summary.high)}]"
    if show_n:
        text += f" (n={summary.n})"
    return text
