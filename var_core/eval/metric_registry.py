"""Every evaluation metric of the project, declared once: what it measures, which direction is better, whether it
is a proxy, where its weights come from, how to enable it, and whether it can run here.

``python -m studies.ablate ls metrics`` prints this registry (:func:`describe_metrics`) with each metric's
availability for the options given on the same command line (e.g. ``--clip-weights DIR``). A metric is registered
with the :func:`metric` decorator on its availability check: a function of the options (a mapping or namespace with
``clip_weights``, ``image_reward_weights``, ``hps_weights``, ``inception_weights``, ``lpips_backbone``,
``lpips_lin``) returning ``None`` when it can run, else the reason and the fix. Kinds:

* ``computed`` — measured on the generated images by the ablation runner;
* ``import`` — needs a heavy external stack (GenEval's detector, DPG-Bench's VQA model) that we do not
  reimplement: the images are exported in the benchmark's layout (``--save-images``), the benchmark runs on its
  own, and ``python -m studies.report DIR --import KIND FILE`` joins its result file (:mod:`ablations.imports`).

Each arm record carries ``metrics_info`` (:func:`metrics_info`): per metric its direction, proxy flag, weights
source, and the local weights actually used (resolved path and sha256, :func:`weights_identity`), or why it did not
run. The text-conditioned metrics (CLIP score, ImageReward, HPSv2.1) are computed by :func:`prompt_metrics`; their
models are loaded once per run and kept in the :class:`~var_core.eval.metrics.MetricContext`.
"""

from __future__ import annotations

import hashlib
import importlib.util
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence

import numpy as np

from ..errors import UserError, did_you_mean

__all__ = ["MetricSpec", "METRICS", "metric", "get_metric", "metric_names", "availability", "describe_metrics",
           "spec_of_key", "directions_line",
           "weights_identity", "metrics_info", "prompt_metrics", "texts_for", "PROMPT_METRICS",
           "requested_classifier_error", "load_requested_weights"]


@dataclass(frozen=True)
class MetricSpec:
    name: str
    title: str  # what it measures, one line
    direction: str  # "higher" | "lower" is better
    proxy: bool  # measured with a stand-in network (the testbed classifier), not the paper's
    weights: str  # where its weights come from
    enable: str  # what to pass to enable it
    kind: str = "computed"  # "computed" | "import"
    keys: tuple[str, ...] = ()  # summary keys it writes (default: its name)
    option: str | None = None  # the option holding its weights path (for metrics_info)
    check: Callable[[Any], str | None] | None = None

    @property
    def summary_keys(self) -> tuple[str, ...]:
        return self.keys or (self.name,)


METRICS: dict[str, MetricSpec] = {}


def metric(name: str, *, title: str, direction: str, proxy: bool, weights: str, enable: str, kind: str = "computed",
           keys: Sequence[str] = (), option: str | None = None):
    """Register the decorated availability check as metric ``name``."""
    if direction not in ("higher", "lower"):
        raise ValueError(f"direction must be 'higher' or 'lower', got {direction!r}")
    if kind not in ("computed", "import"):
        raise ValueError(f"kind must be 'computed' or 'import', got {kind!r}")

    def decorator(check: Callable[[Any], str | None]):
        if name in METRICS:
            raise ValueError(f"metric {name!r} is already registered")
        METRICS[name] = MetricSpec(name, title, direction, proxy, weights, enable, kind, tuple(keys), option, check)
        return check

    return decorator


def get_metric(name: str) -> MetricSpec:
    if name not in METRICS:
        raise UserError(f"unknown metric {name!r}.{did_you_mean(name, METRICS)} Metrics: {', '.join(METRICS)} "
                        f"(python -m studies.ablate ls metrics)")
    return METRICS[name]


def metric_names() -> list[str]:
    return list(METRICS)


def _opt(options: Any, key: str):
    if options is None:
        return None
    if isinstance(options, Mapping):
        return options.get(key)
    return getattr(options, key, None)


def _module(name: str) -> str | None:
    try:
        found = importlib.util.find_spec(name) is not None
    except (ImportError, ValueError):
        found = False
    return None if found else f"the package {name.split('.')[0]!r} is not installed"


def _file(options, key: str, flag: str, what: str) -> str | None:
    value = _opt(options, key)
    if value is None:
        return f"not requested: pass {flag} {what}"
    if not Path(value).expanduser().exists():
        return f"{flag} {value}: not found"
    return None


