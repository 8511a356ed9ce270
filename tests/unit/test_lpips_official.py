"""The project's LPIPS (alex, vgg; v0.1) against the official ``lpips==0.1.4`` goldens of
``../shared/fixtures/official_metrics_tiny`` (random backbones regenerated from the README's recipe; tolerances
from its README), plus identity and noise-monotonicity checks and the metric wiring."""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

import numpy as np
import pytest
import torch

REPO = Path(__file__).resolve().parents[2]

# The fixture README's recipe (pure numpy): torchvision "features.N" layout, uniform(+-sqrt(6/fan_in)) weights
_ALEX = [(0, 3, 64, 11), (3, 64, 192, 5), (6, 192, 384, 3), (8, 384, 256, 3), (10, 256, 256, 3)]
_VGG = [(i, ci, co, 3) for i, ci, co in zip([0, 2, 5, 7, 10, 12, 14, 17, 19, 21, 24, 26, 28],
                                            [3, 64, 64, 128, 128, 256, 256, 256, 512, 512, 512, 512, 512],
                                            [64, 64, 128, 128, 256, 256, 256, 512, 512, 512, 512, 512, 512])]


def _recipe_backbone(net: str) -> dict[str, torch.Tensor]:
    rng = np.random.default_rng({"alex": 1001, "vgg": 1002}[net])
    sd = {}
    for i, cin, cout, k in (_ALEX if net == "alex" else _VGG):
        a = float(np.sqrt(6.0 / (cin * k * k)))
        sd[f"features.{i}.weight"] = torch.from_numpy(rng.uniform(-a, a, size=(cout, cin, k, k)).astype(np.float32))
        sd[f"features.{i}.bias"] = torch.from_numpy(rng.uniform(-0.1, 0.1, size=(cout,)).astype(np.float32))
    return sd


def metrics_fixture_dir() -> Path:
    env = os.environ.get("VARSCOPE_METRICS_FIXTURE")
    return Path(env) if env else REPO.parent / "shared" / "fixtures" / "official_metrics_tiny"


@pytest.fixture(scope="module")
def fx(tmp_path_factory):
    folder = metrics_fixture_dir()
    if not (folder / "golden_lpips_alex.pt").exists():
        pytest.skip(f"official metrics fixture not found at {folder} (set VARSCOPE_METRICS_FIXTURE)")
    torch.set_num_threads(1)
    config = json.loads((folder / "config.json").read_text())
    tmp = tmp_path_factory.mktemp("lpips")
    out = dict(dir=folder, config=config, inputs=torch.load(folder / "lpips_inputs.pt", weights_only=True))
    for net in ("alex", "vgg"):
        sd = _recipe_backbone(net)
        torch.save(sd, tmp / f"{net}_backbone.pth")
        out[net] = dict(state=sd, backbone=tmp / f"{net}_backbone.pth", lin=folder / f"lpips_{net}_lin_v0.1.pth",
                        golden=torch.load(folder / f"golden_lpips_{net}.pt", weights_only=True))
    out["tmp"] = tmp
    return out


def _model(fx, net):
    from var_core.eval.lpips import load_lpips

    return load_lpips(net, fx[net]["backbone"], fx[net]["lin"])


def _batches(fx):
    """Pairs 0-3 as one batch and 4-7 as another (what the goldens did)."""
    inp = fx["inputs"]
    return [(torch.cat([inp["in0"][i] for i in g]), torch.cat([inp["in1"][i] for i in g]))
            for g in (range(0, 4), range(4, 8))]


@pytest.mark.parametrize("net", ["alex", "vgg"])
def test_recipe_regenerates_the_official_backbone(fx, net):
    want = fx["config"]["lpips"][net]["backbone_sha256_per_tensor_float32_bytes"]
    got = {k: hashlib.sha256(v.numpy().tobytes()).hexdigest() for k, v in fx[net]["state"].items()}
    assert got == want
    if net == "alex":
        stored = torch.load(fx["dir"] / "lpips_alex_backbone.pth", weights_only=True)
        assert all(torch.equal(stored[k], v) for k, v in fx[net]["state"].items())


