"""The project's FID Inception, input protocols and FID / KID / IS against the official goldens of
``../shared/fixtures/official_metrics_tiny`` (pytorch-fid 0.3.0 and torch-fidelity 0.4.0 on seeded random weights;
tolerances from its README), plus hand-worked values."""

from __future__ import annotations

import math
import os
from pathlib import Path

import numpy as np
import pytest
import torch

REPO = Path(__file__).resolve().parents[2]


def metrics_fixture_dir() -> Path:
    env = os.environ.get("VARSCOPE_METRICS_FIXTURE")
    return Path(env) if env else REPO.parent / "shared" / "fixtures" / "official_metrics_tiny"


@pytest.fixture(scope="module")
def fx():
    folder = metrics_fixture_dir()
    if not (folder / "golden_fid.pt").exists():
        pytest.skip(f"official metrics fixture not found at {folder} (set VARSCOPE_METRICS_FIXTURE)")
    from var_core.eval.inception import load_fid_inception

    torch.set_num_threads(1)
    inputs = torch.load(folder / "fid_inputs.pt", weights_only=True)
    return dict(
        dir=folder,
        weights=folder / "fid_inception_random.pth",
        net=load_fid_inception(folder / "fid_inception_random.pth"),
        images=inputs["images_uint8"],
        set_a=torch.stack([inputs["images_uint8"][i] for i in inputs["set_a"]]),
        set_b=torch.stack([inputs["images_uint8"][i] for i in inputs["set_b"]]),
        golden=torch.load(folder / "golden_fid.pt", weights_only=True),
        tfid=torch.load(folder / "golden_torch_fidelity_inception.pt", weights_only=True),
    )


def _close(ours, theirs, atol, rtol=0.0):
    torch.testing.assert_close(ours, theirs, atol=atol, rtol=rtol)


def _features(fx, protocol, names):
    """Features of all 12 images, each set of 6 as one batch (what the goldens did)."""
    from var_core.eval.inception import InceptionFeatures

    ext = InceptionFeatures(fx["net"], "2048", protocol, batch_size=6)
    parts = [ext.features(s, names) for s in (fx["set_a"], fx["set_b"])]
    return {n: torch.cat([p[n] for p in parts]) for n in names}


# ----- network and protocols vs the official features ------------------------------------------------------
def test_weight_file_loads_strictly_and_layout_matches(fx):
    state = torch.load(fx["weights"], map_location="cpu", weights_only=True)
    ours = fx["net"].state_dict()
    assert set(ours) == set(state) and len(ours) == 472
    assert all(torch.equal(ours[k], state[k].float()) for k in state)


@pytest.mark.parametrize("idx", [0, 6])
def test_pytorch_fid_input_and_blocks_match_golden(fx, idx):
    from var_core.eval.inception import preprocess

    g = fx["golden"]
    x = preprocess(fx["images"][idx][None], "pytorch-fid")
    stages = dict(zip(("block0", "block1", "block2"), fx["net"].blocks(x, upto=2)))
    stages["input_299_normalized"] = x
    tol = {"input_299_normalized": (1e-6, 0.0), "block0": (1e-4, 1e-5), "block1": (1e-4, 1e-5),
           "block2": (3e-3, 1e-4)}
    for name, v in stages.items():
        p = f"img{idx}_{name}"
        atol, rtol = tol[name]
        assert list(v.shape) == g[p + "_shape"]
        _close(v.pow(2).mean((2, 3)), g[p + "_channel_mean_sq"], atol, rtol)
        if p + "_crop_topleft" in g:
            _close(v[..., :8, :8], g[p + "_crop_topleft"], atol, rtol)
            _close(v[..., -8:, -8:], g[p + "_crop_bottomright"], atol, rtol)
        if p + "_crop_center" in g:
            c = (v.shape[-1] - 8) // 2
            _close(v[..., c:c + 8, c:c + 8], g[p + "_crop_center"], atol, rtol)
    if idx == 6:
        _close(stages["block2"], g["img6_block2"], 3e-3, 1e-4)


def test_pytorch_fid_pooled_features_match_golden(fx):
    g = fx["golden"]
    f = _features(fx, "pytorch-fid", ("64", "192", "768", "2048"))
    _close(f["64"], g["pooled_64"], 1e-4, 1e-5)
    _close(f["192"], g["pooled_192"], 1e-4, 1e-5)
    _close(f["768"], g["pooled_768"], 3e-3, 1e-4)
    _close(f["2048"], g["pool_2048"], 2e-3, 1e-4)


