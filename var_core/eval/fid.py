"""Standard FID, KID and Inception Score on FID-Inception features, reference statistics from local ``.npz``
files and reference folders of images (MJHQ-30K per category, COCO-30K), and the ImageNet 50k protocol.

* **FID** (Heusel et al., 2017): ``‖μa − μb‖² + tr Σa + tr Σb − 2 tr sqrt(Σa Σb)`` in float64, statistics as
  pytorch-fid computes them (``np.mean``, ``np.cov(rowvar=False)``: unbiased). ``method="sqrtm"`` (default) is
  pytorch-fid's ``calculate_frechet_distance``: ``scipy.linalg.sqrtm`` of the product, retried with ``1e-6 · I``
  added to both covariances when the root is not finite, the imaginary part dropped when its diagonal is within
  ``1e-3`` of 0 (else :class:`ValueError`). ``"eigvals"`` is torchmetrics' ``Σ sqrt(eig(Σa Σb)).real``; ``"svd"``
  (features only) the exact nuclear norm of ``Xa Xbᵀ / sqrt((n−1)(m−1))`` — both agree with ``sqrtm`` to ~1e-7
  relative on the fixture, where ``sqrtm`` itself carries error from the rank-deficient product.
* **KID** (Bińkowski et al., 2018): unbiased MMD² with the kernel ``(x·y / d + 1)³``, mean and standard deviation
  over ``subsets`` random subsets of ``subset_size`` samples drawn without replacement (torch-fidelity's and
  torchmetrics' defaults: 100 subsets of 1000; clamped to the smaller set, and the record says so).
* **Inception Score** (Salimans et al., 2016): ``exp E KL(p(y|x) ‖ p(y))`` over ``splits`` consecutive splits of
  the softmax of ``logits_unbiased`` (``pool @ fc.weightᵀ``, without the bias: the original TF code and
  torch-fidelity); mean and population standard deviation (``ddof=0``) over splits.

Reference statistics (:func:`load_reference_statistics`): an ``.npz`` with ``mu`` ``[d]`` and ``sigma`` ``[d, d]``
— pytorch-fid's ``--save-stats`` layout, and also what OpenAI's ADM evaluator stores in its reference batches
(``VIRTUAL_imagenet256_labeled.npz``: ``mu``/``sigma`` of pool_3, ``mu_s``/``sigma_s`` of the spatial features for
sFID, ``arr_0`` sample images). ADM's statistics come from the TensorFlow graph, which the ``"torch-fidelity"``
input protocol reproduces; pairing them with another protocol mixes protocols, and the record names both.

Every result dict names its ``protocol`` (see :mod:`.inception`) and its reference; FIDs of different protocols
are not comparable (on the fixture: 9124.6 pytorch-fid vs 8466.4 torch-fidelity vs 8116.6 torchmetrics).
"""

from __future__ import annotations

import math
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterable, Iterator, Sequence

import numpy as np
import torch

from ..errors import UserError, did_you_mean

__all__ = [
    "FID_METHODS", "IMAGE_SUFFIXES", "IMAGENET_50K", "FrechetResult", "ReferenceStatistics", "activation_statistics",
    "frechet_distance", "frechet_distance_features", "kid", "inception_score", "load_reference_statistics",
    "save_statistics", "reference_images", "list_reference_images", "iter_image_batches", "extract_features",
    "folder_statistics", "fid_against_reference", "fid_against_folder", "reference_protocol_metrics",
]

FID_METHODS = ("sqrtm", "eigvals", "svd")
IMAGE_SUFFIXES = (".png", ".jpg", ".jpeg", ".bmp", ".webp", ".tif", ".tiff")
# The ImageNet 256 class-conditional protocol (VAR, via OpenAI's ADM evaluator): 50 samples for each of the 1000
# classes, FID against the reference batch's statistics, IS over 10 splits of 5000.
IMAGENET_50K = dict(samples=50_000, per_class=50, num_classes=1000, is_splits=10,
                    reference="VIRTUAL_imagenet256_labeled.npz")


# ----- FID -------------------------------------------------------------------------------------------------
def activation_statistics(features) -> tuple[np.ndarray, np.ndarray]:
    """``(mu, sigma)`` in float64 of features ``[n, d]`` (``np.mean(0)``, ``np.cov(rowvar=False)``)."""
    act = np.asarray(features.double().cpu().numpy() if torch.is_tensor(features) else features, dtype=np.float64)
    if act.ndim != 2 or act.shape[0] < 2:
        raise ValueError(f"need features [n >= 2, d] for statistics, got shape {act.shape}")
    return act.mean(0), np.cov(act, rowvar=False)


