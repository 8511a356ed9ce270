"""One policy → generation → metrics vs the cached baseline → a self-describing record (the sweeps' evaluator).

A thin adapter over the public evaluation pieces: :func:`var_core.eval.lightning.run_generation` (Lightning,
per-sample seeds, per-batch timing), :class:`ablations.probes.ProfilerProbe` (analytic FLOPs incl. logit-lens heads,
component timers), :func:`var_core.eval.metrics.compute_arm_metrics` (PSNR / SSIM / MS-SSIM / token agreement vs the
baseline, class accuracy and FID-proxy with the testbed classifier), :mod:`var_core.eval.stats` (bootstrap CIs) and
:mod:`var_core.eval.records` (``varscope.arm/1`` records written atomically, ``find_reusable`` for resume). The
ablation runner (``ablations/runner.py``) has no public "evaluate one arm against a baseline" function, so the
per-arm record assembly lives here; model and sampling resolution reuse the runner's public helpers.

The baseline (the bare engine loop, ``plain_loop=True``) is generated once per output folder and cached there
(``arms/baseline.json`` + ``arms/baseline.pt``); every later evaluation — in this process, in a worker process, or
after a resume — reuses it when model, weights, sampling, samples, batch size and metric context match.

Timing on a shared machine: with ``paired_timing`` (the default) every arm is preceded by a fresh, timed run of the
baseline on the same samples, and ``speedup`` / ``latency_ratio`` pair each arm batch with that run's same batch —
both see the same machine load, seconds apart (MEASURED here: a baseline timed once at the start of a study drifted by
2–3x against arms timed minutes later on the shared 2-core CPU). It doubles the generation time; ``paired_timing=False``
pairs with the cached baseline's timing instead. ``timing_repeats=k`` interleaves k (baseline, arm) pairs and keeps
each batch's minimum time (contention only adds time; the outputs of the repeats must be identical). FLOPs are
analytic and need no pairing.

Summary keys of a record (each a ``Summary`` dict: mean, low, high, n, level, method):
``flops_ratio`` (arm FLOPs / baseline FLOPs, paired over batches), ``latency_ratio`` (arm / baseline generate()
seconds, paired over batches), ``speedup`` (its inverse), ``ms_per_image``, ``psnr`` / ``ssim`` / ``ms_ssim`` /
``token_agreement`` (vs the baseline, per sample), ``class_acc`` (% top-1 of the testbed classifier),
``class_acc_delta`` (arm − baseline, points, paired per sample), ``fid_proxy`` / ``kid_proxy`` / ``is_proxy``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterable

import torch

from var_core.eval import records as rec
from var_core.eval.distributed import resolve_launch
from var_core.eval.lightning import ConditionSet, GenerationRun, run_generation
from var_core.eval.metrics import MetricContext, compute_arm_metrics
from var_core.eval.stats import Summary, bootstrap_ci, paired_bootstrap_ratio

__all__ = ["METRICS", "EvalSettings", "SweepEvaluator", "knob_reads", "metric_value", "MetricSpec"]


@dataclass(frozen=True)
class MetricSpec:
    name: str
    direction: str  # "minimize" | "maximize"
    label: str
    kind: str  # "cost" | "quality"
    needs_classifier: bool = False


METRICS: dict[str, MetricSpec] = {m.name: m for m in (
    MetricSpec("flops_ratio", "minimize", "FLOPs ratio (arm / baseline)", "cost"),
    MetricSpec("latency_ratio", "minimize", "latency ratio (arm / baseline)", "cost"),
    MetricSpec("speedup", "maximize", "speedup (baseline / arm latency)", "cost"),
    MetricSpec("ms_per_image", "minimize", "ms per image", "cost"),
    MetricSpec("psnr", "maximize", "PSNR vs baseline (dB)", "quality"),
    MetricSpec("ssim", "maximize", "SSIM vs baseline", "quality"),
    MetricSpec("ms_ssim", "maximize", "MS-SSIM vs baseline", "quality"),
    MetricSpec("token_agreement", "maximize", "token agreement with baseline", "quality"),
    MetricSpec("class_acc", "maximize", "class accuracy (%)", "quality", needs_classifier=True),
    MetricSpec("class_acc_delta", "maximize", "class accuracy − baseline (points)", "quality",
               needs_classifier=True),
    MetricSpec("fid_proxy", "minimize", "FID-proxy vs baseline", "quality", needs_classifier=True),
    MetricSpec("kid_proxy", "minimize", "KID-proxy vs baseline", "quality", needs_classifier=True),
)}


def metric_value(record_or_summary: dict, name: str) -> float:
    """The mean of one summary metric (NaN when absent)."""
    summary = record_or_summary.get("summary", record_or_summary)
    entry = summary.get(name)
    if not entry or entry.get("mean") is None:
        return math.nan
    return float(entry["mean"])


@dataclass(frozen=True)
class EvalSettings:
    """What every evaluation of a sweep shares (the baseline is keyed on all of it)."""

    model: str | None = None  # None: testbed when its weights are shipped, else official-tiny
    weights: str | None = None
    samples: int = 32
    batch_size: int = 8
    seed: int = 0
    warmup: int = 1
    classifier: str | None = None
    dtype: str = "float32"  # former setting: bfloat16 = precision bf16 when precision is None
    accelerator: str = "auto"  # auto (a CUDA GPU when torch sees one, else the CPU), cpu, gpu
    devices: Any = 1  # one process per evaluation: 1 or a GPU index list ([1] = cuda:1)
    precision: str | None = None  # var_core.engine.precision; None: the family's official mode on a GPU, fp32 on CPU
    threads: int | None = None  # torch intra-op threads of this process (None: leave as is)
    profile: bool = True  # ProfilerProbe: analytic FLOPs (incl. logit lens), component timers, memory
    paired_timing: bool = True  # re-time the baseline right before every arm (shared / loaded machines)
    timing_repeats: int = 1  # timed repetitions of (baseline, arm); each batch's time is the minimum over them
    # real checkpoints, sampling and prompts (studies._model_cli); None: the model's own default
    vae_weights: str | None = None
    text_encoder: str | None = None
    cfg: float | None = None
    top_k: int | None = None
    top_p: float | None = None
    temperature: float | None = None
    draw: str | None = None
    prompts: str | None = None  # a prompt file (var_core.eval.prompts): text-to-image models only
    save_images: bool | str | None = None  # True: <out>/images/<arm>/...; a folder: <folder>/images/<arm>/...
    fid_reference: str | None = None  # --fid-reference NPZ|DIR: FID vs reference statistics (fid_ref*), as ablate

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


def settings_precision(settings: EvalSettings, model: str, device) -> str:
    """The precision an evaluation of ``settings`` runs ``model`` in on ``device``: ``precision``, else the former
    ``dtype`` (bfloat16 = bf16), else the family's official mode on a GPU and fp32 on a CPU."""
    from var_core.engine.precision import precision_from_dtype, resolved_precision
    from var_core.zoo import ZOO

    spec = ZOO.get(str(model).removeprefix("random:"))
    given = settings.precision or precision_from_dtype(None if settings.dtype == "float32" else settings.dtype)
    return resolved_precision(given, spec.family if spec else "var", device)


