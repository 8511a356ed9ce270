"""--fid-reference and the protocol flags (var_core.eval.reference, var_core.zoo.size_options,
var_core.eval.prompts.with_rewritten_prompts): values pinned by hand-worked closed forms and a second FID written
here (eigenvalues of Σa Σb), not by the module's own helpers."""

from __future__ import annotations

import hashlib
import json

import numpy as np
import pytest
import torch
from PIL import Image

from var_core.errors import UserError
from var_core.eval.reference import (FeatureSpace, FIDReference, expand_protocol, load_fid_reference,
                                     make_reference_npz)


def _space(name="mean-rgb", dim=3):
    """Features = the per-channel mean of the image in [0, 255] (so a folder's statistics are checkable by hand)."""
    return FeatureSpace(name, dim, lambda x: x.double().mean((2, 3)) * (255.0 if x.dtype != torch.uint8 else 1.0))


def _fid_eig(mu_a, s_a, mu_b, s_b):
    """FID with tr sqrt(Σa Σb) = Σ sqrt(eig(Σa Σb)) (a second implementation)."""
    ev = np.linalg.eigvals(s_a @ s_b)
    return float(((mu_a - mu_b) ** 2).sum() + np.trace(s_a) + np.trace(s_b) - 2 * np.sqrt(np.abs(ev.real)).sum())


def _identity_reference(mu, sigma, n=None, dim=None):
    dim = dim or mu.size
    space = FeatureSpace("identity", dim, lambda x: x.reshape(x.shape[0], -1).double())
    return FIDReference("mem", "npz", "0" * 64, "pytorch-fid", "identity", dim, {"all": (mu, sigma, n)}, space=space)


def test_fid_against_own_statistics_is_zero_and_shifted_gaussian_is_closed_form():
    rng = np.random.default_rng(0)
    x = rng.normal(size=(3000, 4)) @ rng.normal(size=(4, 4))
    mu, s = x.mean(0), np.cov(x, rowvar=False)
    feats = torch.from_numpy(x).reshape(3000, 4, 1, 1)
    assert abs(_identity_reference(mu, s).arm_metrics(feats)[0]["fid_ref"]["mean"]) < 1e-6
    delta = np.array([1.0, -2.0, 0.5, 3.0])
    # reference N(mu + delta, 4 S): |delta|^2 + tr S + 4 tr S - 2 tr sqrt(4 S^2) = |delta|^2 + tr S
    got = _identity_reference(mu + delta, 4 * s).arm_metrics(feats)[0]["fid_ref"]["mean"]
    assert got == pytest.approx(float(delta @ delta) + np.trace(s), rel=1e-6)


def _write_folder(root, per_cat=6, cats=("aa", "bb")):
    rng = np.random.default_rng(1)
    for c in cats:
        (root / c).mkdir(parents=True)
        for i in range(per_cat):
            Image.fromarray(rng.integers(0, 256, (8, 8, 3), dtype=np.uint8)).save(root / c / f"{i}.png")


def _means(paths):
    return np.stack([np.asarray(Image.open(p).convert("RGB"), np.float64).mean((0, 1)) for p in sorted(paths)])


def test_npz_round_trip_per_category_and_sha256(tmp_path):
    _write_folder(tmp_path / "ref")
    out, counts = make_reference_npz(tmp_path / "ref", tmp_path / "ref.npz", _space())
    assert counts == {"aa": 6, "bb": 6, "all": 12}
    with np.load(out, allow_pickle=False) as d:
        assert str(d["feature_space"]) == "mean-rgb" and int(d["feature_dim"]) == 3
        f_aa = _means((tmp_path / "ref" / "aa").iterdir())
        np.testing.assert_allclose(d["mu__aa"], f_aa.mean(0), rtol=1e-12)
        np.testing.assert_allclose(d["sigma__aa"], np.cov(f_aa, rowvar=False), rtol=1e-10)
        f_all = np.concatenate([f_aa, _means((tmp_path / "ref" / "bb").iterdir())])
        np.testing.assert_allclose(d["mu"], f_all.mean(0), rtol=1e-12)
    ref = load_fid_reference(out, _space())
    assert ref.sha256 == hashlib.sha256(out.read_bytes()).hexdigest()
    assert sorted(ref.stats) == ["aa", "all", "bb"] and ref.stats["aa"][2] == 6
    folder = load_fid_reference(tmp_path / "ref", _space())  # the folder itself: the same statistics
    np.testing.assert_allclose(folder.stats["bb"][0], ref.stats["bb"][0], rtol=1e-12)