@dataclass(frozen=True)
class FrechetResult:
    """FID and its terms: ``fid = mean_term + trace_sigma_a + trace_sigma_b − 2 · trace_sqrtm``."""

    fid: float
    mean_term: float
    trace_sigma_a: float
    trace_sigma_b: float
    trace_sqrtm: float
    method: str

    def to_dict(self) -> dict:
        return dict(fid=self.fid, mean_term=self.mean_term, trace_sigma_a=self.trace_sigma_a,
                    trace_sigma_b=self.trace_sigma_b, trace_sqrtm=self.trace_sqrtm, method=self.method)


def _check_method(method: str, allowed=FID_METHODS) -> None:
    if method not in allowed:
        raise UserError(f"unknown FID method {method!r}; choose from {', '.join(allowed)}."
                        + did_you_mean(method, allowed))


def _trace_sqrt_product(sigma_a: np.ndarray, sigma_b: np.ndarray, method: str, eps: float) -> float:
    if method == "eigvals":
        return float(np.sqrt(np.linalg.eigvals(sigma_a @ sigma_b).astype(complex)).real.sum())
    from scipy import linalg

    def root(a, b):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # "matrix is singular": expected whenever n <= d
            return linalg.sqrtm(a.dot(b))

    covmean = root(sigma_a, sigma_b)
    if not np.isfinite(covmean).all():
        offset = np.eye(sigma_a.shape[0]) * eps
        covmean = root(sigma_a + offset, sigma_b + offset)
    if np.iscomplexobj(covmean):
        imaginary = np.abs(np.diagonal(covmean).imag).max()
        if not np.allclose(np.diagonal(covmean).imag, 0, atol=1e-3):
            raise ValueError(f"the square root of Σa Σb has an imaginary diagonal component of {imaginary:.3g} "
                             f"(> 1e-3): the covariances are too ill-conditioned; use more samples")
        covmean = covmean.real
    return float(np.trace(covmean))


def frechet_distance(mu_a, sigma_a, mu_b, sigma_b, *, method: str = "sqrtm", eps: float = 1e-6) -> FrechetResult:
    """FID between two Gaussians given by their statistics (float64; ``method``: ``"sqrtm"`` as pytorch-fid,
    ``"eigvals"`` as torchmetrics)."""
    _check_method(method, ("sqrtm", "eigvals"))
    mu_a, mu_b = np.atleast_1d(np.asarray(mu_a, np.float64)), np.atleast_1d(np.asarray(mu_b, np.float64))
    sigma_a = np.atleast_2d(np.asarray(sigma_a, np.float64))
    sigma_b = np.atleast_2d(np.asarray(sigma_b, np.float64))
    if mu_a.shape != mu_b.shape or sigma_a.shape != sigma_b.shape or sigma_a.shape != (mu_a.size, mu_a.size):
        raise ValueError(f"statistics do not match: mu {mu_a.shape} / {mu_b.shape}, sigma {sigma_a.shape} / "
                         f"{sigma_b.shape} (features of different dimensions?)")
    diff = mu_a - mu_b
    tr = _trace_sqrt_product(sigma_a, sigma_b, method, eps)
    mean_term, ta, tb = float(diff.dot(diff)), float(np.trace(sigma_a)), float(np.trace(sigma_b))
    return FrechetResult(mean_term + ta + tb - 2 * tr, mean_term, ta, tb, tr, method)


def frechet_distance_features(feat_a, feat_b, *, method: str = "sqrtm") -> FrechetResult:
    """FID between two feature sets ``[n, d]``, ``[m, d]``; ``method="svd"`` computes ``tr sqrt(Σa Σb)`` exactly as the
    nuclear norm of the ``n × m`` matrix of centred features (fast and exact when ``n, m ≪ d``)."""
    _check_method(method)
    mu_a, sigma_a = activation_statistics(feat_a)
    mu_b, sigma_b = activation_statistics(feat_b)
    if method != "svd":
        return frechet_distance(mu_a, sigma_a, mu_b, sigma_b, method=method)
    a = np.asarray(feat_a, np.float64) if not torch.is_tensor(feat_a) else feat_a.double().cpu().numpy()
    b = np.asarray(feat_b, np.float64) if not torch.is_tensor(feat_b) else feat_b.double().cpu().numpy()
    xa = (a - mu_a) / math.sqrt(a.shape[0] - 1)
    xb = (b - mu_b) / math.sqrt(b.shape[0] - 1)
    tr = float(np.linalg.svd(xa @ xb.T, compute_uv=False).sum())
    diff = mu_a - mu_b
    mean_term, ta, tb = float(diff.dot(diff)), float(np.trace(sigma_a)), float(np.trace(sigma_b))
    return FrechetResult(mean_term + ta + tb - 2 * tr, mean_term, ta, tb, tr, "svd")


