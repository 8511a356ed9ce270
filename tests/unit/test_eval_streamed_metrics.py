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


# Peak RSS against the chunk count is a benchmark (docs/benchmarks.md), not a unit test: it depends on the allocator
# and the machine's load; test_fidelity_keeps_no_tensor_per_chunk pins what the code holds.


def _pair(n, side, seed):
    import torch

    g = torch.Generator().manual_seed(seed)
    a = torch.randint(0, 256, (n, 3, side, side), dtype=torch.uint8, generator=g)
    noise = torch.randint(-4, 5, a.shape, generator=g, dtype=torch.int16)
    return a, (a.to(torch.int16) + noise).clamp(0, 255).to(torch.uint8)


def _live_tensors():
    import gc

    import torch

    gc.collect()
    seen = {}
    for obj in gc.get_objects():
        if isinstance(obj, torch.Tensor):
            try:  # fake / functional tensors another test's torch.compile left behind have no data to count
                storage = obj.untyped_storage()
                seen[storage.data_ptr()] = storage.nbytes()
            except (RuntimeError, NotImplementedError):
                continue
    return len(seen), sum(seen.values())


def test_fidelity_keeps_no_tensor_per_chunk():
    """After 2 and after 16 chunks the same tensors are alive, and Python / numpy hold only the per-sample
    floats (5 metrics x 8 bytes per sample, generously 1 KB)."""
    from var_core.eval.metrics import fidelity_per_sample

    a, b = _pair(16 * 64, 32, 0)  # 32 px: chunks of 64
    fidelity_per_sample(a[:2], b[:2])  # imports and first-call caches outside the measurement
    counts = []
    for k in (2, 16):
        n = k * 64
        before = _live_tensors()
        tracemalloc.start()
        values, _ = fidelity_per_sample(a[:n], b[:n])
        held = tracemalloc.get_traced_memory()[0]
        tracemalloc.stop()
        after = _live_tensors()
        assert len(values["psnr"]) == n and held < 1024 * n + 200_000, f"{held} bytes held for {n} samples"
        counts.append((after[0] - before[0], after[1] - before[1]))
    assert counts[0] == counts[1], counts


def test_per_scale_band_is_the_mean_and_its_interval_in_o_samples_memory():
    """The per-scale figure draws the per-scale mean with a 95 % interval around it, and holds less than 100 bytes
    per value beside the record (a pandas row table of (sample, scale, value) plus seaborn: 43 MB for 20,000
    samples x 10 scales; now ~7 MB)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from ablations.report import per_scale_figure

    rng = np.random.default_rng(2)
    n, scales = 20_000, 10
    values = rng.normal(size=(n, scales)) + np.arange(scales)
    record = {"arm": "baseline", "role": "baseline", "metrics": {"per_scale": {"agree": values.tolist()}}}
    warm = {"arm": "baseline", "role": "baseline", "metrics": {"per_scale": {"agree": values[:5].tolist()}}}
    plt.close(per_scale_figure([warm], "agree", "agreement", "t"))  # imports and font caches outside the peak
    tracemalloc.start()
    try:
        fig = per_scale_figure([record], "agree", "agreement", "t")
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    ax = fig.axes[0]
    line = ax.get_lines()[0]
    assert line.get_xdata().tolist() == list(range(scales))
    assert np.allclose(line.get_ydata(), values.mean(0), rtol=0, atol=1e-12)
    band = ax.collections[0].get_paths()[0].vertices
    for s in range(scales):
        ys = band[np.isclose(band[:, 0], s), 1]
        half = 1.96 * values[:, s].std(ddof=1) / math.sqrt(n)
        assert ys.min() == pytest.approx(values[:, s].mean() - half, abs=half * 0.2)
        assert ys.max() == pytest.approx(values[:, s].mean() + half, abs=half * 0.2)
    assert peak < 100 * n * scales, f"peak {peak / 1e6:.0f} MB"
    plt.close(fig)