@pytest.mark.parametrize("net", ["alex", "vgg"])
def test_distances_match_official(fx, net):
    model, g = _model(fx, net), fx[net]["golden"]
    dist, per_layer, maps = [], [], []
    for a, b in _batches(fx):
        d, layers = model(a, b, per_layer=True)
        dist.append(d)
        per_layer.append(layers)
        maps.extend(model(a, b, spatial=True).split(1))
    torch.testing.assert_close(torch.cat(dist), g["dist"], atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(torch.cat(per_layer), g["per_layer"], atol=1e-6, rtol=1e-5)
    for ours, theirs in zip(maps, g["spatial_map"]):
        torch.testing.assert_close(ours, theirs, atol=1e-6, rtol=1e-5)
    assert torch.cat(dist)[3].item() == 0.0  # pair 3 is identical
    assert torch.cat(per_layer).sum(1).sub(torch.cat(dist)).abs().max() < 1e-6
    expected = fx["config"]["lpips"][net]["distances"]
    assert torch.cat(dist).tolist() == pytest.approx(expected, abs=1e-6)


@pytest.mark.parametrize("net", ["alex", "vgg"])
def test_normalised_differences_and_features_match_official(fx, net):
    model, g = _model(fx, net), fx[net]["golden"]
    a, b = _batches(fx)[0]
    for ours, theirs in zip(model.normalized_sq_diffs(a, b), g["pair0_normalized_sq_diff"]):
        torch.testing.assert_close(ours[:1], theirs, atol=1e-6, rtol=0)
    if net == "alex":
        for ours, theirs in zip(model.tapped(a), g["pair0_features_in0"]):
            torch.testing.assert_close(ours[:1], theirs, atol=1e-6, rtol=0)
        for ours, theirs in zip(model.tapped(b), g["pair0_features_in1"]):
            torch.testing.assert_close(ours[:1], theirs, atol=1e-6, rtol=0)


def test_lpips_package_slice_layout_loads_too(fx):
    """The lpips package's own module names (``net.slice{K}.{N}.*``) load into the same model."""
    from var_core.eval.lpips import load_lpips

    index_to_slice = fx["config"]["lpips"]["alex"]["torchvision_features_index_to_lpips_slice"]
    renamed = {}
    for key, value in fx["alex"]["state"].items():
        _, n, param = key.split(".")
        renamed[f"net.slice{index_to_slice[n]}.{n}.{param}"] = value
    torch.save(renamed, fx["tmp"] / "alex_slices.pth")
    model = load_lpips("alex", fx["tmp"] / "alex_slices.pth", fx["alex"]["lin"])
    a, b = _batches(fx)[0]
    torch.testing.assert_close(model(a, b), fx["alex"]["golden"]["dist"][:4], atol=1e-6, rtol=1e-5)


def test_identical_is_zero_and_distance_grows_with_noise(fx):
    from var_core.eval.metrics import lpips_distance

    weights = (fx["alex"]["backbone"], fx["alex"]["lin"])
    x = (fx["inputs"]["in0"][4] + 1) / 2  # [1, 3, 96, 80] in [0, 1]
    noise = torch.randn(x.shape, generator=torch.Generator().manual_seed(7))
    levels = [0.0, 0.02, 0.05, 0.1, 0.2, 0.4]
    arm = torch.cat([(x + s * noise).clamp(0, 1) for s in levels])
    d = lpips_distance(arm, x.expand_as(arm), "alex", weights)
    assert d[0] == 0.0
    assert np.all(np.diff(d) > 0), d


def test_refuses_without_pretrained_weights(fx):
    from var_core.errors import UserError
    from var_core.eval.lpips import load_lpips
    from var_core.eval.metrics import MetricUnavailable, lpips_distance

    with pytest.raises(UserError, match="meaningless"):
        load_lpips("alex", None, fx["alex"]["lin"])
    with pytest.raises(UserError, match="Did you mean 'vgg'"):
        load_lpips("vgg16x", fx["alex"]["backbone"], fx["alex"]["lin"])
    with pytest.raises(UserError, match="shape"):  # the alex linear layers on the vgg backbone
        load_lpips("vgg", fx["vgg"]["backbone"], fx["alex"]["lin"])
    img = torch.zeros(1, 3, 32, 32)
    with pytest.raises(MetricUnavailable, match="meaningless"):
        lpips_distance(img, img, "alex", None)


def test_arm_metrics_report_lpips(fx):
    from var_core.eval.metrics import MetricContext, compute_arm_metrics, lpips_distance

    base = (torch.cat([fx["inputs"]["in0"][i] for i in range(4)]) + 1) / 2
    arm = (torch.cat([fx["inputs"]["in1"][i] for i in range(4)]) + 1) / 2
    tokens = [[] for _ in range(4)]
    labels = torch.zeros(4, dtype=torch.long)
    ctx = MetricContext(lpips_backbone=str(fx["alex"]["backbone"]), lpips_lin=str(fx["alex"]["lin"]))
    m = compute_arm_metrics(arm, base, labels, tokens, tokens, ctx)
    want = lpips_distance(arm, base, "alex", (fx["alex"]["backbone"], fx["alex"]["lin"]))
    assert m.per_sample["lpips_alex"] == pytest.approx(want.tolist(), abs=0)
    assert m.per_sample["lpips_alex"][3] == 0.0  # pair 3 is identical
    plain = compute_arm_metrics(arm, base, labels, tokens, tokens, MetricContext())
    assert "lpips_alex" not in plain.per_sample and "--lpips-backbone" in plain.unavailable["lpips_alex"]
