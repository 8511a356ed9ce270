"""Deterministic, offline, procedural image dataset for the testbed VAR.

Why this dataset looks the way it does
--------------------------------------
The testbed model is a *tiny* class-conditional VAR (a few transformer blocks,
width ~128, 64x64 pixels, next-scale schedule up to a 16x16 token map) trained
for tens of CPU minutes.  A feasibility run showed what such a model learns
first: **local statistics** -- colour, brightness, texture energy and texture
scale -- long before **global structure**.  Classes defined by geometry
(squares vs. triangles, stripes, checkerboards, rings) were rendered
recognisably only 0-16 % of the time, while gradients, fine texture and soft
blobs reached 88-100 %.

Two requirements follow:

1. *Classes must be separable by cues a tiny VAR renders early.*  Every class
   therefore owns (a) a distinctive **colour palette** (its own region of the
   hue circle, or a distinctive saturation/brightness regime) **and** (b) a
   distinctive **content type** (flat / smooth ramp / soft blobs / single disc /
   pixel noise / coarse cells / oriented grain / photo structure / fractal
   clouds / sparse points).  Either cue alone nearly identifies the class, so
   a generated image is recognisable even when its geometry is only
   approximately right.  No class depends on exact shapes, counts or phases.

2. *Instances must vary in complexity* so that adaptive (content-aware) token
   pruning has something to adapt to.  Each generator draws per-instance
   parameters (texture amplitude and scale, edge softness, blob count, star
   density, crop zoom, spatial masks mixing flat and textured regions) so that
   each class spans a range of :func:`complexity_score` values, and many images
   contain flat, smooth, textured and fine-detailed regions side by side.

Classes (index: name -- palette; content)::

    0 flat_field      crimson/red, mid-bright;  uniform colour, soft off-centre
                      vignette, optional faint grain          (lowest complexity)
    1 gradient        orange -> yellow, bright;  smooth linear/radial ramp with a
                      random transition sharpness
    2 blobs           lime/green on near-black green; 1-10 soft Gaussian blobs
    3 disc            magenta/pink on pale cream;  one large disc, random edge
                      softness and spherical shading
    4 fine_noise      neutral grey;  pixel-scale noise, spatially masked so that
                      flat and textured regions mix
    5 coarse_texture  violet/lavender;  blurred-noise cells (2-5 px features)
    6 wood_grain      dark brown / tan;  warped oriented rings + fine streaks
    7 photo           teal duotone ("cyanotype");  crops of scikit-image's
                      bundled photos at several zoom levels
    8 clouds          sky blue + white;  thresholded 1/f^beta fractal noise
    9 starfield       near-black blue;  sparse bright points + faint nebula

Determinism
-----------
Sample ``index`` of split ``split`` under ``seed`` is generated from its own
generator ``numpy.random.default_rng([seed, split_id, index])`` (a
``SeedSequence`` over the three integers), so it is identical regardless of
access order, DataLoader workers or batch composition.  Train
(``split_id=0``) and held-out (``split_id=1``) use independent streams; all
parameters are continuous, so identical images across splits do not occur.
The label is ``index % 10`` (balanced for any prefix of length ``k * 10``).

Speed
-----
All generators are a handful of numpy ops on a 64x64 grid; filtering uses
cached FFT transfer functions.  Generation runs at well under 1 ms/image on one
core, i.e. 20k images in roughly 10-20 s.  :func:`make_tensor_dataset` can cache
its result as a ``.pt`` file.
"""

from __future__ import annotations

import colorsys
import functools
import hashlib
import math
from pathlib import Path
from typing import Callable, Sequence

import numpy as np
import torch
from torch.utils.data import Dataset

__all__ = [
    "CLASS_NAMES",
    "NUM_CLASSES",
    "SPLITS",
    "TestbedDataset",
    "generate_image",
    "make_tensor_dataset",
    "complexity_score",
    "save_contact_sheet",
]

