"""The shared ablation runner: arms → Lightning generation with profilers → metrics vs baseline → records → report.

``run_study(StudyOptions(family="scorer"))`` does, in order:

1. builds the family's arms and applies ``--set`` overrides (errors here, before any model is loaded);
2. loads the model (``testbed`` when its weights are shipped, else ``official-tiny``, unless ``model`` is given) and
   the metric context (testbed classifier where it applies);
3. runs the baseline, then every arm, each through :func:`var_core.eval.lightning.run_generation` with a
   :class:`~ablations.probes.ProfilerProbe` (latency breakdown, analytic FLOPs, peak memory) — or reuses its record
   from an earlier run into the same folder (same config hash, model, sampling and sample set);
4. computes the metrics against the baseline (same seeds), writes the arm's JSON record atomically and its sample
   grid as soon as the arm finishes;
5. re-times one batch per arm with the arms interleaved (``timing_interleaved.json``: the latency-regime speedup,
   the table's headline); a resumed study reuses that measurement when it covers the same arms and settings, and
   ``retime=True`` (``--retime``) re-measures it; the file says what it covered and when and why it was measured;
6. writes the table (CSV + Markdown), the plots, the labelled overview grid and the W&B run (offline by default).

Every number that needs the baseline is paired by sample index (and the speedup by batch, when both were cut the
same way).

Safety of a results folder: one study at a time holds ``<out>/study.lock`` (pid, host, start time; a lock left by a
dead process on this host is taken over with a note). Tensor files are read with ``weights_only=True`` (no pickled
code runs); a record or tensor file that cannot be read is named, moved aside to ``*.corrupt`` and its arm
recomputed. Every arm's record keeps the identity of the baseline it was measured against
(:func:`baseline_identity`); when the baseline is recomputed, the arms measured against the old one are recomputed.
"""

from __future__ import annotations

import dataclasses
import datetime as _dt
import hashlib
import json
import math
import os
import shutil
import socket
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import numpy as np
import torch

from var_core.eval import records as rec
from var_core.errors import UserError
from var_core.engine.precision import parameter_dtype, run_tag, study_precision
from var_core.eval.distributed import Launch, RankChannel, resolve_accelerator, resolve_launch, started_ranks
from var_core.eval.lightning import ConditionSet, GenerationRun, ResultFileError, run_generation
from var_core.eval.metrics import MetricContext, compute_arm_metrics
from var_core.eval.activity import activity
from var_core.eval.reference import protocol_record
from var_core.eval.stats import Summary, bootstrap_ci, paired_bootstrap_ratio, paired_wilcoxon
from var_core.eval.twomodel import check_refiner_override

from .base import Arm, FamilyContext, build_arms
from .model_key import study_model_key
from .overrides import apply_overrides, check_overrides_on_model, parse_overrides
from .swaps import apply_swaps, extra_arms
from .loadwatch import LoadProbe, load_summary
from .probes import ProfilerProbe
from .results_folder import (  # noqa: F401 - the results folder's format and guarantees (LOCK_NAME ... re-exported)
    LOCK_NAME, ResultsFolderBusy, _check_record_file, _is_ddp_child, _key_changes, _load_verified, _quarantine,
    _restore_kept, _set_aside, _stale_against_baseline, baseline_identity, close_spool, open_spool, results_lock)

__all__ = ["StudyOptions", "StudyPlan", "StudyResult", "plan_study", "run_study", "resolve_model",
           "resolve_sampling", "sampling_overrides", "load_study_model", "load_prompts", "study_conditions",
           "images_root", "export_arm_images", "default_out_dir", "results_lock", "ResultsFolderBusy", "baseline_identity",
           "LOCK_NAME", "identical_to_baseline", "SUPERSEDED_DIR"]

TEXT_TO_IMAGE_FAMILIES = ("infinity", "hart")  # families conditioned on prompts (the others on class labels)
PAIRED_TESTS = ("class_prob", "class_correct", "entropy_mean")


@dataclass
class StudyOptions:
    family: str
    model: str | None = None  # None: the testbed if its weights are shipped, else official-tiny
    weights: str | None = None
    samples: int = 64
    batch_size: int = 16
    seed: int = 0
    out: str | None = None
    accelerator: str = "cpu"
    devices: int | str | list[int] = 1  # Lightning's forms: N, auto, -1, GPU indices [0, 1]
    num_nodes: int = 1  # with --strategy ddp / torchrun / SLURM (see var_core.eval.distributed)
    strategy: str = "auto"
    wandb: str = "offline"  # offline | online | disabled
    overrides: tuple[str, ...] = ()
    swaps: tuple[str, ...] = ()  # --swap KIND=NAME[:k=v,...] on every non-baseline arm (ablations.swaps)
    extra_arms: tuple[str, ...] = ()  # --extra-arm NAME=PRESET[+EDIT...]: arms added to the family (ablations.swaps)
    method: str = "nova"  # base of the 'options' family
    warmup: int = 1
    progress: bool = True
    dtype: str = "float32"  # former setting: bfloat16 = precision bf16 when precision is None
    precision: str | None = None  # var_core.engine.precision; None: the family's official mode on a GPU, CPU fp32
    arms: tuple[str, ...] | None = None  # run only these arm names (the baseline always runs)
    inception_weights: str | None = None
    clip_weights: str | None = None
    image_reward_weights: str | None = None  # ImageReward.pt or its folder (var_core.eval.image_reward)
    hps_weights: str | None = None  # HPS_v2.1_compressed.pt or its folder (var_core.eval.hps)
    lpips_backbone: str | None = None  # LPIPS backbone (torchvision features layout; var_core.eval.lpips)
    lpips_lin: str | None = None  # LPIPS v0.1 linear layers
    lpips_net: str = "alex"
    fid_protocol: str | None = None  # None: var_core.eval.inception.DEFAULT_PROTOCOL
    classifier: str | None = None  # testbed classifier weights (default: the shipped file)
    profile: bool = True
    threads: int | str | None = "auto"  # intra-op threads per process: int, "auto" (see resolve_threads), None = torch
    grid_samples: int = 8
    plots: bool = True
    timing_rounds: int = 5  # interleaved re-timing rounds per arm (0: off): latency speedup robust to load drift
    timing_batch: int = 1  # batch size of the interleaved re-timing (1: the latency regime)
    retime: bool = False  # re-measure the interleaved re-timing even when the folder's one covers these arms
    # real checkpoints, sampling and prompts (studies._model_cli: --vae-weights --text-encoder --cfg --top-k --top-p
    # --temperature --prompts --save-images); None: the model's own default
    vae_weights: str | None = None
    text_encoder: str | None = None  # Infinity: a flan-t5-xl folder or its Hugging Face cache folder
    cfg: float | None = None
    top_k: int | None = None
    top_p: float | None = None
    temperature: float | None = None
    draw: str | None = None
    prompts: str | None = None  # a prompt file (var_core.eval.prompts): text-to-image models only
    save_images: bool | str | None = None  # True: <out>/images/<arm>/...; a folder: <folder>/images/<arm>/...
    # the papers' protocols (studies._evaluation_cli.add_protocol_arguments; var_core.eval.reference)
    fid_reference: str | None = None  # .npz of mu/sigma or a folder of images: FID vs reference (fid_ref*)
    protocol: str | None = None  # a named preset (imagenet-50k), already expanded into samples / sampling
    more_smooth: bool | None = None  # HART's Gumbel smoothing (None: the model's default)
    resolution: str | None = None  # Infinity pn / HART resolution (var_core.zoo.size_options)
    aspect: float | None = None  # Infinity h_div_w
    prompts_rewritten: str | None = None  # GenEval rewritten prompts, aligned with --prompts


@dataclass
class StudyPlan:
    options: StudyOptions
    arms: list[Arm]
    model: str
    weights: str | None
    notes: list[str]
    out_dir: Path


@dataclass
class StudyResult:
    out_dir: Path
    records: list[dict]
    computed: list[str]  # arm names generated in this run
    reused: list[str]  # arm names whose records were reused
    unavailable: list[Arm]
    outputs: dict[str, Any]  # table / plots / grids / wandb paths
    seconds: float


# ----- resolution ------------------------------------------------------------------------------------------
def resolve_model(name: str | None, weights: str | None) -> tuple[str, str | None, list[str]]:
    from var_core.zoo import TESTBED_DIR

    notes = []
    if name is None:
        if weights is not None or (TESTBED_DIR / "testbed.json").is_file():
            name = "testbed"
        else:
            name = "official-tiny"
            notes.append(f"the testbed's weights are not shipped yet ({TESTBED_DIR / 'testbed.json'} is missing): "
                         f"using 'official-tiny', the tiny random VAR of the official-code fixture (its images are "
                         f"noise, so only speed and fidelity-to-baseline numbers mean something)")
    return name, weights, notes


def sampling_overrides(options) -> dict:
    """The sampling knobs ``options`` sets (``cfg``, ``top_k``, ``top_p``, ``temperature``, ``draw``; None = not
    set)."""
    return {k: getattr(options, k) for k in ("cfg", "top_k", "top_p", "temperature", "draw", "more_smooth")
            if getattr(options, k, None) is not None}


