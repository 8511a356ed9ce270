"""var_core.eval.metrics: fidelity, token agreement, classifier applicability, feature-space FID/KID/IS."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from var_core.eval.metrics import (PSNR_CAP, MetricUnavailable, classifier_compatibility, clip_score,
                                   fid_kid, fidelity_per_sample, frechet_distance, inception_fid,
                                   inception_score_proxy, ms_ssim_settings, quantize01, token_agreement)


def _images(n=4, size=64, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.rand(n, 3, size, size, generator=g)


def test_fidelity_identical_and_known_psnr():
    a = quantize01(_images())
    values, unavailable = fidelity_per_sample(a, a)
    assert np.all(values["psnr"] == PSNR_CAP) and np.allclose(values["ssim"], 1.0)
    assert np.allclose(values["ms_ssim"], 1.0) and np.all(values["identical"] == 1)
    assert not unavailable
    b = (a + 10 / 255).clamp(0, 1)  # uniform shift of 10 levels where not clipped
    values, _ = fidelity_per_sample(b, a)
    mse = ((quantize01(b) - a) ** 2).flatten(1).mean(1)
    assert np.allclose(values["psnr"], (10 * torch.log10(1 / mse)).numpy(), atol=1e-4)
    assert np.all(values["ssim"] < 1) and np.all(values["identical"] == 0)


def test_ms_ssim_settings_by_size():
    assert ms_ssim_settings(256, 256)[0] == {}
    assert ms_ssim_settings(64, 64)[0]["kernel_size"] == 7
    kwargs, reason = ms_ssim_settings(16, 16)
    assert kwargs is None and "too small" in reason
    values, unavailable = fidelity_per_sample(_images(2, 16), _images(2, 16, 1))
    assert "ms_ssim" in unavailable and "ms_ssim" not in values


def test_token_agreement():
    base = [[torch.tensor([1, 2, 3, 4]), torch.tensor([1, 1])], [torch.tensor([5, 6, 7, 8]), None]]
    arm = [[torch.tensor([1, 2, 0, 0]), torch.tensor([1, 1])], [torch.tensor([5, 6, 7, 8]), torch.tensor([0, 0])]]
    out = token_agreement(arm, base)
    assert out.shape == (2, 2)
    assert out[0].tolist() == [0.5, 1.0] and out[1, 0] == 1.0 and np.isnan(out[1, 1])
    bits = [[torch.tensor([[1, 0], [1, 1]])]]
    assert token_agreement([[torch.tensor([[1, 0], [0, 1]])]], bits)[0, 0] == 0.5


class _FakeClassifier:
    num_classes = 10
    image_size = 64


class _Adapter:
    def __init__(self, family="var", classes=10, size=64, name="testbed"):
        self.family, self.image_size, self.model_name = family, size, name
        self.cfg = type("Cfg", (), {"num_classes": classes})()


def test_classifier_compatibility_reasons():
    clf = _FakeClassifier()
    assert classifier_compatibility(_Adapter(), clf) is None
    assert "128-px" in classifier_compatibility(_Adapter(size=128), clf)
    assert "1000 classes" in classifier_compatibility(_Adapter(classes=1000), clf)
    assert "not class-conditional" in classifier_compatibility(_Adapter(family="infinity"), clf)
    assert "testbed" in classifier_compatibility(_Adapter(name="official-tiny"), clf)
    assert classifier_compatibility(_Adapter(), None, "weights missing") == "weights missing"


class _Features(torch.nn.Module):
    num_features = 8

    def __init__(self):
        super().__init__()
        self.proj = torch.nn.Linear(3 * 4 * 4, 8)
        torch.nn.init.normal_(self.proj.weight, generator=torch.Generator().manual_seed(0))

    def forward(self, x):
        x = x.float() / 255 if x.dtype == torch.uint8 else x.float()
        return self.proj(torch.nn.functional.adaptive_avg_pool2d(x, 4).flatten(1))


def test_fid_kid_with_feature_module_matches_numpy_frechet():
    feats = _Features()
    a, b = _images(24, 32, 0), _images(24, 32, 1)
    out = fid_kid(a, b, feats, paired=True, n_resamples=30)
    fid = out["fid_proxy"]
    with torch.no_grad():
        ref = frechet_distance(feats(quantize01(a)).double().numpy(), feats(quantize01(b)).double().numpy())
    assert fid["mean"] == pytest.approx(ref, rel=1e-3, abs=1e-4)
    assert fid["n"] == 24 and fid["low"] <= fid["high"]
    assert "kid_proxy" in out
    same = fid_kid(a, a, feats, paired=True, n_resamples=10)["fid_proxy"]["mean"]
    assert abs(same) < 1e-3


def test_inception_score_proxy_range():
    class Logits(_Features):
        num_features = 8

    out = inception_score_proxy(_images(16, 32), Logits(), n_resamples=20)
    assert 1.0 <= out["mean"] <= 8.0 and out["n"] == 16


def test_standard_metrics_need_local_weights(tmp_path):
    imgs = _images(2, 32)
    with pytest.raises(MetricUnavailable, match="--inception-weights"):
        inception_fid(imgs, imgs, None)
    with pytest.raises(MetricUnavailable, match="not found"):
        inception_fid(imgs, imgs, tmp_path / "missing.pth")
    with pytest.raises(MetricUnavailable, match="--clip-weights"):
        clip_score(imgs, ["a", "b"], None)
    with pytest.raises(MetricUnavailable, match="not found"):
        clip_score(imgs, ["a", "b"], tmp_path / "nope")


# ----- PSNR summaries (issue 11) ---------------------------------------------------------------------------
def _shifted_set():
    """Four 8-bit images of constant level 100; the arm shifts image 0 by 10 levels, image 1 by 1 level and
    leaves images 2 and 3 untouched (identical)."""
    base = torch.full((4, 3, 32, 32), 100 / 255)
    arm = base.clone()
    arm[0] += 10 / 255
    arm[1] += 1 / 255
    return arm, base


def test_psnr_summaries_hand_computed_from_images():
    from var_core.eval.metrics import MetricContext, compute_arm_metrics

    arm, base = _shifted_set()
    tokens = [[] for _ in range(4)]
    m = compute_arm_metrics(arm, base, torch.zeros(4, dtype=torch.long), tokens, tokens, MetricContext())
    # by hand: MSE = (10/255)^2 and (1/255)^2 -> PSNR = 20 log10(25.5) = 28.1308 dB and 20 log10(255) = 48.1308 dB
    assert m.per_sample["identical"] == [0.0, 0.0, 1.0, 1.0]
    assert m.per_sample["psnr"][:2] == pytest.approx([28.1308, 48.1308], abs=1e-3)
    diff = m.set_level["psnr_differing"]
    assert diff["mean"] == pytest.approx((28.1308 + 48.1308) / 2, abs=1e-3) and diff["n"] == 2
    assert diff["low"] == pytest.approx(28.1308, abs=1e-3) and diff["high"] == pytest.approx(48.1308, abs=1e-3)
    # PSNR of the mean MSE over all four: mean MSE = (100 + 1 + 0 + 0) / (4 * 255^2) -> 10 log10(260100 / 101)
    pooled = m.set_level["psnr_mean_mse"]
    assert pooled["mean"] == pytest.approx(34.1080, abs=1e-3) and pooled["n"] == 4
    assert pooled["low"] <= pooled["mean"] <= pooled["high"]
    # the old capped mean is still there (per sample) and is what the new summaries correct: (28.13+48.13+200)/4
    assert np.mean(m.per_sample["psnr"]) == pytest.approx(69.0654, abs=1e-3)


def test_psnr_summaries_all_identical_and_inferred_flags():
    from var_core.eval.metrics import psnr_summaries

    out = psnr_summaries([PSNR_CAP] * 3, [1, 1, 1])
    assert out["psnr_differing"]["n"] == 0 and np.isnan(out["psnr_differing"]["mean"])
    assert "identical" in out["psnr_differing"]["method"]
    assert out["psnr_mean_mse"]["mean"] == PSNR_CAP and out["psnr_mean_mse"]["n"] == 3
    # flags default to psnr >= cap; a missing value is dropped: MSE 1e-3 and 1e-4 -> mean 5.5e-4 -> 32.5964 dB
    out = psnr_summaries([30.0, None, 40.0, PSNR_CAP])
    assert out["psnr_differing"]["mean"] == pytest.approx(35.0) and out["psnr_differing"]["n"] == 2
    assert out["psnr_mean_mse"]["mean"] == pytest.approx(10 * np.log10(3 / (1e-3 + 1e-4)), abs=1e-9)
    assert out["psnr_mean_mse"]["n"] == 3


# ----- KID interval (issue 11) -----------------------------------------------------------------------------
def _mmd_positions(fx, fy, ix, iy):
    """Unbiased MMD^2 with the cubic polynomial kernel by explicit loops over resample positions, skipping pairs
    of positions that hold the same original sample."""
    d = fx.shape[1]

    def k(a, b):
        return (a @ b / d + 1.0) ** 3

    def within(f, idx):
        total, count = 0.0, 0
        for p in range(len(idx)):
            for q in range(len(idx)):
                if idx[p] != idx[q]:
                    total += k(f[idx[p]], f[idx[q]])
                    count += 1
        return total / count

    cross = np.mean([[k(fx[i], fy[j]) for j in iy] for i in ix])
    return within(fx, ix) + within(fy, iy) - 2 * cross


def test_kid_unbiased_matches_torchmetrics_and_position_loops():
    from torchmetrics.image.kid import poly_mmd

    from var_core.eval.metrics import _poly_kernel, kid_unbiased

    rng = np.random.default_rng(3)
    fx, fy = rng.normal(size=(7, 5)), rng.normal(0.3, 1.0, size=(7, 5))
    kxx, kyy, kxy = _poly_kernel(fx, fx), _poly_kernel(fy, fy), _poly_kernel(fx, fy)
    ref = float(poly_mmd(torch.from_numpy(fx), torch.from_numpy(fy)))
    assert kid_unbiased(kxx, kyy, kxy) == pytest.approx(ref, rel=1e-10)
    ix = np.array([0, 0, 2, 3, 3, 3, 6])
    iy = np.array([1, 1, 1, 4, 5, 6, 6])
    w = lambda idx: np.bincount(idx, minlength=7).astype(float)  # noqa: E731
    assert kid_unbiased(kxx, kyy, kxy, w(ix), w(iy)) == pytest.approx(_mmd_positions(fx, fy, ix, iy), rel=1e-10)


def test_kid_bootstrap_interval_pinned_against_loop_bootstrap():
    from var_core.eval.metrics import kid_bootstrap

    rng = np.random.default_rng(5)
    fx, fy = rng.normal(size=(6, 4)), rng.normal(0.5, 1.0, size=(6, 4))
    lo, hi, method = kid_bootstrap(fx, fy, paired=True, n_resamples=20, seed=11)
    draws = np.random.default_rng(11)
    values = []
    for _ in range(20):
        idx = draws.integers(0, 6, 6)
        values.append(_mmd_positions(fx, fy, idx, idx))
    assert (lo, hi) == pytest.approx(tuple(np.quantile(values, [0.025, 0.975])), rel=1e-9)
    assert hi > lo and "bootstrap" in method


def test_kid_interval_not_degenerate_when_n_at_most_subset_size():
    from torchmetrics.image.kid import poly_mmd

    feats = _Features()
    a, b = _images(24, 32, 0), _images(24, 32, 1)  # 24 <= the subset size of 50: every subset was the whole set
    kid = fid_kid(a, b, feats, paired=True, n_resamples=50)["kid_proxy"]
    with torch.no_grad():
        fa, fb = feats(quantize01(a)).double(), feats(quantize01(b)).double()
    assert kid["mean"] == pytest.approx(float(poly_mmd(fb, fa)), rel=1e-3, abs=1e-6)
    assert kid["low"] < kid["high"] and kid["low"] <= kid["mean"] <= kid["high"] and kid["n"] == 24
    small = fid_kid(a[:3], b[:3], feats, paired=True, n_resamples=10)["kid_proxy"]
    assert np.isnan(small["low"]) and np.isnan(small["high"]) and "n too small" in small["method"]
    assert np.isfinite(small["mean"]) and small["n"] == 3