CLASS_NAMES: tuple[str, ...] = (
    "flat_field",
    "gradient",
    "blobs",
    "disc",
    "fine_noise",
    "coarse_texture",
    "wood_grain",
    "photo",
    "clouds",
    "starfield",
)
NUM_CLASSES = len(CLASS_NAMES)

#: split name -> stream id used in the per-index seed
SPLITS: dict[str, int] = {"train": 0, "heldout": 1}

#: default dataset lengths when ``size=None`` (the dataset is procedural, so
#: these are only conventions)
DEFAULT_SIZES: dict[str, int] = {"train": 50_000, "heldout": 5_000}

# bump when any generator changes, so on-disk caches are invalidated
GENERATOR_VERSION = 1


# --------------------------------------------------------------------------
# small numpy helpers
# --------------------------------------------------------------------------
@functools.lru_cache(maxsize=8)
def _grid(size: int) -> tuple[np.ndarray, np.ndarray]:
    """Pixel-centre coordinates in [-1, 1] (x to the right, y downwards)."""
    c = (np.arange(size, dtype=np.float32) + 0.5) / size * 2.0 - 1.0
    yy, xx = np.meshgrid(c, c, indexing="ij")
    return xx, yy


@functools.lru_cache(maxsize=8)
def _freq_radius(size: int) -> np.ndarray:
    """|f| in cycles/pixel on the rfft2 grid of a size x size image."""
    fy = np.fft.fftfreq(size)[:, None]
    fx = np.fft.rfftfreq(size)[None, :]
    return np.sqrt(fx * fx + fy * fy).astype(np.float32)


@functools.lru_cache(maxsize=64)
def _gauss_tf(size: int, sigma_q: float) -> np.ndarray:
    """Gaussian transfer function (sigma in pixels, quantised for caching)."""
    r = _freq_radius(size)
    return np.exp(-2.0 * math.pi**2 * sigma_q**2 * r * r).astype(np.float32)


def _normalise(a: np.ndarray) -> np.ndarray:
    a = a - a.mean()
    s = a.std()
    return a / s if s > 1e-8 else a


def _blur(a: np.ndarray, sigma: float) -> np.ndarray:
    """Periodic Gaussian blur via FFT (sigma in pixels, quantised to 0.05)."""
    sq = round(max(sigma, 0.05) * 20) / 20
    return np.fft.irfft2(np.fft.rfft2(a) * _gauss_tf(a.shape[0], sq), s=a.shape).astype(np.float32)


def _smooth_noise(rng: np.random.Generator, size: int, sigma: float) -> np.ndarray:
    """White noise low-passed with a Gaussian of ``sigma`` px; zero mean, unit std."""
    return _normalise(_blur(rng.standard_normal((size, size), dtype=np.float32), sigma))


def _fractal_noise(rng: np.random.Generator, size: int, beta: float) -> np.ndarray:
    """Noise with power spectrum ~ 1/f^beta; zero mean, unit std."""
    r = _freq_radius(size) * size  # cycles per image
    amp = np.zeros_like(r)
    nz = r > 0
    amp[nz] = r[nz] ** (-beta / 2.0)
    w = rng.standard_normal((size, size), dtype=np.float32)
    return _normalise(np.fft.irfft2(np.fft.rfft2(w) * amp, s=(size, size)).astype(np.float32))


def _hsv(h_deg: float, s: float, v: float) -> np.ndarray:
    return np.asarray(colorsys.hsv_to_rgb((h_deg / 360.0) % 1.0, s, v), dtype=np.float32)


def _ramp(t: np.ndarray, stops: Sequence[np.ndarray]) -> np.ndarray:
    """Map a scalar field t in [0, 1] through evenly spaced colour stops -> HxWx3."""
    t = np.clip(t, 0.0, 1.0)
    if len(stops) == 2:
        c0, c1 = stops
        return c0 + t[..., None] * (c1 - c0)
    cs = np.stack(stops)  # K x 3
    xs = np.linspace(0.0, 1.0, len(stops))
    return np.stack([np.interp(t, xs, cs[:, k]) for k in range(3)], axis=-1).astype(np.float32)