# ----- KID and IS ------------------------------------------------------------------------------------------
def _mmd2_unbiased(x: np.ndarray, y: np.ndarray) -> float:
    d = x.shape[1]
    k_xx = (x @ x.T / d + 1.0) ** 3
    k_yy = (y @ y.T / d + 1.0) ** 3
    k_xy = (x @ y.T / d + 1.0) ** 3
    m, n = x.shape[0], y.shape[0]
    within_x = (k_xx.sum() - np.trace(k_xx)) / (m * (m - 1))
    within_y = (k_yy.sum() - np.trace(k_yy)) / (n * (n - 1))
    return float(within_x + within_y - 2 * k_xy.mean())


def kid(feat_a, feat_b, *, subsets: int = 100, subset_size: int = 1000, seed: int = 0) -> dict:
    """KID ``{mean, std, subsets, subset_size}`` (float64; polynomial kernel of degree 3, ``γ = 1/d``, ``c = 1``).
    Each subset draws ``subset_size`` samples from each set without replacement (seeded numpy generator);
    ``subset_size`` is clamped to the smaller set."""
    a = feat_a.double().cpu().numpy() if torch.is_tensor(feat_a) else np.asarray(feat_a, np.float64)
    b = feat_b.double().cpu().numpy() if torch.is_tensor(feat_b) else np.asarray(feat_b, np.float64)
    size = min(int(subset_size), a.shape[0], b.shape[0])
    if size < 2:
        raise ValueError(f"KID needs at least 2 samples per set, got {a.shape[0]} and {b.shape[0]}")
    rng = np.random.default_rng(seed)
    values = np.array([_mmd2_unbiased(a[rng.choice(a.shape[0], size, replace=False)],
                                      b[rng.choice(b.shape[0], size, replace=False)]) for _ in range(int(subsets))])
    return dict(mean=float(values.mean()), std=float(values.std()), subsets=int(subsets), subset_size=size,
                clamped=size < int(subset_size))


def inception_score(logits, *, splits: int = 10) -> dict:
    """Inception Score ``{mean, std, splits}`` from logits ``[n, classes]`` (float64 softmax; consecutive splits of
    ``n // splits`` samples, the remainder dropped as the original code does)."""
    z = logits.double().cpu().numpy() if torch.is_tensor(logits) else np.asarray(logits, np.float64)
    n = z.shape[0]
    if n < splits or splits < 1:
        raise ValueError(f"Inception Score over {splits} splits needs at least {splits} samples, got {n}")
    z = z - z.max(1, keepdims=True)
    log_p = z - np.log(np.exp(z).sum(1, keepdims=True))
    p = np.exp(log_p)
    part = n // splits
    scores = []
    for k in range(splits):
        pk, lk = p[k * part:(k + 1) * part], log_p[k * part:(k + 1) * part]
        log_marginal = np.log(pk.mean(0, keepdims=True))
        scores.append(math.exp(float((pk * (lk - log_marginal)).sum(1).mean())))
    return dict(mean=float(np.mean(scores)), std=float(np.std(scores)), splits=int(splits))


# ----- reference statistics --------------------------------------------------------------------------------
@dataclass
class ReferenceStatistics:
    """``mu``/``sigma`` of a reference set and where they came from (``layout``: ``"pytorch-fid"`` or ``"adm"``;
    ``protocol``: the input protocol they were computed with, when known)."""

    mu: np.ndarray
    sigma: np.ndarray
    source: str
    layout: str
    protocol: str | None = None
    n: int | None = None
    extra: dict = field(default_factory=dict)