def resolve_sampling(adapter, model: str, weights: str | None, overrides: dict | None = None):
    """The model's default sampling (its adapter's, the testbed card's, else ``SamplingConfig()``) with
    ``overrides`` (``--cfg --top-k --top-p --temperature``) applied; a value out of range is a ``UserError``."""
    base = _default_sampling(adapter, model, weights)
    if not overrides:
        return base
    if "more_smooth" in overrides and not hasattr(base, "more_smooth"):
        raise UserError(f"--more-smooth / --no-more-smooth is HART's Gumbel smoothing; {model} samples without it: "
                        f"drop the option")
    try:
        return dataclasses.replace(base, **overrides)
    except ValueError as exc:
        raise UserError(f"sampling: {exc} (check --cfg / --top-k / --top-p / --temperature)") from None


def load_study_reference(options, metric_ctx: MetricContext, conditions):
    """``--fid-reference``: the :class:`~var_core.eval.reference.FIDReference` in the study's feature space, with
    the generated samples' categories (prompt categories, or the class names); None when not given."""
    if getattr(options, "fid_reference", None) is None:
        return None
    from var_core.eval.reference import load_fid_reference, study_feature_space

    space = study_feature_space(metric_ctx)
    if space is None:
        raise UserError(f"--fid-reference needs a feature network: pass --inception-weights FILE (the FID "
                        f"Inception; {metric_ctx.classifier_reason or 'no testbed classifier'})")
    reference = load_fid_reference(options.fid_reference, space)
    reference.class_names = metric_ctx.class_names
    reference.seed, reference.n_resamples = metric_ctx.seed, metric_ctx.n_resamples  # its bootstrap interval
    categories = getattr(conditions, "categories", None)
    if categories is not None and any(c is not None for c in categories):
        reference.sample_categories = tuple(categories)
    return reference


def size_options_of(options) -> dict:
    """``--resolution`` / ``--aspect`` of a study, as :func:`load_study_model` keywords (only those given)."""
    return {k: getattr(options, k) for k in ("resolution", "aspect") if getattr(options, k, None) is not None}


def load_study_model(model: str, weights: str | None, *, vae_weights: str | None = None,
                     text_encoder: str | None = None, dtype=torch.float32, device: str = "cpu", seed: int = 0,
                     resolution: str | None = None, aspect: float | None = None):
    """``var_core.zoo.load_model`` with the checkpoint paths of a study (``--weights --vae-weights
    --text-encoder``); ``--text-encoder`` on a class-conditional model is a ``UserError``."""
    from var_core.zoo import ZOO, load_model

    kwargs: dict[str, Any] = {}
    if vae_weights is not None:
        base = model.removeprefix("random:")
        if model.startswith("random:") or base in ("testbed", "testbed-small", "official-tiny",
                                                    "official-infinity-tiny"):
            raise UserError(f"--vae-weights is for the official checkpoints (var-d16 … var-d36, infinity-2b, "
                            f"infinity-8b, infinity-tiny); {model} "
                            + ("draws seeded random weights" if model.startswith("random:") else
                               "loads its own folder (--weights)") + ": drop the option")
        kwargs["vae_weights"] = vae_weights
    if text_encoder is not None:
        family = getattr(ZOO.get(model.removeprefix("random:")), "family", None)
        if family not in TEXT_TO_IMAGE_FAMILIES:
            raise UserError(f"--text-encoder is for text-to-image models (Infinity: flan-T5, HART: Qwen2); {model} "
                            f"is class-conditional: drop the option")
        kwargs["text_encoder"] = text_encoder
    if resolution is not None or aspect is not None:  # --resolution / --aspect: checked against the model's sizes
        from var_core.zoo import size_options

        kwargs.update(size_options(model, resolution, aspect))
    adapter = load_model(model, weights=weights, dtype=dtype, device=device, seed=seed, **kwargs)
    if resolution is not None or aspect is not None:
        from var_core.zoo import check_native_size

        check_native_size(model, adapter, resolution, aspect)
    return adapter


def load_prompts(path: str | None, rewritten: str | None = None):
    """The :class:`~var_core.eval.prompts.PromptSet` of ``--prompts`` (None when not given), its prompts replaced
    by ``--prompts-rewritten`` when given (:func:`var_core.eval.prompts.with_rewritten_prompts`)."""
    if path is None:
        if rewritten is not None:
            raise UserError("--prompts-rewritten replaces the prompts of --prompts (GenEval metadata): give both")
        return None
    from var_core.eval.prompts import load_prompt_set, with_rewritten_prompts

    prompt_set = load_prompt_set(path)
    return prompt_set if rewritten is None else with_rewritten_prompts(prompt_set, rewritten)


def study_conditions(adapter, samples: int, seed: int, prompt_set=None) -> ConditionSet:
    """Balanced class labels, or with a prompt set sample ``i`` on prompt ``i mod P`` (text-to-image only)."""
    if prompt_set is not None:
        if getattr(adapter, "family", None) not in TEXT_TO_IMAGE_FAMILIES:
            raise UserError(f"--prompts needs a text-to-image model (random:infinity-tiny, infinity-2b, "
                            f"hart-0.7b, ...); "
                            f"{getattr(adapter, 'model_name', 'this model')} is class-conditional: drop --prompts")
        return prompt_set.conditions(samples, seed)
    num_classes = int(getattr(getattr(adapter, "cfg", None), "num_classes", 1) or 1)
    return ConditionSet.balanced(samples, num_classes, seed)


def images_root(save_images: bool | str | None, out_dir: str | Path) -> Path | None:
    """Where ``--save-images`` puts its ``images/`` tree: the results folder, or the folder it names."""
    if save_images is None or save_images is False:
        return None
    if save_images is True or save_images == "":
        return Path(out_dir)
    return Path(save_images).expanduser()


def export_arm_images(root: Path | None, arm: str, run: GenerationRun | None, conditions: ConditionSet,
                      prompt_set=None, log: Callable[[str], None] = print) -> dict | None:
    """Write one arm's images in the evaluators' layouts (:mod:`var_core.eval.export`) when ``root`` is set."""
    if root is None:
        return None
    if run is None or run.images_u8 is None:
        log(f"    images of {arm!r}: not exported (its stored samples hold no images)")
        return None
    from var_core.eval.export import export_images

    meta = prompt_set.geneval_metadata if prompt_set is not None else None
    out = export_images(root, arm, run.images_u8, conditions, indices=run.indices, prompt_metadata=meta)
    log(f"    images: {len(run.indices)} PNGs in {out['folder']} ({', '.join(out['layouts'])})")
    return out


def _default_sampling(adapter, model: str, weights: str | None):
    from var_core.engine import SamplingConfig

    default = getattr(adapter, "default_sampling", None)
    if isinstance(default, SamplingConfig):
        return default
    if isinstance(default, dict):
        return SamplingConfig(**default)
    from var_core.zoo import is_testbed, testbed_folder

    if is_testbed(model):
        card = testbed_folder(model, weights) / "testbed.json"
        try:
            data = json.loads(card.read_text()).get("default_sampling")
            if data:
                return SamplingConfig(**{k: v for k, v in data.items()
                                         if k in {f.name for f in dataclasses.fields(SamplingConfig)}})
        except (OSError, ValueError, TypeError):
            pass
    return SamplingConfig()


def resolve_threads(setting: int | str | None) -> tuple[int | None, str]:
    """Threads per process for a study, decided once before the first arm (so every arm runs alike).

    ``"auto"``: torch's default unless the 1-minute load average says other processes already occupy cores, then
    only the free cores (at least 1). On a shared 2-core machine two OpenMP threads competing with other jobs run
    several times slower than one (each parallel region waits for a descheduled thread), which would make every
    timing meaningless. ``None`` / ``"torch"``: torch's default; an int: exactly that many.
    """
    if setting is None or setting == "torch":
        return None, f"torch default ({torch.get_num_threads()})"
    if setting == "auto":
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
        try:
            load = os.getloadavg()[0]
        except (OSError, AttributeError):
            return None, f"auto: load unknown, torch default ({torch.get_num_threads()})"
        free = cores - int(round(load))
        threads = max(1, min(torch.get_num_threads(), free))
        if threads == torch.get_num_threads():
            return None, f"auto: {cores} cores, 1-min load {load:.1f} -> torch default ({threads})"
        return threads, f"auto: {cores} cores, 1-min load {load:.1f} (other jobs) -> {threads} thread(s)"
    threads = int(setting)
    if threads < 1:
        raise ValueError(f"--threads must be >= 1, 'auto' or 'torch', got {setting!r}")
    return threads, f"explicit ({threads})"


SAMPLING_TAGS = (("cfg", "cfg"), ("top_k", "topk"), ("top_p", "topp"), ("temperature", "temp"), ("draw", "draw"))


def _zoo_family(model: str) -> str:
    from var_core.zoo import ZOO

    spec = ZOO.get(str(model).removeprefix("random:"))
    return spec.family if spec is not None else "var"


