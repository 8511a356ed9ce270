"""Set and per-sample metrics whose memory does not grow with the number of samples (issue 26): KID's kernel in
blocks, fidelity chunk by chunk. Values pinned against direct computations written here."""
import math
import tracemalloc

import numpy as np
import pytest


def _direct_mmd(fx, fy, wx=None, wy=None):
    """Unbiased MMD² with the cubic polynomial kernel from the whole n x n matrices, per-sample counts ``w``;
    self-pairs of one original sample left out (written independently of var_core)."""
    d = fx.shape[1]
    wx = np.ones(len(fx)) if wx is None else wx
    wy = np.ones(len(fy)) if wy is None else wy
    kxx, kyy, kxy = ((fx @ fx.T) / d + 1) ** 3, ((fy @ fy.T) / d + 1) ** 3, ((fx @ fy.T) / d + 1) ** 3
    sx = sum(wx[i] * wx[j] * kxx[i, j] for i in range(len(fx)) for j in range(len(fx)) if i != j)
    sy = sum(wy[i] * wy[j] * kyy[i, j] for i in range(len(fy)) for j in range(len(fy)) if i != j)
    px, py = wx.sum() ** 2 - (wx ** 2).sum(), wy.sum() ** 2 - (wy ** 2).sum()
    return sx / px + sy / py - 2 * (wx @ kxy @ wy) / (wx.sum() * wy.sum())


def test_kid_streamed_in_blocks_equals_the_whole_kernel():
    from var_core.eval.metrics import kid_weighted

    rng = np.random.default_rng(7)
    fx, fy = rng.normal(size=(10, 4)), rng.normal(0.4, 1.2, size=(7, 4))  # 10 and 7: blocks of 3 leave remainders
    direct = _direct_mmd(fx, fy)
    for block in (1, 3, 4, 1024):
        assert kid_weighted(fx, fy, block=block)[0] == pytest.approx(direct, rel=1e-12)
    wx = np.stack([np.bincount(rng.integers(0, 10, 10), minlength=10) for _ in range(3)]).astype(float)
    wy = np.stack([np.bincount(rng.integers(0, 7, 7), minlength=7) for _ in range(3)]).astype(float)
    got = kid_weighted(fx, fy, wx, wy, block=3)
    assert got == pytest.approx([_direct_mmd(fx, fy, wx[r], wy[r]) for r in range(3)], rel=1e-12)


def test_kid_bootstrap_does_not_depend_on_the_block_and_matches_the_whole_kernel():
    from var_core.eval.metrics import kid_bootstrap

    rng = np.random.default_rng(5)
    fx, fy = rng.normal(size=(9, 3)), rng.normal(0.5, 1.0, size=(11, 3))
    draws, values = np.random.default_rng(4), []
    for _ in range(30):  # unpaired: x's counts then y's, one resample at a time
        wx = np.bincount(draws.integers(0, 9, 9), minlength=9).astype(float)
        wy = np.bincount(draws.integers(0, 11, 11), minlength=11).astype(float)
        values.append(_direct_mmd(fx, fy, wx, wy))
    want = tuple(np.quantile(values, [0.025, 0.975]))
    for block in (2, 1024):
        lo, hi, _ = kid_bootstrap(fx, fy, paired=False, n_resamples=30, seed=4, block=block)
        assert (lo, hi) == pytest.approx(want, rel=1e-10)


def test_kid_memory_is_blocks_not_the_whole_kernel():
    """3,000 samples: one n x n float64 kernel is 72 MB; the streamed KID and its bootstrap stay far below."""
    from var_core.eval.metrics import kid_bootstrap, kid_weighted

    rng = np.random.default_rng(0)
    n = 3000
    fx, fy = rng.normal(size=(n, 8)), rng.normal(0.1, 1.0, size=(n, 8))
    tracemalloc.start()
    try:
        kid_weighted(fx, fy, block=256)
        kid_bootstrap(fx, fy, paired=True, n_resamples=10, seed=0, block=256)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < n * n * 8 / 4, f"peak {peak / 1e6:.1f} MB"
    assert math.isfinite(float(kid_weighted(fx[:50], fy[:50])[0]))
