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