def load_reference_statistics(path: str | Path) -> ReferenceStatistics:
    """Reference ``mu``/``sigma`` from a LOCAL ``.npz`` (pytorch-fid's layout or the ADM evaluator's reference
    batch, which also holds ``mu_s``/``sigma_s`` and ``arr_0``; see the module docstring)."""
    p = Path(path).expanduser()
    if not p.is_file():
        raise UserError(f"FID reference statistics not found at {p}; pass a local .npz with 'mu' and 'sigma' "
                        f"(pytorch-fid --save-stats, or the ADM evaluator's VIRTUAL_imagenet256_labeled.npz)")
    try:
        data = np.load(p, allow_pickle=False)
    except Exception as exc:  # noqa: BLE001
        raise UserError(f"cannot read {p} as .npz ({type(exc).__name__}: {exc})") from None
    with data:
        keys = list(data.keys())
        if "mu" not in keys or "sigma" not in keys:
            raise UserError(f"{p} has arrays {keys}, but FID reference statistics need 'mu' and 'sigma'")
        mu, sigma = np.asarray(data["mu"], np.float64), np.asarray(data["sigma"], np.float64)
        adm = "arr_0" in keys or "mu_s" in keys
        protocol = str(data["protocol"]) if "protocol" in keys else ("tensorflow (ADM evaluator)" if adm else None)
        n = int(data["n"]) if "n" in keys else None
        extra = {k: tuple(data[k].shape) for k in keys if k not in ("mu", "sigma")}
    if sigma.shape != (mu.size, mu.size):
        raise UserError(f"{p}: sigma has shape {sigma.shape}, expected ({mu.size}, {mu.size}) for mu of {mu.size}")
    return ReferenceStatistics(mu, sigma, str(p), "adm" if adm else "pytorch-fid", protocol, n, extra)


def save_statistics(path: str | Path, mu: np.ndarray, sigma: np.ndarray, *, protocol: str | None = None,
                    n: int | None = None) -> Path:
    """Write ``mu``/``sigma`` in pytorch-fid's layout (plus ``protocol`` and ``n`` when given, which it ignores)."""
    p = Path(path)
    extra = {}
    if protocol is not None:
        extra["protocol"] = np.asarray(protocol)
    if n is not None:
        extra["n"] = np.asarray(n)
    np.savez(p, mu=np.asarray(mu, np.float64), sigma=np.asarray(sigma, np.float64), **extra)
    return p if p.suffix == ".npz" else p.with_name(p.name + ".npz")


def reference_images(path: str | Path) -> torch.Tensor:
    """The ``arr_0`` images of an ADM reference batch as uint8 ``[N, 3, H, W]`` (for KID / recomputed statistics)."""
    with np.load(Path(path).expanduser(), allow_pickle=False) as data:
        if "arr_0" not in data:
            raise UserError(f"{path} holds no images ('arr_0'); only statistics")
        arr = np.asarray(data["arr_0"])
    if arr.dtype != np.uint8 or arr.ndim != 4 or arr.shape[-1] != 3:
        raise UserError(f"{path}: arr_0 is {arr.dtype} {arr.shape}, expected uint8 [N, H, W, 3]")
    return torch.from_numpy(arr).permute(0, 3, 1, 2).contiguous()


# ----- reference folders -----------------------------------------------------------------------------------
def _images_in(folder: Path) -> list[Path]:
    return sorted(p for p in folder.iterdir() if p.is_file() and p.suffix.lower() in IMAGE_SUFFIXES)


def list_reference_images(folder: str | Path) -> dict[str, list[Path]]:
    """Images of a reference folder: ``{"all": [...]}`` for a flat folder (COCO-30K), or one entry per
    sub-folder (MJHQ-30K's categories: ``animals``, ``art``, ..., ``people``) plus ``"all"`` (their union)."""
    root = Path(folder).expanduser()
    if not root.is_dir():
        raise UserError(f"FID reference folder not found at {root}")
    flat = _images_in(root)
    groups = {d.name: _images_in(d) for d in sorted(root.iterdir()) if d.is_dir()}
    groups = {k: v for k, v in groups.items() if v}
    if not flat and not groups:
        raise UserError(f"{root} holds no images ({', '.join(IMAGE_SUFFIXES)}) and no sub-folders with images")
    out = dict(groups)
    out["all"] = flat + [p for v in groups.values() for p in v]
    return out


def _load_image(path: Path) -> torch.Tensor:
    from PIL import Image

    with Image.open(path) as img:
        arr = np.asarray(img.convert("RGB"), dtype=np.uint8)
    return torch.from_numpy(arr.copy()).permute(2, 0, 1)


def iter_image_batches(paths: Sequence[Path], batch_size: int = 50) -> Iterator[torch.Tensor]:
    """uint8 ``[b, 3, H, W]`` batches in order (PIL → RGB, no resizing: the protocol resizes); a size change starts a
    new batch."""
    batch: list[torch.Tensor] = []
    for p in paths:
        img = _load_image(Path(p))
        if batch and (len(batch) >= batch_size or img.shape != batch[0].shape):
            yield torch.stack(batch)
            batch = []
        batch.append(img)
    if batch:
        yield torch.stack(batch)