def default_out_dir(options: StudyOptions, model: str) -> Path:
    """``results/ablate/<family>[-<method>]_<model>_n<N>_seed<S>`` plus one readable part per setting that changes
    the results when it is not the default: ``_set-<hash>`` (``--set``), ``_prompts-<file stem>``, ``_cfg3_topk600
    _topp0.9_temp0.8_draw-inverse_cdf`` (each sampling knob given), ``_res-1M_aspect0.5`` (``--resolution`` /
    ``--aspect``), ``_bfloat16`` (``--dtype``) and
    ``_w-<hash>`` (``--weights`` / ``--vae-weights`` / ``--text-encoder``: a hash of their resolved paths). Two
    studies that differ in any of these never share a default folder (their records would replace each other's)."""
    tag = f"{options.family}"
    if options.family == "options":
        tag += f"-{options.method}"
    tag += f"_{rec.arm_slug(model.replace(':', '-'))}_n{options.samples}_seed{options.seed}"
    if options.overrides:
        tag += "_set-" + hashlib.sha1(" ".join(sorted(options.overrides)).encode()).hexdigest()[:8]
    edits = [f"swap {s}" for s in getattr(options, "swaps", ())] + [f"extra {e}" for e in getattr(options, "extra_arms",
                                                                                                   ())]
    if edits:  # --swap / --extra-arm (order matters for swaps: not sorted)
        tag += "_arms-" + hashlib.sha1("\n".join(edits).encode()).hexdigest()[:8]
    if getattr(options, "prompts", None):
        tag += "_prompts-" + rec.arm_slug(Path(options.prompts).stem)
    given = sampling_overrides(options)
    for name, short in SAMPLING_TAGS:
        if name in given:
            value = given[name]
            tag += f"_{short}-{value}" if isinstance(value, str) else f"_{short}{value:g}"
    size = size_options_of(options)  # --resolution / --aspect when given (another schedule, other images)
    if "resolution" in size:
        tag += f"_res-{size['resolution']}"
    if "aspect" in size:
        tag += f"_aspect{float(size['aspect']):g}"
    # where and in which precision: _bfloat16 (the former --dtype, on a CPU), else _<cpu|gpu>_<precision> unless
    # the CPU in fp32 (var_core.engine.precision.run_tag)
    device = torch.device("cuda" if resolve_accelerator(options.accelerator) == "gpu" else "cpu")
    precision = study_precision(getattr(options, "precision", None), getattr(options, "dtype", "float32"),
                                _zoo_family(model), device)
    tag += "_bfloat16" if (device.type, precision) == ("cpu", "bf16") else run_tag(device.type, precision)
    paths = [(name, getattr(options, name, None)) for name in ("weights", "vae_weights", "text_encoder")]
    paths = [f"{name}={Path(value).expanduser().resolve()}" for name, value in paths if value]
    if paths:
        tag += "_w-" + hashlib.sha1("\n".join(paths).encode()).hexdigest()[:8]
    return Path("results") / "ablate" / rec.arm_slug(tag)


def plan_study(options: StudyOptions) -> StudyPlan:
    """Arms (with overrides), model and output folder — every configuration error surfaces here."""
    if options.samples < 2:
        raise ValueError(f"--samples must be >= 2 (confidence intervals need spread), got {options.samples}")
    if options.batch_size < 1:
        raise ValueError(f"--batch-size must be >= 1, got {options.batch_size}")
    if options.wandb not in ("offline", "online", "disabled"):
        raise ValueError(f"--wandb must be offline, online or disabled, got {options.wandb!r}")
    model, weights, notes = resolve_model(options.model, options.weights)
    arms = build_arms(options.family, FamilyContext(method=options.method, model=study_model_key(model),
                                                    model_name=model))
    arms = extra_arms(arms, getattr(options, "extra_arms", ()))  # ablations.swaps: --extra-arm, then --swap
    arms = apply_swaps(arms, getattr(options, "swaps", ()))
    arms = apply_overrides(arms, parse_overrides(list(options.overrides)))
    if options.arms:
        wanted = set(options.arms)
        unknown = wanted - {a.name for a in arms}
        if unknown:
            raise ValueError(f"unknown arm(s) {sorted(unknown)}; arms of {options.family}: "
                             f"{', '.join(a.name for a in arms)}")
        arms = [a for a in arms if a.role == "baseline" or a.name in wanted]
    if options.prompts is not None:
        # a bad prompt file fails here, before any model is loaded
        load_prompts(options.prompts, options.prompts_rewritten)
        from var_core.zoo import ZOO

        if getattr(ZOO.get(model.removeprefix("random:")), "family", None) not in TEXT_TO_IMAGE_FAMILIES:
            raise UserError(f"--prompts needs a text-to-image model (random:infinity-tiny, infinity-2b, "
                            f"hart-0.7b, ...); "
                            f"{model} is class-conditional: drop --prompts")
    if sampling_overrides(options):
        from var_core.engine import SamplingConfig

        knobs = sampling_overrides(options)
        if knobs.pop("more_smooth", None) is not None:  # HART's own sampling field (var_core.eval.reference)
            from var_core.zoo import ZOO

            if getattr(ZOO.get(model.removeprefix("random:")), "family", None) != "hart":
                raise UserError(f"--more-smooth / --no-more-smooth is HART's Gumbel smoothing; {model} samples "
                                f"without it: drop the option")
        try:  # each knob's range is checked on its own: out-of-range values fail before any model is loaded
            SamplingConfig(**knobs)
        except ValueError as exc:
            raise UserError(f"sampling: {exc} (check --cfg / --top-k / --top-p / --temperature)") from None
    out_dir = Path(options.out) if options.out else default_out_dir(options, model)
    return StudyPlan(options, arms, model, weights, notes, out_dir)


# ----- one arm ---------------------------------------------------------------------------------------------
def _summaries(per_sample: dict[str, list], seed: int) -> dict[str, dict]:
    return {name: bootstrap_ci(values, seed=seed).to_dict() for name, values in per_sample.items()}


def _timing(run: GenerationRun, seed: int) -> dict:
    batches = [{"first_index": b["indices"][0] if b["indices"] else None, "size": b["size"],
                "seconds": b["seconds"], "rank": b["rank"]} for b in run.batches]
    ms_per_image = [1000 * b["seconds"] / b["size"] for b in run.batches if b["size"]]
    total_images = sum(b["size"] for b in run.batches)
    out: dict[str, Any] = {
        "batches": batches, "ms_per_image": bootstrap_ci(ms_per_image, seed=seed).to_dict(),
        "generate_seconds": sum(b["seconds"] for b in run.batches), "predict_wall_seconds": run.wall_seconds,
        "images": total_images, "warmup_batch_size": run.warmup_batch_size,
    }
    probes = [b.get("probes", {}).get("profile") for b in run.batches]
    probes = [p for p in probes if p]
    if probes:
        comp: dict[str, float] = {}
        for p in probes:
            for k, v in p.get("component_self_ms", {}).items():
                comp[k] = comp.get(k, 0.0) + v
        if comp:
            out["breakdown_ms_per_image"] = {k: v / max(total_images, 1) for k, v in
                                             sorted(comp.items(), key=lambda kv: -kv[1])}
            out["breakdown_note"] = ("self time per component (profilers.timers.ComponentTimer spans, inside the "
                                     "timed region), summed over batches and divided by the number of images")
        flops = [p.get("flops") for p in probes]
        if all(f is not None for f in flops):
            out["flops_per_image"] = sum(flops) / max(total_images, 1)
            by: dict[str, float] = {}
            for p in probes:
                for k, v in p.get("flops_by_component", {}).items():
                    by[k] = by.get(k, 0.0) + v / max(total_images, 1)
            out["flops_by_component_per_image"] = by
        else:
            errors = {p.get("flops_error") for p in probes if p.get("flops_error")}
            out["flops_error"] = "; ".join(sorted(errors)) or "no FLOPs"
        for key in ("kv_bytes_per_image", "kv_peak_bytes_per_image", "kv_alloc_bytes_per_image",
                    "kv_alloc_peak_bytes_per_image"):  # measured KV cache (ablations.probes)
            values = [p[key] for p in probes if p.get(key) is not None]
            if values:
                out[key] = max(values)
        peaks = [p.get("peak_memory_bytes") for p in probes if p.get("peak_memory_bytes") is not None]
        if peaks:
            out["peak_memory_bytes"] = max(peaks)
            out["memory_source"] = probes[0].get("memory_source")
        reserved = [p["reserved_memory_bytes"] for p in probes if p.get("reserved_memory_bytes") is not None]
        if reserved:  # CUDA: torch.cuda.max_memory_reserved over the generation (the caching allocator's hold)
            out["reserved_memory_bytes"] = max(reserved)
        notes = {p.get("note") for p in probes if p.get("note")}
        if notes:
            out["profiler_note"] = "; ".join(sorted(notes))
    else:
        out["profiler_note"] = "no profiler attached (wall-clock per batch only)"
    return out


def _kept_fraction(run: GenerationRun, adapter) -> list[float | None]:
    """Per scale: the tokens a sample kept over all blocks and branches / the dense count, averaged over samples.

    A ragged batch (samples keeping different counts) is padded to its widest row; each row counts its own kept
    tokens (the batch's ``valid_tokens``), not that padded width, so the fraction does not depend on the batch
    size. Batches are weighted by their sample count; a skipped scale counts 0. Batches recorded without
    ``valid_tokens`` (older runs) fall back to ``kept_tokens``."""
    out = []
    for s, (h, w) in enumerate(adapter.scale_hw):
        total, samples = 0.0, 0
        for b in run.batches:
            kept = b.get("valid_tokens") or b["kept_tokens"]
            size = int(b.get("size") or len(b.get("indices") or ()) or 1)
            if s >= len(kept) or b["skipped"][s]:
                samples += size
                continue
            counts = [n for block in kept[s] for n in block]
            if not counts:
                continue
            total += size * sum(counts) / (len(counts) * h * w)
            samples += size
        out.append(total / samples if samples else None)
    return out