# ----- the registry ----------------------------------------------------------------------------------------
_TORCHMETRICS = "none (torchmetrics, against the baseline image of the same seed)"
_INCEPTION = ("the FID Inception-v3 (2015-12-05 TF graph) file of pytorch-fid (pt_inception-2015-12-05-6726825d.pth) "
              "or torch-fidelity, local; network in var_core/eval/inception.py")
_TESTBED = "the testbed classifier shipped in var_core/testbed/weights (a stand-in for Inception)"


@metric("psnr", title="PSNR vs the baseline (dB); psnr_differing / psnr_mean_mse in the table", direction="higher",
        proxy=False, weights=_TORCHMETRICS, enable="always on",
        keys=("psnr", "psnr_differing", "psnr_mean_mse"))
def _psnr(options):
    return _module("torchmetrics")


@metric("ssim", title="SSIM vs the baseline", direction="higher", proxy=False, weights=_TORCHMETRICS,
        enable="always on (images of at least 7 px)")
def _ssim(options):
    return _module("torchmetrics")


@metric("ms_ssim", title="MS-SSIM vs the baseline", direction="higher", proxy=False, weights=_TORCHMETRICS,
        enable="always on (images above 24 px; 3 scales below 161 px)")
def _ms_ssim(options):
    return _module("torchmetrics")


@metric("lpips", title="LPIPS v0.1 vs the baseline (lpips_alex / lpips_vgg)", direction="lower", proxy=False,
        weights="the lpips package's v0.1 linear layers + the pretrained torchvision AlexNet / VGG16 backbone, local "
                "files; network in var_core/eval/lpips.py",
        enable="--lpips-backbone FILE --lpips-lin FILE [--lpips-net alex|vgg]", keys=("lpips_alex", "lpips_vgg"),
        option="lpips_backbone")
def _lpips(options):
    if _opt(options, "lpips_backbone") is None or _opt(options, "lpips_lin") is None:
        return "not requested: pass --lpips-backbone FILE and --lpips-lin FILE (random backbones are meaningless)"
    return _file(options, "lpips_backbone", "--lpips-backbone", "FILE") or _file(options, "lpips_lin", "--lpips-lin",
                                                                                 "FILE")


@metric("fid", title="FID vs the baseline's images (Inception-v3 pool features)", direction="lower", proxy=False,
        weights=_INCEPTION, enable="--inception-weights FILE [--fid-protocol torch-fidelity|pytorch-fid]",
        keys=("fid_inception",), option="inception_weights")
def _fid(options):
    return _file(options, "inception_weights", "--inception-weights", "FILE")


@metric("kid", title="KID vs the baseline's images (Inception-v3 pool features)", direction="lower", proxy=False,
        weights=_INCEPTION, enable="--inception-weights FILE", keys=("kid_inception",), option="inception_weights")
def _kid(options):
    return _file(options, "inception_weights", "--inception-weights", "FILE")


@metric("is", title="Inception Score (Inception-v3 logits)", direction="higher", proxy=False, weights=_INCEPTION,
        enable="--inception-weights FILE", keys=("is_inception",), option="inception_weights")
def _is(options):
    return _file(options, "inception_weights", "--inception-weights", "FILE")


@metric("clip_score", title="CLIP score: max(100 cos(image, prompt), 0), torchmetrics CLIPScore",
        direction="higher", proxy=False,
        weights="a local Hugging Face CLIP folder (e.g. openai/clip-vit-large-patch14), loaded by transformers",
        enable="--clip-weights DIR", option="clip_weights")
def _clip(options):
    return _file(options, "clip_weights", "--clip-weights", "DIR") or _module("transformers")


@metric("image_reward", title="ImageReward (BLIP ViT-L/16 + BERT-base + MLP, normalised reward)",
        direction="higher", proxy=False,
        weights="THUDM's released ImageReward.pt + a bert-base-uncased tokenizer folder beside it; network in "
                "var_core/eval/image_reward.py",
        enable="--image-reward-weights FILE_OR_DIR", option="image_reward_weights")
def _image_reward(options):
    return (_file(options, "image_reward_weights", "--image-reward-weights", "FILE_OR_DIR")
            or _module("transformers"))


@metric("hpsv2", title="HPSv2.1: 100 cos(image, prompt) with the fine-tuned OpenCLIP ViT-H-14", direction="higher",
        proxy=False,
        weights="the released HPS_v2.1_compressed.pt (open_clip layout) + a CLIP tokenizer folder beside it; network "
                "in var_core/eval/hps.py",
        enable="--hps-weights FILE_OR_DIR", option="hps_weights")
def _hps(options):
    return _file(options, "hps_weights", "--hps-weights", "FILE_OR_DIR") or _module("transformers")


