"""FID against reference statistics (``--fid-reference``): the papers' protocol, where the generated set is compared
with a fixed reference (ImageNet's ADM reference batch for VAR, MJHQ-30K per category for Infinity / HART / FastVAR,
COCO-30K), not with the baseline's images.

A reference is

* an ``.npz`` with ``mu`` / ``sigma`` (pytorch-fid's ``--save-stats`` layout, :func:`make_reference_npz`'s, or the
  ADM evaluator's reference batch, whose ``arr_0`` images are used instead when its statistics were made with other
  features than the study's), read with ``numpy.load(allow_pickle=False)``; per-category statistics are the
  ``mu__<category>`` / ``sigma__<category>`` / ``n__<category>`` arrays that :func:`make_reference_npz` writes for
  a folder of per-category sub-folders;
* a folder of images (flat: one FID; with sub-folders: one FID per sub-folder, MJHQ-30K's ``animals`` ... ``people``,
  plus their union), whose statistics are computed with the study's feature network.

The feature network is the study's (:func:`study_feature_space`): the FID Inception pool3 (2048-d, under the
record's input protocol) when ``--inception-weights`` is given, else the testbed classifier's 128-d features (the
"FID-proxy" space: not comparable with any paper's FID). A reference made with other features is refused: our own
``.npz`` names its feature space (``feature_space``, ``feature_dim``); a foreign one is checked by its dimension.

Every FID entry names its protocol: the feature space, the reference file and its sha256 (of the folder: of its
sorted relative paths and file contents), the reference's and the generated set's sample counts, and the category.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Sequence

import numpy as np
import torch

from ..errors import UserError
from .fid import (activation_statistics, frechet_distance, iter_image_batches, list_reference_images)

__all__ = ["FeatureSpace", "FIDReference", "RunningMoments", "ReferenceAccumulator", "study_feature_space",
           "feature_space_for_model", "load_fid_reference", "make_reference_npz", "file_sha256", "folder_sha256",
           "export_testbed_images", "expand_protocol", "protocol_record", "PROTOCOLS", "FORMAT"]

FORMAT = "varscope-fid-reference-1"
CATEGORY_SEP = "__"


@dataclass
class FeatureSpace:
    """The features a study's FID is computed in: ``name`` (stored in a reference ``.npz``), ``dim`` and the
    ``extractor`` (uint8 or float ``[N, 3, H, W]`` -> float ``[N, dim]``)."""

    name: str
    dim: int
    extractor: Callable[[torch.Tensor], torch.Tensor]
    label: str = ""

    @torch.no_grad()
    def features(self, images: torch.Tensor) -> np.ndarray:
        return np.asarray(self.extractor(images).double().cpu().numpy(), dtype=np.float64)


def study_feature_space(ctx) -> FeatureSpace | None:
    """The feature space of a :class:`~var_core.eval.metrics.MetricContext`: Inception with local weights, else the
    testbed classifier's (FID-proxy), else None."""
    if getattr(ctx, "inception_weights", None) is not None:
        from .metrics import _inception_extractor

        ext = _inception_extractor(ctx.inception_weights, ctx.fid_protocol)
        return FeatureSpace(f"inception-v3-pool3/{ctx.fid_protocol}", 2048, ext,
                            f"FID (Inception pool3, {ctx.fid_protocol} input protocol)")
    if getattr(ctx, "feature_extractor", None) is not None:
        return FeatureSpace("testbed-classifier", int(ctx.feature_extractor.num_features), ctx.feature_extractor,
                            "FID-proxy (testbed classifier features, not comparable with a paper's FID)")
    return None


def feature_space_for_model(model: str | None, *, classifier=None, inception_weights=None,
                            fid_protocol: str | None = None) -> FeatureSpace:
    """The feature space a study of ``model`` would use (``varscope fid-reference make``)."""
    from .inception import DEFAULT_PROTOCOL, check_protocol

    if inception_weights is not None:
        from .metrics import _inception_extractor, MetricUnavailable

        protocol = check_protocol(fid_protocol or DEFAULT_PROTOCOL)
        try:
            ext = _inception_extractor(inception_weights, protocol)
        except MetricUnavailable as exc:
            raise UserError(str(exc)) from None
        return FeatureSpace(f"inception-v3-pool3/{protocol}", 2048, ext, "FID (Inception pool3)")
    name = (model or "testbed").removeprefix("random:")
    if not name.startswith("testbed"):
        raise UserError(f"a study of {name} computes FID with the FID Inception: pass --inception-weights "
                        f"pt_inception-2015-12-05-6726825d.pth (only the testbed models use the testbed classifier's "
                        f"features)")
    from ..testbed.classifier import ClassifierFeatureExtractor, load_classifier

    try:
        clf = load_classifier(classifier)
    except Exception as exc:  # noqa: BLE001
        raise UserError(f"the testbed classifier does not load ({type(exc).__name__}: {exc}); pass --classifier "
                        f"FILE") from None
    ext = ClassifierFeatureExtractor(clf)
    return FeatureSpace("testbed-classifier", int(ext.num_features), ext, "FID-proxy (testbed classifier features)")