def _arm_record(config: rec.RunConfig, arm: Arm, run: GenerationRun, metrics, adapter, plan: StudyPlan,
                base_record: dict | None, metric_signature: dict) -> dict:
    record = rec.new_record(config)
    record["changes"] = arm.changes
    record["model"].update({"family": getattr(adapter, "family", None), "image_size": getattr(adapter, "image_size",
                            None), "num_scales": getattr(adapter, "num_scales", None),
                            "num_classes": getattr(getattr(adapter, "cfg", None), "num_classes", None)})
    record["environment"] = rec.environment_info(adapter, accelerator=config.accelerator, devices=config.devices,
                                                 strategy=config.strategy, processes=run.processes,
                                                 num_nodes=config.num_nodes)
    record["timing"].update(_timing(run, plan.options.seed))
    entropy = run.entropy
    with np.errstate(all="ignore"):
        entropy_mean = np.nanmean(entropy, axis=1) if entropy.size else np.zeros(0)
    per_sample = dict(metrics.per_sample)
    per_sample["entropy_mean"] = [None if not math.isfinite(v) else float(v) for v in entropy_mean]
    record["metrics"] = {
        "index": run.indices, "label": run.labels.tolist(), "per_sample": per_sample,
        "per_scale": {"token_agreement": metrics.per_scale.get("token_agreement"),
                      "entropy": [[None if not math.isfinite(v) else float(v) for v in row] for row in entropy],
                      "kept_fraction": _kept_fraction(run, adapter)},
        "activation_scale": run.activation_scale, "set_level": metrics.set_level,
        "unavailable": metrics.unavailable, "signature": metric_signature,
        "history_first_batch": run.batches[0].get("history") if run.batches else None,
    }
    record["metrics_info"] = metrics.info  # per metric: direction, proxy, weights path + sha256, state
    record["activity"] = activity(run.batches, run.activation_scale, adapter.scale_hw,  # how often each part acted
                                  None if config.plain_loop else config.policy.to_dict())
    summary = _summaries(per_sample, plan.options.seed)
    summary.update(metrics.set_level)
    summary["ms_per_image"] = record["timing"]["ms_per_image"]
    summary.update(_absolute_costs(record["timing"]))
    if base_record is not None:
        _add_relative(record, summary, base_record, plan.options.seed)
    record["summary"] = summary
    record["status"] = "complete"
    return record


def _absolute_costs(timing: dict) -> dict:
    """GFLOPs per image and peak memory (MiB) as point summaries (analytic / measured once, no interval)."""
    out = {}
    n = timing.get("images", 0)
    if timing.get("flops_per_image") is not None:
        g = timing["flops_per_image"] / 1e9
        out["gflops_per_image"] = Summary(g, g, g, n, method="analytic").to_dict()
    if timing.get("kv_bytes_per_image") is not None:
        m = timing["kv_bytes_per_image"] / 2 ** 20
        out["kv_mb"] = Summary(m, m, m, n, method="measured (KV-cache tensors)").to_dict()
    if timing.get("kv_alloc_bytes_per_image") is not None:
        m = timing["kv_alloc_bytes_per_image"] / 2 ** 20
        out["kv_alloc_mb"] = Summary(m, m, m, n, method="measured (KV buffers' storages, last scale)").to_dict()
    if timing.get("peak_memory_bytes") is not None:
        m = timing["peak_memory_bytes"] / 2 ** 20
        out["peak_memory_mb"] = Summary(m, m, m, n, method=timing.get("memory_source", "")).to_dict()
    return out


def _add_relative(record: dict, summary: dict, base_record: dict, seed: int) -> None:
    """Speedup, FLOPs and memory ratios and paired tests against the baseline record."""
    base_t, arm_t = base_record["timing"], record["timing"]
    base_b = {(b["first_index"], b["size"]): b["seconds"] for b in base_t.get("batches", [])}
    arm_b = {(b["first_index"], b["size"]): b["seconds"] for b in arm_t.get("batches", [])}
    if base_b and set(base_b) == set(arm_b):
        keys = sorted(base_b, key=lambda k: (k[0] is None, k[0]))
        speed = paired_bootstrap_ratio([base_b[k] for k in keys], [arm_b[k] for k in keys], seed=seed)
        note = "paired by batch (same samples)"
    else:
        b, a = base_t["ms_per_image"]["mean"], arm_t["ms_per_image"]["mean"]
        value = b / a if a else math.nan
        speed = Summary(value, math.nan, math.nan, len(arm_b), method="ratio of means (batches differ)")
        note = "ratio of mean ms/image (the baseline's batches were cut differently)"
    summary["speedup"] = speed.to_dict()
    arm_t["speedup_note"] = note
    if base_t.get("flops_per_image") and arm_t.get("flops_per_image") is not None:
        ratio = arm_t["flops_per_image"] / base_t["flops_per_image"]
        summary["flops_ratio"] = Summary(ratio, ratio, ratio, arm_t.get("images", 0), method="analytic").to_dict()
    if base_t.get("kv_bytes_per_image") and arm_t.get("kv_bytes_per_image") is not None:
        ratio = arm_t["kv_bytes_per_image"] / base_t["kv_bytes_per_image"]
        summary["kv_ratio"] = Summary(ratio, ratio, ratio, arm_t.get("images", 0),
                                      method="measured (KV-cache tensors)").to_dict()
    if base_t.get("kv_alloc_bytes_per_image") and arm_t.get("kv_alloc_bytes_per_image") is not None:
        ratio = arm_t["kv_alloc_bytes_per_image"] / base_t["kv_alloc_bytes_per_image"]
        summary["kv_alloc_ratio"] = Summary(ratio, ratio, ratio, arm_t.get("images", 0),
                                            method="measured (KV buffers' storages, last scale)").to_dict()
    if base_t.get("peak_memory_bytes") and arm_t.get("peak_memory_bytes") is not None:
        ratio = arm_t["peak_memory_bytes"] / base_t["peak_memory_bytes"]
        summary["memory_ratio"] = Summary(ratio, ratio, ratio, arm_t.get("images", 0),
                                          method=arm_t.get("memory_source", "")).to_dict()
    tests = {}
    base_ps = base_record["metrics"]["per_sample"]
    arm_ps = record["metrics"]["per_sample"]
    same_samples = base_record["metrics"]["index"] == record["metrics"]["index"]
    for name in PAIRED_TESTS:
        if same_samples and name in base_ps and name in arm_ps:
            tests[name] = paired_wilcoxon(arm_ps[name], base_ps[name]).to_dict()
    record["metrics"]["wilcoxon_vs_baseline"] = tests


def _refresh_metrics(out_dir: Path, found: dict, metric_ctx: MetricContext, signature: dict,
                     base_run: GenerationRun | None, base_record: dict | None, plan: StudyPlan, log,
                     run: GenerationRun | None = None) -> dict | None:
    """``found`` with its metrics recomputed from its stored tensors (``run``, or read from its tensor file;
    None when they are missing or unreadable)."""
    is_base = found["role"] == "baseline"
    pt = rec.record_paths(out_dir, found["arm"])[1]
    if not is_base and (base_run is None or base_record is None):
        return None
    if run is None:
        if not pt.is_file():
            return None
        try:
            run = GenerationRun.load(pt)
        except ResultFileError as exc:
            _quarantine(pt, exc.reason, f"recompute arm {found['arm']!r}", log)
            return None
    reference = run if is_base else base_run
    metrics = compute_arm_metrics(run.images_u8, reference.images_u8, run.labels, run.tokens, reference.tokens,
                                  metric_ctx, is_baseline=is_base)
    record = json.loads(json.dumps(found))  # deep copy
    per_sample = dict(metrics.per_sample)
    per_sample["entropy_mean"] = found["metrics"]["per_sample"].get("entropy_mean") or []
    record["metrics"].update(per_sample=per_sample, set_level=metrics.set_level, unavailable=metrics.unavailable,
                             signature=signature)
    record["metrics_info"] = metrics.info
    record["protocol"] = protocol_record(plan.options, metric_ctx.fid_reference)  # var_core.eval.reference
    record["metrics"]["per_scale"]["token_agreement"] = metrics.per_scale.get("token_agreement")
    summary = _summaries(per_sample, plan.options.seed)
    summary.update(metrics.set_level)
    summary["ms_per_image"] = record["timing"]["ms_per_image"]
    summary.update(_absolute_costs(record["timing"]))
    if not is_base:
        _add_relative(record, summary, base_record, plan.options.seed)
    record["summary"] = summary
    record["metrics_refreshed"] = True
    rec.write_json_atomic(rec.record_paths(out_dir, found["arm"])[0], record, root=out_dir)
    log(f"{found['arm']}: metrics recomputed from the stored samples (the metric context changed)")
    return record


def _metric_signature(ctx: MetricContext) -> dict:
    return {"classifier": ctx.classifier is not None, "classifier_reason": ctx.classifier_reason,
            "real_images": None if ctx.real_images is None else int(ctx.real_images.shape[0]),
            "inception": ctx.inception_weights, "clip": ctx.clip_weights,
            "image_reward": getattr(ctx, "image_reward_weights", None), "hps": getattr(ctx, "hps_weights", None),
            "fid_protocol": ctx.fid_protocol, "lpips": [ctx.lpips_net, ctx.lpips_backbone, ctx.lpips_lin],
            "version": 3,  # 2: CLIP score per sample, ImageReward, HPSv2.1; 3: FID protocol, LPIPS
            **({"fid_reference": ctx.fid_reference.sha256} if getattr(ctx, "fid_reference", None) else {})}


