"""Sample grids carry their row labels (arm names) in the image: a left margin with text, the samples unchanged."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from PIL import Image

from ablations.grids import save_labelled_grid
from var_core.eval.images import save_grid

K, H = 3, 16  # 2 rows x 3 samples of 16 px, upscaled 2x


def _images(seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.rand(2 * K, 3, H, H, generator=g)


def _png(path) -> np.ndarray:
    return np.asarray(Image.open(path).convert("RGB"))


@pytest.fixture()
def grids(tmp_path):
    images = _images()
    plain = _png(save_grid(images, tmp_path / "plain.png", nrow=K, upscale=2))
    labelled = _png(save_labelled_grid(images, tmp_path / "a.png", nrow=K, upscale=2,
                                       row_labels=["baseline", "fastvar"]))
    other = _png(save_labelled_grid(images, tmp_path / "b.png", nrow=K, upscale=2,
                                    row_labels=["baseline", "ldpruning_skip"]))
    return plain, labelled, other


def test_samples_are_the_unlabelled_grid_right_of_a_margin(grids):
    plain, labelled, _ = grids
    # the unlabelled grid: 2 + 3 * (16 + 2) = 56 px wide, 2 + 2 * 18 = 38 px high, times 2
    assert plain.shape == (76, 112, 3)
    margin = labelled.shape[1] - plain.shape[1]
    assert labelled.shape[0] == plain.shape[0] and margin > 12
    assert np.array_equal(labelled[:, margin:], plain)  # the samples, pixel for pixel


def test_each_row_has_its_label_in_the_margin(grids):
    plain, labelled, other = grids
    margin = labelled.shape[1] - plain.shape[1]
    strip = labelled[:, :margin].min(axis=2)  # darkest channel
    row_h = (H + 2) * 2
    for r in range(2):
        band = strip[4 + r * row_h: 4 + r * row_h + H * 2]
        assert (band < 128).sum() > 20, f"row {r}: no text in the margin"  # dark glyph pixels on white
    assert strip[:4].min() == 255  # above the first row: blank
    # the same first label draws the same pixels; a different second label draws different ones
    other_margin = other.shape[1] - plain.shape[1]
    assert other_margin > margin  # a longer name, a wider margin
    first = slice(4, 4 + H * 2)
    second = slice(4 + row_h, 4 + row_h + H * 2)
    a, b = labelled[:, :margin].min(axis=2), other[:, :other_margin].min(axis=2)
    assert np.array_equal(a[first], b[first, :margin])
    assert not np.array_equal(a[second], b[second, :margin])


def test_a_long_name_wraps_instead_of_widening_without_bound(tmp_path):
    long_name = "scorer.extractor=sobel,schedule.tau=0.7,granularity=branch,restorer=identity"
    path = save_labelled_grid(_images(), tmp_path / "long.png", nrow=K, upscale=4, row_labels=["baseline", long_name],
                              max_label_width=120)
    width = _png(path).shape[1]
    assert width - (2 + K * (H + 2)) * 4 <= 120 + 2 * 6  # the margin is capped


def test_wrong_number_of_labels_is_refused(tmp_path):
    with pytest.raises(ValueError, match="2 rows"):
        save_labelled_grid(_images(), tmp_path / "x.png", nrow=K, row_labels=["only one"])


def test_twenty_rows_each_with_its_label(tmp_path):
    """An overview of 20 arms: 20 rows, none dropped, each with text in its margin band (issue 25)."""
    names = [f"{s}@tau={t}" for s in ("entropy", "random", "mse", "lhep", "freq") for t in (0.2, 0.4, 0.6, 0.8)]
    images = torch.rand(20 * 2, 3, H, H, generator=torch.Generator().manual_seed(1))
    plain = _png(save_grid(images, tmp_path / "plain.png", nrow=2, upscale=2))
    labelled = _png(save_labelled_grid(images, tmp_path / "many.png", nrow=2, upscale=2, row_labels=names))
    row_h = (H + 2) * 2
    assert plain.shape[0] == labelled.shape[0] == 4 + 20 * row_h  # 2 px padding above and below, times 2
    margin = labelled.shape[1] - plain.shape[1]
    assert np.array_equal(labelled[:, margin:], plain)
    strip = labelled[:, :margin].min(axis=2)
    for r in range(20):
        band = strip[4 + r * row_h: 4 + r * row_h + H * 2]
        assert (band < 128).sum() > 20, f"row {r} ({names[r]}): no text in the margin"