def file_sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def folder_sha256(root: Path, paths: Sequence[Path]) -> str:
    """sha256 over the sorted relative paths and contents of a reference folder's images."""
    h = hashlib.sha256()
    for p in sorted(paths):
        h.update(str(Path(p).relative_to(root)).encode() + b"\0")
        h.update(bytes.fromhex(file_sha256(Path(p))))
    return h.hexdigest()


@dataclass
class FIDReference:
    """Reference statistics per category (``"all"`` and, for per-category references, one per category):
    ``stats[category] = (mu, sigma, n)``."""

    source: str
    kind: str  # "npz" | "folder"
    sha256: str
    layout: str  # "varscope" | "pytorch-fid" | "adm" | "adm-images" | "folder"
    feature_space: str
    dim: int
    stats: dict[str, tuple[np.ndarray, np.ndarray, int | None]]
    note: str | None = None
    sample_categories: Sequence[str | None] | None = None  # the generated samples' categories (prompt sets)
    class_names: Sequence[str] | None = None
    space: FeatureSpace | None = field(default=None, repr=False)
    seed: int = 0  # the interval's bootstrap (the study's --seed)
    n_resamples: int = 200

    def describe(self) -> dict:
        """What every record stores of the reference (``protocol.fid_reference``)."""
        return {"file": self.source, "kind": self.kind, "sha256": self.sha256, "layout": self.layout,
                "feature_space": self.feature_space, "feature_dim": self.dim,
                "categories": sorted(c for c in self.stats if c != "all"),
                "n_reference": {c: s[2] for c, s in self.stats.items()}, "note": self.note}

    def _categories_of(self, labels, n: int) -> list[str | None] | None:
        if self.sample_categories is not None:
            cats = list(self.sample_categories)
            return [cats[i % len(cats)] for i in range(n)] if cats else None
        if self.class_names is not None and labels is not None:
            names = list(self.class_names)
            return [names[int(v)] if 0 <= int(v) < len(names) else None
                    for v in torch.as_tensor(labels).reshape(-1)[:n].tolist()]
        return None

    def new_accumulator(self) -> "ReferenceAccumulator":
        """Running statistics of the generated set, fed batch by batch (memory O(d²), not O(samples))."""
        return ReferenceAccumulator(self)

    def arm_metrics(self, images: torch.Tensor, labels=None, *, chunk: int = 64, quantize: bool = False
                    ) -> tuple[dict[str, dict], dict[str, str]]:
        """``fid_ref`` (all samples against the reference's ``all``) and ``fid_ref_<category>`` (the samples of
        that category against the category's statistics), each a summary naming its protocol; and the
        unavailable ones with why. ``images`` go through the feature network ``chunk`` at a time (``quantize``:
        each chunk to the 8-bit grid first, as every study metric reads images)."""
        from .metric_base import quantize01

        acc = self.new_accumulator()
        labels = None if labels is None else torch.as_tensor(labels).reshape(-1)
        for i in range(0, images.shape[0], chunk):  # one chunk at a time (a float copy of a chunk only)
            part = images[i:i + chunk]
            acc.update(quantize01(part) if quantize else part, None if labels is None else labels[i:i + chunk])
        return acc.finish()

    def _entry(self, moments: "RunningMoments", category: str, features: np.ndarray | None = None) -> dict:
        mu_r, sigma_r, n_r = self.stats[category]
        mu, sigma = moments.statistics()
        value = float(frechet_distance(mu, sigma, mu_r, sigma_r).fid)
        low = high = None
        method = "no interval (the generated samples' features were not kept)"
        if features is not None and features.shape[0] >= 2:
            lo, hi, resamples = reference_fid_interval(features, mu_r, sigma_r, n_resamples=self.n_resamples,
                                                       seed=self.seed)
            low, high = min(lo, value), max(hi, value)
            method = (f"bootstrap over the generated samples ({resamples} resamples) against the fixed reference "
                      f"statistics (the reference's own sampling error is not in the interval); percentile, "
                      f"bias-shifted")
        return {"mean": value, "low": low, "high": high, "n": int(moments.n), "level": 0.95 if low is not None
                else None, "method": method,
                "features": self.dim, "feature_space": self.feature_space, "category": category,
                "reference": self.source, "reference_sha256": self.sha256, "n_reference": n_r,
                "protocol": f"FID vs reference ({self.feature_space})"}