# ----- the study -------------------------------------------------------------------------------------------
def _check_arms_on_model(available: list[Arm], unavailable: list[Arm], adapter, sampling, model: str,
                         log: Callable[[str], None]) -> tuple[list[Arm], list[Arm]]:
    """Ask every arm's components whether they fit this model (``Component.check_model``) before anything is
    generated; an arm that does not is reported as unavailable with the reason and the fix, and the others run.
    A per-model preset's arm gets the config resolved for this model (what runs, and what its record hashes)."""
    from var_core.accel import build_policy
    from var_core.engine.loop import generation_info
    from var_core.eval.twomodel import model_switch_for

    info = generation_info(adapter, 1, adapter.initial_guidance(sampling), sampling=sampling)
    fit, unfit = [], []
    for arm in available:
        policy = build_policy(arm.config) if arm.role != "baseline" else None
        try:
            if policy is not None and hasattr(policy, "check_model"):
                policy.check_model(info)
                arm = dataclasses.replace(arm, config=getattr(policy, "config", arm.config))
            if policy is not None:  # a second model (engine.switch) must share this model's tokenizer
                model_switch_for(arm.config, adapter)
            fit.append(arm)
        except ValueError as exc:
            unfit.append(dataclasses.replace(arm, error=f"cannot run on {model}: {exc}"))
            log(f"arm {arm.name!r} is unavailable here and is skipped: {unfit[-1].error}")
    return fit, unavailable + unfit


def run_study(options: StudyOptions, log: Callable[[str], None] = print, plan: StudyPlan | None = None
              ) -> StudyResult:
    """Run (or resume) a study in ``plan.out_dir`` while holding its lock (see :func:`results_lock`).

    An entry point that reports the folder on Ctrl-C registers ``plan_study(options).out_dir`` (the folder is
    decided there, before anything runs) and passes that plan here."""
    started = time.perf_counter()
    plan = plan or plan_study(options)
    # one decision of where generation runs (accelerator auto, devices forms, nodes, strategy, torchrun / SLURM)
    launch = resolve_launch(options.accelerator, options.devices, options.num_nodes, options.strategy)
    if not launch.is_rank_zero:  # another rank of a ddp / torchrun / SLURM launch: no lock, writes nothing
        with started_ranks(launch, log) as channel:
            return _follow_study(options, plan, launch, channel, log, started)
    # never write through a link planted in the results folder (or the --save-images tree): refuse it, naming it
    rec.refuse_links_in(plan.out_dir)
    image_root = images_root(options.save_images, plan.out_dir)
    if image_root is not None:
        rec.check_no_links(image_root / "images", image_root)
        rec.refuse_links_in(image_root / "images")
    with results_lock(plan.out_dir, log):
        with started_ranks(launch, log) as channel:
            return _run_study(options, log, plan, started, launch=launch, channel=channel)


def _follow_study(options: StudyOptions, plan: StudyPlan, launch: Launch, channel: RankChannel,
                  log: Callable[[str], None], started: float) -> StudyResult:
    """A rank other than 0: load the same model on this rank's device, then join every generation rank 0 announces
    (same policy, sampling, samples, batch size, warm-up, threads) until it says it is done. Rank 0 decides which
    arms to reuse or compute and writes everything; this rank reads and writes nothing in the results folder."""
    adapter = load_study_model(plan.model, plan.weights, vae_weights=options.vae_weights,
                               text_encoder=options.text_encoder,
                               dtype=parameter_dtype(options.precision, options.dtype),
                               device=launch.load_device, **size_options_of(options))
    adapter.precision = study_precision(options.precision, options.dtype, adapter.family, launch.device)
    joined = 0
    while True:
        message = channel.receive()
        kind = message.get("kind")
        if kind == "done":
            break
        if kind != "generate":
            raise RuntimeError(f"rank 0 stopped ({kind}); see its output. Rank {launch.rank} stops too")
        spool = tempfile.mkdtemp(prefix="varscope-spool-")  # this rank's batches; rank 0 receives them at the end
        try:
            run_generation(adapter, message["conditions"], policy_config=message["policy"],
                           sampling=message["sampling"], batch_size=message["batch_size"], warmup=message["warmup"],
                           warmup_batch_size=message.get("warmup_batch_size"),
                           probes=[ProfilerProbe(device=launch.device)] if message["profile"] else [],
                           threads=message["threads"], progress=False, launch=launch, spool=spool,
                           skip_first=message.get("skip_first") or [])
        finally:
            shutil.rmtree(spool, ignore_errors=True)
        joined += 1
    log(f"rank {launch.rank}: joined {joined} generation(s) of rank 0, which writes the results in {plan.out_dir}")
    return StudyResult(plan.out_dir, [], [], [], [], {}, time.perf_counter() - started)


@dataclass
class _Study:
    """What every step of a study shares once the model is loaded (:func:`_prepare_study`)."""

    options: StudyOptions
    plan: StudyPlan
    launch: Launch
    adapter: Any
    dtype: torch.dtype
    precision: str
    sampling: Any
    conditions: ConditionSet
    prompt_set: Any
    metric_ctx: MetricContext
    signature: dict
    available: list[Arm]
    unavailable: list[Arm]
    image_root: Path | None
    threads: int | None = None
    probes: list = dataclasses.field(default_factory=list)

    @property
    def out_dir(self) -> Path:
        return self.plan.out_dir

    @property
    def device(self):
        return self.launch.device  # this process's device: probes, the interleaved re-timing and the records

    def config_for(self, arm: Arm) -> rec.RunConfig:
        o = self.options
        return rec.RunConfig(
            arm=arm.name, family=o.family, policy=arm.config, model=self.plan.model, weights=self.plan.weights,
            sampling=self.sampling, conditions=self.conditions, batch_size=o.batch_size, warmup=o.warmup,
            role=arm.role if arm.role == "baseline" else "arm", description=arm.description,
            plain_loop=arm.role == "baseline", dtype=str(self.dtype).removeprefix("torch."),
            precision=self.precision, accelerator=self.launch.accelerator, devices=self.launch.devices,
            strategy=self.launch.strategy, num_nodes=self.launch.num_nodes, vae_weights=o.vae_weights,
            text_encoder=o.text_encoder, size=size_options_of(o) or None)  # --resolution / --aspect: reuse key


@dataclass
class _Progress:
    """The arms done so far and the baseline every later arm is measured against (its samples stay on disk)."""

    records: list[dict] = dataclasses.field(default_factory=list)
    computed: list[str] = dataclasses.field(default_factory=list)
    reused: list[str] = dataclasses.field(default_factory=list)
    base_run: GenerationRun | None = None
    base_record: dict | None = None
    base_identity: str | None = None
    # the first generation of this process warms with a full batch (allocator and kernels at the timed shapes);
    # later arms only need their own code paths run once: one sample (a full-batch warm-up was a third of an arm)
    warm_batch: int | None = None
    recompute_reason: str | None = None  # why the arm at hand is computed although a record of it existed


def _run_study(options: StudyOptions, log: Callable[[str], None], plan: StudyPlan, started: float,
               launch: Launch | None = None, channel: RankChannel | None = None) -> StudyResult:
    """The study loop: prepare, keep other configurations' records, each arm reused or computed, the interleaved
    re-timing, then the report and the manifest."""
    if launch is None:
        launch = resolve_launch(options.accelerator, options.devices, options.num_nodes, options.strategy)
    study = _prepare_study(options, plan, launch, log)
    _keep_other_configurations(study, log)
    _decide_threads(study, log)
    progress = _Progress()
    for position, arm in enumerate(study.available, 1):
        if not _reuse_arm(study, progress, arm, f"[{position}/{len(study.available)}]", log):
            _compute_arm(study, progress, arm, f"[{position}/{len(study.available)}]", channel, log)
    if channel is not None:
        channel.close()  # nothing more to generate: the other ranks are released before rank-0-only work
    interleaved, interleaved_reused = _interleaved_step(study, log)
    return _finish_study(study, progress, interleaved, interleaved_reused, started, log)