def test_torch_fidelity_protocol_matches_its_extractor(fx):
    t = fx["tfid"]
    names = ("64", "192", "768", "2048", "logits_unbiased", "logits")
    f = _features(fx, "torch-fidelity", names)
    _close(f["64"], t["tfid_64"], 1e-4, 1e-5)
    _close(f["192"], t["tfid_192"], 1e-4, 1e-5)
    for n in names[2:]:
        _close(f[n], t[f"tfid_{n}"], 2e-3, 1e-4)
    # the protocols really differ on these images (README: up to 3.4 on the pool features)
    assert (f["2048"] - fx["golden"]["pool_2048"]).abs().max() > 1.0


def test_tf1_resize_hand_worked():
    from var_core.eval.inception import resize_bilinear_tf1

    # 2 px -> 4 px: source coordinates 0, 0.5, 1, 1.5 (no half-pixel offset), the last column repeated
    x = torch.tensor([[[[0.0, 10.0]]]])
    out = resize_bilinear_tf1(x, (1, 4))
    assert out.flatten().tolist() == [0.0, 5.0, 10.0, 10.0]
    # 3 rows -> 2 rows: coordinates 0 and 1.5 -> rows 0 and the mean of rows 1 and 2
    y = torch.tensor([[[[0.0], [4.0], [8.0]]]])
    assert resize_bilinear_tf1(y, (2, 1)).flatten().tolist() == [0.0, 6.0]


# ----- FID values ------------------------------------------------------------------------------------------
def _stats(feats):
    from var_core.eval.fid import activation_statistics

    return activation_statistics(feats[:6]), activation_statistics(feats[6:])


def test_frechet_on_stored_features_matches_pytorch_fid(fx):
    from var_core.eval.fid import frechet_distance

    g = fx["golden"]
    for dims, key in ((2048, "pool_2048"), (768, "pooled_768"), (192, "pooled_192"), (64, "pooled_64")):
        (mu_a, s_a), (mu_b, s_b) = _stats(g[key])
        r = frechet_distance(mu_a, s_a, mu_b, s_b)
        want = g["fid"][dims]
        assert r.fid == pytest.approx(want["fid"], rel=1e-6)
        assert r.trace_sqrtm == pytest.approx(want["trace_sqrtm"], rel=5e-5)
        for term in ("mean_term", "trace_sigma_a", "trace_sigma_b"):
            assert getattr(r, term) == pytest.approx(want[term], rel=1e-9)
    assert g["fid"][2048]["fid"] == pytest.approx(9124.62597989534, rel=1e-12)


def test_exact_and_torchmetrics_forms_agree_with_golden(fx):
    from var_core.eval.fid import frechet_distance, frechet_distance_features

    g = fx["golden"]
    feats = g["pool_2048"].double()
    exact = frechet_distance_features(feats[:6], feats[6:], method="svd")
    # README: the exact nuclear norm gives 103.267950 and FID 9124.626452
    assert exact.trace_sqrtm == pytest.approx(103.267950, abs=2e-6)
    assert exact.fid == pytest.approx(9124.626452, abs=2e-5)
    (mu_a, s_a), (mu_b, s_b) = _stats(g["pooled_768"])
    eig = frechet_distance(mu_a, s_a, mu_b, s_b, method="eigvals")
    assert eig.fid == pytest.approx(g["fid"][768]["fid"], rel=1e-6)


def test_fid_from_our_features_matches_golden(fx):
    from var_core.eval.fid import frechet_distance, frechet_distance_features

    g = fx["golden"]
    f = _features(fx, "pytorch-fid", ("192", "2048"))
    assert frechet_distance_features(f["2048"][:6], f["2048"][6:], method="svd").fid == pytest.approx(
        g["fid"][2048]["fid"], rel=1e-5)
    (mu_a, s_a), (mu_b, s_b) = _stats(f["192"])
    assert frechet_distance(mu_a, s_a, mu_b, s_b).fid == pytest.approx(g["fid"][192]["fid"], rel=1e-5)


def test_torchmetrics_with_our_extractor_reproduces_its_fids(fx):
    """The bug this replaces: torchmetrics got torch-fidelity's tuple-returning extractor. Ours returns a tensor;
    torchmetrics' FID with it equals torchmetrics' own (antialias=False -> torch-fidelity protocol: 8466.3633)."""
    from var_core.eval.fid import frechet_distance_features
    from var_core.eval.metrics import inception_fid

    info = fx["tfid"]["info"]["torchmetrics_fid"]
    value = inception_fid(fx["set_b"], fx["set_a"], fx["weights"], protocol="torch-fidelity")
    assert value == pytest.approx(info["antialias_False"], rel=1e-5)
    # torchmetrics' default (antialias=True) is the "torchmetrics" protocol: 8116.5518
    f = _features(fx, "torchmetrics", ("2048",))["2048"]
    assert frechet_distance_features(f[:6], f[6:], method="svd").fid == pytest.approx(info["antialias_True"],
                                                                                      rel=1e-5)