#: flops one FID-vs-reference bootstrap may spend before it takes fewer resamples (said in its ``method``)
REFERENCE_BOOTSTRAP_FLOPS = 6e10
MIN_REFERENCE_RESAMPLES = 50


def reference_fid_interval(features: np.ndarray, mu_r: np.ndarray, sigma_r: np.ndarray, *, n_resamples: int = 200,
                           seed: int = 0, level: float = 0.95) -> tuple[float, float, int]:
    """Percentile bootstrap interval of the FID of ``features`` ``[n, d]`` (the generated samples, resampled with
    replacement) against fixed reference statistics ``(mu_r, sigma_r)``, shifted by the bootstrap's bias (duplicates
    in a resample inflate FID, as for :func:`var_core.eval.metrics.fid_bootstrap`). Only the generated side varies:
    the reference is a fixed published file (its own sampling error is not in the interval).

    Each resample is a weight vector (counts of ``rng.integers(0, n, n)``), so its covariance is
    ``(Yᵀ diag(w) Y − n m mᵀ) / (n − 1)`` on the shifted features, with no copy of the resampled rows, and
    ``tr sqrt(Σ Σ_r) = Σ sqrt(eig(R Σ R))`` with ``R = Σ_r^{1/2}`` computed once. Cost ``n d² + d³`` per resample:
    beyond :data:`REFERENCE_BOOTSTRAP_FLOPS` fewer resamples are drawn (at least :data:`MIN_REFERENCE_RESAMPLES`).
    Returns ``(low, high, resamples)``."""
    x = np.asarray(features, np.float64)
    n, d = x.shape
    shift = x.mean(0)
    y = x - shift
    sym = (np.asarray(sigma_r, np.float64) + np.asarray(sigma_r, np.float64).T) / 2
    evals, evecs = np.linalg.eigh(sym)
    root = (evecs * np.sqrt(np.clip(evals, 0, None))) @ evecs.T
    tr_r, mu_r = float(np.trace(sym)), np.asarray(mu_r, np.float64)

    def fid(w: np.ndarray) -> float:
        m = (w @ y) / n
        cov = ((y * w[:, None]).T @ y - n * np.outer(m, m)) / (n - 1)
        inner = root @ cov @ root
        tr_covmean = float(np.sqrt(np.clip(np.linalg.eigvalsh((inner + inner.T) / 2), 0, None)).sum())
        return float(((shift + m - mu_r) ** 2).sum() + np.trace(cov) + tr_r - 2 * tr_covmean)

    resamples = int(min(n_resamples, max(MIN_REFERENCE_RESAMPLES,
                                         REFERENCE_BOOTSTRAP_FLOPS // (n * d * d + 10 * d ** 3))))
    rng = np.random.default_rng(seed)
    values = np.array([fid(np.bincount(rng.integers(0, n, n), minlength=n).astype(np.float64))
                       for _ in range(resamples)])
    lo, hi = np.quantile(values, [(1 - level) / 2, 1 - (1 - level) / 2])
    bias = float(values.mean()) - fid(np.ones(n))
    return max(0.0, float(lo) - bias), max(0.0, float(hi) - bias), resamples


class RunningMoments:
    """Mean and unbiased covariance of features fed in batches (sums of ``x − shift``, the shift being the first
    batch's mean, so the float64 sums do not cancel); equal to ``np.mean`` / ``np.cov(rowvar=False)`` of the
    concatenation."""

    def __init__(self):
        self.n, self.shift, self.s1, self.s2 = 0, None, None, None

    def update(self, feats: np.ndarray) -> None:
        x = np.asarray(feats, np.float64)
        if x.shape[0] == 0:
            return
        if self.shift is None:
            self.shift = x.mean(0)
            self.s1 = np.zeros_like(self.shift)
            self.s2 = np.zeros((x.shape[1], x.shape[1]))
        y = x - self.shift
        self.n += x.shape[0]
        self.s1 += y.sum(0)
        self.s2 += y.T @ y

    def statistics(self) -> tuple[np.ndarray, np.ndarray]:
        if self.n < 2:
            raise ValueError(f"FID statistics need at least 2 samples, got {self.n}")
        mean_y = self.s1 / self.n
        sigma = (self.s2 - self.n * np.outer(mean_y, mean_y)) / (self.n - 1)
        return self.shift + mean_y, sigma


class ReferenceAccumulator:
    """The generated side of :class:`FIDReference`, batch by batch: ``update(images, labels)`` in sample order
    (the sample index continues across calls: prompt categories are per sample), then ``finish()``."""

    def __init__(self, reference: FIDReference):
        self.ref = reference
        self.index = 0
        self.moments: dict[str, RunningMoments] = {"all": RunningMoments()}
        self.uncategorised = False
        # the generated samples' features (float32, d values per sample: 8 KB for Inception) for the interval
        self.features: dict[str, list[np.ndarray]] = {"all": []}

    def update(self, images: torch.Tensor, labels=None) -> None:
        feats = self.ref.space.features(images)
        n = feats.shape[0]
        self.moments["all"].update(feats)
        self.features["all"].append(np.asarray(feats, np.float32))
        if len(self.ref.stats) > 1:
            cats = self.ref._categories_of(labels, n) if self.ref.sample_categories is None else [
                self.ref.sample_categories[(self.index + i) % len(self.ref.sample_categories)] for i in range(n)]
            if cats is None:
                self.uncategorised = True
            else:
                for c in set(cats) & set(self.ref.stats):
                    if c != "all":
                        rows = feats[[i for i, pc in enumerate(cats) if pc == c]]
                        self.moments.setdefault(c, RunningMoments()).update(rows)
                        self.features.setdefault(c, []).append(np.asarray(rows, np.float32))
        self.index += n

    def finish(self) -> tuple[dict[str, dict], dict[str, str]]:
        def feats(c: str) -> np.ndarray | None:
            parts = self.features.get(c)
            return np.concatenate(parts) if parts else None

        values, unavailable = {"fid_ref": self.ref._entry(self.moments["all"], "all", feats("all"))}, {}
        for c in (c for c in self.ref.stats if c != "all"):
            key = f"fid_ref_{c}"
            if self.uncategorised:
                unavailable[key] = ("the generated samples have no category (a class-conditional model with class "
                                    "names, or a prompt file with categories such as MJHQ-30K's)")
                continue
            m = self.moments.get(c)
            if m is None or m.n < 2:
                unavailable[key] = (f"{0 if m is None else m.n} generated sample(s) of category {c!r}; FID needs at "
                                    f"least 2")
                continue
            values[key] = self.ref._entry(m, c, feats(c))
        return values, unavailable


def _folder_stats(root: Path, space: FeatureSpace, batch_size: int = 50):
    """Per-category and ``all`` statistics of a reference folder, each image through the network once."""
    groups = list_reference_images(root)
    for c, paths in groups.items():
        if len(paths) < 2:
            raise UserError(f"{root}: category {c!r} has {len(paths)} image(s); FID statistics need at least 2")
    moments = {c: RunningMoments() for c in groups}
    in_category = {p for c, paths in groups.items() if c != "all" for p in paths}
    passes = [(c, paths) for c, paths in groups.items() if c != "all"]
    passes.append(("all", [p for p in groups["all"] if p not in in_category]))  # the flat images
    for c, paths in passes:
        for batch in iter_image_batches(paths, batch_size):
            feats = space.features(batch)
            moments["all"].update(feats)
            if c != "all":
                moments[c].update(feats)
    stats = {c: (*m.statistics(), int(m.n)) for c, m in moments.items()}
    return stats, folder_sha256(root, groups["all"])


def load_fid_reference(path: str | Path, space: FeatureSpace) -> FIDReference:
    """The reference of ``--fid-reference PATH`` in ``space``; a :class:`UserError` for a missing / unreadable
    file, or statistics made with other features than the study's."""
    p = Path(path).expanduser()
    if p.is_dir():
        stats, sha = _folder_stats(p, space)
        return FIDReference(str(p), "folder", sha, "folder", space.name, space.dim, stats, space=space)
    if not p.is_file():
        raise UserError(f"--fid-reference {path}: no such file or folder; give an .npz with 'mu'/'sigma' or a "
                        f"folder of images")
    try:
        data = np.load(p, allow_pickle=False)
        keys = list(data.keys())
    except Exception as exc:  # noqa: BLE001
        raise UserError(f"--fid-reference {p}: not a readable .npz ({type(exc).__name__}: {exc})") from None
    make = "make one with `varscope fid-reference make DIR OUT.npz` in the study's feature space"
    with data:
        stored = str(data["feature_space"]) if "feature_space" in keys else None
        if stored is not None and stored != space.name:
            raise UserError(f"--fid-reference {p} was made with {stored!r} features, but this study's FID uses "
                            f"{space.name!r} ({space.dim}-d): {make}")
        stats: dict = {}
        layout = "varscope" if stored is not None else ("adm" if "arr_0" in keys or "mu_s" in keys else "pytorch-fid")
        note = None
        if "mu" in keys and "sigma" in keys:
            mu, sigma = np.asarray(data["mu"], np.float64), np.asarray(data["sigma"], np.float64)
            if mu.ndim != 1 or sigma.shape != (mu.size, mu.size):
                raise UserError(f"--fid-reference {p}: mu {mu.shape} / sigma {sigma.shape} are not [d] / [d, d]")
            if mu.size == space.dim:
                stats["all"] = (mu, sigma, int(data["n"]) if "n" in keys else None)
                for k in keys:
                    if k.startswith("mu" + CATEGORY_SEP):
                        c = k[len("mu" + CATEGORY_SEP):]
                        n_key = "n" + CATEGORY_SEP + c
                        stats[c] = (np.asarray(data[k], np.float64),
                                    np.asarray(data["sigma" + CATEGORY_SEP + c], np.float64),
                                    int(data[n_key]) if n_key in keys else None)
            elif "arr_0" not in keys:
                raise UserError(f"--fid-reference {p} holds {mu.size}-d statistics, but this study's FID uses "
                                f"{space.name!r} features ({space.dim}-d): {make}"
                                + (" (2048-d is the FID Inception's: pass --inception-weights)"
                                   if mu.size == 2048 else ""))
            else:
                note = (f"its {mu.size}-d mu/sigma are not in the study's {space.dim}-d feature space: statistics "
                        f"recomputed from its arr_0 images")
        if not stats:
            if "arr_0" not in keys:
                raise UserError(f"--fid-reference {p} has arrays {keys}; it needs 'mu' and 'sigma' (or the ADM "
                                f"evaluator's 'arr_0' images)")
            arr = np.asarray(data["arr_0"])
            if arr.dtype != np.uint8 or arr.ndim != 4 or arr.shape[-1] != 3:
                raise UserError(f"--fid-reference {p}: arr_0 is {arr.dtype} {arr.shape}, expected uint8 "
                                f"[N, H, W, 3]")
            images = torch.from_numpy(arr).permute(0, 3, 1, 2)
            feats = np.concatenate([space.features(images[i:i + 100]) for i in range(0, images.shape[0], 100)])
            mu, sigma = activation_statistics(feats)
            stats["all"] = (mu, sigma, int(feats.shape[0]))
            layout = "adm-images"
    return FIDReference(str(p), "npz", file_sha256(p), layout, space.name, space.dim, stats, note=note, space=space)


def make_reference_npz(folder: str | Path, out: str | Path, space: FeatureSpace) -> tuple[Path, dict]:
    """Write the statistics of a folder of images (per sub-folder too) in ``space`` to ``out``: ``mu``/``sigma``
    (pytorch-fid's keys) plus ``n``, ``feature_space``, ``feature_dim``, ``format`` and per category
    ``mu__<c>``/``sigma__<c>``/``n__<c>``. Returns the path and ``{category: n}``."""
    root = Path(folder).expanduser()
    stats, sha = _folder_stats(root, space)
    arrays: dict[str, Any] = {"format": np.asarray(FORMAT), "feature_space": np.asarray(space.name),
                              "feature_dim": np.asarray(space.dim), "source_sha256": np.asarray(sha)}
    for c, (mu, sigma, n) in stats.items():
        suffix = "" if c == "all" else CATEGORY_SEP + c
        arrays["mu" + suffix], arrays["sigma" + suffix], arrays["n" + suffix] = mu, sigma, np.asarray(n)
    out = Path(out).expanduser()
    if out.suffix != ".npz":
        out = out.with_name(out.name + ".npz")
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f".{out.name}.tmp.npz")
    np.savez(tmp, **arrays)
    tmp.replace(out)
    return out, {c: s[2] for c, s in stats.items()}


def export_testbed_images(out: str | Path, per_class: int, *, split: str = "train", image_size: int = 64,
                          per_category: bool = False, seed: int = 0) -> int:
    """The testbed's training images (:mod:`var_core.testbed.data`) as PNG: ``per_class`` of each class, flat or
    in one sub-folder per class name. Returns the count."""
    from PIL import Image

    from ..testbed.data import CLASS_NAMES, generate_image

    root = Path(out).expanduser()
    count, index, seen = 0, 0, {c: 0 for c in range(len(CLASS_NAMES))}
    while min(seen.values()) < per_class:
        img, label = generate_image(split, index, seed, image_size)
        index += 1
        if seen[label] >= per_class:
            continue
        seen[label] += 1
        folder = root / CLASS_NAMES[label] if per_category else root
        folder.mkdir(parents=True, exist_ok=True)
        u8 = np.clip(np.rint(img * 255.0), 0, 255).astype(np.uint8)
        Image.fromarray(u8).save(folder / f"{split}_{index - 1:06d}.png")
        count += 1
    return count


# ----- named protocols (--protocol) --------------------------------------------------------------------------
#: ``--protocol NAME``: a paper's evaluation as one flag. ``imagenet-50k``: VAR's ImageNet-256 FID (VAR README,
#: "FID 1.73": 50 samples per class, cfg 1.5, top-p 0.96, top-k 900, more_smooth off; OpenAI's ADM evaluator
#: against VIRTUAL_imagenet256_labeled.npz), generic over the model's class count (the testbed: 10 x 50 = 500).
PROTOCOLS = {
    "imagenet-50k": dict(per_class=50, cfg=1.5, top_k=900, top_p=0.96,
                         description="50 samples per class, VAR's sampling (cfg 1.5, top-k 900, top-p 0.96), FID "
                                     "and IS against --fid-reference (VIRTUAL_imagenet256_labeled.npz on ImageNet)"),
}


def model_num_classes(model: str | None) -> int:
    """The class count of a class-conditional zoo model, without loading it."""
    from ..zoo import ZOO

    name = (model or "testbed").removeprefix("random:")
    if name.startswith("testbed"):
        from ..testbed.data import NUM_CLASSES

        return int(NUM_CLASSES)
    spec = ZOO.get(name)
    if spec is None:
        from ..errors import did_you_mean

        raise UserError(f"unknown model {name!r}." + did_you_mean(name, ZOO))
    if spec.family != "var":
        raise UserError(f"--protocol imagenet-50k is class-conditional; {name} is text-to-image ({spec.family}): "
                        f"use --prompts with --fid-reference (MJHQ-30K / COCO-30K) instead")
    n = getattr(spec.var_config, "num_classes", None)
    if not n:
        raise UserError(f"{name} does not state its class count; give --samples instead of --protocol")
    return int(n)


def expand_protocol(name: str, model: str | None, given: dict) -> dict:
    """The settings ``--protocol name`` stands for on ``model`` (``samples = per_class x classes`` and the
    sampling), with the explicitly ``given`` ones kept."""
    if name not in PROTOCOLS:
        from ..errors import did_you_mean

        raise UserError(f"unknown protocol {name!r}; choose from {', '.join(PROTOCOLS)}."
                        + did_you_mean(name, PROTOCOLS))
    preset = PROTOCOLS[name]
    out = {"samples": preset["per_class"] * model_num_classes(model), "cfg": preset["cfg"], "top_k": preset["top_k"],
           "top_p": preset["top_p"]}
    out.update(given)
    return out


def protocol_record(options, reference: "FIDReference | None") -> dict:
    """``record["protocol"]``: the protocol flags of a study and, with ``--fid-reference``, the reference (file,
    sha256, feature space, counts); every arm's record stores it."""
    name = getattr(options, "protocol", None)
    out = {"name": name or ("fid-reference" if reference is not None else None),
           "samples": int(options.samples),
           "preset": {k: v for k, v in PROTOCOLS[name].items() if k != "description"} if name else None,
           "deviations": None,
           "fid_reference": reference.describe() if reference is not None else None,
           "resolution": getattr(options, "resolution", None), "aspect": getattr(options, "aspect", None),
           "more_smooth": getattr(options, "more_smooth", None),
           "prompts_rewritten": getattr(options, "prompts_rewritten", None),
           "prompts_rewritten_sha256": (file_sha256(Path(options.prompts_rewritten).expanduser())
                                        if getattr(options, "prompts_rewritten", None) else None)}
    if name:
        want = expand_protocol(name, options.model, {})
        dev = {k: getattr(options, k, None) for k in want if getattr(options, k, None) != want[k]}
        out["deviations"] = dev or None
    return out