def _prepare_study(options: StudyOptions, plan: StudyPlan, launch: Launch, log: Callable[[str], None]) -> _Study:
    """Load the model, decide sampling, conditions and metrics, check every arm on the model, write the manifest
    (status running)."""
    for note in plan.notes:
        log(f"note: {note}")
    out_dir = plan.out_dir
    rec.make_dirs(out_dir / "arms", out_dir)
    available = [a for a in plan.arms if a.ok]
    unavailable = [a for a in plan.arms if not a.ok]
    for arm in unavailable:
        log(f"arm {arm.name!r} is unavailable here and is skipped: {arm.error}")
    if not any(a.role == "baseline" for a in available):
        raise RuntimeError("the baseline arm cannot be built")
    dtype = parameter_dtype(options.precision, options.dtype)
    for note in launch.notes:
        log(f"note: {note}")
    # loaded where it runs (the CPU for ddp_spawn, whose workers get a copy that Lightning moves to their device)
    adapter = load_study_model(plan.model, plan.weights, vae_weights=options.vae_weights,
                               text_encoder=options.text_encoder, dtype=dtype, device=launch.load_device,
                               **size_options_of(options))
    # generate() runs in it, records state it and it is part of every arm's reuse key (var_core.engine.precision)
    adapter.precision = precision = study_precision(options.precision, options.dtype, adapter.family, launch.device)
    sampling = resolve_sampling(adapter, plan.model, plan.weights, sampling_overrides(options))
    # a --set scale / block beyond this model is the user's mistake: an error, not a skipped or baseline-like arm
    check_overrides_on_model(available, options.overrides, adapter.num_scales, adapter.num_blocks, plan.model)
    check_refiner_override(available, options.overrides, adapter)  # --set refiner=ENTRY must share the tokenizer
    available, unavailable = _check_arms_on_model(available, unavailable, adapter, sampling, plan.model, log)
    prompt_set = load_prompts(options.prompts, options.prompts_rewritten)
    conditions = study_conditions(adapter, options.samples, options.seed, prompt_set)
    if prompt_set is not None:
        plan.notes.append(f"prompts: {len(prompt_set)} from {prompt_set.source} ({prompt_set.format}); sample i uses "
                          f"prompt i mod {len(prompt_set)}")
    metric_ctx = MetricContext.build(adapter, classifier_path=options.classifier,
                                     inception_weights=options.inception_weights,
                                     clip_weights=options.clip_weights, real_count=options.samples,
                                     seed=options.seed, image_reward_weights=options.image_reward_weights,
                                     hps_weights=options.hps_weights, prompts=conditions.prompts,
                                     lpips_backbone=options.lpips_backbone, lpips_lin=options.lpips_lin,
                                     lpips_net=options.lpips_net, fid_protocol=options.fid_protocol)
    metric_ctx.fid_reference = load_study_reference(options, metric_ctx, conditions)
    study = _Study(options, plan, launch, adapter, dtype, precision, sampling, conditions, prompt_set, metric_ctx,
                   _metric_signature(metric_ctx), available, unavailable, images_root(options.save_images, out_dir))
    log(f"study {options.family!r}: {len(available)} arms on {plan.model} ({adapter.image_size}px, "
        f"{adapter.num_scales} scales), {options.samples} samples per arm, batch {options.batch_size}, "
        f"sampling {sampling}; results in {out_dir}")
    if metric_ctx.classifier_reason:
        log(f"class accuracy / FID-proxy: n/a ({metric_ctx.classifier_reason})")
    _write_manifest(out_dir, plan, adapter, sampling, conditions, status="running")
    return study


def _keep_other_configurations(study: _Study, log: Callable[[str], None]) -> None:
    """Finished records of another configuration (other --samples, sampling, dtype, weights, --set ...) in the
    files this study is about to write are moved aside, never replaced: superseded/<tag>/ (one line says where);
    this configuration's records kept there by an earlier run come back."""
    out_dir, other, changes = study.out_dir, [], set()
    for arm in study.available:
        json_path = rec.record_paths(out_dir, arm.name)[0]
        _check_record_file(json_path, log)
        old = rec.read_record(json_path)
        new_key = rec.to_jsonable(study.config_for(arm).key())
        if old is not None and old.get("key") != new_key:
            other.append((arm.name, old))
            changes.add(_key_changes(old.get("key") or {}, new_key))
    if other:
        _set_aside(out_dir, other, "made with another configuration: " + "; ".join(sorted(changes)), log,
                   study.image_root)
    _restore_kept(out_dir, {a.name: rec.to_jsonable(study.config_for(a).key()) for a in study.available}, log,
                  study.image_root)


def _decide_threads(study: _Study, log: Callable[[str], None]) -> None:
    """Threads per process (a resumed ``auto`` study runs its missing arms like the reused ones) and the probes."""
    threads, threads_reason = resolve_threads(study.options.threads)
    if study.options.threads == "auto":  # resuming: run the missing arms like the reused ones, for comparable timings
        base_arm = next(a for a in study.available if a.role == "baseline")
        previous = rec.find_reusable(study.out_dir, study.config_for(base_arm))
        processes = (previous or {}).get("environment", {}).get("processes") or []
        if processes and processes[0].get("threads"):
            threads = int(processes[0]["threads"])
            threads_reason = f"auto: {threads}, as in the reused records of this folder"
    log(f"threads per process: {threads_reason}")
    study.plan.notes.append(f"threads per process: {threads_reason}")
    study.threads = threads
    # the load probe first: its readings enclose only the timed batch, not the profiler's reductions
    study.probes = [LoadProbe()] + ([ProfilerProbe(device=study.device)] if study.options.profile else [])


def _reuse_arm(study: _Study, progress: _Progress, arm: Arm, tag: str, log: Callable[[str], None]) -> bool:
    """Reuse the arm's finished record when its key, tensors and baseline still hold (metrics refreshed when the
    metric context changed); False when it must be computed (``progress.recompute_reason`` says why)."""
    out_dir, is_base = study.out_dir, arm.role == "baseline"
    config = study.config_for(arm)
    json_path, pt_path = rec.record_paths(out_dir, arm.name)
    _check_record_file(json_path, log)
    found = rec.find_reusable(out_dir, config, need_tensors=is_base)
    found_run, progress.recompute_reason = None, None
    if found is not None:  # its tensors must be readable (weights_only) and be those of the record
        found, found_run = _load_verified(out_dir, found, log)
        if found is None:
            progress.recompute_reason = "its tensor file could not be read or did not match it (moved to *.corrupt)"
        if is_base and found_run is None:
            found = None  # the later arms need the baseline's samples
            progress.recompute_reason = progress.recompute_reason or "the baseline's tensor file is missing"
    if found is not None and not is_base:
        assert progress.base_record is not None and progress.base_identity is not None, "the baseline runs first"
        why = _stale_against_baseline(found, progress.base_record, progress.base_identity)
        if why is not None:
            log(f"{tag} {arm.name}: recomputing the finished record: {why}")
            found, progress.recompute_reason = None, why
    if found is not None and found.get("metrics", {}).get("signature") != study.signature:
        # measured with another metric context (e.g. the classifier appeared since): recompute the metrics
        # from the stored tensors, keep the generation and its timing; regenerate if the tensors are gone
        found = _refresh_metrics(out_dir, found, study.metric_ctx, study.signature, progress.base_run,
                                 progress.base_record, study.plan, log, run=found_run)
    if found is None:
        return False
    log(f"{tag} {arm.name}: reusing the finished record "
        f"({found['summary'].get('ms_per_image', {}).get('mean', float('nan')):.1f} ms/image)")
    if found["arm"] != arm.name:  # renamed arm: keep a copy (record and tensors) under the current name
        _copy_renamed(out_dir, found["arm"], arm.name)
        found = dict(found, arm=arm.name, description=arm.description, changes=arm.changes)
        rec.write_json_atomic(json_path, found, root=out_dir)
    if is_base:
        progress.base_run, progress.base_record = found_run, found
        progress.base_identity = baseline_identity(found, found_run)
    elif "identical_to_baseline" not in found and found_run is not None:
        # a record written before this was recorded: computed from the stored samples and kept in it
        found = dict(found, identical_to_baseline=identical_to_baseline(found_run, progress.base_run))
        rec.write_json_atomic(json_path, found, root=out_dir)
    if not is_base:
        _warn_unchanged(arm.name, found.get("identical_to_baseline"), found.get("metrics", {}).get(
            "activation_scale"), study.adapter.num_scales, log)
    progress.records.append(found)
    progress.reused.append(arm.name)
    export_arm_images(study.image_root, arm.name, found_run, study.conditions, study.prompt_set, log)
    return True


def _copy_renamed(out_dir: Path, old_name: str, new_name: str) -> None:
    """A renamed arm's tensors under its current name: the index file and, beside it, its samples folder."""
    from var_core.eval.store import samples_folder

    old_pt, pt_path = rec.record_paths(out_dir, old_name)[1], rec.record_paths(out_dir, new_name)[1]
    if not old_pt.is_file() or pt_path.is_file():
        return
    old_samples = samples_folder(old_pt)
    if old_samples.is_dir() and not old_samples.is_symlink():  # an index (varscope.run/2): copy its folder too
        new_samples = samples_folder(pt_path)
        tmp = new_samples.with_name(f".{new_samples.name}.{os.getpid()}.tmp")
        shutil.rmtree(tmp, ignore_errors=True)
        shutil.copytree(old_samples, tmp, symlinks=False)
        if new_samples.exists():
            shutil.rmtree(new_samples)
        os.replace(tmp, new_samples)
        run = GenerationRun.load(old_pt)
        run.samples_dir = new_samples  # the index names the copy
        rec.write_atomic(pt_path, run.save, root=out_dir)
    else:
        rec.write_atomic(pt_path, lambda tmp: shutil.copyfile(old_pt, tmp), root=out_dir)