def _sigmoid(x: np.ndarray) -> np.ndarray:
    return 1.0 / (1.0 + np.exp(-x))


def _log_uniform(rng: np.random.Generator, lo: float, hi: float) -> float:
    return float(math.exp(rng.uniform(math.log(lo), math.log(hi))))


def _region_mask(rng: np.random.Generator, size: int, px: float, p_full: float) -> np.ndarray:
    """Smooth [0,1] mask that leaves part of the image flat and part detailed.

    With probability ``p_full`` the mask is all ones (fully detailed image);
    otherwise a thresholded low-frequency noise field with a random coverage
    and a random boundary softness.
    """
    if rng.random() < p_full:
        return np.ones((size, size), np.float32)
    low = _smooth_noise(rng, size, rng.uniform(7.0, 14.0) * px)
    thr = rng.uniform(-1.0, 1.0)
    k = _log_uniform(rng, 1.5, 10.0)
    return _sigmoid(k * (low - thr)).astype(np.float32)


# --------------------------------------------------------------------------
# class generators: (rng, size) -> HxWx3 float32 in [0, 1]
# --------------------------------------------------------------------------
def _gen_flat_field(rng: np.random.Generator, size: int) -> np.ndarray:
    """Uniform crimson field, soft off-centre vignette, sometimes faint grain."""
    xx, yy = _grid(size)
    c = _hsv(rng.uniform(-15.0, 15.0), rng.uniform(0.55, 0.85), rng.uniform(0.45, 0.8))
    cx, cy = rng.uniform(-0.3, 0.3, size=2)
    r2 = ((xx - cx) ** 2 + (yy - cy) ** 2) / rng.uniform(1.2, 2.5)
    vig = 1.0 - rng.uniform(0.0, 0.5) * np.clip(r2, 0.0, 1.0) ** rng.uniform(0.7, 1.5)
    img = c[None, None, :] * vig[..., None]
    if rng.random() < 0.3:
        img = img + rng.uniform(0.004, 0.02) * rng.standard_normal((size, size, 1), dtype=np.float32)
    return img


def _gen_gradient(rng: np.random.Generator, size: int) -> np.ndarray:
    """Orange -> yellow ramp: linear (70 %) or radial, random transition sharpness."""
    xx, yy = _grid(size)
    c0 = _hsv(rng.uniform(18.0, 35.0), rng.uniform(0.75, 1.0), rng.uniform(0.8, 1.0))
    c1 = _hsv(rng.uniform(45.0, 60.0), rng.uniform(0.45, 0.95), rng.uniform(0.88, 1.0))
    if rng.random() < 0.5:
        c0, c1 = c1, c0
    if rng.random() < 0.7:
        th = rng.uniform(0.0, 2.0 * math.pi)
        u = (xx * math.cos(th) + yy * math.sin(th)) / math.sqrt(2.0)  # in [-1, 1]
    else:
        cx, cy = rng.uniform(-0.6, 0.6, size=2)
        u = np.sqrt((xx - cx) ** 2 + (yy - cy) ** 2) - rng.uniform(0.4, 1.0)
    k = _log_uniform(rng, 1.0, 14.0)
    t = _sigmoid(k * (u - rng.uniform(-0.3, 0.3)))
    lo, hi = float(t.min()), float(t.max())
    t = (t - lo) / max(hi - lo, 1e-6)
    stops = [c0, c1]
    if rng.random() < 0.35:  # a pale middle stop for a little variety
        stops = [c0, _hsv(rng.uniform(35.0, 50.0), rng.uniform(0.3, 0.6), 1.0), c1]
    return _ramp(t, stops)


