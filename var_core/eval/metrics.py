"""Quality metrics of an accelerated arm against the baseline generated from the same seeds.

Per sample (paired with the baseline sample of the same index, label and seed):

* ``psnr`` (dB, capped at :data:`PSNR_CAP` for identical images; ``identical`` says which were), ``ssim``, ``ms_ssim`` (where the image size
  allows: the 5-scale default from 161 px, the 3-scale ``kernel_size=7`` variant from 25 px; ``n/a`` below);
* ``token_agreement`` per scale: the fraction of the scale's tokens equal to the baseline's (Infinity: all bits of
  a token equal); ``NaN`` for a scale either run skipped;
* ``class_correct``: the testbed classifier's top-1 prediction equals the conditioning label — only for a
  class-conditional model whose classes and image size match the classifier's (the testbed); otherwise ``n/a``
  with the reason.

Per arm, from the per-sample PSNR (:func:`psnr_summaries`; in ``set_level`` and so in every summary):

* ``psnr_differing``: mean PSNR over the samples whose image differs from the baseline's (``n`` = how many);
  ``n = 0`` and NaN when every image is identical. The plain ``psnr`` summary averages the capped per-sample
  values, so identical images (100 dB each) inflate it: an arm with a third of its images untouched can show
  ~50 dB while its changed images average ~35 dB. Read ``psnr_differing`` together with the identical fraction
  (the ``identical`` summary, mean of the per-sample 0/1 flags).
* ``psnr_mean_mse``: ``10 log10(1 / mean MSE)`` over all samples (identical images count as MSE 0), capped at
  :data:`PSNR_CAP` when all are identical — one number that weighs identical images without a cap artefact.

Per set (with a bootstrap interval over samples, see :func:`fid_bootstrap` / :func:`kid_bootstrap`):

* ``fid_proxy`` / ``kid_proxy``: FID / KID between the arm's and the baseline's images in the testbed
  classifier's 128-d feature space (torchmetrics ``feature=ClassifierFeatureExtractor``); ``fid_real``: the same
  against the testbed's held-out images (testbed only); ``is_proxy``: Inception Score with the classifier's logits.
  These are proxies: the feature network is the project's small classifier, not Inception-v3, and with tens of
  samples FID is biased upward — compare arms at the same ``n`` only.
* Standard Inception FID and CLIP score only with local weights (:func:`inception_fid`, :func:`clip_score`):
  a clear :class:`MetricUnavailable` otherwise, never a download. With ``--inception-weights`` the arm also gets
  ``fid_inception`` / ``kid_inception`` against the baseline and ``is_inception`` (:func:`standard_set_metrics`:
  the project's FID Inception, :mod:`.inception`), each naming its input ``protocol`` (``MetricContext.fid_protocol``,
  default ``torch-fidelity``; FIDs of different protocols are not comparable).
* ``clip_score``, ``image_reward``, ``hpsv2`` per sample, each image against its own prompt, when their local
  weights are given (:func:`var_core.eval.metric_registry.prompt_metrics`; networks in :mod:`.clip_score`,
  :mod:`.image_reward`, :mod:`.hps`); every arm record names each metric's direction, proxy flag and weights
  (path + sha256) in ``metrics_info`` (:mod:`.metric_registry`, ``python -m studies.ablate ls metrics``).
* ``lpips_<net>`` per sample (:func:`lpips_distance`, :mod:`.lpips`) when the pretrained backbone and the v0.1
  linear layers are given as local files; otherwise unavailable (random backbone weights make LPIPS meaningless).

Every image is quantised to 8 bits before any metric (what a saved PNG holds), so a resumed run that reloads the
baseline's stored images computes exactly the numbers a fresh run does.
"""

from __future__ import annotations

import dataclasses
import math
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Sequence

import numpy as np
import torch

from .stats import Summary
from .metric_base import LOCAL_METRIC, MetricUnavailable, quantize01  # noqa: F401 - part of this module's API

__all__ = [
    "PSNR_CAP", "MetricUnavailable", "MetricContext", "quantize01", "fidelity_per_sample", "ms_ssim_settings",
    "token_agreement", "classifier_compatibility", "class_correct", "classify", "ArmMetrics", "fid_kid", "inception_score_proxy",
    "frechet_distance", "CachedExtractor", "psnr_summaries", "kid_unbiased", "kid_bootstrap", "MIN_KID_BOOTSTRAP",
    "kid_weighted", "KID_BLOCK", "fid_bootstrap", "inception_fid", "clip_score", "compute_arm_metrics", "lpips_distance", "standard_set_metrics",
]

PSNR_CAP = 100.0  # dB given to identical images (8-bit images never exceed ~90 dB otherwise)
MIN_KID_BOOTSTRAP = 4  # fewer samples: KID gets no interval (NaN bounds, method says "n too small")



METRIC_CHUNK = 64  # images per forward pass of a metric network: memory O(chunk), not O(samples) (issue 26)
# pixels per chunk: MS-SSIM's pyramid held ~50 MB per 256-px image of a chunk (64 of them: 3.3 GB), so larger
# images go in fewer per chunk: 64 up to 90 px, 32 at 128 px, 8 at 256, 2 at 512, 1 at 1024
METRIC_CHUNK_PIXELS = 1 << 19