def launch_tag(settings: EvalSettings, model: str) -> str:
    """The part of a default results folder that names the device and precision (empty on a CPU in fp32):
    :func:`var_core.engine.precision.run_tag`."""
    from var_core.engine.precision import run_tag

    launch = resolve_launch(settings.accelerator, settings.devices, 1, "auto", external=False)
    return run_tag(launch.device.type, settings_precision(settings, model, launch.device))


class _ReadRecorder:
    """Stands in for a component config and records which of its fields are read."""

    def __init__(self, config, prefix: str, reads: set[str]):
        object.__setattr__(self, "_config", config)
        object.__setattr__(self, "_prefix", prefix)
        object.__setattr__(self, "_reads", reads)

    def __getattr__(self, name: str):
        value = getattr(self._config, name)
        if not name.startswith("_") and not callable(value):
            self._reads.add(f"{self._prefix}{name}")
        return value


def knob_reads(adapter, policy, samples: int = 2, seed: int = 0, sampling=None) -> set[str]:
    """Dotted paths of the knobs the policy's components read during one small generation.

    A knob the base policy never reads (e.g. ``lhep.fft_radius`` with the Haar extractor, or any knob of a method
    that never activates on this model) would be "tuned" without effect; sweeps warn about such fields.
    """
    from var_core.accel.policy import AccelPolicy
    from var_core.engine import SamplingConfig, generate

    reads: set[str] = set()
    built = AccelPolicy(policy)
    for kind, part in built.parts.items():
        part.config = _ReadRecorder(part.config, f"{kind}.", reads)
    built.config = _ReadRecorder(policy, "", reads)
    num_classes = int(getattr(getattr(adapter, "cfg", None), "num_classes", 1) or 1)
    labels = (torch.arange(samples) % num_classes).to(getattr(adapter, "device", "cpu"))
    with torch.inference_mode():
        generate(adapter, labels, seeds=[seed * 1000 + i for i in range(samples)], policy=built,
                 sampling=sampling or SamplingConfig())
    return reads