def _compute_arm(study: _Study, progress: _Progress, arm: Arm, tag: str, channel: RankChannel | None,
                 log: Callable[[str], None]) -> None:
    """Generate the arm batch by batch into its spool (resumed after a kill), measure it against the baseline's
    stored samples, and write its samples folder, index file and record (then its grid and exported images)."""
    options, out_dir, is_base = study.options, study.out_dir, arm.role == "baseline"
    config = study.config_for(arm)
    json_path, pt_path = rec.record_paths(out_dir, arm.name)
    log(f"{tag} {arm.name}: {arm.description}")
    t0 = time.perf_counter()
    # batches reach arms/<slug>.partial/ as they finish; a killed run resumes at the next unfinished one
    spool, skip = open_spool(out_dir, arm.name, config.key(), -(-len(study.conditions) // options.batch_size), log)
    if channel is not None:  # the other ranks join this generation
        channel.send({"kind": "generate", "arm": arm.name, "policy": None if is_base else arm.config,
                      "sampling": study.sampling, "conditions": study.conditions, "batch_size": options.batch_size,
                      "warmup": options.warmup, "warmup_batch_size": progress.warm_batch, "threads": study.threads,
                      "profile": bool(options.profile), "skip_first": skip})
    run = run_generation(study.adapter, study.conditions, policy_config=None if is_base else arm.config,
                         sampling=study.sampling, batch_size=options.batch_size, warmup=options.warmup,
                         warmup_batch_size=progress.warm_batch, launch=study.launch, probes=study.probes,
                         threads=study.threads, spool=spool, skip_first=skip,
                         progress=f"{tag} {arm.name}" if options.progress else False)
    progress.warm_batch = 1
    base_run = run if is_base else progress.base_run
    assert base_run is not None, "the baseline runs first"
    # images and tokens are read batch by batch from the two spools (the arm's and the baseline's samples)
    metrics = compute_arm_metrics(run.images_u8, base_run.images_u8, run.labels, run.tokens, base_run.tokens,
                                  study.metric_ctx, is_baseline=is_base)
    record = _arm_record(config, arm, run, metrics, study.adapter, study.plan,
                         None if is_base else progress.base_record, study.signature)
    record["protocol"] = protocol_record(options, study.metric_ctx.fid_reference)  # var_core.eval.reference
    record["timing"]["arm_wall_seconds"] = time.perf_counter() - t0
    record["tensors"] = {"file": pt_path.name, "sha256": run.content_hash()}
    used_threads = (run.processes[0].get("threads") if run.processes else None) or study.threads
    record["timing"]["load"] = load_summary(run.batches, used_threads, torch.device(study.device).type
                                            if study.device is not None else study.adapter.device.type)
    if not is_base:
        record["identical_to_baseline"] = identical_to_baseline(run, base_run)
        _warn_unchanged(arm.name, record["identical_to_baseline"], run.activation_scale, study.adapter.num_scales,
                        log)
    else:
        progress.base_identity = baseline_identity(record, run)
    record["baseline"] = {"arm": next(a.name for a in study.available if a.role == "baseline"),
                          "identity": progress.base_identity,
                          "created": record["created"] if is_base else progress.base_record["created"]}
    _write_arm(study, arm, run, record, progress.recompute_reason, log)
    if is_base:
        progress.base_run, progress.base_record = run, record
    _save_grid(out_dir, arm.name, run, base_run, options.grid_samples)
    export_arm_images(study.image_root, arm.name, run, study.conditions, study.prompt_set, log)
    progress.records.append(record)
    progress.computed.append(arm.name)
    s = record["summary"]
    log(f"    {s['ms_per_image']['mean']:.1f} ms/image"
        + (f", speedup {s['speedup']['mean']:.2f}x" if "speedup" in s else "")
        + (f", PSNR {s['psnr_mean_mse']['mean']:.2f} dB (of the mean MSE)" if "psnr_mean_mse" in s else "")
        + (f", class acc {s['class_correct']['mean']:.3f}" if "class_correct" in s else "")
        + f"  ({record['timing']['arm_wall_seconds']:.1f} s)")


def _write_arm(study: _Study, arm: Arm, run: GenerationRun, record: dict, recompute_reason: str | None,
               log: Callable[[str], None]) -> None:
    """The arm's files, in crash-safe order: an earlier finished record of it set aside, the spool renamed to
    ``arms/<slug>.samples/`` (the samples, batch files), the index file, the record last."""
    from var_core.eval.store import samples_folder

    out_dir = study.out_dir
    json_path, pt_path = rec.record_paths(out_dir, arm.name)
    old = rec.read_record(json_path)  # a finished record of this arm that is recomputed: kept, not replaced
    if old is not None:
        _set_aside(out_dir, [(arm.name, old)], "recomputed: " + (recompute_reason or "its files could not be "
                   "reused"), log, study.image_root)
    if run.samples_dir is not None:
        run.move_samples(samples_folder(pt_path))
    rec.write_atomic(pt_path, run.save, root=out_dir)
    rec.write_json_atomic(json_path, record, root=out_dir)
    close_spool(out_dir, arm.name)  # the arm's samples and record are written: its batches are done


def _interleaved_step(study: _Study, log: Callable[[str], None]) -> tuple[dict | None, bool]:
    """The interleaved re-timing: reused when the folder's covers these arms and settings, else measured."""
    options, out_dir, available = study.options, study.out_dir, study.available
    interleaved, interleaved_reused = None, False
    if options.timing_rounds > 0 and len(available) > 1:
        covers = interleaved_covers({a.name: study.config_for(a).key() for a in available}, options.timing_rounds,
                                    min(options.timing_batch, len(study.conditions)),
                                    study.threads if study.threads is not None else torch.get_num_threads(),
                                    study.device if study.device is not None else study.adapter.device,
                                    options.seed)
        previous = _read_interleaved(out_dir, log)
        why = retime_reason(previous, covers, options.retime)
        if why is None:
            interleaved, interleaved_reused = previous, True
            m = previous["measured"]
            log(f"interleaved timing: reusing the measurement {m['id']} of {m['at']} (same arms and settings; "
                f"--retime re-measures)")
        else:
            log(f"interleaved timing ({why}): {options.timing_rounds} rounds of a batch of {options.timing_batch} "
                f"per arm, arms back to back in rotating order")
            interleaved = interleaved_timing(study.adapter, available, study.conditions, study.sampling,
                                             options.timing_batch, options.timing_rounds, seed=options.seed,
                                             threads=study.threads, device=study.device)
            interleaved["covers"] = covers
            interleaved["measured"] = _measurement(why)
            if previous is not None:  # when and why the earlier measurements were taken (their numbers are gone)
                interleaved["history"] = list(previous.get("history") or []) + (
                    [previous["measured"]] if isinstance(previous.get("measured"), dict) else [])
            rec.write_json_atomic(out_dir / "timing_interleaved.json", interleaved, root=out_dir)
    elif options.retime:
        log("note: --retime has nothing to re-measure (--timing-rounds 0, or a single arm)")
    return interleaved, interleaved_reused


def _finish_study(study: _Study, progress: _Progress, interleaved: dict | None, interleaved_reused: bool,
                  started: float, log: Callable[[str], None]) -> StudyResult:
    """The family's own analysis, the report (table, plots, grids, W&B) and the manifest (status complete)."""
    from . import report
    from .base import AnalysisContext, run_analysis

    options, out_dir, available = study.options, study.out_dir, study.available
    # the family's own measurement beyond its table (criterion IoU, entropy maps, gamma curve, tau calibration)
    analysis = run_analysis(options.family, AnalysisContext(study.adapter, study.conditions, study.sampling,
                                                            out_dir, available, threads=study.threads, log=log))
    outputs = report.write_report(out_dir, progress.records, study.unavailable, plan=study.plan,
                                  adapter=study.adapter, log=log, plots=options.plots,
                                  grid_samples=options.grid_samples, wandb_mode=options.wandb,
                                  base_run=progress.base_run, interleaved=interleaved)
    if analysis:
        outputs["analysis"] = analysis
    if interleaved is not None and options.timing_rounds > 0 and len(available) > 1:
        outputs["timing_interleaved_measured"] = dict(interleaved.get("measured") or {}, reused=interleaved_reused)
    seconds = time.perf_counter() - started
    _write_manifest(out_dir, study.plan, study.adapter, study.sampling, study.conditions, status="complete",
                    records=progress.records, outputs=outputs, seconds=seconds, computed=progress.computed,
                    reused=progress.reused)
    return StudyResult(out_dir, progress.records, progress.computed, progress.reused, study.unavailable, outputs,
                       seconds)


INTERLEAVED_FILE = "timing_interleaved.json"


def interleaved_covers(arm_keys: dict[str, dict], rounds: int, batch_size: int, threads: int, device, seed: int
                       ) -> dict:
    """What an interleaved re-timing measured, as compared on resume: every arm's record key (policy config hash,
    model, weights, dtype, sampling, sample set), the rounds, the batch, the threads, the device and the bootstrap
    seed. A measurement is reused only when all of it is unchanged (:func:`retime_reason`)."""
    covers = {"arms": {name: arm_keys[name] for name in sorted(arm_keys)}, "rounds": int(rounds),
              "batch_size": int(batch_size), "threads": int(threads), "device": str(torch.device(device)),
              "seed": int(seed)}
    return json.loads(json.dumps(rec.to_jsonable(covers)))  # as stored (tuples -> lists), so it compares equal


def retime_reason(previous: dict | None, covers: dict, retime: bool = False) -> str | None:
    """Why the interleaved re-timing must be measured (again), or None when ``previous`` (the folder's
    ``timing_interleaved.json``) covers exactly these arms and settings and no re-measurement was asked for."""
    if retime:
        return "re-measured on request (--retime)"
    if previous is None:
        return "first measurement in this folder"
    old = previous.get("covers")
    if not isinstance(old, dict) or not isinstance(previous.get("measured"), dict):
        return "the folder's measurement does not say what it covered (written before that was recorded)"
    old_arms, new_arms = old.get("arms") or {}, covers["arms"]
    changes = []
    added = sorted(set(new_arms) - set(old_arms))
    removed = sorted(set(old_arms) - set(new_arms))
    changed = sorted(n for n in set(new_arms) & set(old_arms) if new_arms[n] != old_arms[n])
    for label, names in (("added", added), ("removed", removed), ("changed", changed)):
        if names:
            changes.append(f"arms {label}: {', '.join(names)}")
    for key in ("rounds", "batch_size", "threads", "device", "seed"):
        if old.get(key) != covers[key]:
            changes.append(f"{key} {old.get(key)} -> {covers[key]}")
    return "; ".join(changes) if changes else None


def _measurement(reason: str) -> dict:
    """When, where and why an interleaved re-timing was measured (its ``measured`` entry)."""
    import uuid

    return {"id": uuid.uuid4().hex[:12], "at": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="microseconds"),
            "reason": reason, "git": rec.git_info(), "host": socket.gethostname(),
            "command": " ".join(sys.argv) if sys.argv else None}


def _read_interleaved(out_dir: Path, log: Callable[[str], None]) -> dict | None:
    """The folder's interleaved re-timing, or None (missing; unreadable: moved aside and re-measured)."""
    path = Path(out_dir) / INTERLEAVED_FILE
    if not path.is_file():
        return None
    try:
        data = json.loads(path.read_text())
        if not isinstance(data, dict) or not isinstance(data.get("arms"), dict):
            raise ValueError("not an interleaved re-timing")
        return data
    except (OSError, ValueError) as exc:
        _quarantine(path, f"{type(exc).__name__}: {exc}", "re-measure the interleaved timing", log)
        return None


def interleaved_timing(adapter, arms: list[Arm], conditions: ConditionSet, sampling, batch_size: int, rounds: int,
                       *, seed: int = 0, threads: int | None = None, device: torch.device | str | None = None) -> dict:
    """Re-time one batch (the first ``batch_size`` samples) per arm, ``rounds`` times, the arms in a rotating order
    within each round. With the default batch of 1 this is the latency-regime speedup; the main runs give the
    throughput-batch one (DESIGN.md: "speedup at batch 1 and at a throughput batch").

    The per-arm Lightning runs are sequential, so a change in machine load between arms (a shared CPU) biases
    their speedups; here every round times all arms back to back, and the speedup of an arm is the paired ratio
    of the baseline's and the arm's time in the same round (bootstrap interval over rounds). Same timed region as
    the main runs (``generate()`` with the same sampling and policy; no tracer attached), after one untimed
    warm-up generation per arm at this batch size.

    ``device``: where to time (the study's device, :attr:`var_core.eval.distributed.Launch.device`); the adapter is
    moved there first, so the speedup is measured on the device the user asked for, whatever moved the model in
    between. The result names the device it ran on.
    """
    from var_core.accel.policy import build_policy
    from var_core.engine import GenerationOptions, Policy, generate
    from var_core.eval.records import attention_backend, device_name, model_dtype

    if device is not None and torch.device(device) != adapter.device:
        adapter.to(device)
    n = min(batch_size, len(conditions))
    labels = conditions.inputs(range(n), device=adapter.device)  # class labels, or the prompts of a prompt set
    seeds = conditions.seeds[:n]
    options = GenerationOptions(check_finite=adapter.device.type == "cpu")
    previous = torch.get_num_threads()
    if threads is not None:
        torch.set_num_threads(threads)
    policies = {a.name: (Policy() if a.role == "baseline" else build_policy(a.config)) for a in arms}
    from var_core.eval.twomodel import model_switch_for

    switches = {a.name: (None if a.role == "baseline" else model_switch_for(a.config, adapter)) for a in arms}

    def sync():
        if adapter.device.type == "cuda":
            torch.cuda.synchronize(adapter.device)

    times: dict[str, list[float]] = {a.name: [] for a in arms}
    try:
        for a in arms:  # warm-up at this batch size (new shapes), untimed
            generate(adapter, labels, seeds=seeds, sampling=sampling, policy=policies[a.name], options=options,
                     switch=switches[a.name])
        for r in range(rounds):
            order = arms[r % len(arms):] + arms[:r % len(arms)]
            for a in order:
                sync()
                t0 = time.perf_counter_ns()
                with torch.inference_mode():  # no autograd bookkeeping in the timed region (issue 27)
                    generate(adapter, labels, seeds=seeds, sampling=sampling, policy=policies[a.name],
                             options=options, switch=switches[a.name])
                sync()
                times[a.name].append((time.perf_counter_ns() - t0) / 1e9)
    finally:
        torch.set_num_threads(previous)
    base = next(a.name for a in arms if a.role == "baseline")
    out = {"rounds": rounds, "batch_size": n, "threads": torch.get_num_threads() if threads is None else threads,
           "timed_region": "generate() of the first batch of the sample set, no tracer; arms interleaved",
           "device": str(adapter.device), "device_name": device_name(adapter.device), "dtype": model_dtype(adapter),
           "attention_backend": attention_backend(adapter), "arms": {}}
    for a in arms:
        ms = [1000 * t / n for t in times[a.name]]
        entry = {"seconds": times[a.name], "ms_per_image": bootstrap_ci(ms, seed=seed).to_dict()}
        if a.name != base:
            entry["speedup"] = paired_bootstrap_ratio(times[base], times[a.name], seed=seed).to_dict()
        out["arms"][a.name] = entry
    return out


def identical_to_baseline(run: GenerationRun | None, base_run: GenerationRun | None) -> dict | None:
    """Whether an arm changed anything: per sample (paired by sample index), are all its tokens at every scale and
    its image equal to the baseline's? ``identical`` is True only when every token and every image of every sample
    is; None when it cannot be told (no baseline samples, other sample indices, tokens not kept)."""
    if run is None or base_run is None or list(run.indices) != list(base_run.indices):
        return None
    n = len(run.indices)
    tokens_equal = 0
    for mine, theirs in zip(run.tokens, base_run.tokens):
        if any(t is None for t in mine) or any(t is None for t in theirs):
            return None  # tokens were not kept: equality unknown
        tokens_equal += int(len(mine) == len(theirs) and all(a.shape == b.shape and torch.equal(a, b)
                                                              for a, b in zip(mine, theirs)))
    images_equal = None
    if run.images_u8 is not None and base_run.images_u8 is not None:
        images_equal = sum(int(torch.equal(a, b)) for a, b in zip(run.images_u8, base_run.images_u8))
    same = tokens_equal == n and (images_equal is None or images_equal == n)
    return {"identical": bool(same), "samples": n, "tokens_equal": tokens_equal, "images_equal": images_equal}


def _never_activated(activation_scale, num_scales: int | None) -> bool:
    """Every sample's activation scale says "never" (``num_scales`` or more); False when any is unknown (None)."""
    if not activation_scale or num_scales is None:
        return False
    return all(a is not None and a >= num_scales for a in activation_scale)


def _warn_unchanged(name: str, identical: dict | None, activation_scale, num_scales: int | None,
                    log: Callable[[str], None]) -> None:
    """One warning line when an arm is identical to the baseline or its method never activated."""
    never = _never_activated(activation_scale, num_scales)
    why = (f"its method never activated on any of the {len(activation_scale)} samples (on this model's "
           f"{num_scales} scales)") if never else ""
    if identical and identical.get("identical"):
        log(f"warning: arm {name!r} is identical to the baseline (every token and image of all {identical['samples']} "
            f"samples): {why or 'it changed nothing here'}; its speedup can only be noise")
    elif never:
        log(f"warning: arm {name!r}: {why}; it computes what the baseline computes")


def _save_grid(out_dir: Path, name: str, run: GenerationRun, base_run: GenerationRun, k: int) -> None:
    """The arm's grid: the baseline's row and the arm's (same seeds), each labelled in the image."""
    from .grids import save_labelled_grid

    if run.images_u8 is None or base_run.images_u8 is None:
        return
    k = min(k, len(run))
    first = lambda r: r.images_u8[:k].float() / 255.0  # noqa: E731 - the first k only, not a float copy of all
    images = first(run) if run is base_run else torch.cat([first(base_run), first(run)])
    labels = [name] if run is base_run else ["baseline", name]
    upscale = max(1, 128 // run.images_u8.shape[-1])
    save_labelled_grid(images, out_dir / "grids" / f"{rec.arm_slug(name)}.png", nrow=k, upscale=upscale,
                       row_labels=labels, root=out_dir)


def _write_manifest(out_dir: Path, plan: StudyPlan, adapter, sampling, conditions, *, status: str,
                    records: list[dict] | None = None, outputs: dict | None = None, seconds: float | None = None,
                    computed=None, reused=None) -> None:
    options = dataclasses.asdict(plan.options)
    manifest = {
        "schema": "varscope.study/1", "status": status, "family": plan.options.family, "options": options,
        "model": {"name": plan.model, "weights": plan.weights, "image_size": getattr(adapter, "image_size", None),
                  "num_scales": getattr(adapter, "num_scales", None), "family": getattr(adapter, "family", None)},
        "notes": plan.notes,
        "sampling": {"cfg": sampling.cfg, "top_k": sampling.top_k, "top_p": sampling.top_p,
                     "temperature": sampling.temperature},
        "samples": {"n": len(conditions), "base_seed": conditions.base_seed, "hash": conditions.content_hash()},
        "arms": [{"name": a.name, "role": a.role, "config_hash": a.config_hash, "changes": a.changes,
                  "description": a.description, "error": a.error,
                  "record": str(rec.record_paths(out_dir, a.name)[0].relative_to(out_dir)) if a.ok else None}
                 for a in plan.arms],
        "command": " ".join(sys.argv) if sys.argv else None,
        "outputs": outputs or {}, "seconds": seconds, "computed": computed, "reused": reused,
    }
    if conditions.prompts is not None:  # the prompt of every sample (with its tag / category), as the records have it
        manifest["samples"].update({k: v for k, v in conditions.to_dict().items()
                                    if k in ("prompts", "tags", "categories", "prompt_ids")},
                                   prompt_file=plan.options.prompts)
    rec.write_json_atomic(out_dir / "study.json", manifest, root=out_dir)