@torch.no_grad()
def extract_features(batches: Iterable[torch.Tensor], extractor) -> torch.Tensor:
    """Concatenated ``extractor(batch)`` over image batches, float32 ``[N, d]``."""
    out = [extractor(b).float().cpu() for b in batches]
    return torch.cat(out) if out else torch.zeros(0, int(getattr(extractor, "num_features", 0)))


def folder_statistics(folder: str | Path, extractor, *, categories: Sequence[str] | None = None,
                      batch_size: int = 50, limit: int | None = None) -> dict[str, ReferenceStatistics]:
    """Statistics of a reference folder per category (``"all"``, or the named sub-folders), with ``extractor`` an
    :class:`~var_core.eval.inception.InceptionFeatures` (its protocol is recorded). ``limit``: the first ``limit``
    images of each category (sorted by name)."""
    groups = list_reference_images(folder)
    wanted = list(categories) if categories else ["all"]
    for c in wanted:
        if c not in groups:
            raise UserError(f"{folder} has no category {c!r}; it has {', '.join(groups)}." + did_you_mean(c, groups))
    protocol = getattr(extractor, "protocol", None)
    out = {}
    for c in wanted:
        paths = groups[c][:limit] if limit else groups[c]
        feats = extract_features(iter_image_batches(paths, batch_size), extractor)
        mu, sigma = activation_statistics(feats)
        out[c] = ReferenceStatistics(mu, sigma, f"{folder}:{c}", "folder", protocol, int(feats.shape[0]))
    return out


# ----- whole protocols -------------------------------------------------------------------------------------
def fid_against_reference(features, reference: ReferenceStatistics, *, protocol: str,
                          method: str = "sqrtm") -> dict:
    """FID record of generated ``features`` against reference statistics; names the protocol of both sides."""
    mu, sigma = activation_statistics(features)
    result = frechet_distance(mu, sigma, reference.mu, reference.sigma, method=method)
    record = dict(result.to_dict(), protocol=protocol, reference=reference.source, reference_layout=reference.layout,
                  reference_protocol=reference.protocol, n=int(np.asarray(features).shape[0]), n_reference=reference.n)
    if reference.protocol is not None and reference.protocol != protocol and not (
            protocol == "torch-fidelity" and reference.layout == "adm"):
        record["warning"] = (f"the reference statistics were computed with {reference.protocol!r}, the features "
                             f"with {protocol!r}: the FID mixes protocols")
    return record


def fid_against_folder(images_or_features, folder: str | Path, extractor, *, category: str = "all",
                       batch_size: int = 50, limit: int | None = None, method: str = "sqrtm") -> dict:
    """FID record of generated images (uint8 / float ``[N, 3, H, W]``) or their features ``[N, d]`` against one
    category of a reference folder, both through ``extractor`` (same protocol on both sides)."""
    x = images_or_features
    feats = extractor(x) if torch.is_tensor(x) and x.dim() == 4 else x
    reference = folder_statistics(folder, extractor, categories=[category], batch_size=batch_size, limit=limit)
    return dict(fid_against_reference(feats, reference[category], protocol=extractor.protocol, method=method),
                category=category)


@torch.no_grad()
def reference_protocol_metrics(batches: Iterable[torch.Tensor], extractor, reference: ReferenceStatistics, *,
                               is_splits: int = IMAGENET_50K["is_splits"], method: str = "sqrtm") -> dict:
    """The ImageNet 50k protocol (class-conditional VAR): stream the generated image batches through the FID
    Inception once, then ``{"fid": FID record against the reference statistics, "is": Inception Score over
    ``is_splits`` splits}``, both naming the protocol. ``extractor``: an
    :class:`~var_core.eval.inception.InceptionFeatures` (its protocol is used)."""
    pools, logits = [], []
    for batch in batches:
        f = extractor.features(batch, ("2048", "logits_unbiased"))
        pools.append(f["2048"])
        logits.append(f["logits_unbiased"])
    if not pools:
        raise ValueError("no generated images")
    pool, logit = torch.cat(pools), torch.cat(logits)
    protocol = extractor.protocol
    fid = fid_against_reference(pool, reference, protocol=protocol, method=method)
    score = dict(inception_score(logit, splits=is_splits), protocol=protocol, n=int(logit.shape[0]),
                 logits="pool @ fc.weight^T (no bias)")
    if pool.shape[0] != IMAGENET_50K["samples"]:
        fid["note"] = f"{pool.shape[0]} samples, not the protocol's {IMAGENET_50K['samples']}: FID is biased by n"
    return {"fid": fid, "is": score}