@metric("geneval", title="GenEval: single/two objects, counting, colors, position, attribute binding, overall",
        direction="higher", proxy=False, kind="import",
        weights="GenEval's own Mask2Former detector and CLIP ViT-L/14, run by its evaluate_images.py (not here)",
        enable="run with --save-images, evaluate images/<arm>/geneval with GenEval, then python -m studies.report "
               "DIR --import geneval RESULTS.jsonl",
        keys=("geneval_single_object", "geneval_two_object", "geneval_counting", "geneval_colors",
              "geneval_position", "geneval_color_attr", "geneval_overall"))
def _geneval(options):
    return None


@metric("dpg", title="DPG-Bench: global, entity, attribute, relation, other, overall", direction="higher",
        proxy=False, kind="import",
        weights="DPG-Bench's mPLUG-large VQA model, run by its compute_dpg_bench.py (not here)",
        enable="run with --save-images, score each arm's images (images/<arm>/) with DPG-Bench, then python -m "
               "studies.report DIR --import dpg RESULTS.csv [--import-arm ARM]",
        keys=("dpg_global", "dpg_entity", "dpg_attribute", "dpg_relation", "dpg_other", "dpg_overall"))
def _dpg(options):
    return None


@metric("token_agreement", title="fraction of tokens equal to the baseline's, per scale", direction="higher",
        proxy=False, weights="none", enable="always on")
def _tokens(options):
    return None


@metric("class_acc", title="testbed classifier top-1 accuracy on the conditioning class", direction="higher",
        proxy=True, weights=_TESTBED, enable="on for the testbed model (class-conditional, its classes)",
        keys=("class_correct",))
def _class_acc(options):
    return None


@metric("fid_proxy", title="FID vs the baseline in the testbed classifier's feature space", direction="lower",
        proxy=True, weights=_TESTBED, enable="on for the testbed model", keys=("fid_proxy", "fid_real"))
def _fid_proxy(options):
    return None


@metric("kid_proxy", title="KID vs the baseline in the testbed classifier's feature space", direction="lower",
        proxy=True, weights=_TESTBED, enable="on for the testbed model")
def _kid_proxy(options):
    return None


@metric("is_proxy", title="Inception Score with the testbed classifier's logits", direction="higher", proxy=True,
        weights=_TESTBED, enable="on for the testbed model")
def _is_proxy(options):
    return None


def availability(name: str, options: Any = None) -> str | None:
    """``None`` when metric ``name`` can run with ``options``, else the reason (and the fix)."""
    spec = get_metric(name)
    try:
        return spec.check(options) if spec.check else None
    except Exception as exc:  # noqa: BLE001 - a check must never break the listing
        return f"check failed ({type(exc).__name__}: {exc})"


def spec_of_key(key: str) -> MetricSpec | None:
    """The metric that writes summary key ``key`` (``lpips_alex`` -> lpips, ``geneval_overall`` -> geneval)."""
    for spec in METRICS.values():
        if key in spec.summary_keys:
            return spec
    return None


def directions_line(keys: Sequence[str]) -> str:
    """One footer line: which of the table's quality columns are better higher / lower, and which are proxies."""
    higher, lower, proxies = [], [], []
    for key in keys:
        spec = spec_of_key(key)
        if spec is None:
            continue
        (higher if spec.direction == "higher" else lower).append(f"`{key}`")
        if spec.proxy:
            proxies.append(f"`{key}`")
    if not higher and not lower:
        return ""
    parts = []
    if higher:
        parts.append("higher is better: " + ", ".join(higher))
    if lower:
        parts.append("lower is better: " + ", ".join(lower))
    text = "Quality columns (python -m studies.ablate ls metrics): " + "; ".join(parts)
    if proxies:
        text += "; proxies (testbed classifier, not the paper's network): " + ", ".join(proxies)
    return text + "."


def describe_metrics(options: Any = None) -> list[str]:
    """The lines ``python -m studies.ablate ls metrics`` prints."""
    lines = ["Metrics (direction: which is better; proxy: a stand-in network, not the paper's):"]
    for name, spec in METRICS.items():
        why = availability(name, options)
        state = "available" if why is None else f"unavailable ({why})"
        if spec.kind == "import":
            state = "import" + ("" if why is None else f" ({why})")
        lines.append(f"  {name:<15} {spec.direction} is better{', proxy' if spec.proxy else ''}; {state}")
        lines.append(f"  {'':<15} {spec.title}")
        lines.append(f"  {'':<15} weights: {spec.weights}")
        lines.append(f"  {'':<15} enable : {spec.enable}")
    return lines


# ----- weights identity ------------------------------------------------------------------------------------
_HASHES: dict[tuple, str] = {}