def test_fid_of_a_set_with_itself_is_zero(fx):
    from var_core.eval.fid import activation_statistics, frechet_distance, frechet_distance_features

    f = fx["golden"]["pool_2048"].double()
    assert abs(frechet_distance_features(f, f, method="svd").fid) < 1e-8 * f.pow(2).sum().item()
    # 12 samples in 192 dims: Σ² has rank 11, and scipy's sqrtm of that singular product is accurate to ~5e-7
    # relative (the official FID carries the same error)
    mu, sigma = activation_statistics(fx["golden"]["pooled_192"])
    scale = 2 * np.trace(sigma)
    for method in ("sqrtm", "eigvals"):
        r = frechet_distance(mu, sigma, mu, sigma, method=method)
        assert r.mean_term == 0.0 and abs(r.fid) < 1e-6 * scale


def test_standard_set_metrics_name_protocol_and_match_golden(fx):
    from var_core.eval.metrics import MetricContext, standard_set_metrics

    ctx = MetricContext(inception_weights=str(fx["weights"]), fid_protocol="pytorch-fid", n_resamples=20)
    out = standard_set_metrics(fx["set_b"].float() / 255, fx["set_a"].float() / 255, ctx)
    assert out["fid_inception"]["mean"] == pytest.approx(fx["golden"]["fid"][2048]["fid"], rel=1e-5)
    assert all(out[k]["protocol"] == "pytorch-fid" and "pytorch-fid" in out[k]["method"]
               for k in ("fid_inception", "kid_inception", "is_inception"))
    same = standard_set_metrics(fx["set_a"].float() / 255, fx["set_a"].float() / 255, ctx)
    assert abs(same["fid_inception"]["mean"]) < 1e-6


# ----- reference statistics and folders --------------------------------------------------------------------
def test_reference_npz_layouts(fx, tmp_path):
    from var_core.eval.fid import fid_against_reference, load_reference_statistics, save_statistics

    g = fx["golden"]
    (mu_a, s_a), (mu_b, s_b) = _stats(g["pooled_64"])
    save_statistics(tmp_path / "ref.npz", mu_a, s_a, protocol="pytorch-fid", n=6)
    np.savez(tmp_path / "adm.npz", mu=mu_a, sigma=s_a, mu_s=np.zeros(3), sigma_s=np.eye(3),
             arr_0=np.zeros((2, 8, 8, 3), np.uint8))
    ours = load_reference_statistics(tmp_path / "ref.npz")
    adm = load_reference_statistics(tmp_path / "adm.npz")
    assert (ours.layout, ours.protocol, ours.n) == ("pytorch-fid", "pytorch-fid", 6)
    assert adm.layout == "adm"
    for ref in (ours, adm):
        rec = fid_against_reference(g["pooled_64"][6:], ref, protocol="pytorch-fid")
        assert rec["fid"] == pytest.approx(g["fid"][64]["fid"], rel=1e-9) and rec["protocol"] == "pytorch-fid"
    assert "warning" in fid_against_reference(g["pooled_64"][6:], adm, protocol="pytorch-fid")
    from var_core.errors import UserError

    np.savez(tmp_path / "bad.npz", m=mu_a)
    with pytest.raises(UserError, match="'mu' and 'sigma'"):
        load_reference_statistics(tmp_path / "bad.npz")


def test_reference_folder_per_category_matches_calculate_fid_given_paths(fx, tmp_path):
    """PNG copies of set_a split into two category folders: 'all' reproduces pytorch-fid's own
    calculate_fid_given_paths value (dims 64)."""
    from PIL import Image

    from var_core.eval.fid import fid_against_folder, list_reference_images
    from var_core.eval.inception import InceptionFeatures

    for i, img in enumerate(fx["set_a"]):
        sub = tmp_path / ("cats" if i < 3 else "dogs")
        sub.mkdir(exist_ok=True)
        Image.fromarray(img.permute(1, 2, 0).numpy()).save(sub / f"{i}.png")
    groups = list_reference_images(tmp_path)
    assert sorted(groups) == ["all", "cats", "dogs"] and len(groups["all"]) == 6
    ext = InceptionFeatures(fx["net"], "64", "pytorch-fid", batch_size=6)
    rec = fid_against_folder(fx["set_b"], tmp_path, ext, category="all")
    assert rec["fid"] == pytest.approx(fx["golden"]["fid_via_calculate_fid_given_paths"][64], rel=1e-5)
    assert rec["protocol"] == "pytorch-fid" and rec["n_reference"] == 6


