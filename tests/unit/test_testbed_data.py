"""Unit tests for the procedural testbed dataset and its classifier (CPU, ~10 s)."""

from __future__ import annotations

import math

import pytest
import torch

from var_core.testbed.classifier import (
    ClassifierFeatureExtractor,
    ClassifierLogitsExtractor,
    TestbedClassifier,
    classifier_accuracy,
    default_weights_path,
    load_classifier,
)
from var_core.testbed.data import (
    CLASS_NAMES,
    NUM_CLASSES,
    TestbedDataset,
    complexity_score,
    make_tensor_dataset,
)

HAVE_WEIGHTS = default_weights_path().is_file()
needs_weights = pytest.mark.skipif(not HAVE_WEIGHTS, reason="shipped classifier weights absent")


@pytest.fixture(scope="module")
def heldout200():
    return make_tensor_dataset("heldout", 200, seed=0)


def test_class_names():
    assert len(CLASS_NAMES) == NUM_CLASSES == 10
    assert len(set(CLASS_NAMES)) == NUM_CLASSES


def test_item_shape_range_and_type():
    ds = TestbedDataset("train", size=30, seed=0)
    assert len(ds) == 30
    for i in range(NUM_CLASSES):
        img, lab = ds[i]
        assert isinstance(lab, int) and lab == i
        assert img.shape == (3, 64, 64) and img.dtype == torch.float32
        assert torch.isfinite(img).all()
        assert img.min() >= -1.0 and img.max() <= 1.0
    with pytest.raises(IndexError):
        ds[30]


def test_determinism_same_index_and_order():
    a = TestbedDataset("train", size=100, seed=3)
    b = TestbedDataset("train", size=100, seed=3)
    idx = [57, 3, 99, 12, 40, 0, 71]
    first = {i: a[i][0] for i in idx}
    # different access order, fresh object, repeated access
    for i in reversed(idx):
        assert torch.equal(b[i][0], first[i])
        assert torch.equal(a[i][0], first[i])
    # materialised tensor dataset matches item-wise access
    x, y = make_tensor_dataset("train", 20, seed=3)
    for i in range(20):
        img, lab = a[i]
        assert torch.equal(x[i], img) and int(y[i]) == lab


def test_seed_changes_images():
    a = TestbedDataset("train", size=10, seed=0)[4][0]
    b = TestbedDataset("train", size=10, seed=1)[4][0]
    assert not torch.equal(a, b)


def test_splits_do_not_overlap():
    xt, yt = make_tensor_dataset("train", 200, seed=0)
    xh, yh = make_tensor_dataset("heldout", 200, seed=0)
    ft = xt.flatten(1)
    fh = xh.flatten(1)
    # no identical (or near-identical) images between the splits
    d = torch.cdist(ft, fh)
    assert float(d.min()) > 1e-3
    # and no duplicates within a split either
    dt = torch.cdist(ft, ft) + torch.eye(len(ft)) * 1e9
    assert float(dt.min()) > 1e-3


def test_labels_cover_all_classes_balanced():
    _, y = make_tensor_dataset("heldout", 50, seed=0)
    assert torch.equal(torch.bincount(y, minlength=NUM_CLASSES), torch.full((NUM_CLASSES,), 5))
    assert torch.equal(TestbedDataset("train", size=50).labels(), y)


def test_uint8_and_cache(tmp_path):
    x, y = make_tensor_dataset("train", 12, seed=0)
    xu, yu = make_tensor_dataset("train", 12, seed=0, dtype=torch.uint8, cache_dir=tmp_path)
    assert xu.dtype == torch.uint8 and torch.equal(y, yu)
    assert (xu.float() / 127.5 - 1.0 - x).abs().max() <= 1.0 / 127.5 + 1e-6
    assert len(list(tmp_path.glob("*.pt"))) == 1
    xc, yc = make_tensor_dataset("train", 12, seed=0, dtype=torch.uint8, cache_dir=tmp_path)
    assert torch.equal(xc, xu) and torch.equal(yc, yu)


def test_complexity_score_orders_content(heldout200):
    x, y = heldout200
    s = complexity_score(x)
    assert s.shape == (200,) and torch.isfinite(s).all()
    assert math.isclose(complexity_score(x[0]), float(s[0]), rel_tol=1e-5)
    assert complexity_score(torch.zeros(3, 64, 64)) == 0.0
    med = {CLASS_NAMES[c]: float(s[y == c].median()) for c in range(NUM_CLASSES)}
    assert med["flat_field"] < med["coarse_texture"] < med["fine_noise"]
    assert med["gradient"] < med["photo"]
    # complexity varies within textured classes (what adaptive pruning needs)
    for name in ("fine_noise", "photo", "clouds", "starfield"):
        sc = s[y == CLASS_NAMES.index(name)]
        assert float(sc.max()) > 2.0 * float(sc.min()), name


def test_classifier_shapes_untrained():
    m = TestbedClassifier(10).eval()
    x = torch.rand(2, 3, 64, 64) * 2 - 1
    assert m(x).shape == (2, 10)
    assert m.features(x).shape == (2, m.feature_dim)
    n = sum(p.numel() for p in m.parameters())
    assert n * 4 <= 1_000_000  # fp32 weights stay under 1 MB


def test_load_classifier_missing_path(tmp_path):
    with pytest.raises(FileNotFoundError, match="train_classifier"):
        load_classifier(tmp_path / "nope.safetensors")


@needs_weights
def test_shipped_classifier_accuracy(heldout200):
    x, y = heldout200
    m = load_classifier()
    assert not m.training
    assert classifier_accuracy(m, x, y) >= 0.95


@needs_weights
@pytest.mark.filterwarnings("ignore:Metric .* will save all extracted features")
def test_feature_wrappers_with_torchmetrics(heldout200):
    from torchmetrics.image.fid import FrechetInceptionDistance
    from torchmetrics.image.inception import InceptionScore
    from torchmetrics.image.kid import KernelInceptionDistance

    x, _ = heldout200
    x01 = (x + 1) / 2
    real, fake = x01[:32], x01[32:64]
    clf = load_classifier()
    feat = ClassifierFeatureExtractor(clf)
    assert feat.num_features == 128

    # float [0,1] and uint8 [0,255] inputs give (nearly) the same features
    f_float = feat(real[:4])
    f_u8 = feat((real[:4] * 255).round().to(torch.uint8))
    assert f_float.shape == (4, 128)
    assert torch.allclose(f_float, f_u8, atol=0.05)

    fid = FrechetInceptionDistance(feature=feat, normalize=True)
    fid.update(real, real=True)
    fid.update(fake, real=False)
    v = fid.compute()
    assert torch.isfinite(v) and float(v) > 0.0
    fid.reset()
    fid.update(real, real=True)
    fid.update(real, real=False)
    assert abs(float(fid.compute())) < 1e-3 * float(v) + 1e-4

    kid = KernelInceptionDistance(feature=feat, normalize=True, subset_size=16, subsets=5)
    kid.update(real, real=True)
    kid.update(fake, real=False)
    assert all(torch.isfinite(t) for t in kid.compute())

    inc = InceptionScore(feature=ClassifierLogitsExtractor(clf), normalize=True, splits=2)
    inc.update(x01[:40])  # IS converts to uint8 itself
    mean, _ = inc.compute()
    assert torch.isfinite(mean) and 1.0 <= float(mean) <= NUM_CLASSES + 1e-3