def chunk_of(images) -> int:
    """Images per metric chunk for images of this size (:data:`METRIC_CHUNK` at most)."""
    h, w = int(images.shape[-2]), int(images.shape[-1])
    return max(1, min(METRIC_CHUNK, METRIC_CHUNK_PIXELS // max(1, h * w)))


def _libc_malloc_trim():
    try:
        import ctypes
        import ctypes.util

        return ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6").malloc_trim
    except (OSError, AttributeError):  # not glibc (macOS, musl): nothing to release
        return None


_MALLOC_TRIM = _libc_malloc_trim()


def release_freed_memory() -> None:
    """Give the pages of freed chunk buffers back to the OS (glibc ``malloc_trim``; a no-op elsewhere).

    Why: a metric chunk's buffers (MS-SSIM's pyramid, conv inputs: tens of MB) are freed after every chunk, but
    glibc raises its mmap threshold once such a block is freed, so later ones come from the heap, and the heap's
    freed pages stay resident — RSS grew with the number of chunks (+90 MB peak at 2,048 64-px samples vs 128 for
    PSNR / SSIM / MS-SSIM) although no tensor outlived its chunk."""
    if _MALLOC_TRIM is not None:
        _MALLOC_TRIM(0)


def _chunks(images: torch.Tensor, size: int | None = None):
    """``images`` (uint8 or [0, 1] floats) as 8-bit-quantised float chunks of ``size`` (default
    :func:`chunk_of`): only one chunk is ever a float copy (a whole set's float copy was 4x its uint8 size, 12 MB
    per 1024-px image); the freed pages of each chunk are released before the next (:func:`release_freed_memory`)."""
    size = size or chunk_of(images)
    for i in range(0, images.shape[0], size):
        yield quantize01(images[i:i + size])
        release_freed_memory()


def _features(images: torch.Tensor, extractor) -> torch.Tensor:
    """``extractor`` applied chunk by chunk (its activations never hold the whole set at once)."""
    out = [extractor(chunk).detach().cpu() for chunk in _chunks(images)]
    return torch.cat(out) if out else torch.zeros(0)


class _Given(torch.nn.Module):
    """An identity 'feature extractor' so torchmetrics' FID / KID / IS run on features computed chunk by chunk."""

    def __init__(self, num_features: int):
        super().__init__()
        self.num_features = int(num_features)

    def forward(self, features: torch.Tensor) -> torch.Tensor:
        return features


# ----- fidelity to the baseline ----------------------------------------------------------------------------
def ms_ssim_settings(height: int, width: int) -> tuple[dict | None, str]:
    """torchmetrics MS-SSIM keyword arguments for an image size, or ``None`` with the reason."""
    side = min(height, width)
    if side > 160:
        return {}, "5 scales, kernel 11"
    if side > 24:
        return dict(kernel_size=7, betas=(0.0448, 0.2856, 0.3001)), "3 scales, kernel 7 (images below 161 px)"
    return None, f"images of {height}x{width} px are too small for MS-SSIM (needs > 24 px)"


def fidelity_per_sample(arm_B3HW: torch.Tensor, base_B3HW: torch.Tensor) -> tuple[dict[str, np.ndarray], dict]:
    """Per-sample PSNR / SSIM / MS-SSIM of ``arm`` vs ``base`` (both ``[B, 3, H, W]`` in ``[0, 1]``).

    Returns ``(values, unavailable)``: ``values[name]`` is a float array ``[B]``; ``unavailable[name]`` a reason.
    """
    from torchmetrics.functional.image import (multiscale_structural_similarity_index_measure,
                                               structural_similarity_index_measure)

    if arm_B3HW.shape != base_B3HW.shape:
        raise ValueError(f"image shapes differ: {tuple(arm_B3HW.shape)} vs {tuple(base_B3HW.shape)}")
    chunk = chunk_of(arm_B3HW)
    if arm_B3HW.shape[0] > chunk:  # per-sample values: chunk by chunk, memory O(chunk)
        parts = []
        for i in range(0, arm_B3HW.shape[0], chunk):
            parts.append(fidelity_per_sample(arm_B3HW[i:i + chunk], base_B3HW[i:i + chunk]))
            release_freed_memory()
        return {k: np.concatenate([p[0][k] for p in parts]) for k in parts[0][0]}, parts[0][1]
    a, b = quantize01(arm_B3HW), quantize01(base_B3HW)
    H, W = a.shape[-2:]
    mse = (a - b).pow(2).flatten(1).mean(1)
    psnr = torch.where(mse > 0, 10 * torch.log10(1.0 / mse.clamp_min(1e-20)), torch.full_like(mse, PSNR_CAP))
    values = {"psnr": psnr.clamp(max=PSNR_CAP).double().numpy(), "identical": (mse == 0).double().numpy()}
    unavailable = {}
    kernel = 11 if min(H, W) >= 32 else 7
    if min(H, W) >= kernel:
        ssim = structural_similarity_index_measure(a, b, data_range=1.0, reduction="none", kernel_size=kernel)
        values["ssim"] = ssim.double().numpy()
    else:
        unavailable["ssim"] = f"images of {H}x{W} px are smaller than the SSIM window"
    kwargs, note = ms_ssim_settings(H, W)
    if kwargs is None:
        unavailable["ms_ssim"] = note
    else:
        ms = multiscale_structural_similarity_index_measure(a, b, data_range=1.0, reduction="none",
                                                            normalize="relu", **kwargs)
        values["ms_ssim"] = ms.double().numpy()
    return values, unavailable


def psnr_summaries(psnr: Sequence[float | None], identical: Sequence[float | None] | None = None, *,
                   seed: int = 0) -> dict[str, dict]:
    """``psnr_differing`` and ``psnr_mean_mse`` Summary dicts from per-sample PSNR (dB) and identical flags.

    ``identical`` defaults to ``psnr >= PSNR_CAP``. A sample's MSE is ``10 ** (-psnr / 10)`` (0 when identical);
    samples with a missing PSNR are dropped. Intervals: the bootstrap of :func:`~var_core.eval.stats.bootstrap_ci`
    over the samples used.
    """
    from .stats import bootstrap_ci

    p = np.asarray([np.nan if v is None else v for v in psnr], dtype=float)
    if identical is None:
        same = p >= PSNR_CAP
    else:
        flags = np.asarray([np.nan if v is None else v for v in identical], dtype=float)
        if flags.shape != p.shape:
            raise ValueError(f"{p.shape[0]} PSNR values vs {flags.shape[0]} identical flags")
        same = np.where(np.isfinite(flags), flags > 0, p >= PSNR_CAP)
    keep = np.isfinite(p)
    p, same = p[keep], same[keep]
    n_all, n_same = int(p.size), int(same.sum())
    differing = p[~same]
    if differing.size:
        diff = bootstrap_ci(differing, seed=seed)
        diff = dataclasses.replace(diff, method=f"{diff.method}; over the {differing.size} of {n_all} samples "
                                                f"that differ from the baseline ({n_same} identical)")
    else:
        diff = Summary(math.nan, math.nan, math.nan, 0,
                       method=f"all {n_all} samples identical to the baseline" if n_all else "no samples")
    mse = np.where(same, 0.0, 10.0 ** (-p / 10.0))
    floor = 10.0 ** (-PSNR_CAP / 10.0)

    def psnr_of_mean(x, axis=-1):
        return 10.0 * np.log10(1.0 / np.maximum(np.mean(x, axis=axis), floor))

    if n_all:
        pooled = bootstrap_ci(mse, seed=seed, statistic=psnr_of_mean)
        pooled = dataclasses.replace(pooled, method=f"{pooled.method}; 10 log10(1 / mean MSE) over all {n_all} "
                                                    f"samples ({n_same} identical, MSE 0), capped at {PSNR_CAP:g} dB")
    else:
        pooled = Summary(math.nan, math.nan, math.nan, 0, method="no samples")
    return {"psnr_differing": diff.to_dict(), "psnr_mean_mse": pooled.to_dict()}


def token_agreement(arm_tokens: Sequence[Sequence[torch.Tensor | None]],
                    base_tokens: Sequence[Sequence[torch.Tensor | None]]) -> np.ndarray:
    """``[num_samples, num_scales]`` fraction of each scale's tokens equal to the baseline's (NaN if skipped).

    ``*_tokens[i][s]``: sample ``i``'s tokens at scale ``s``, ``[N]`` (VAR ids) or ``[N, d]`` (Infinity bits).
    """
    if len(arm_tokens) != len(base_tokens):
        raise ValueError(f"{len(arm_tokens)} arm samples vs {len(base_tokens)} baseline samples")
    num_scales = max((len(t) for t in base_tokens), default=0)
    out = np.full((len(arm_tokens), num_scales), np.nan)
    for i, (arm, base) in enumerate(zip(arm_tokens, base_tokens)):
        for s in range(min(len(arm), len(base))):
            x, y = arm[s], base[s]
            if x is None or y is None:
                continue
            equal = x == y
            if equal.dim() > 1:
                equal = equal.flatten(1).all(1)
            out[i, s] = float(equal.float().mean())
    return out


# ----- class fidelity --------------------------------------------------------------------------------------
def classifier_compatibility(adapter: Any, classifier: Any | None, classifier_error: str | None = None
                             ) -> str | None:
    """``None`` when the testbed classifier can judge this model's images, else the reason it cannot."""
    if classifier is None:
        return classifier_error or "no testbed classifier loaded"
    family = getattr(adapter, "family", "?")
    if family != "var":
        return f"the model family {family!r} is not class-conditional (the classifier reads testbed classes)"
    num_classes = getattr(getattr(adapter, "cfg", None), "num_classes", None)
    if num_classes != classifier.num_classes:
        return f"the model has {num_classes} classes, the testbed classifier {classifier.num_classes}"
    size = getattr(adapter, "image_size", None)
    if size != classifier.image_size:
        return (f"the model makes {size}-px images, the testbed classifier was trained on "
                f"{classifier.image_size}-px testbed images (its classes would be meaningless here)")
    name = str(getattr(adapter, "model_name", "")).removeprefix("random:")
    if name and name not in ("testbed", "testbed-small"):
        return (f"the model {getattr(adapter, 'model_name', name)!r} was not trained on the testbed classes "
                f"(class accuracy is defined for the testbed only)")
    return None


@torch.no_grad()
def classify(images_B3HW: torch.Tensor, labels_B: torch.Tensor, classifier, batch_size: int = 256
             ) -> tuple[np.ndarray, np.ndarray]:
    """Per sample: ``correct`` (1.0 / 0.0: top-1 class equals the label) and ``prob`` (softmax probability the
    classifier gives the label — a continuous class-fidelity score for paired tests)."""
    size = classifier.image_size

    def logits_of(chunk):
        x = chunk * 2 - 1
        if tuple(x.shape[-2:]) != (size, size):
            x = torch.nn.functional.interpolate(x, size=(size, size), mode="bilinear", antialias=True)
        return classifier(x.float())

    logits = torch.cat([logits_of(chunk) for chunk in _chunks(images_B3HW, min(batch_size, chunk_of(images_B3HW)))])
    labels = labels_B.cpu().long()
    correct = (logits.argmax(1).cpu() == labels).double().numpy()
    prob = logits.float().softmax(1).cpu().gather(1, labels.view(-1, 1)).view(-1).double().numpy()
    return correct, prob


def class_correct(images_B3HW: torch.Tensor, labels_B: torch.Tensor, classifier) -> np.ndarray:
    """Per-sample 1.0 / 0.0: the classifier's top-1 class equals the label."""
    return classify(images_B3HW, labels_B, classifier)[0]


# ----- set-level metrics (classifier feature space) --------------------------------------------------------
def frechet_distance(feat_a: np.ndarray, feat_b: np.ndarray) -> float:
    """Fréchet distance between Gaussians fitted to two feature sets ``[n, d]`` and ``[m, d]``.

    ``tr sqrt(C_a C_b)`` is computed exactly as the nuclear norm of ``X_a X_bᵀ / sqrt((n-1)(m-1))`` (``X``: the
    centred features), since the non-zero eigenvalues of ``C_a C_b`` are the squared singular values of that
    matrix. With fewer samples than feature dimensions (the usual case here) this is an ``n × m`` SVD instead of
    a ``d × d`` eigen-decomposition, which makes the bootstrap cheap; otherwise the ``d × d`` form is used.
    """
    n, m = len(feat_a), len(feat_b)
    mu_a, mu_b = feat_a.mean(0), feat_b.mean(0)
    xa, xb = feat_a - mu_a, feat_b - mu_b
    tr_a = float((xa ** 2).sum() / (n - 1))
    tr_b = float((xb ** 2).sum() / (m - 1))
    d = feat_a.shape[1]
    if min(n, m) <= d:
        tr_covmean = float(np.linalg.svd(xa @ xb.T, compute_uv=False).sum() / math.sqrt((n - 1) * (m - 1)))
    else:
        cov_a, cov_b = xa.T @ xa / (n - 1), xb.T @ xb / (m - 1)
        tr_covmean = float(np.sqrt(np.clip(np.linalg.eigvals(cov_a @ cov_b).real, 0, None)).sum())
    return float(((mu_a - mu_b) ** 2).sum() + tr_a + tr_b - 2 * tr_covmean)


class CachedExtractor(torch.nn.Module):
    """Wraps a feature module and memoises its output per input content (a hash of the image bytes), so the
    baseline's and the real images' features are computed once per run however many metrics and arms use them.
    Exposes ``num_features`` for torchmetrics."""

    def __init__(self, module: torch.nn.Module, max_entries: int = 16):
        super().__init__()
        self.module = module
        self.num_features = getattr(module, "num_features", None)
        self.max_entries = max_entries
        self._cache: dict[bytes, torch.Tensor] = {}

    @torch.no_grad()
    def forward(self, images: torch.Tensor) -> torch.Tensor:
        import hashlib

        data = images.detach().cpu().contiguous()
        key = hashlib.blake2b(data.numpy().tobytes(), digest_size=16).digest() + str(
            (tuple(data.shape), data.dtype)).encode()
        if key not in self._cache:
            if len(self._cache) >= self.max_entries:
                self._cache.pop(next(iter(self._cache)))
            self._cache[key] = self.module(images)
        return self._cache[key]


def fid_bootstrap(feat_arm: np.ndarray, feat_ref: np.ndarray, *, paired: bool, n_resamples: int = 200,
                  seed: int = 0, level: float = 0.95) -> tuple[float, float]:
    """Bias-corrected percentile bootstrap interval of the Fréchet distance (sample indices resampled, jointly if
    ``paired``)."""
    rng = np.random.default_rng(seed)
    n, m = len(feat_arm), len(feat_ref)
    values = []
    for _ in range(n_resamples):
        i = rng.integers(0, n, n)
        j = i if paired and n == m else rng.integers(0, m, m)
        values.append(frechet_distance(feat_arm[i], feat_ref[j]))
    lo, hi = np.quantile(values, [(1 - level) / 2, 1 - (1 - level) / 2])
    # Resampling with replacement duplicates samples, which inflates FID (a strong upward bias at tens of
    # samples): shift the percentile interval by the bootstrap estimate of that bias.
    bias = float(np.mean(values)) - frechet_distance(feat_arm, feat_ref)
    return max(0.0, float(lo) - bias), max(0.0, float(hi) - bias)


def _poly_kernel(x: np.ndarray, y: np.ndarray) -> np.ndarray:
    """torchmetrics' KID kernel with its defaults: ``(x·y / d + 1) ** 3``."""
    return (x @ y.T / x.shape[1] + 1.0) ** 3


def kid_unbiased(k_xx: np.ndarray, k_yy: np.ndarray, k_xy: np.ndarray, w_x: np.ndarray | None = None,
                 w_y: np.ndarray | None = None) -> float:
    """Unbiased MMD² (KID) from kernel matrices, optionally of a resample given by per-sample counts ``w``.

    Within a set the sum runs over pairs of *distinct original samples* (a resample's duplicates are not paired
    with themselves, which would add ``k(x, x)`` terms and bias the bootstrap upwards); with all counts 1 this is
    the usual unbiased estimate (torchmetrics' ``poly_mmd`` of the whole sets). NaN when a set has fewer than two
    distinct samples.
    """
    w_x = np.ones(k_xx.shape[0]) if w_x is None else np.asarray(w_x, dtype=float)
    w_y = np.ones(k_yy.shape[0]) if w_y is None else np.asarray(w_y, dtype=float)

    def within(k, w):
        pairs = w.sum() ** 2 - (w ** 2).sum()
        return (w @ k @ w - (w ** 2 * np.diag(k)).sum()) / pairs if pairs > 0 else math.nan

    cross = (w_x @ k_xy @ w_y) / (w_x.sum() * w_y.sum())
    return float(within(k_xx, w_x) + within(k_yy, w_y) - 2 * cross)


KID_BLOCK = 1024  # samples per side of one kernel block: KID holds block² kernel values, not n²


def _kernel_sums(x: np.ndarray, y: np.ndarray, w_x: np.ndarray, w_y: np.ndarray, block: int) -> np.ndarray:
    """``w_x[r] @ K(x, y) @ w_y[r]`` for every row ``r`` of the weights ``[R, n]`` / ``[R, m]``, with the kernel
    built ``block`` x ``block`` at a time (memory O(block² + R·block); the whole matrix was n² float64, 7 GB per
    kernel at 30,000 samples)."""
    total = np.zeros(w_x.shape[0])
    for i in range(0, x.shape[0], block):
        left = w_x[:, i:i + block]
        for j in range(0, y.shape[0], block):
            total += ((left @ _poly_kernel(x[i:i + block], y[j:j + block])) * w_y[:, j:j + block]).sum(1)
    return total


def kid_weighted(feat_x: np.ndarray, feat_y: np.ndarray, w_x: np.ndarray | None = None,
                 w_y: np.ndarray | None = None, *, block: int = KID_BLOCK) -> np.ndarray:
    """:func:`kid_unbiased` of the features themselves, streamed: the kernel is never held whole (blocks of
    ``block`` samples per side, :data:`KID_BLOCK`). ``w_x`` / ``w_y`` are per-sample counts ``[R, n]`` / ``[R, m]``
    (one row per resample; ``None``: every count 1, the unbiased MMD² of the whole sets); returns ``[R]`` values,
    the same estimator as :func:`kid_unbiased` on the full kernel matrices (only the summation order differs)."""
    x, y = np.asarray(feat_x, dtype=np.float64), np.asarray(feat_y, dtype=np.float64)
    w_x = np.ones((1, x.shape[0])) if w_x is None else np.atleast_2d(np.asarray(w_x, dtype=float))
    w_y = np.ones((1, y.shape[0])) if w_y is None else np.atleast_2d(np.asarray(w_y, dtype=float))

    def within(f, w):
        diag = ((f * f).sum(1) / f.shape[1] + 1.0) ** 3  # k(f_i, f_i): a resample's self-pairs are left out
        pairs = w.sum(1) ** 2 - (w ** 2).sum(1)
        with np.errstate(invalid="ignore", divide="ignore"):
            return np.where(pairs > 0, (_kernel_sums(f, f, w, w, block) - (w ** 2) @ diag) / pairs, math.nan)

    cross = _kernel_sums(x, y, w_x, w_y, block) / (w_x.sum(1) * w_y.sum(1))
    return within(x, w_x) + within(y, w_y) - 2 * cross


def kid_bootstrap(feat_arm: np.ndarray, feat_ref: np.ndarray, *, paired: bool, n_resamples: int = 200,
                  seed: int = 0, level: float = 0.95, block: int = KID_BLOCK) -> tuple[float, float, str]:
    """Percentile bootstrap interval of KID over samples (indices resampled, jointly if ``paired``), with the
    method label. Fewer than :data:`MIN_KID_BOOTSTRAP` samples on either side: NaN bounds, "n too small".
    Every resample's KID comes from one streamed pass over the kernel (:func:`kid_weighted`): memory
    O(block² + resamples x n counts), not n²."""
    n, m = len(feat_arm), len(feat_ref)
    if min(n, m) < MIN_KID_BOOTSTRAP:
        return math.nan, math.nan, f"n too small for an interval (n={min(n, m)} < {MIN_KID_BOOTSTRAP})"
    rng = np.random.default_rng(seed)
    same = paired and n == m
    w_x, w_y = np.empty((n_resamples, n)), (None if same else np.empty((n_resamples, m)))
    for r in range(n_resamples):  # the draws in the order of one resample at a time
        w_x[r] = np.bincount(rng.integers(0, n, n), minlength=n)
        if not same:
            w_y[r] = np.bincount(rng.integers(0, m, m), minlength=m)
    values = kid_weighted(feat_arm, feat_ref, w_x, w_x if same else w_y, block=block)
    values = values[np.isfinite(values)]
    if values.size < max(10, n_resamples // 2):
        return math.nan, math.nan, "n too small for an interval (too few usable resamples)"
    lo, hi = np.quantile(values, [(1 - level) / 2, 1 - (1 - level) / 2])
    return float(lo), float(hi), (f"bootstrap percentile over samples ({'paired, ' if same else ''}"
                                  f"{n_resamples} resamples; duplicates not paired with themselves)")


@torch.no_grad()
def fid_kid(arm_images: torch.Tensor, ref_images: torch.Tensor, feature_extractor, *, paired: bool = True,
            seed: int = 0, suffix: str = "_proxy", n_resamples: int = 200) -> dict[str, dict]:
    """FID and KID of ``arm`` against ``ref`` via torchmetrics with ``feature=feature_extractor``.

    Both intervals are bootstraps over samples (jointly resampled when ``paired``) on the same features
    (:func:`fid_bootstrap`, :func:`kid_bootstrap`). KID's point is torchmetrics' mean over random subsets of
    ``min(50, n, m)`` samples; its interval is no longer ± 1.96 sd over those subsets, which is zero whenever
    ``n <= 50`` (every subset is then the whole set). Returns ``{"fid<suffix>": Summary dict, "kid<suffix>": ...}``.
    """
    from torchmetrics.image.fid import FrechetInceptionDistance
    from torchmetrics.image.kid import KernelInceptionDistance

    n = arm_images.shape[0]
    if n < 2 or ref_images.shape[0] < 2:
        return {}
    out: dict[str, dict] = {}
    with torch.random.fork_rng(devices=[]), warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torchmetrics' feature-buffer notices
        torch.manual_seed(seed)
        # features chunk by chunk (memory O(chunk)); torchmetrics then reads them through an identity module
        fa, fr = _features(arm_images, feature_extractor), _features(ref_images, feature_extractor)
        given = _Given(fa.shape[1])
        fid = FrechetInceptionDistance(feature=given, normalize=False, reset_real_features=True, **LOCAL_METRIC)
        fid.update(fr, real=True)
        fid.update(fa, real=False)
        fid_value = float(fid.compute())
        feat_a = fa.double().numpy()
        feat_r = fr.double().numpy()
        r = fr
        lo, hi = fid_bootstrap(feat_a, feat_r, paired=paired, n_resamples=n_resamples, seed=seed)
        out[f"fid{suffix}"] = dict(mean=fid_value, low=min(lo, fid_value), high=max(hi, fid_value), n=n, level=0.95,
                                   method="bootstrap percentile, bias-shifted")
        subset = max(2, min(50, n, r.shape[0]))
        kid = KernelInceptionDistance(feature=given, subsets=50, subset_size=subset, normalize=False,
                                      **LOCAL_METRIC)
        kid.update(fr, real=True)
        kid.update(fa, real=False)
        kid_mean = float(kid.compute()[0])
        lo, hi, how = kid_bootstrap(feat_a, feat_r, paired=paired, n_resamples=n_resamples, seed=seed)
        if math.isfinite(lo) and math.isfinite(hi):
            lo, hi = min(lo, kid_mean), max(hi, kid_mean)
        out[f"kid{suffix}"] = dict(mean=kid_mean, low=lo, high=hi, n=n, level=0.95,
                                   method=f"point: mean over subsets of {subset}; interval: {how}")
    return out


def _inception_score(probs: np.ndarray) -> float:
    """``exp E_x KL(p(y|x) || p(y))`` of class probabilities ``[n, classes]`` (one split)."""
    marginal = probs.mean(0, keepdims=True)
    return math.exp((probs * (np.log(probs + 1e-12) - np.log(marginal + 1e-12))).sum(1).mean())


@torch.no_grad()
def inception_score_proxy(images: torch.Tensor, logits_extractor, *, seed: int = 0, n_resamples: int = 200
                          ) -> dict:
    """Inception Score (torchmetrics, one split) with the classifier's logits; bootstrap interval over samples."""
    from torchmetrics.image.inception import InceptionScore

    n = images.shape[0]
    logits = _features(images, logits_extractor)  # chunk by chunk: memory O(chunk)
    with torch.random.fork_rng(devices=[]), warnings.catch_warnings():
        warnings.simplefilter("ignore")  # feature-buffer notice; std over one split
        torch.manual_seed(seed)
        metric = InceptionScore(feature=_Given(logits.shape[1]), splits=1, normalize=False, **LOCAL_METRIC)
        metric.update(logits)
        value = float(metric.compute()[0])
    probs = logits.double().softmax(-1).numpy()
    rng = np.random.default_rng(seed)
    boot = []
    for _ in range(n_resamples):
        boot.append(_inception_score(probs[rng.integers(0, n, n)]))
    lo, hi = np.quantile(boot, [0.025, 0.975])
    # duplicates in a resample lower IS (fewer distinct predictions): shift by the bootstrap bias, as for FID
    bias = float(np.mean(boot)) - _inception_score(probs)
    lo, hi = float(lo) - bias, float(hi) - bias
    return dict(mean=value, low=min(lo, value), high=max(hi, value), n=n, level=0.95,
                method="bootstrap percentile, bias-shifted")


# ----- standard metrics, local weights only ----------------------------------------------------------------
def _inception_extractor(weights: str | Path | None, protocol: str):
    """The project's FID Inception (``2048`` pool features) under ``protocol`` from a LOCAL file, or
    :class:`MetricUnavailable` saying what is missing."""
    from ..errors import UserError
    from .inception import InceptionFeatures, check_protocol, load_fid_inception

    if weights is None:
        raise MetricUnavailable("standard Inception FID needs local weights: pass --inception-weights "
                                "pt_inception-2015-12-05-6726825d.pth (pytorch-fid's or torch-fidelity's file; "
                                "nothing is downloaded)")
    path = Path(weights).expanduser()
    if not path.is_file():
        raise MetricUnavailable(f"Inception weights not found at {path}")
    check_protocol(protocol)  # a bad protocol name is the user's error, not an unavailable metric
    try:
        net = load_fid_inception(path)
    except UserError as exc:
        raise MetricUnavailable(str(exc)) from None
    return InceptionFeatures(net, "2048", protocol)


def inception_fid(arm_images: torch.Tensor, ref_images: torch.Tensor, weights: str | Path | None, *,
                  protocol: str | None = None) -> float:
    """Standard Inception-v3 FID of ``arm`` against ``ref`` from a LOCAL weight file; never downloads.

    The project's FID Inception (:mod:`.inception`, reproducing pytorch-fid's and torch-fidelity's features) is
    handed to torchmetrics' ``FrechetInceptionDistance`` as a custom ``feature=`` module returning a tensor (what
    torchmetrics needs; torch-fidelity's own extractor returns a tuple and failed there). ``protocol``: the input
    pipeline (:data:`~var_core.eval.inception.PROTOCOLS`, default ``torch-fidelity``)."""
    from torchmetrics.image.fid import FrechetInceptionDistance

    from .inception import DEFAULT_PROTOCOL, to_uint8

    extractor = _inception_extractor(weights, protocol or DEFAULT_PROTOCOL)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torchmetrics' feature-buffer notices
        metric = FrechetInceptionDistance(feature=extractor, normalize=False, **LOCAL_METRIC)
        metric.update(to_uint8(quantize01(ref_images)), real=True)
        metric.update(to_uint8(quantize01(arm_images)), real=False)
        return float(metric.compute())


@torch.no_grad()
def standard_set_metrics(arm_images: torch.Tensor, base_images: torch.Tensor | None, ctx: "MetricContext"
                         ) -> dict[str, dict]:
    """``fid_inception`` and ``kid_inception`` of ``arm`` against ``base`` (paired bootstrap intervals, as for the
    proxies; FID exact via the SVD form in float64) and ``is_inception`` (logits without bias; one split below
    500 samples, else 10), each Summary dict carrying ``protocol``. ``base_images=None``: IS only."""
    from .fid import inception_score

    protocol = ctx.fid_protocol
    extractor = _inception_extractor(ctx.inception_weights, protocol)
    names = ("2048", "logits_unbiased")

    def features(images):
        import hashlib

        digest = hashlib.blake2b(digest_size=16)
        for chunk in _chunks(images):  # memory O(chunk): never a float copy of the whole set
            digest.update(chunk.contiguous().numpy().tobytes())
        key = (digest.hexdigest(), tuple(images.shape), protocol,
               str(Path(ctx.inception_weights).expanduser().resolve()))
        cache = ctx._inception_cache
        if key not in cache:
            if len(cache) >= 8:
                cache.pop(next(iter(cache)))
            parts = [extractor.features(chunk.contiguous(), names) for chunk in _chunks(images)]
            cache[key] = {n: torch.cat([p[n] for p in parts]) for n in names}
        return cache[key]

    out: dict[str, dict] = {}
    arm = features(arm_images)
    n = int(arm_images.shape[0])
    note = f"protocol {protocol}"
    if base_images is not None and n >= 2 and base_images.shape[0] >= 2:
        base = features(base_images)
        fa, fb = arm["2048"].double().numpy(), base["2048"].double().numpy()
        value = frechet_distance(fa, fb)
        lo, hi = fid_bootstrap(fa, fb, paired=True, n_resamples=ctx.n_resamples, seed=ctx.seed)
        out["fid_inception"] = dict(mean=value, low=min(lo, value), high=max(hi, value), n=n, level=0.95,
                                    method=f"{note}; vs the baseline; bootstrap percentile, bias-shifted",
                                    protocol=protocol)
        k_point = float(kid_weighted(fa, fb)[0])
        lo, hi, how = kid_bootstrap(fa, fb, paired=True, n_resamples=ctx.n_resamples, seed=ctx.seed)
        if math.isfinite(lo) and math.isfinite(hi):
            lo, hi = min(lo, k_point), max(hi, k_point)
        out["kid_inception"] = dict(mean=k_point, low=lo, high=hi, n=n, level=0.95,
                                    method=f"{note}; vs the baseline; unbiased MMD² of all samples (kernel streamed in "
                                           f"{KID_BLOCK}-sample blocks); interval: {how}",
                                    protocol=protocol)
    if n >= 2:
        splits = 1 if n < 500 else 10
        score = inception_score(arm["logits_unbiased"], splits=splits)
        spread = 1.96 * score["std"] if splits > 1 else math.nan
        out["is_inception"] = dict(mean=score["mean"], low=score["mean"] - spread, high=score["mean"] + spread,
                                   n=n, level=0.95, protocol=protocol,
                                   method=f"{note}; {splits} split(s), logits without bias" +
                                          ("; ± 1.96 sd over splits" if splits > 1 else "; no interval"))
    return out


@torch.no_grad()
def lpips_distance(arm: torch.Tensor, base: torch.Tensor, net: str = "alex", weights=None,
                   batch_size: int = 16) -> np.ndarray:
    """Per-sample LPIPS v0.1 of ``arm`` vs ``base`` (``[B, 3, H, W]`` in ``[0, 1]``, quantised to 8 bits first).

    ``weights``: ``(backbone_file, lin_file)`` or ``{"backbone": ..., "lin": ...}`` — the backbone's pretrained
    torchvision weights and the lpips package's ``weights/v0.1/<net>.pth``, both local. Missing either:
    :class:`MetricUnavailable` (random backbone weights make LPIPS meaningless)."""
    from ..errors import UserError
    from .lpips import load_lpips

    if isinstance(weights, dict):
        backbone, lin = weights.get("backbone"), weights.get("lin")
    elif isinstance(weights, (tuple, list)) and len(weights) == 2:
        backbone, lin = weights
    elif weights is None:
        backbone = lin = None
    else:
        raise UserError(f"LPIPS weights must be (backbone_file, lin_file) or a dict with 'backbone' and 'lin', "
                        f"got {weights!r}")
    if arm.shape != base.shape:
        raise ValueError(f"image shapes differ: {tuple(arm.shape)} vs {tuple(base.shape)}")
    try:
        model = load_lpips(net, backbone, lin)
    except UserError as exc:
        if "unknown LPIPS backbone" in str(exc):
            raise
        raise MetricUnavailable(f"LPIPS unavailable: {exc}") from None
    out = [model(quantize01(arm[i:i + batch_size]) * 2 - 1, quantize01(base[i:i + batch_size]) * 2 - 1)
           for i in range(0, arm.shape[0], batch_size)]
    return torch.cat(out).double().numpy() if out else np.zeros(0)


def clip_score(images: torch.Tensor, texts: Sequence[str], model_dir: str | Path | None) -> float:
    """Mean CLIP score (torchmetrics ``CLIPScore``) from a LOCAL model directory; never downloads. Per-sample
    scores and the loading rules: :mod:`.clip_score`."""
    from .clip_score import clip_scores

    return float(np.mean(clip_scores(images, texts, model_dir)))


# ----- everything for one arm ------------------------------------------------------------------------------
@dataclass
class MetricContext:
    """What every arm of a run is measured with (built once per run)."""

    classifier: Any | None = None
    classifier_reason: str | None = None  # why class accuracy / the proxies are n/a (None: available)
    feature_extractor: Any | None = None
    logits_extractor: Any | None = None
    real_images: torch.Tensor | None = None  # testbed held-out images for fid_real (testbed only)
    real_reason: str | None = None
    inception_weights: str | None = None
    clip_weights: str | None = None
    class_names: Sequence[str] | None = None
    seed: int = 0
    n_resamples: int = 200
    fid_protocol: str = "torch-fidelity"  # input pipeline of the FID Inception (var_core.eval.inception.PROTOCOLS)
    lpips_net: str = "alex"  # LPIPS backbone: "alex" (the authors' default) or "vgg"
    lpips_backbone: str | None = None  # the backbone's pretrained torchvision weights (local file)
    lpips_lin: str | None = None  # the lpips package's weights/v0.1/<net>.pth (local file)
    _inception_cache: dict = field(default_factory=dict, repr=False, compare=False)
    image_reward_weights: str | None = None  # ImageReward.pt or its folder (var_core.eval.image_reward)
    hps_weights: str | None = None  # HPS_v2.1_compressed.pt or its folder (var_core.eval.hps)
    prompts: Sequence[str] | None = None  # the condition set's prompt per sample (text-to-image prompt sets)
    label_prompt: str | None = None  # "...{label}...": the text a class label conditions on (Infinity's label prompts)
    _loaded_models: dict = field(default_factory=dict, repr=False, compare=False)  # prompt-metric scorers, per run
    fid_reference: Any | None = None  # --fid-reference: var_core.eval.reference.FIDReference (fid_ref, fid_ref_<c>)

    @staticmethod
    def build(adapter, *, classifier_path: str | Path | None = None, inception_weights=None, clip_weights=None,
              real_count: int = 0, seed: int = 0, fid_protocol: str | None = None, lpips_net: str = "alex",
              lpips_backbone=None, lpips_lin=None, image_reward_weights=None, hps_weights=None,
              prompts: Sequence[str] | None = None) -> "MetricContext":
        """Load the testbed classifier (if its weights exist) and decide what applies to ``adapter``."""
        from .inception import DEFAULT_PROTOCOL, check_protocol
        from .lpips import NETS

        if lpips_net not in NETS:
            from ..errors import UserError, did_you_mean

            raise UserError(f"unknown LPIPS backbone {lpips_net!r}; choose from {', '.join(NETS)}."
                            + did_you_mean(lpips_net, NETS))
        ctx = MetricContext(inception_weights=inception_weights, clip_weights=clip_weights, seed=seed,
                            fid_protocol=check_protocol(fid_protocol or DEFAULT_PROTOCOL), lpips_net=lpips_net,
                            lpips_backbone=None if lpips_backbone is None else str(lpips_backbone),
                            lpips_lin=None if lpips_lin is None else str(lpips_lin),
                            image_reward_weights=None if image_reward_weights is None else str(image_reward_weights),
                            hps_weights=None if hps_weights is None else str(hps_weights),
                            prompts=None if prompts is None else tuple(str(p) for p in prompts))
        if getattr(adapter, "family", None) == "infinity":  # class-label commands drive it with fixed prompts
            from ..engine.adapters.infinity_adapter import LABEL_PROMPT

            ctx.label_prompt = LABEL_PROMPT
        elif getattr(adapter, "family", None) == "hart":
            from ..engine.adapters.hart_adapter import LABEL_PROMPT as HART_LABEL_PROMPT

            ctx.label_prompt = HART_LABEL_PROMPT
        from .metric_registry import load_requested_weights

        load_requested_weights(ctx)  # a named LPIPS / Inception / CLIP ... file that cannot load: an error, now
        try:
            from ..testbed.classifier import (ClassifierFeatureExtractor, ClassifierLogitsExtractor,
                                              load_classifier)

            classifier = load_classifier(classifier_path)
        except Exception as exc:  # noqa: BLE001 - missing weights / being trained: say so in the table
            if classifier_path is not None:  # asked for by name: an error before anything is generated
                from .metric_registry import requested_classifier_error

                raise requested_classifier_error(classifier_path, f"{type(exc).__name__}: {exc}") from None
            ctx.classifier_reason = f"testbed classifier unavailable ({exc})"
            return ctx
        reason = classifier_compatibility(adapter, classifier)
        if reason is not None and classifier_path is not None:
            from .metric_registry import requested_classifier_error

            raise requested_classifier_error(classifier_path, reason)
        ctx.classifier_reason = reason
        if reason is None:
            ctx.classifier = classifier
            ctx.feature_extractor = CachedExtractor(ClassifierFeatureExtractor(classifier))
            ctx.logits_extractor = CachedExtractor(ClassifierLogitsExtractor(classifier))
            try:
                from ..testbed.data import CLASS_NAMES, generate_image

                ctx.class_names = CLASS_NAMES
                if real_count:
                    # uint8 (what every metric reads after quantize01), filled one image at a time: 12 KB per
                    # 64-px image instead of a list of float copies and their stack
                    size = classifier.image_size
                    real = torch.empty(real_count, 3, size, size, dtype=torch.uint8)
                    for i in range(real_count):
                        img = torch.from_numpy(generate_image("heldout", i, 0, size)[0]).permute(2, 0, 1)
                        real[i] = img.clamp(0, 1).mul(255).round().to(torch.uint8)
                    ctx.real_images = real
            except Exception as exc:  # noqa: BLE001
                ctx.real_reason = f"testbed held-out images unavailable ({exc})"
        else:
            ctx.real_reason = reason
        return ctx


@dataclass
class ArmMetrics:
    per_sample: dict[str, list] = field(default_factory=dict)  # name -> [n] (None for missing)
    per_scale: dict[str, list] = field(default_factory=dict)  # name -> [n][num_scales]
    set_level: dict[str, dict] = field(default_factory=dict)  # name -> Summary dict
    unavailable: dict[str, str] = field(default_factory=dict)  # name -> reason
    info: dict[str, dict] = field(default_factory=dict)  # metric -> direction, proxy, weights (path, sha256), state


def _as_list(arr: np.ndarray) -> list:
    return [None if not np.isfinite(v) else float(v) for v in np.asarray(arr, dtype=float).ravel()]


def compute_arm_metrics(arm_images: torch.Tensor, base_images: torch.Tensor, labels: torch.Tensor,
                        arm_tokens, base_tokens, ctx: MetricContext, *, is_baseline: bool = False) -> ArmMetrics:
    """All metrics of one arm. ``is_baseline``: the reference itself (no fidelity; set metrics vs real only).

    ``arm_images`` / ``base_images``: uint8 ``[n, 3, H, W]`` tensors or an arm's stored samples
    (:class:`~var_core.eval.store.SpoolImages`, read batch file by batch file): every metric reads them in slices of
    :func:`chunk_of` images, per-sample metrics pair each slice with the baseline's same slice, so memory is
    O(chunk) in images (the set-level metrics keep one feature row per sample)."""
    # a set no larger than one chunk: one tensor (below a chunk the metrics take the set whole)
    arm_images, base_images = (x[:] if x is not None and not isinstance(x, torch.Tensor) and len(x) <= chunk_of(x)
                               else x for x in (arm_images, base_images))
    out = ArmMetrics()
    if not is_baseline:
        values, unavailable = fidelity_per_sample(arm_images, base_images)
        out.per_sample.update({k: _as_list(v) for k, v in values.items()})
        out.set_level.update(psnr_summaries(values["psnr"], values["identical"], seed=ctx.seed))
        out.unavailable.update(unavailable)
        agreement = token_agreement(arm_tokens, base_tokens)
        out.per_scale["token_agreement"] = [[None if not np.isfinite(v) else float(v) for v in row]
                                            for row in agreement]
        with np.errstate(all="ignore"):
            overall = np.nanmean(agreement, axis=1) if agreement.size else np.zeros(0)
        out.per_sample["token_agreement"] = _as_list(overall)
    if ctx.classifier is not None:
        correct, prob = classify(arm_images, labels, ctx.classifier)
        out.per_sample["class_correct"] = _as_list(correct)
        out.per_sample["class_prob"] = _as_list(prob)
        if is_baseline:
            out.unavailable["fid_proxy"] = out.unavailable["kid_proxy"] = "reference arm"
        else:
            out.set_level.update(fid_kid(arm_images, base_images, ctx.feature_extractor, paired=True,
                                         seed=ctx.seed, suffix="_proxy", n_resamples=ctx.n_resamples))
        if arm_images.shape[0] >= 2:
            out.set_level["is_proxy"] = inception_score_proxy(arm_images, ctx.logits_extractor, seed=ctx.seed,
                                                              n_resamples=ctx.n_resamples)
        if ctx.real_images is not None:
            out.set_level.update(fid_kid(arm_images, ctx.real_images, ctx.feature_extractor, paired=False,
                                         seed=ctx.seed, suffix="_real", n_resamples=ctx.n_resamples))
        else:
            out.unavailable["fid_real"] = ctx.real_reason or "no real reference images"
    else:
        reason = ctx.classifier_reason or "no classifier"
        for name in ("class_correct", "class_prob", "fid_proxy", "kid_proxy", "is_proxy", "fid_real"):
            out.unavailable[name] = reason
    try:
        if ctx.inception_weights is None:
            raise MetricUnavailable("standard Inception FID: not requested (pass --inception-weights FILE)")
        standard = standard_set_metrics(arm_images, None if is_baseline else base_images, ctx)
        out.set_level.update(standard)
        for name in ("fid_inception", "kid_inception", "is_inception"):
            if name not in standard:
                out.unavailable[name] = ("reference arm" if is_baseline and name != "is_inception"
                                         else "fewer than 2 samples")
    except MetricUnavailable as exc:
        for name in ("fid_inception", "kid_inception", "is_inception"):
            out.unavailable[name] = str(exc)
    if ctx.fid_reference is not None:  # the papers' FID against reference statistics, the baseline's included
        values, unavailable = ctx.fid_reference.arm_metrics(arm_images, labels, quantize=True,
                                                              chunk=chunk_of(arm_images))
        out.set_level.update(values)
        out.unavailable.update(unavailable)
    lpips_name = f"lpips_{ctx.lpips_net}"
    if is_baseline:
        out.unavailable[lpips_name] = "reference arm"
    elif ctx.lpips_backbone is None and ctx.lpips_lin is None:
        out.unavailable[lpips_name] = ("LPIPS: not requested (pass --lpips-backbone FILE (pretrained torchvision "
                                       "alexnet/vgg16 weights) and --lpips-lin FILE (lpips weights/v0.1/<net>.pth))")
    else:
        try:
            values = lpips_distance(arm_images, base_images, ctx.lpips_net, (ctx.lpips_backbone, ctx.lpips_lin))
            out.per_sample[lpips_name] = _as_list(values)
        except MetricUnavailable as exc:
            out.unavailable[lpips_name] = str(exc)
    from .metric_registry import metrics_info, prompt_metrics

    values, unavailable = {}, {}  # CLIP score, ImageReward, HPSv2.1 per sample, chunk by chunk
    n = arm_images.shape[0]
    per_sample_prompts = ctx.prompts is not None and len(ctx.prompts) == n
    step = chunk_of(arm_images)
    for i in range(0, n, step):
        part_ctx = dataclasses.replace(ctx, prompts=tuple(ctx.prompts[i:i + step])) \
            if per_sample_prompts and n > step else ctx  # the caches (loaded scorers) stay shared
        part, unavailable = prompt_metrics(quantize01(arm_images[i:i + step]), labels[i:i + step],
                                           part_ctx)
        for k, v in part.items():
            values.setdefault(k, []).append(np.asarray(v, dtype=float))
    values = {k: np.concatenate(v) for k, v in values.items()}
    out.per_sample.update({k: _as_list(v) for k, v in values.items()})
    out.unavailable.update(unavailable)
    out.info = metrics_info(ctx, out.unavailable, list(out.per_sample) + list(out.set_level))
    return out