# ----- KID and IS, hand-worked -----------------------------------------------------------------------------
def test_kid_hand_worked():
    from var_core.eval.fid import kid

    # d = 1, k(a, b) = (ab + 1)^3: within x = k(0,1) = 1, within y = k(2,3) = 343,
    # cross = (1 + 1 + 27 + 64) / 4 = 23.25  ->  1 + 343 - 2 * 23.25 = 297.5
    out = kid(np.array([[0.0], [1.0]]), np.array([[2.0], [3.0]]), subsets=5, subset_size=2)
    assert out["mean"] == pytest.approx(297.5) and out["std"] == pytest.approx(0.0)
    assert kid(np.array([[0.0], [1.0]]), np.array([[2.0], [3.0]]), subset_size=1000)["clamped"] is True


def test_inception_score_hand_worked():
    from var_core.eval.fid import inception_score

    # p = (0.75, 0.25) and (0.25, 0.75), marginal (0.5, 0.5): KL = 0.75 ln 1.5 + 0.25 ln 0.5 = 0.1308120
    logits = torch.tensor([[math.log(3.0), 0.0], [0.0, math.log(3.0)]], dtype=torch.float64)
    assert inception_score(logits, splits=1)["mean"] == pytest.approx(math.exp(0.75 * math.log(1.5)
                                                                               + 0.25 * math.log(0.5)), rel=1e-12)
    assert inception_score(torch.zeros(20, 7), splits=10)["mean"] == pytest.approx(1.0)


def test_unknown_protocol_and_missing_weights(tmp_path):
    from var_core.errors import UserError
    from var_core.eval.inception import load_fid_inception, preprocess
    from var_core.eval.metrics import MetricUnavailable, inception_fid

    from var_core.eval.inception import DEFAULT_PROTOCOL
    from var_core.eval.metrics import MetricContext

    assert DEFAULT_PROTOCOL == MetricContext().fid_protocol == "torch-fidelity"  # VAR's ADM-evaluator pipeline
    with pytest.raises(UserError, match="Did you mean 'pytorch-fid'"):
        preprocess(torch.zeros(1, 3, 8, 8, dtype=torch.uint8), "pytorch_fid")
    with pytest.raises(UserError, match="not found"):
        load_fid_inception(tmp_path / "none.pth")
    torch.save({"fc.weight": torch.zeros(2, 2)}, tmp_path / "wrong.pth")
    with pytest.raises(MetricUnavailable, match="not an FID Inception"):
        inception_fid(torch.zeros(2, 3, 8, 8), torch.zeros(2, 3, 8, 8), tmp_path / "wrong.pth")


def test_reference_protocol_streams_fid_and_is(fx):
    """The ImageNet-50k-style path (batches -> FID vs reference statistics + IS), torch-fidelity protocol: FID equals
    pytorch-fid's Frechet distance on torch-fidelity's features (README: 8466.3634); IS equals a direct numpy
    evaluation of the official logits."""
    from var_core.eval.fid import ReferenceStatistics, activation_statistics, reference_protocol_metrics
    from var_core.eval.inception import InceptionFeatures

    t = fx["tfid"]
    mu, sigma = activation_statistics(t["tfid_2048"][:6])
    ref = ReferenceStatistics(mu, sigma, "set_a", "pytorch-fid", "torch-fidelity", 6)
    ext = InceptionFeatures(fx["net"], "2048", "torch-fidelity", batch_size=6)
    out = reference_protocol_metrics([fx["set_b"][:3], fx["set_b"][3:]], ext, ref, is_splits=2, method="eigvals")
    assert out["fid"]["fid"] == pytest.approx(t["info"]["pytorch_fid_frechet_on_tfid_2048"], rel=1e-5)
    assert out["fid"]["protocol"] == out["is"]["protocol"] == "torch-fidelity" and "note" in out["fid"]
    z = t["tfid_logits_unbiased"][6:].double().numpy()
    p = np.exp(z) / np.exp(z).sum(1, keepdims=True)
    scores = [np.exp((q * (np.log(q) - np.log(q.mean(0)))).sum(1).mean()) for q in (p[:3], p[3:])]
    assert out["is"]["mean"] == pytest.approx(np.mean(scores), rel=1e-4)
    assert out["is"]["std"] == pytest.approx(np.std(scores), rel=1e-3, abs=1e-6)