def test_per_category_fid_uses_the_samples_of_that_category(tmp_path):
    rng = np.random.default_rng(2)
    ref_a, ref_b = rng.normal(size=(50, 3)), rng.normal(3.0, 2.0, size=(50, 3))
    stats = {c: (f.mean(0), np.cov(f, rowvar=False), 50) for c, f in (("cat", ref_a), ("dog", ref_b))}
    allf = np.concatenate([ref_a, ref_b])
    stats["all"] = (allf.mean(0), np.cov(allf, rowvar=False), 100)
    space = FeatureSpace("identity", 3, lambda x: x.reshape(x.shape[0], -1).double())
    ref = FIDReference("mem", "npz", "0" * 64, "varscope", "identity", 3, stats, class_names=("cat", "dog"),
                       space=space)
    gen = rng.normal(1.0, 1.0, size=(40, 3))
    labels = torch.tensor([0, 1] * 20)
    values, unavailable = ref.arm_metrics(torch.from_numpy(gen).reshape(40, 3, 1, 1), labels)
    g_cat = gen[0::2]
    want = _fid_eig(g_cat.mean(0), np.cov(g_cat, rowvar=False), *stats["cat"][:2])
    assert values["fid_ref_cat"]["mean"] == pytest.approx(want, rel=1e-6)
    assert values["fid_ref_cat"]["n"] == 20 and values["fid_ref_cat"]["category"] == "cat"
    assert values["fid_ref"]["mean"] == pytest.approx(_fid_eig(gen.mean(0), np.cov(gen, rowvar=False),
                                                               *stats["all"][:2]), rel=1e-6)
    assert not unavailable


def test_reference_of_other_features_is_refused(tmp_path):
    np.savez(tmp_path / "ours.npz", mu=np.zeros(3), sigma=np.eye(3), feature_space=np.asarray("testbed-classifier"),
             feature_dim=np.asarray(3))
    with pytest.raises(UserError, match="made with 'testbed-classifier' features.*'mean-rgb'"):
        load_fid_reference(tmp_path / "ours.npz", _space())
    np.savez(tmp_path / "pytorch_fid.npz", mu=np.zeros(2048), sigma=np.eye(2048))
    with pytest.raises(UserError, match="2048-d statistics.*3-d.*--inception-weights"):
        load_fid_reference(tmp_path / "pytorch_fid.npz", _space())
    # an ADM reference batch: its 2048-d mu/sigma do not fit, its arr_0 images are used instead
    imgs = np.random.default_rng(3).integers(0, 256, (10, 8, 8, 3), dtype=np.uint8)
    np.savez(tmp_path / "adm.npz", mu=np.zeros(2048), sigma=np.eye(2048), arr_0=imgs)
    ref = load_fid_reference(tmp_path / "adm.npz", _space())
    assert ref.layout == "adm-images" and ref.stats["all"][2] == 10
    np.testing.assert_allclose(ref.stats["all"][0], imgs.astype(np.float64).mean((1, 2)).mean(0), rtol=1e-12)
    (tmp_path / "bad.npz").write_bytes(b"not a zip")
    with pytest.raises(UserError, match="not a readable .npz"):
        load_fid_reference(tmp_path / "bad.npz", _space())


def test_imagenet_50k_protocol_is_generic_over_classes():
    assert expand_protocol("imagenet-50k", "testbed", {}) == dict(samples=500, cfg=1.5, top_k=900, top_p=0.96)
    assert expand_protocol("imagenet-50k", "var-d16", {})["samples"] == 50_000
    assert expand_protocol("imagenet-50k", "testbed", {"cfg": 2.0})["cfg"] == 2.0
    with pytest.raises(UserError, match="text-to-image"):
        expand_protocol("imagenet-50k", "infinity-2b", {})


def test_size_options_lists_the_valid_values():
    from var_core.zoo import check_native_size, size_options

    assert size_options("infinity-2b", "1024", 0.5) == {"pn": "1M", "h_div_w": 0.5}
    assert size_options("infinity-2b", "0.25M", 1.333) == {"pn": "0.25M", "h_div_w": 1.333}
    with pytest.raises(UserError, match=r"--aspect 0\.7 .*valid: 0\.333, 0\.4, 0\.5, 0\.571, 0\.666, 0\.75, 0\.8, 1,"):
        size_options("infinity-2b", None, 0.7)
    with pytest.raises(UserError, match=r"valid: 0\.06M \(256px\), 0\.25M \(512px\), 0\.60M \(768px\), 1M"):
        size_options("infinity-2b", "2048", None)
    with pytest.raises(UserError, match="square images only"):
        size_options("testbed", None, 0.5)

    class Native:
        image_size = 64
    check_native_size("testbed", Native(), "64")
    with pytest.raises(UserError, match=r"64px images only \(valid --resolution: 64\)"):
        check_native_size("testbed", Native(), "128")