def _gen_blobs(rng: np.random.Generator, size: int) -> np.ndarray:
    """1-10 soft lime/green Gaussian blobs alpha-composited on dark green."""
    xx, yy = _grid(size)
    img = np.broadcast_to(
        _hsv(rng.uniform(100.0, 150.0), rng.uniform(0.4, 0.8), rng.uniform(0.04, 0.18)), (size, size, 3)
    ).copy()
    n = int(rng.integers(1, 11))
    rmax = 0.45 if n <= 2 else 0.3
    for _ in range(n):
        cx, cy = rng.uniform(-0.9, 0.9, size=2)
        rad = rng.uniform(0.08, rmax)
        col = _hsv(rng.uniform(75.0, 135.0), rng.uniform(0.55, 1.0), rng.uniform(0.6, 1.0))
        d2 = ((xx - cx) ** 2 + (yy - cy) ** 2) / (rad * rad)
        hardness = rng.uniform(1.0, 3.0)  # 1 = Gaussian, >1 = flatter top, crisper edge
        a = (np.exp(-0.5 * d2**hardness) * rng.uniform(0.7, 1.0))[..., None]
        img = img * (1.0 - a) + col * a
    return img


def _gen_disc(rng: np.random.Generator, size: int) -> np.ndarray:
    """One large magenta disc on pale cream, random edge softness and shading."""
    xx, yy = _grid(size)
    bg = _hsv(rng.uniform(35.0, 60.0), rng.uniform(0.04, 0.2), rng.uniform(0.85, 0.97))
    col = _hsv(rng.uniform(295.0, 335.0), rng.uniform(0.55, 0.9), rng.uniform(0.6, 0.92))
    cx, cy = rng.uniform(-0.2, 0.2, size=2)
    rad = rng.uniform(0.35, 0.65)
    r = np.sqrt((xx - cx) ** 2 + (yy - cy) ** 2)
    soft = _log_uniform(rng, 0.01, 0.12)
    a = _sigmoid((rad - r) / soft)[..., None]
    th = rng.uniform(0.0, 2.0 * math.pi)
    shade = 1.0 - rng.uniform(0.0, 0.45) * np.clip(
        ((xx - cx) * math.cos(th) + (yy - cy) * math.sin(th)) / rad * 0.5 + 0.5, 0.0, 1.0
    )
    bgimg = bg * (1.0 - rng.uniform(0.0, 0.15) * np.clip(r / 1.4, 0, 1))[..., None]  # faint bg vignette
    return bgimg * (1.0 - a) + (col * shade[..., None]) * a


def _gen_fine_noise(rng: np.random.Generator, size: int) -> np.ndarray:
    """Neutral grey with pixel-scale noise, masked so flat and noisy areas mix."""
    px = size / 64.0
    base = _hsv(rng.uniform(0.0, 360.0), rng.uniform(0.0, 0.06), rng.uniform(0.35, 0.65))
    n = _smooth_noise(rng, size, rng.uniform(0.5, 1.1) * px)
    m = _region_mask(rng, size, px, p_full=0.35)
    amp = rng.uniform(0.08, 0.28)
    lum = 1.0 + amp / max(float(base.mean()), 0.2) * n * m
    return base[None, None, :] * lum[..., None]


def _gen_coarse_texture(rng: np.random.Generator, size: int) -> np.ndarray:
    """Violet cells: blurred noise (2-5 px) through a contrast sigmoid."""
    px = size / 64.0
    dark = _hsv(rng.uniform(255.0, 280.0), rng.uniform(0.5, 0.85), rng.uniform(0.15, 0.35))
    light = _hsv(rng.uniform(265.0, 290.0), rng.uniform(0.2, 0.5), rng.uniform(0.7, 0.95))
    f = _smooth_noise(rng, size, rng.uniform(2.0, 5.0) * px)
    if rng.random() < 0.5:  # a second, finer octave
        f = f + rng.uniform(0.1, 0.5) * _smooth_noise(rng, size, rng.uniform(0.8, 1.5) * px)
    t = _sigmoid(rng.uniform(1.0, 4.0) * f)
    m = _region_mask(rng, size, px, p_full=0.6)
    t = t * m + rng.uniform(0.35, 0.65) * (1.0 - m)  # masked-out regions -> flat mid violet
    return _ramp(t, [dark, light])