class SweepEvaluator:
    """Loads the model once; evaluates policies against the (cached) baseline of ``out_dir``."""

    def __init__(self, settings: EvalSettings, out_dir: str | Path, log: Callable[[str], None] = print,
                 family: str = "sweep"):
        from ablations.runner import (images_root, load_prompts, load_study_model, load_study_reference,
                                      resolve_model, resolve_sampling, sampling_overrides, study_conditions)

        if settings.samples < 2:
            raise ValueError(f"need at least 2 samples (confidence intervals need spread), got {settings.samples}")
        if settings.threads:
            torch.set_num_threads(int(settings.threads))
        self.settings = settings
        self.out_dir = Path(out_dir)
        self.log = log
        self.family = family
        self.model, self.weights, self.notes = resolve_model(settings.model, settings.weights)
        # the same decision as the ablation runner (var_core.eval.distributed): auto = a CUDA GPU when present;
        # one process per evaluation (sweep workers are separate processes, never ranks of one group)
        self.launch = resolve_launch(settings.accelerator, settings.devices, 1, "auto", external=False)
        if self.launch.world_size != 1:
            raise ValueError(f"a sweep evaluates in one process: --devices {settings.devices} asks for "
                             f"{self.launch.world_size}; give one GPU index (e.g. --devices 1,) or start --workers")
        from var_core.engine.precision import parse_precision

        self.precision = settings_precision(settings, self.model, self.launch.device)
        self.param_dtype = parse_precision(self.precision).param_dtype
        self.adapter = load_study_model(self.model, self.weights, vae_weights=settings.vae_weights,
                                        text_encoder=settings.text_encoder, dtype=getattr(torch, self.param_dtype),
                                        device=self.launch.load_device)
        self.adapter.precision = self.precision  # generate() runs in it (var_core.engine.precision)
        self.sampling = resolve_sampling(self.adapter, self.model, self.weights, sampling_overrides(settings))
        self.prompt_set = load_prompts(settings.prompts)
        self.conditions: ConditionSet = study_conditions(self.adapter, settings.samples, settings.seed,
                                                         self.prompt_set)
        self.image_root = images_root(settings.save_images, self.out_dir)
        self.metric_ctx = MetricContext.build(self.adapter, classifier_path=settings.classifier, seed=settings.seed)
        # --fid-reference: the papers' FID vs reference statistics in every record, with its interval
        self.metric_ctx.fid_reference = load_study_reference(settings, self.metric_ctx, self.conditions)
        self.signature = {"classifier": self.metric_ctx.classifier is not None,
                          "classifier_reason": self.metric_ctx.classifier_reason, "batch_size": settings.batch_size,
                          "warmup": settings.warmup, "profile": settings.profile,
                          "paired_timing": settings.paired_timing, "timing_repeats": settings.timing_repeats,
                          "evaluator": "sweeps/1",
                          **({"fid_reference": self.metric_ctx.fid_reference.sha256}
                             if self.metric_ctx.fid_reference is not None else {})}
        self._base_run: GenerationRun | None = None
        self._base_record: dict | None = None

    # ----- description ------------------------------------------------------------------------------------
    def available(self, metric: str) -> str | None:
        """``None`` if ``metric`` can be measured here, else the reason it cannot."""
        if metric not in METRICS:
            return f"unknown metric {metric!r}; metrics: {', '.join(METRICS)}"
        spec = METRICS[metric]
        if spec.needs_classifier and self.metric_ctx.classifier is None:
            return self.metric_ctx.classifier_reason or "the testbed classifier is not available"
        if metric in ("ssim", "ms_ssim"):
            side = int(getattr(self.adapter, "image_size", 0) or 0)
            if metric == "ms_ssim" and side <= 24 or metric == "ssim" and side < 7:
                return f"images of {side} px are too small for {metric}"
        if metric in ("flops_ratio",) and not self.settings.profile:
            return "FLOPs need the profiler probe (profile=True)"
        return None

    def describe(self) -> dict:
        a = self.adapter
        return {"model": self.model, "weights": self.weights, "notes": self.notes,
                "image_size": getattr(a, "image_size", None), "num_scales": getattr(a, "num_scales", None),
                "sampling": {"cfg": self.sampling.cfg, "top_k": self.sampling.top_k, "top_p": self.sampling.top_p,
                             "temperature": self.sampling.temperature, "draw": self.sampling.draw},
                "samples": {"n": len(self.conditions), "base_seed": self.conditions.base_seed,
                            "hash": self.conditions.content_hash()},
                "settings": self.settings.to_dict(), "metric_context": self.signature,
                "device": str(self.launch.device), "precision": self.precision,
                "threads": torch.get_num_threads()}

    def run_config(self, name: str, policy, *, baseline: bool = False, description: str = "") -> rec.RunConfig:
        return rec.RunConfig(arm=name, family=self.family, policy=policy, model=self.model, weights=self.weights,
                             sampling=self.sampling, conditions=self.conditions, batch_size=self.settings.batch_size,
                             warmup=self.settings.warmup, role="baseline" if baseline else "arm",
                             description=description, plain_loop=baseline, dtype=self.param_dtype,
                             accelerator=self.launch.accelerator, devices=self.launch.devices,
                             precision=self.precision)

    def _probes(self) -> list:
        if not self.settings.profile:
            return []
        from ablations.probes import ProfilerProbe

        return [ProfilerProbe(device=self.launch.device)]

    # ----- the baseline -----------------------------------------------------------------------------------
    def baseline(self) -> dict:
        """The baseline record (generated once per output folder, then reused)."""
        if self._base_record is not None:
            return self._base_record
        from var_core.accel.presets import get_preset

        config = self.run_config("baseline", get_preset("baseline"), baseline=True,
                                 description="the plain model (bare engine loop): reference of every metric")
        found = rec.find_reusable(self.out_dir, config, need_tensors=True)
        if found is not None and found.get("metrics", {}).get("signature") == self.signature:
            _, pt = rec.record_paths(self.out_dir, found["arm"])
            self._base_run = GenerationRun.load(pt)
            self._base_record = found
            self.log(f"baseline: reusing {rec.record_paths(self.out_dir, found['arm'])[0]} "
                     f"({metric_value(found, 'ms_per_image'):.1f} ms/image)")
            return found
        self.log(f"baseline: generating {len(self.conditions)} samples on {self.model} "
                 f"(batch {self.settings.batch_size}) ...")
        run = _min_timing([self._generate(None) for _ in range(max(1, self.settings.timing_repeats))])
        metrics = compute_arm_metrics(run.images, run.images, run.labels, run.tokens, run.tokens, self.metric_ctx,
                                      is_baseline=True)
        record = self._record(config, run, metrics, None)
        json_path, pt_path = rec.record_paths(self.out_dir, "baseline")
        run.save(pt_path)
        rec.write_json_atomic(json_path, record)
        self._export(config.arm, run)
        self._base_run, self._base_record = run, record
        self.log(f"baseline: {metric_value(record, 'ms_per_image'):.1f} ms/image")
        return record

    # ----- one arm ----------------------------------------------------------------------------------------
    def evaluate(self, name: str, policy, *, description: str = "", reuse: bool = True,
                 extra: dict | None = None) -> dict:
        """The record of ``policy`` (reused from ``out_dir`` if an identical evaluation exists). A per-model
        preset's config is resolved for this model first: the record hashes what runs."""
        from var_core.accel.presets import resolve_config
        from var_core.engine.loop import generation_info

        policy = resolve_config(policy, generation_info(self.adapter, 1, self.adapter.initial_guidance(self.sampling)))
        base = self.baseline()
        config = self.run_config(name, policy, description=description)
        json_path, _ = rec.record_paths(self.out_dir, name)
        if reuse:
            found = rec.find_reusable(self.out_dir, config)
            if found is not None and found.get("metrics", {}).get("signature") == self.signature:
                if found["arm"] != name:
                    found = dict(found, arm=name, reused_from=found["arm"])
                    if extra:
                        found.update(extra)
                    rec.write_json_atomic(json_path, found)
                return found
        t0 = time.perf_counter()
        references, runs = [], []
        for _ in range(max(1, self.settings.timing_repeats)):  # interleaved: baseline, arm, baseline, arm, ...
            if self.settings.paired_timing:
                references.append(self._generate(None))
            runs.append(self._generate(policy))
        run = _min_timing(runs)
        reference = _min_timing(references) if references else None
        metrics = compute_arm_metrics(run.images, self._base_run.images, run.labels, run.tokens,
                                      self._base_run.tokens, self.metric_ctx, is_baseline=False)
        record = self._record(config, run, metrics, base, reference)
        record["timing"]["arm_wall_seconds"] = time.perf_counter() - t0
        if extra:
            record.update(extra)
        rec.write_json_atomic(json_path, record)
        self._export(name, run)
        return record

    def _export(self, name: str, run: GenerationRun) -> None:
        """``--save-images``: the arm's images in the evaluators' layouts (var_core.eval.export)."""
        from ablations.runner import export_arm_images

        export_arm_images(self.image_root, name, run, self.conditions, self.prompt_set, self.log)

    def _generate(self, policy) -> GenerationRun:
        return run_generation(self.adapter, self.conditions, policy_config=policy, sampling=self.sampling,
                              batch_size=self.settings.batch_size, warmup=self.settings.warmup,
                              probes=self._probes(), progress=False, launch=self.launch)

    def _record(self, config: rec.RunConfig, run: GenerationRun, metrics, base: dict | None,
                reference: GenerationRun | None = None) -> dict:
        seed = self.settings.seed
        record = rec.new_record(config)
        record["environment"] = rec.environment_info(self.adapter, accelerator=self.launch.accelerator,
                                                     devices=self.launch.devices, strategy=self.launch.strategy,
                                                     processes=run.processes)
        batches = []
        for b in run.batches:
            probe = (b.get("probes") or {}).get("profile") or {}
            batches.append({"first_index": b["indices"][0] if b["indices"] else None, "size": b["size"],
                            "seconds": b["seconds"], "seconds_repeats": b.get("seconds_repeats"),
                            "flops": probe.get("flops"), "peak_memory_bytes": probe.get("peak_memory_bytes")})
        record["timing"].update({
            "batches": batches, "generate_seconds": sum(b["seconds"] for b in batches),
            "predict_wall_seconds": run.wall_seconds, "images": sum(b["size"] for b in batches),
            "threads": torch.get_num_threads(),
        })
        if reference is not None:
            record["timing"]["reference_batches"] = [
                {"first_index": b["indices"][0] if b["indices"] else None, "size": b["size"], "seconds": b["seconds"],
                 "seconds_repeats": b.get("seconds_repeats")} for b in reference.batches]
            same = (reference.images_u8 is not None and self._base_run is not None
                    and torch.equal(reference.images_u8, self._base_run.images_u8))
            record["timing"]["reference_note"] = (
                "speedup / latency_ratio pair each arm batch with the same batch of a baseline (bare loop) run "
                "generated immediately before the arm, so both see the same machine load; that run reproduced the "
                "cached baseline's images: " + str(bool(same)))
        per_sample = dict(metrics.per_sample)
        record["metrics"] = {"index": run.indices, "label": run.labels.tolist(), "per_sample": per_sample,
                             "set_level": metrics.set_level, "unavailable": metrics.unavailable,
                             "signature": self.signature, "activation_scale": run.activation_scale,
                             "kept_tokens_first_batch": run.batches[0]["kept_tokens"] if run.batches else None}
        summary: dict[str, Any] = {}
        for key, values in per_sample.items():
            summary[key] = bootstrap_ci(values, seed=seed).to_dict()
        if "class_correct" in per_sample:
            summary["class_acc"] = bootstrap_ci([None if v is None else 100.0 * v for v in
                                                 per_sample["class_correct"]], seed=seed).to_dict()
        summary.update(metrics.set_level)
        ms = [1000 * b["seconds"] / b["size"] for b in batches if b["size"]]
        summary["ms_per_image"] = bootstrap_ci(ms, seed=seed).to_dict()
        if base is not None:
            self._relative(summary, record, base)
        else:
            one = Summary(1.0, 1.0, 1.0, len(batches), method="reference").to_dict()
            summary.update(speedup=one, latency_ratio=one, flops_ratio=one)
            if "class_acc" in summary:
                summary["class_acc_delta"] = Summary(0.0, 0.0, 0.0, len(run.indices), method="reference").to_dict()
        record["summary"] = summary
        record["status"] = "complete"
        return record

    def _relative(self, summary: dict, record: dict, base: dict) -> None:
        seed = self.settings.seed
        base_b = {(b["first_index"], b["size"]): b for b in base["timing"]["batches"]}
        arm_b = {(b["first_index"], b["size"]): b for b in record["timing"]["batches"]}
        if set(base_b) != set(arm_b):
            raise RuntimeError("the baseline's batches differ from the arm's (batch size changed?)")
        keys = sorted(base_b, key=lambda k: k[0])
        timed = base_b
        if record["timing"].get("reference_batches"):
            timed = {(b["first_index"], b["size"]): b for b in record["timing"]["reference_batches"]}
        bs, ar = [timed[k]["seconds"] for k in keys], [arm_b[k]["seconds"] for k in keys]
        summary["speedup"] = paired_bootstrap_ratio(bs, ar, seed=seed).to_dict()
        summary["latency_ratio"] = paired_bootstrap_ratio(ar, bs, seed=seed).to_dict()
        bf, af = [base_b[k]["flops"] for k in keys], [arm_b[k]["flops"] for k in keys]
        if all(v is not None for v in bf + af):
            summary["flops_ratio"] = paired_bootstrap_ratio(af, bf, seed=seed).to_dict()
        base_cc = base["metrics"]["per_sample"].get("class_correct")
        arm_cc = record["metrics"]["per_sample"].get("class_correct")
        if base_cc is not None and arm_cc is not None and base["metrics"]["index"] == record["metrics"]["index"]:
            diff = [None if (a is None or b is None) else 100.0 * (a - b) for a, b in zip(arm_cc, base_cc)]
            summary["class_acc_delta"] = bootstrap_ci(diff, seed=seed).to_dict()

    # ----- diagnostics ------------------------------------------------------------------------------------
    def unread_fields(self, policy, paths: Iterable[str]) -> list[str]:
        """Those of ``paths`` that the policy's components did not read in a 2-sample probe generation."""
        reads = knob_reads(self.adapter, policy, samples=2, seed=self.settings.seed, sampling=self.sampling)
        return [p for p in paths if p not in reads]


def _min_timing(runs: list[GenerationRun]) -> GenerationRun:
    """The first run with each batch's seconds replaced by the minimum over the repeats (noise on a shared machine
    only adds time); the repeats' outputs must be identical (same seeds)."""
    first = runs[0]
    if len(runs) == 1:
        return first
    for other in runs[1:]:
        if first.images_u8 is not None and not torch.equal(first.images_u8, other.images_u8):
            raise RuntimeError("a repeated generation differs from the first (non-deterministic policy?)")
    batches = []
    for i, b in enumerate(first.batches):
        seconds = [r.batches[i]["seconds"] for r in runs]
        batches.append(dict(b, seconds=min(seconds), seconds_repeats=seconds))
    return dataclasses.replace(first, batches=batches)


@contextlib.contextmanager
def torch_threads(n: int | None):
    """Temporarily set torch's intra-op thread count."""
    if not n:
        yield
        return
    old = torch.get_num_threads()
    torch.set_num_threads(int(n))
    try:
        yield
    finally:
        torch.set_num_threads(old)