def test_rewritten_prompts_keep_geneval_metadata(tmp_path):
    from var_core.eval.prompts import load_prompt_set, with_rewritten_prompts

    rows = [{"tag": "single_object", "include": [{"class": "cat", "count": 1}], "prompt": "a photo of a cat"},
            {"tag": "colors", "include": [{"class": "car", "count": 1, "color": "red"}], "prompt": "a red car"}]
    meta = tmp_path / "evaluation_metadata.jsonl"
    meta.write_text("".join(json.dumps(r) + "\n" for r in rows))
    base = load_prompt_set(str(meta))
    (tmp_path / "rw.txt").write_text("a detailed photo of one cat\na red car\n")
    rw = with_rewritten_prompts(base, tmp_path / "rw.txt")
    assert rw.prompts == ("a detailed photo of one cat", "a red car")
    assert rw.geneval_metadata(0) == rows[0]  # the evaluator still scores against the original row
    assert rw.rewritten["changed"] == 1
    assert rw.rewritten["sha256"] == hashlib.sha256((tmp_path / "rw.txt").read_bytes()).hexdigest()
    (tmp_path / "short.txt").write_text("only one\n")
    with pytest.raises(UserError, match="has 1 prompts, --prompts .* has 2"):
        with_rewritten_prompts(base, tmp_path / "short.txt")


def test_running_moments_equal_numpy_over_uneven_batches_and_chunks():
    from var_core.eval.reference import RunningMoments

    rng = np.random.default_rng(4)
    x = rng.normal(50.0, 3.0, size=(101, 5))  # a large mean: the shifted sums must not cancel
    m = RunningMoments()
    for a, b in ((0, 1), (1, 40), (40, 41), (41, 101)):
        m.update(x[a:b])
    mu, sigma = m.statistics()
    np.testing.assert_allclose(mu, x.mean(0), rtol=1e-13)
    np.testing.assert_allclose(sigma, np.cov(x, rowvar=False), rtol=1e-9)
    # the generated side streamed in chunks of 7 (categories across chunk borders) = in one piece
    ref_feats = rng.normal(size=(60, 5))
    stats = {"all": (ref_feats.mean(0), np.cov(ref_feats, rowvar=False), 60),
             "a": (ref_feats[:30].mean(0), np.cov(ref_feats[:30], rowvar=False), 30)}
    space = FeatureSpace("identity", 5, lambda t: t.reshape(t.shape[0], -1).double())
    ref = FIDReference("mem", "npz", "0" * 64, "varscope", "identity", 5, stats, space=space,
                       sample_categories=["a", "b", "a"])
    imgs = torch.from_numpy(x).reshape(101, 5, 1, 1)
    whole, _ = ref.arm_metrics(imgs, chunk=1000)
    chunked, _ = ref.arm_metrics(imgs, chunk=7)
    idx_a = [i for i in range(101) if i % 3 != 1]
    want = _fid_eig(x[idx_a].mean(0), np.cov(x[idx_a], rowvar=False), *stats["a"][:2])
    assert chunked["fid_ref_a"]["mean"] == pytest.approx(want, rel=1e-6) and chunked["fid_ref_a"]["n"] == len(idx_a)
    assert chunked["fid_ref"]["mean"] == pytest.approx(whole["fid_ref"]["mean"], rel=1e-9)


def test_protocol_record_names_preset_and_deviations():
    from types import SimpleNamespace

    from var_core.eval.reference import protocol_record

    opts = SimpleNamespace(protocol="imagenet-50k", model="testbed", samples=40, cfg=1.5, top_k=900, top_p=0.96,
                           resolution=None, aspect=None, more_smooth=False, prompts_rewritten=None)
    rec = protocol_record(opts, None)
    assert rec["name"] == "imagenet-50k" and rec["samples"] == 40
    assert rec["deviations"] == {"samples": 40}  # the preset's 500 = 50 x 10 classes was overridden
    assert rec["preset"] == {"per_class": 50, "cfg": 1.5, "top_k": 900, "top_p": 0.96}
    assert rec["fid_reference"] is None and rec["more_smooth"] is False