def _gen_wood_grain(rng: np.random.Generator, size: int) -> np.ndarray:
    """Brown/tan wood: warped sinusoidal rings, sharpened, plus fine streaks."""
    px = size / 64.0
    xx, yy = _grid(size)
    dark = _hsv(rng.uniform(15.0, 28.0), rng.uniform(0.6, 0.85), rng.uniform(0.15, 0.3))
    light = _hsv(rng.uniform(24.0, 36.0), rng.uniform(0.4, 0.62), rng.uniform(0.48, 0.68))
    th = rng.uniform(0.0, math.pi)
    u = xx * math.cos(th) + yy * math.sin(th)
    if rng.random() < 0.3:  # ring centre inside/near the image (knot-like)
        cx, cy = rng.uniform(-1.5, 1.5, size=2)
        u = np.sqrt((xx - cx) ** 2 + (yy - cy) ** 2)
    # cycles per unit length (image width = 2 units); <= 8 keeps the period
    # >= 4 px, and capping warp * freq keeps the local ring frequency of the
    # warped pattern low enough that it never aliases into moire
    freq = rng.uniform(2.5, 8.0)
    warp_amp = rng.uniform(0.02, min(0.2, 0.5 / freq))
    warp = warp_amp * _smooth_noise(rng, size, rng.uniform(9.0, 16.0) * px)
    t = 0.5 + 0.5 * np.sin(2.0 * math.pi * freq * (u + warp) + rng.uniform(0, 2 * math.pi))
    t = t ** rng.uniform(1.0, 4.0)  # >1: thin dark-to-light lines
    t = t + rng.uniform(0.03, 0.12) * _smooth_noise(rng, size, 0.6 * px)
    return _ramp(t, [light, dark])


# photo sources: scikit-image's bundled images (shipped inside the wheel, so
# this stays offline).  hubble_deep_field / retina are excluded: mostly black,
# they would look like the starfield class.
_PHOTO_NAMES = (
    "astronaut",
    "coffee",
    "chelsea",
    "rocket",
    "immunohistochemistry",
    "camera",
    "coins",
    "moon",
    "brick",
    "gravel",
)