def _file_sha256(path: Path) -> str:
    st = path.stat()
    key = (str(path.resolve()), st.st_size, st.st_mtime_ns)
    if key not in _HASHES:
        h = hashlib.sha256()
        with open(path, "rb") as f:
            for block in iter(lambda: f.read(1 << 20), b""):
                h.update(block)
        _HASHES[key] = h.hexdigest()
    return _HASHES[key]


def weights_identity(path: str | Path | None) -> dict | None:
    """``{"path", "sha256", "bytes", "files"}`` of a weights file or folder (a folder: the sha256 of the sorted
    lines ``<relative path> <file sha256>`` of every non-hidden file in it); ``None`` for no path. Hashes are
    cached per (path, size, mtime) within the process."""
    if path is None:
        return None
    p = Path(path).expanduser()
    if not p.exists():
        return {"path": str(p), "sha256": None, "bytes": None, "files": 0, "error": "not found"}
    if p.is_file():
        return {"path": str(p.resolve()), "sha256": _file_sha256(p), "bytes": p.stat().st_size, "files": 1}
    files = sorted(f for f in p.rglob("*") if f.is_file()
                   and not any(part.startswith(".") for part in f.relative_to(p).parts))
    listing = "".join(f"{f.relative_to(p).as_posix()} {_file_sha256(f)}\n" for f in files)
    return {"path": str(p.resolve()), "sha256": hashlib.sha256(listing.encode()).hexdigest(),
            "bytes": sum(f.stat().st_size for f in files), "files": len(files)}


def metrics_info(ctx, unavailable: Mapping[str, str] | None = None, computed: Sequence[str] = ()) -> dict:
    """Per metric of the registry: direction, proxy flag, weights source, the local weights used (path + sha256,
    see :func:`weights_identity`) and its state in this record (``computed`` / the reason it is not)."""
    unavailable = dict(unavailable or {})
    computed = set(computed)
    out = {}
    for name, spec in METRICS.items():
        entry: dict[str, Any] = {"direction": spec.direction, "proxy": spec.proxy, "kind": spec.kind,
                                 "weights_source": spec.weights}
        if spec.option is not None:
            entry["weights"] = weights_identity(_opt(ctx, spec.option))
        keys = [k for k in spec.summary_keys]
        if spec.kind == "import":
            entry["state"] = "imported by python -m studies.report --import (see imports/)"
        elif any(k in computed for k in keys):
            entry["state"] = "computed"
        else:
            reasons = [unavailable[k] for k in keys if k in unavailable]
            entry["state"] = f"unavailable: {reasons[0]}" if reasons else "not computed for this arm"
        out[name] = entry
    return out


# ----- text-conditioned metrics ----------------------------------------------------------------------------
PROMPT_METRICS = ("clip_score", "image_reward", "hpsv2")


def texts_for(ctx, labels) -> list[str]:
    """The prompt of each sample: ``ctx.prompts`` (the condition set's, in sample order) when it has one per
    image, else ``ctx.label_prompt.format(label=k)`` (what the model was conditioned on: Infinity's fixed
    per-label prompt), else a caption from the class name (``"a {name} image"``; the class index when no names are known)."""
    labels = [int(x) for x in (labels.tolist() if hasattr(labels, "tolist") else labels)]
    prompts = getattr(ctx, "prompts", None)
    if prompts is not None and len(prompts) == len(labels):
        return [str(p) for p in prompts]
    template = getattr(ctx, "label_prompt", None)
    if template is not None:
        return [template.format(label=k) for k in labels]
    names = getattr(ctx, "class_names", None)
    if names:
        return [f"a {names[k].replace('_', ' ')} image" if 0 <= k < len(names) else f"class {k}" for k in labels]
    return [f"class {k}" for k in labels]


def _loaded(ctx, key: str, loader: Callable[[], Any]):
    """A scorer loaded once per run (or the MetricUnavailable it raised, re-raised for every arm)."""
    from .metric_base import MetricUnavailable

    cache = ctx._loaded_models
    if key not in cache:
        try:
            cache[key] = loader()
        except MetricUnavailable as exc:
            cache[key] = exc
    value = cache[key]
    if isinstance(value, MetricUnavailable):
        raise MetricUnavailable(str(value))
    return value