def _block_mean(a: np.ndarray, f: int) -> np.ndarray:
    h, w = (a.shape[0] // f) * f, (a.shape[1] // f) * f
    return a[:h, :w].reshape(h // f, f, w // f, f).mean(axis=(1, 3))


@functools.lru_cache(maxsize=4)
def _photo_pyramid(size: int) -> tuple[np.ndarray, ...]:
    """Luminance images (float32 [0,1]) at several integer downscales.

    A crop of ``size`` px from a level downscaled by ``f`` covers ``f*size``
    source pixels: f=1 gives zoomed-in, smooth crops; large f gives busy,
    detailed crops -- a built-in complexity range.
    """
    import skimage.data as skd  # optional dependency (extra "testbed")

    levels = []
    for name in _PHOTO_NAMES:
        im = np.asarray(getattr(skd, name)(), dtype=np.float32) / 255.0
        if im.ndim == 3:
            im = im[..., :3] @ np.asarray([0.299, 0.587, 0.114], np.float32)
        for f in (1, 2, 3, 4, 6):
            lv = _block_mean(im, f) if f > 1 else im
            if min(lv.shape) >= size + 8:
                levels.append(np.ascontiguousarray(lv, dtype=np.float32))
    return tuple(levels)


def _gen_photo(rng: np.random.Generator, size: int) -> np.ndarray:
    """Crop of a bundled photo, tone-jittered, mapped to a teal duotone."""
    levels = _photo_pyramid(size)
    lv = levels[int(rng.integers(len(levels)))]
    y0 = int(rng.integers(0, lv.shape[0] - size + 1))
    x0 = int(rng.integers(0, lv.shape[1] - size + 1))
    L = lv[y0 : y0 + size, x0 : x0 + size]
    L = np.rot90(L, int(rng.integers(4)))
    if rng.random() < 0.5:
        L = L[:, ::-1]
    lo, hi = np.percentile(L, [1.0, 99.0])
    L = np.clip((L - lo) / max(hi - lo, 0.05), 0.0, 1.0)  # auto-contrast ...
    L = L ** _log_uniform(rng, 0.6, 1.6)  # ... then gamma jitter
    hue = rng.uniform(168.0, 190.0)
    stops = [
        _hsv(hue + 12.0, rng.uniform(0.7, 0.95), rng.uniform(0.08, 0.18)),
        _hsv(hue, rng.uniform(0.6, 0.85), rng.uniform(0.45, 0.6)),
        _hsv(hue - 10.0, rng.uniform(0.15, 0.35), rng.uniform(0.88, 0.98)),
    ]
    return _ramp(np.ascontiguousarray(L), stops)


def _gen_clouds(rng: np.random.Generator, size: int) -> np.ndarray:
    """Sky-blue background with white clouds from thresholded 1/f^beta noise."""
    h = rng.uniform(200.0, 222.0)
    sky = _hsv(h, rng.uniform(0.45, 0.8), rng.uniform(0.7, 0.95))
    white = _hsv(h, rng.uniform(0.0, 0.08), rng.uniform(0.93, 1.0))
    shadow = _hsv(h, rng.uniform(0.1, 0.25), rng.uniform(0.7, 0.85))
    f = _fractal_noise(rng, size, rng.uniform(1.8, 3.4))  # low beta = more fine detail
    t = np.clip((f - rng.uniform(-0.8, 0.9)) * rng.uniform(0.4, 1.8), 0.0, 1.0)
    # cloud bodies brighten towards their cores; edges pick up a grey-blue shade
    return _ramp(t, [sky, shadow, white]) if rng.random() < 0.5 else _ramp(t, [sky, white])


def _gen_starfield(rng: np.random.Generator, size: int) -> np.ndarray:
    """Near-black blue sky, faint nebula, 15-400 stars of power-law brightness."""
    px = size / 64.0
    img = np.broadcast_to(
        _hsv(rng.uniform(220.0, 260.0), rng.uniform(0.4, 0.8), rng.uniform(0.02, 0.08)), (size, size, 3)
    ).copy()
    if rng.random() < 0.6:
        neb = np.clip(_fractal_noise(rng, size, rng.uniform(2.5, 3.5)) - rng.uniform(0.0, 1.0), 0.0, None)
        img += rng.uniform(0.03, 0.15) * neb[..., None] * _hsv(rng.uniform(240.0, 300.0), 0.7, 1.0)
    n = int(_log_uniform(rng, 15.0, 400.0) * px * px)
    stars = np.zeros((size, size), np.float32)
    ys = rng.integers(0, size, n)
    xs = rng.integers(0, size, n)
    np.add.at(stars, (ys, xs), (rng.uniform(0.15, 1.0, n) ** 2).astype(np.float32))
    sig = rng.uniform(0.45, 0.8) * px
    stars = _blur(stars, sig) * (2.0 * math.pi * sig * sig)  # keep peak ~ brightness
    nb = int(rng.integers(0, 4))  # a few big bright stars
    if nb:
        big = np.zeros((size, size), np.float32)
        big[rng.integers(0, size, nb), rng.integers(0, size, nb)] = 1.0
        sb = rng.uniform(1.0, 1.8) * px
        stars += _blur(big, sb) * (2.0 * math.pi * sb * sb)
    star_col = _hsv(rng.uniform(30.0, 60.0), rng.uniform(0.0, 0.3), 1.0)
    return img + np.clip(stars, 0.0, 1.5)[..., None] * star_col


_GENERATORS: tuple[Callable[[np.random.Generator, int], np.ndarray], ...] = (
    _gen_flat_field,
    _gen_gradient,
    _gen_blobs,
    _gen_disc,
    _gen_fine_noise,
    _gen_coarse_texture,
    _gen_wood_grain,
    _gen_photo,
    _gen_clouds,
    _gen_starfield,
)
assert len(_GENERATORS) == NUM_CLASSES


# --------------------------------------------------------------------------
# public API
# --------------------------------------------------------------------------
def _split_id(split: str) -> int:
    try:
        return SPLITS[split]
    except KeyError:
        raise ValueError(f"unknown split {split!r}; expected one of {tuple(SPLITS)}") from None


def label_of(index: int) -> int:
    """Class label of sample ``index`` (round-robin, so prefixes are balanced)."""
    return int(index) % NUM_CLASSES


def generate_image(split: str, index: int, seed: int = 0, image_size: int = 64) -> tuple[np.ndarray, int]:
    """Generate sample ``index`` of ``split``: (HxWx3 float32 in [0,1], label).

    Pure function of ``(split, index, seed, image_size)``.
    """
    if index < 0:
        raise IndexError(index)
    rng = np.random.default_rng([int(seed), _split_id(split), int(index)])
    label = label_of(index)
    img = _GENERATORS[label](rng, int(image_size))
    return np.clip(img, 0.0, 1.0).astype(np.float32, copy=False), label


def _to_tensor(img01: np.ndarray) -> torch.Tensor:
    return torch.from_numpy(np.ascontiguousarray(img01.transpose(2, 0, 1))).mul_(2.0).sub_(1.0)


class TestbedDataset(Dataset):
    """Procedural class-labelled 64x64 RGB dataset (see module docstring).

    Args:
        split: ``"train"`` or ``"heldout"`` (independent random streams).
        size: number of samples; ``None`` -> 50k for train, 5k for held-out.
        seed: global seed; sample ``i`` depends only on ``(seed, split, i)``.
        image_size: side length in pixels (generators are resolution-aware,
            but the testbed uses 64).

    Items are ``(img, label)`` with ``img`` a float32 ``[3, H, W]`` tensor in
    ``[-1, 1]`` and ``label`` an ``int`` in ``[0, 10)``.
    """

    __test__ = False  # keep pytest from collecting this class

    def __init__(self, split: str = "train", size: int | None = None, seed: int = 0, image_size: int = 64):
        _split_id(split)
        self.split = split
        self.size = DEFAULT_SIZES[split] if size is None else int(size)
        self.seed = int(seed)
        self.image_size = int(image_size)
        self.class_names = CLASS_NAMES
        self.num_classes = NUM_CLASSES

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, index: int) -> tuple[torch.Tensor, int]:
        if index < 0:
            index += self.size
        if not 0 <= index < self.size:
            raise IndexError(index)
        img, label = generate_image(self.split, index, self.seed, self.image_size)
        return _to_tensor(img), label

    def labels(self) -> torch.Tensor:
        """All labels without generating images."""
        return torch.arange(self.size) % NUM_CLASSES


def make_tensor_dataset(
    split: str = "train",
    n: int = 20_000,
    seed: int = 0,
    image_size: int = 64,
    cache_dir: str | Path | None = None,
    dtype: torch.dtype = torch.float32,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Materialise the first ``n`` samples: ``(images [n,3,H,W], labels [n] int64)``.

    Images equal ``TestbedDataset(split, seed=seed)[i][0]`` for ``i < n``.
    ``dtype``: ``torch.float32`` (default, [-1, 1]), ``torch.float16``/
    ``torch.bfloat16`` ([-1, 1], half the memory), or ``torch.uint8`` (values
    ``round((x + 1) * 127.5)`` in [0, 255], a quarter of the memory -- 20k
    images = 245 MB instead of 983 MB).  With ``cache_dir`` the result is
    stored as / loaded from a ``.pt`` file whose name encodes all arguments
    and the generator version.
    """
    _split_id(split)
    cache_path = None
    if cache_dir is not None:
        tag = f"{split}-n{n}-s{seed}-px{image_size}-{str(dtype).replace('torch.', '')}-v{GENERATOR_VERSION}"
        key = hashlib.sha1(tag.encode()).hexdigest()[:8]
        cache_path = Path(cache_dir) / f"testbed_{tag}-{key}.pt"
        if cache_path.is_file():
            blob = torch.load(cache_path, map_location="cpu", weights_only=True)
            return blob["images"], blob["labels"]

    images = torch.empty((n, 3, image_size, image_size), dtype=dtype)
    labels = torch.empty(n, dtype=torch.int64)
    for i in range(n):
        img, lab = generate_image(split, i, seed, image_size)
        t = torch.from_numpy(np.ascontiguousarray(img.transpose(2, 0, 1)))
        if dtype == torch.uint8:
            images[i] = t.mul_(255.0).round_().to(torch.uint8)
        else:
            images[i] = t.mul_(2.0).sub_(1.0).to(dtype)
        labels[i] = lab

    if cache_path is not None:
        cache_path.parent.mkdir(parents=True, exist_ok=True)
        tmp = cache_path.with_suffix(".tmp")
        torch.save({"images": images, "labels": labels}, tmp)
        tmp.replace(cache_path)
    return images, labels


def complexity_score(img: torch.Tensor | np.ndarray) -> torch.Tensor | float:
    """Mean gradient energy: mean over channels/pixels of dx^2 + dy^2.

    Input: ``[3,H,W]`` or ``[N,3,H,W]`` (tensor or array) in [-1, 1] (any
    consistent range works; the score scales quadratically with the range).
    Returns a float for a single image, a ``[N]`` float tensor for a batch.
    Forward differences, no wrap-around.  Rough scale at 64 px for [-1,1]
    images: flat fields ~1e-4, smooth ramps/discs ~1e-3, textures and detailed
    photos 1e-2 .. 1e-1, dense pixel noise ~1e-1 and above.
    """
    x = torch.as_tensor(img, dtype=torch.float32)
    single = x.dim() == 3
    if single:
        x = x.unsqueeze(0)
    if x.dim() != 4:
        raise ValueError(f"expected [3,H,W] or [N,3,H,W], got shape {tuple(x.shape)}")
    dx = x[..., :, 1:] - x[..., :, :-1]
    dy = x[..., 1:, :] - x[..., :-1, :]
    s = dx.pow(2).mean(dim=(1, 2, 3)) + dy.pow(2).mean(dim=(1, 2, 3))
    return float(s[0]) if single else s


def save_contact_sheet(
    path: str | Path,
    per_class: int = 8,
    split: str = "train",
    seed: int = 0,
    image_size: int = 64,
    sort_by_complexity: bool = True,
) -> Path:
    """Save a PNG grid: one row per class, ``per_class`` examples per row.

    Examples within a row are sorted by :func:`complexity_score` (shown
    above each tile) to make the within-class complexity range visible.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    path = Path(path)
    fig, axes = plt.subplots(
        NUM_CLASSES, per_class, figsize=(per_class * 1.15 + 1.6, NUM_CLASSES * 1.3), squeeze=False
    )
    for c in range(NUM_CLASSES):
        idx = [c + NUM_CLASSES * j for j in range(per_class)]
        imgs = [generate_image(split, i, seed, image_size)[0] for i in idx]
        scores = [complexity_score(_to_tensor(im)) for im in imgs]
        order = np.argsort(scores) if sort_by_complexity else np.arange(per_class)
        for j, k in enumerate(order):
            ax = axes[c, j]
            ax.imshow(imgs[k], interpolation="nearest")
            ax.set_xticks([])
            ax.set_yticks([])
            ax.set_title(f"{scores[k]:.2g}", fontsize=6, pad=2)
        axes[c, 0].set_ylabel(f"{c}: {CLASS_NAMES[c]}", fontsize=8, rotation=0, ha="right", va="center")
    fig.suptitle("varscope testbed dataset (title = complexity_score, sorted)", fontsize=9)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


if __name__ == "__main__":  # pragma: no cover
    import argparse

    p = argparse.ArgumentParser(description="Render a contact sheet of the testbed dataset")
    p.add_argument("--out", default="docs/images/testbed_dataset.png")
    p.add_argument("--per-class", type=int, default=8)
    a = p.parse_args()
    print(save_contact_sheet(a.out, per_class=a.per_class))