def prompt_metrics(images, labels, ctx) -> tuple[dict[str, np.ndarray], dict[str, str]]:
    """CLIP score, ImageReward and HPSv2.1 per sample, for the metrics whose weights ``ctx`` names:
    ``(values, unavailable)`` (``values[name]``: float array ``[B]``; ``unavailable[name]``: the reason)."""
    from .metric_base import MetricUnavailable

    values: dict[str, np.ndarray] = {}
    unavailable: dict[str, str] = {}
    texts = None
    for name in PROMPT_METRICS:
        spec = METRICS[name]
        path = _opt(ctx, spec.option)
        if path is None:
            unavailable[name] = f"{name}: not requested (pass {spec.enable})"
            continue
        try:
            if texts is None:
                texts = texts_for(ctx, labels)
            values[name] = _score(name, images, texts, ctx, path)
        except MetricUnavailable as exc:
            unavailable[name] = str(exc)
    return values, unavailable


def requested_classifier_error(path, problem: str) -> UserError:
    """The error for a ``--classifier`` file the user named that cannot judge this study (unreadable, corrupt,
    truncated, or for other classes / image sizes): an explicitly requested metric that cannot run stops the study
    before anything is generated, instead of leaving its column n/a."""
    return UserError(f"--classifier {path}: the testbed classifier cannot be used ({problem}); give a "
                     f"classifier.safetensors written by python -m var_core.testbed.train_classifier for this model, "
                     f"or leave --classifier out (the shipped classifier)")


def _one_line(exc: BaseException) -> str:
    text = " ".join(str(exc).split())
    return f"{type(exc).__name__}: {text[:200]}" if text else type(exc).__name__


def load_requested_weights(ctx) -> None:
    """Load, before anything is generated, every metric network whose local weights the user named
    (``--lpips-backbone`` / ``--lpips-lin``, ``--inception-weights``, ``--clip-weights``,
    ``--image-reward-weights``, ``--hps-weights``): one that cannot load is a :class:`UserError` naming the option
    and the file. Without this the study would run for hours and leave the requested column n/a. The loaders cache
    what they load, so the metrics reuse it."""
    from .metric_base import MetricUnavailable

    backbone, lin = _opt(ctx, "lpips_backbone"), _opt(ctx, "lpips_lin")
    if backbone is not None or lin is not None:
        if backbone is None or lin is None:
            given, missing = ("--lpips-backbone", "--lpips-lin") if lin is None else ("--lpips-lin",
                                                                                      "--lpips-backbone")
            raise UserError(f"{given} {backbone if lin is None else lin} was given without {missing}: LPIPS needs both (the pretrained backbone and "
                            f"the lpips package's weights/v0.1/<net>.pth linear layers); pass {missing} FILE too")
        from .lpips import load_lpips

        try:
            load_lpips(ctx.lpips_net, backbone, lin)
        except UserError as exc:
            raise UserError(f"--lpips-backbone {backbone} / --lpips-lin {lin}: LPIPS cannot load ({exc}); pass "
                            f"readable, complete weight files, or leave both options out") from None
    inception = _opt(ctx, "inception_weights")
    if inception is not None:
        from .inception import load_fid_inception

        try:
            load_fid_inception(inception)
        except UserError as exc:
            raise UserError(f"--inception-weights {inception}: the FID Inception cannot load ({exc})") from None
    for name in PROMPT_METRICS:
        spec = METRICS[name]
        path = _opt(ctx, spec.option)
        if path is None:
            continue
        try:
            _score_model(name, ctx, path)
        except (MetricUnavailable, UserError, OSError, ValueError, RuntimeError) as exc:
            flag = "--" + spec.option.replace("_", "-")
            raise UserError(f"{flag} {path}: {spec.title.split(' (')[0]} cannot load ({_one_line(exc)}); pass a "
                            f"readable, complete local copy, or leave {flag} out") from None


def _device() -> str:
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"  # scorers run where the accelerator is, if any


def _score_model(name: str, ctx, path):
    """The scorer of prompt metric ``name`` from ``path``, loaded once per run (see :func:`_loaded`)."""
    if name == "clip_score":
        from .clip_score import load_clip

        return _loaded(ctx, f"clip:{path}", lambda: load_clip(path).to(_device()))
    if name == "image_reward":
        from .image_reward import load_image_reward

        return _loaded(ctx, f"ir:{path}", lambda: load_image_reward(path).to(_device()))
    from .hps import load_hps

    return _loaded(ctx, f"hps:{path}", lambda: load_hps(path).to(_device()))


def _score(name: str, images, texts, ctx, path) -> np.ndarray:
    model = _score_model(name, ctx, path)
    if name == "clip_score":
        from .clip_score import clip_scores

        return clip_scores(images, texts, model)
    if name == "image_reward":
        from .image_reward import image_reward_scores

        return image_reward_scores(images, texts, model)
    from .hps import hps_scores

    return hps_scores(images, texts, model)

