"""The latency report of ``python -m studies.latency`` (and ``studies.gpucheck``): timing protocol, summary rows,
per-scale tables, the breakdown of one scale, the markdown report and its files.

:func:`report_latency` takes a :class:`LatencySettings` and a loaded model (``studies.latency.run_latency`` loads it:
this layer does not import ``ablations``) and writes ``report.md``, ``summary.csv``, ``repeats.csv``,
``per_scale.csv``, ``report.json``, the figures (:mod:`profilers.latency_plots`,
:func:`profilers.breakdown.write_breakdown`) and, with ``profile``, a torch.profiler trace.
:func:`arch_flops_table` is the arch-only FLOPs table of ``--arch-flops`` (nothing loaded or run).

Measurement protocol (DESIGN.md "Measure honestly"): ``--warmup`` generations per method and batch size discarded;
then ``--repeats`` rounds, each running every method once in a seeded shuffled order (machine noise hits all
methods alike); medians with the interquartile range and min–max over the rounds; speedups are ratios of medians,
and the per-round paired ratios give their spread. Each round runs every method twice: the latency (``total_ms``)
is ``time.perf_counter`` around a plain ``generate()`` call with no tracer attached, synchronised on the timed
device (``torch.cuda.synchronize(device)``) before and after; the breakdown comes from a second, instrumented
call (``instrumented_total_ms``) in which a :class:`~profilers.timers.ComponentTimer` (CUDA events on GPU, no
synchronisation inside the loop; measured overhead below 1 %, docs/benchmarks.md) separates **text encoding**
(Infinity's ``text_encode`` span) and **VQ decode** (``vq_decode``) from the **transformer** (= instrumented total −
text encoding − VQ decode: the text projections,
the scale loop, sampling, the latent updates and the policy's own work). FLOPs (analytic, following the kept
tokens) and memory come from one extra untimed generation per method and batch size with the same seeds: CUDA
``max_memory_allocated`` per scale and over the whole generation (``max_memory_reserved`` too) on GPU, the analytic estimate of ``profilers.memory`` on CPU (the report says
which).
"""

from __future__ import annotations

import dataclasses
import json
import os
import platform
import random
import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from profilers.latency_plots import plot_methods_latency, plot_methods_memory, plot_methods_per_scale
from var_core.errors import UserError

# entropy work: the components' scoring spans (profilers.benchmarks.SCORING_SPANS) plus NOVA's lens projection
ENTROPY_COMPONENTS = ("accel/scorer", "accel/entropy", "lens")
PROMPTS = (
    "a red cat sitting on a sofa", "a lighthouse at dusk, oil painting", "two dogs playing in the snow",
    "a bowl of ramen, studio photo", "a futuristic city skyline at night", "an astronaut riding a horse",
    "a watercolor of a mountain lake", "a close-up of a sunflower with a bee",
)
MIB = 1024 ** 2
REFERENCE = "baseline"  # the method every speedup and FLOPs ratio is taken against
#: the measurement protocol, as the ``studies.latency --help`` text states it
PROTOCOL = __doc__[__doc__.index("Measurement protocol"):].strip()


@dataclass(frozen=True)
class LatencySettings:
    model: str | None = None  # None: testbed when its weights are shipped, else official-tiny
    weights: str | None = None
    method: str = "nova"
    compare: tuple[str, ...] = ("baseline",)
    batch_size: int = 1
    throughput_batch: int = 16  # 0: no throughput batch
    repeats: int = 5
    warmup: int = 2
    out: str | None = None
    profile: bool = False
    seed: int = 0
    threads: int | None = None
    device: str | None = None
    dtype: str = "float32"
    precision: str | None = None  # --precision (var_core.engine.precision); None: the family's default there
    breakdown_scale: int | None = None  # default: the last scale
    plots: bool = True
    all_breakdowns: bool = False  # per-method breakdown figures for the throughput batch too
    # real checkpoints, sampling and prompts (studies._model_cli); None: the model's own default
    vae_weights: str | None = None
    text_encoder: str | None = None
    cfg: float | None = None
    top_k: int | None = None
    top_p: float | None = None
    temperature: float | None = None
    draw: str | None = None
    prompts: str | None = None  # Infinity: a prompt file (sample i: prompt i mod P) instead of PROMPTS
    save_images: bool | str | None = None  # the untimed reference generation's images, images/<method>_b<B>/


@dataclass
class MethodRun:
    """Everything measured for one (method, batch size)."""

    method: str
    batch: int
    repeats: list[dict] = field(default_factory=list)  # one dict per timed run
    scale_ms: list[dict] = field(default_factory=list)  # per timed run: {scale: window ms}
    timers: list[Any] = field(default_factory=list)  # the ComponentTimer of each timed run
    flops: Any = None  # profilers.flops.FlopReport
    memory: Any = None  # profilers.memory.MemoryReport (the source shown)
    memory_analytic: Any = None
    overall_peak_bytes: int | None = None  # CUDA: whole generation incl. decode
    computed_tokens: list[int] = field(default_factory=list)
    skipped_scales: list[int] = field(default_factory=list)

    def median_timer(self):
        """The timer of the run whose total time is the median (the representative breakdown)."""
        totals = [r["total_ms"] for r in self.repeats]
        order = sorted(range(len(totals)), key=totals.__getitem__)
        return self.timers[order[(len(order) - 1) // 2]]


# ----- small helpers ------------------------------------------------------------------------------------------
def spread(values) -> dict:
    """Median, quartiles (inclusive method) and min–max of a list of numbers."""
    values = sorted(float(v) for v in values)
    if not values:
        return {"median": float("nan"), "q1": float("nan"), "q3": float("nan"), "min": float("nan"),
                "max": float("nan"), "n": 0}
    if len(values) >= 2:
        q1, _, q3 = statistics.quantiles(values, n=4, method="inclusive")
    else:
        q1 = q3 = values[0]
    return {"median": statistics.median(values), "q1": q1, "q3": q3, "min": values[0], "max": values[-1],
            "n": len(values)}


def _fmt_spread(s: dict, digits: int = 1) -> str:
    if not s["n"]:
        return "—"
    return f"{s['median']:.{digits}f} [{s['q1']:.{digits}f}–{s['q3']:.{digits}f}]"


def _sync(device) -> None:
    """Wait for the TIMED device's queued work (``cuda:1`` is not the current device unless made so)."""
    device = torch.device(device)
    if device.type == "cuda" and torch.cuda.is_available():
        torch.cuda.synchronize(device)


def conditions_for(adapter, batch: int, seed: int, prompts=None):
    """Prompts (Infinity: the text encoder runs inside the timed call, in its own span) or class labels.
    ``prompts``: a :class:`~var_core.eval.prompts.PromptSet` (``--prompts``), sample ``i`` on prompt ``i mod P``."""
    if prompts is not None:
        if adapter.family != "infinity":
            raise UserError("--prompts needs a text-to-image model (random:infinity-tiny, infinity-2b, ...): drop it "
                            "for a class-conditional model")
        return prompts.conditions(batch).prompts
    if adapter.family == "infinity":
        return [PROMPTS[(seed + i) % len(PROMPTS)] for i in range(batch)]
    num_classes = int(adapter.cfg.num_classes)
    return torch.tensor([(seed + 37 * i) % num_classes for i in range(batch)])


def _prompt_set(settings: LatencySettings):
    """``--prompts`` read once per process (None when not given)."""
    if settings.prompts is None:
        return None
    from var_core.eval.prompts import load_prompt_set

    key = str(settings.prompts)
    if key not in _PROMPT_SETS:
        _PROMPT_SETS[key] = load_prompt_set(settings.prompts)
    return _PROMPT_SETS[key]


_PROMPT_SETS: dict = {}


def _save_images(settings: LatencySettings, adapter, arm: str, images, batch: int, prompt_set, root: Path,
                 log) -> None:
    """``--save-images``: the reference generation of one method and batch (samples 0..B-1, seeds seed+i), written
    under ``root`` in the evaluators' layouts."""
    from var_core.eval.export import export_images
    from var_core.eval.lightning import ConditionSet

    if prompt_set is not None:
        conditions = prompt_set.conditions(batch, settings.seed)
        meta = prompt_set.geneval_metadata
    elif adapter.family == "infinity":
        conditions = ConditionSet.from_prompts(conditions_for(adapter, batch, settings.seed), batch, settings.seed)
        meta = None
    else:
        labels = conditions_for(adapter, batch, settings.seed)
        conditions = ConditionSet(tuple(int(v) for v in labels), settings.seed)
        meta = None
    out = export_images(root, arm, images, conditions, prompt_metadata=meta,
                        seeds=list(range(settings.seed, settings.seed + batch)))
    log(f"  images: {out['images']} PNGs of {arm} in {out['folder']}")


def model_weight_bytes(adapter) -> int:
    from profilers.memory import weight_bytes

    seen, total = set(), 0
    for value in vars(adapter).values():
        if isinstance(value, torch.nn.Module) and id(value) not in seen:
            seen.add(id(value))
            total += weight_bytes(value)
    return total


class _AdapterTracer:
    """Points ``adapter.tracer`` (Infinity's ``text_encode`` span) at a tracer for the duration of a call."""

    def __init__(self, adapter, tracer):
        self.adapter, self.tracer = adapter, tracer

    def __enter__(self):
        self.had = hasattr(self.adapter, "tracer")
        self.old = getattr(self.adapter, "tracer", None)
        if self.had:
            self.adapter.tracer = self.tracer
        return self

    def __exit__(self, *exc):
        if self.had:
            self.adapter.tracer = self.old


def _git() -> dict:
    """Provenance of the report: the same helper the ablation records use."""
    from var_core.eval.records import git_info

    return git_info(Path(__file__).resolve().parents[1])


def _environment(adapter, device, settings: LatencySettings, timer_kind: str, memory_source: str) -> dict:
    """What the numbers depend on (the fields of ``var_core.eval.records.environment_info``, without importing
    Lightning)."""
    from importlib import metadata

    from var_core.eval.records import device_name, model_dtype, sdpa_backend

    packages = {"python": sys.version.split()[0], "platform": platform.platform()}
    for name in ("torch", "numpy", "pandas", "seaborn", "matplotlib"):
        try:
            packages[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            packages[name] = None
    dtype = model_dtype(adapter)
    env = {
        "git": _git(), "packages": packages, "device": str(device), "device_name": device_name(device),
        "dtype": dtype, "attention_backend": sdpa_backend(device), "threads": torch.get_num_threads(),
        "interop_threads": torch.get_num_interop_threads(), "hostname": platform.node(),
    }
    from var_core.engine.precision import declared_precision

    # --precision as the last generate() ran it, else as declared (matmul precision, autocast dtype)
    ran = getattr(adapter, "precision_ran", None) or declared_precision(getattr(adapter, "precision", None))
    env.update({k: ran.get(k) for k in ("precision", "matmul_precision", "autocast_dtype")})
    env.update({
        "torch": torch.__version__, "timer": timer_kind, "memory_source": memory_source,
        "load_average_start": list(os.getloadavg()) if hasattr(os, "getloadavg") else None,
        "cpu_count": os.cpu_count(),
        "cuda": torch.version.cuda if torch.cuda.is_available() else None,
    })
    return env


# ----- measurement --------------------------------------------------------------------------------------------
def _plain_run(adapter, conditions, seeds, sampling, policy, options, device) -> float:
    """Milliseconds of one ``generate()`` timed by the wall clock alone (no tracer: no span events, no per-scale
    hooks), synchronised on the timed device before and after — the latency headline. The breakdown comes from
    the instrumented run (:func:`_timed_run`) of the same round."""
    from var_core.engine import generate

    _sync(device)
    start = time.perf_counter()
    with torch.inference_mode():  # no autograd bookkeeping in the timed region (issue 27)
        generate(adapter, conditions, seeds=seeds, sampling=sampling, policy=policy, options=options)
    _sync(device)
    return (time.perf_counter() - start) * 1e3


def _timed_run(adapter, conditions, seeds, sampling, policy, options, device):
    from profilers.timers import ComponentTimer
    from var_core.engine import generate

    timer = ComponentTimer(device=device)
    with _AdapterTracer(adapter, timer):
        _sync(device)
        start = time.perf_counter()
        with torch.inference_mode():  # as the plain run (issue 27)
            generate(adapter, conditions, seeds=seeds, sampling=sampling, policy=policy, tracer=timer,
                     options=options)
        _sync(device)
        wall_ms = (time.perf_counter() - start) * 1e3
    frame = timer.frame()
    text_ms = float(frame.loc[frame["component"] == "text_encode", "inclusive_ms"].sum())
    decode_ms = float(frame.loc[frame["component"] == "vq_decode", "inclusive_ms"].sum())
    windows = timer.scale_windows()
    entropy_ms = float(frame.loc[frame["component"].isin(ENTROPY_COMPONENTS), "self_ms"].sum())
    row = {
        "total_ms": wall_ms, "text_encode_ms": text_ms, "vq_decode_ms": decode_ms,
        "transformer_ms": wall_ms - text_ms - decode_ms, "scale_loop_ms": float(windows.sum()),
        "entropy_ms": entropy_ms, "spans_ms": timer.total_ms(),
    }
    return row, {int(k): float(v) for k, v in windows.items()}, timer


def _reference_run(adapter, conditions, seeds, sampling, policy, options, device, batch: int, run: MethodRun):
    """One untimed generation: records → FLOPs (with the logit-lens blocks the timer saw) and memory."""
    from profilers.flops import count_flops, infinity_text_len
    from profilers.memory import PeakMemoryTracer, analytic_memory
    from profilers.timers import ComponentTimer
    from profilers.torch_profiler import CompositeTracer
    from var_core.engine import generate

    timer = ComponentTimer(device=device)
    peak = PeakMemoryTracer(device)
    cuda = peak.active
    if cuda:
        torch.cuda.reset_peak_memory_stats(device)
    with _AdapterTracer(adapter, timer):
        result = generate(adapter, conditions, seeds=seeds, sampling=sampling, policy=policy,
                          tracer=CompositeTracer(timer, peak), options=options)
    if cuda:  # the tracer resets the peak counter at every scale: combine its per-scale peaks with the rest
        run.overall_peak_bytes = max(int(torch.cuda.max_memory_allocated(device)), peak.report().peak_bytes)
    text_len = None
    if adapter.family == "infinity":
        text_len = infinity_text_len(adapter, conditions, sampling.cfg)
    run.flops = count_flops(adapter, result, batch_size=batch, include_decode=True,
                            text_len=text_len)
    weights = model_weight_bytes(adapter)
    arch = run.flops.arch
    run.memory_analytic = analytic_memory(arch, result.records, batch, weights=weights)
    run.memory = peak.report(weights) if cuda else run.memory_analytic
    run.computed_tokens = result.computed_tokens_per_scale()
    run.skipped_scales = [r.scale_index for r in result.records if r.skipped]
    return result


def measure(adapter, methods: list[str], batch: int, settings: LatencySettings, sampling, device,
            log=print, images_root: Path | None = None) -> dict[str, MethodRun]:
    """Warm-up, reference run and interleaved timed rounds for every method at one batch size (``images_root``:
    where the reference runs' images go, ``--save-images``; None: not saved)."""
    from var_core.accel import build_policy
    from var_core.accel.presets import get_preset
    from var_core.engine import GenerationOptions

    options = GenerationOptions(check_finite=False, decode=True, keep_raw_logits=True)
    prompt_set = _prompt_set(settings)
    conditions = conditions_for(adapter, batch, settings.seed, prompt_set)
    seeds = list(range(settings.seed, settings.seed + batch))
    from var_core.eval.twomodel import attach_model_switch  # a two-model preset's refiner (CoDe)

    policies = {name: attach_model_switch(build_policy(get_preset(name)), adapter) for name in methods}
    runs = {name: MethodRun(name, batch) for name in methods}
    for name in methods:
        result = _reference_run(adapter, conditions, seeds, sampling, policies[name], options, device, batch,
                                runs[name])
        if images_root is not None and result.images is not None:
            _save_images(settings, adapter, f"{name}_b{batch}", result.images, batch, prompt_set, images_root, log)
    for w in range(settings.warmup):
        for name in methods:
            _timed_run(adapter, conditions, seeds, sampling, policies[name], options, device)
    rng = random.Random(settings.seed * 1000 + batch)
    for r in range(settings.repeats):
        order = list(methods)
        rng.shuffle(order)
        for name in order:
            plain_ms = _plain_run(adapter, conditions, seeds, sampling, policies[name], options, device)
            row, windows, timer = _timed_run(adapter, conditions, seeds, sampling, policies[name], options, device)
            # total_ms: the uninstrumented run; the breakdown (text / transformer / decode) is the instrumented one's
            row.update(instrumented_total_ms=row["total_ms"], total_ms=plain_ms)
            row.update(method=name, batch=batch, round=r, position=order.index(name))
            runs[name].repeats.append(row)
            runs[name].scale_ms.append(windows)
            runs[name].timers.append(timer)
        log(f"  batch {batch} round {r + 1}/{settings.repeats}: " + ", ".join(
            f"{n} {runs[n].repeats[-1]['total_ms']:.0f} ms" for n in methods))
    return runs


# ----- tables ------------------------------------------------------------------------------------------------
def summary_rows(runs: dict[str, MethodRun], reference: str) -> list[dict]:
    """The side-by-side of methods at one batch size (speedups against ``reference``)."""
    base = runs[reference]
    base_tf = spread([r["transformer_ms"] for r in base.repeats])["median"]
    base_total = spread([r["total_ms"] for r in base.repeats])["median"]
    base_flops = base.flops.total_for(exclude=("vq_decode",))
    rows = []
    for name, run in runs.items():
        total = spread([r["total_ms"] for r in run.repeats])
        tf = spread([r["transformer_ms"] for r in run.repeats])
        text = spread([r["text_encode_ms"] for r in run.repeats])
        dec = spread([r["vq_decode_ms"] for r in run.repeats])
        ent = spread([r["entropy_ms"] for r in run.repeats])
        paired_tf = [b["transformer_ms"] / m["transformer_ms"] for b, m in zip(base.repeats, run.repeats)]
        paired_total = [b["total_ms"] / m["total_ms"] for b, m in zip(base.repeats, run.repeats)]
        gflops = run.flops.total_for(exclude=("vq_decode",)) / 1e9
        flops_ratio = gflops * 1e9 / base_flops
        mem = run.memory
        rows.append({
            "method": name, "batch": run.batch, "repeats": len(run.repeats),
            "total_ms": total["median"], "total_q1": total["q1"], "total_q3": total["q3"],
            "total_min": total["min"], "total_max": total["max"],
            "text_encode_ms": text["median"],
            "transformer_ms": tf["median"], "transformer_q1": tf["q1"], "transformer_q3": tf["q3"],
            "transformer_min": tf["min"], "transformer_max": tf["max"],
            "vq_decode_ms": dec["median"],
            "speedup_transformer": base_tf / tf["median"],
            "speedup_transformer_q1": spread(paired_tf)["q1"], "speedup_transformer_q3": spread(paired_tf)["q3"],
            "speedup_total": base_total / total["median"],
            "speedup_total_q1": spread(paired_total)["q1"], "speedup_total_q3": spread(paired_total)["q3"],
            "gflops_transformer": gflops, "gflops_decode": run.flops.total_for(components=("vq_decode",)) / 1e9,
            "flops_ratio": flops_ratio, "ideal_speedup": 1 / flops_ratio if flops_ratio > 0 else float("nan"),
            "speedup_vs_ideal": (base_tf / tf["median"]) * flops_ratio,
            "peak_mib": mem.peak_bytes / MIB, "memory_source": mem.source,
            "peak_mib_analytic": run.memory_analytic.peak_bytes / MIB,
            "overall_peak_mib": (run.overall_peak_bytes / MIB) if run.overall_peak_bytes else float("nan"),
            "kv_cache_mib": max((s.kv_cache_bytes for s in run.memory_analytic.scales), default=0) / MIB,
            "images_per_s": run.batch / (total["median"] / 1e3),
            "ms_per_image": total["median"] / run.batch,
            "entropy_ms": ent["median"], "entropy_share": ent["median"] / tf["median"] if tf["median"] else 0.0,
            "computed_tokens": sum(run.computed_tokens), "skipped_scales": " ".join(map(str, run.skipped_scales)),
        })
    return rows


def per_scale_rows(runs: dict[str, MethodRun]) -> list[dict]:
    rows = []
    for name, run in runs.items():
        flops = run.flops.per_scale()["total"].to_dict()
        memory = {s.scale: s for s in run.memory.scales}
        analytic = {s.scale: s for s in run.memory_analytic.scales}
        scales = sorted({s for w in run.scale_ms for s in w} | set(int(k) for k in analytic))
        records_tokens = dict(enumerate(run.computed_tokens))
        for scale in scales:
            ms = spread([w[scale] for w in run.scale_ms if scale in w])
            hw = run.flops.arch.scale_hw[scale]
            mem = memory.get(scale)
            rows.append({
                "method": name, "batch": run.batch, "scale": scale, "h": hw[0], "w": hw[1],
                "tokens": hw[0] * hw[1], "computed_tokens": records_tokens.get(scale, 0),
                "ms": ms["median"], "ms_q1": ms["q1"], "ms_q3": ms["q3"], "ms_min": ms["min"], "ms_max": ms["max"],
                "gflops": float(flops.get(scale, 0.0)),
                "peak_mib": mem.peak_bytes / MIB if mem else float("nan"),
                "memory_source": run.memory.source,
                "analytic_peak_mib": analytic[scale].peak_bytes / MIB if scale in analytic else float("nan"),
                "kv_cache_mib": analytic[scale].kv_cache_bytes / MIB if scale in analytic else float("nan"),
            })
    return rows


def representative_scale(run: MethodRun, wanted: int | None, num_scales: int) -> int:
    timer = run.median_timer()
    seen = sorted(int(s) for s in timer.frame()["scale"].unique() if s >= 0)
    target = num_scales - 1 if wanted is None else wanted
    if target in seen:
        return target
    lower = [s for s in seen if s <= target]
    return lower[-1] if lower else seen[-1]


def scale_table(run: MethodRun, scale: int):
    """Breakdown of one scale (NOVA's Table 8 layout): ``profilers.breakdown.scale_breakdown`` of every timed run,
    then per component the **median over the runs** of its milliseconds, so a run descheduled inside one span cannot
    put a spike in the table. ``share`` is of ``total (Σ medians)``; the median scale window is listed below it
    (it is larger when the spikes hit different components in different runs). Returns ``(table, entropy_ms,
    entropy_pct)``: the median entropy/scoring time (``accel/scorer`` + ``accel/entropy`` + logit lens) at that
    scale and its share of the total."""
    import pandas as pd

    from profilers.breakdown import _label, scale_breakdown

    window_row = "total (scale window)"
    tables, entropy, windows = [], [], []
    for timer in run.timers:
        frame = timer.frame()
        if scale not in set(frame["scale"]):
            continue
        tables.append(scale_breakdown(timer, scale, flops=run.flops)["ms"].drop(index=window_row))
        at = frame[frame["scale"] == scale]
        entropy.append(float(at.loc[at["component"].isin(ENTROPY_COMPONENTS), "self_ms"].sum()))
        windows.append(float(timer.scale_windows().get(scale, 0.0)))
    table = pd.DataFrame({"ms": pd.concat(tables, axis=1).fillna(0.0).median(axis=1)})
    table = table.sort_values("ms", ascending=False)
    total = float(table["ms"].sum())
    gflops = run.flops.frame()
    gflops = gflops[gflops["scale"] == scale].groupby("component")["flops"].sum() / 1e9
    gflops.index = [_label(c) for c in gflops.index]
    table["gflops"] = gflops.reindex(table.index)
    table.loc["total (Σ medians)"] = [total, float(gflops.sum())]
    table.loc[f"scale window (median of {len(windows)} runs)"] = [statistics.median(windows), float("nan")]
    table["share"] = 100 * table["ms"] / total if total else 0.0
    table.index.name = f"scale {scale}"
    entropy_ms = statistics.median(entropy)
    return table, entropy_ms, (100 * entropy_ms / total if total else 0.0)


# ----- profiling ---------------------------------------------------------------------------------------------
def run_profile(adapter, method: str, batch: int, settings: LatencySettings, sampling, out: Path):
    from profilers.torch_profiler import ProfileSchedule, profile_generations
    from var_core.accel import build_policy
    from var_core.accel.presets import get_preset
    from var_core.engine import GenerationOptions, generate

    options = GenerationOptions(check_finite=False, decode=True, keep_raw_logits=True)
    conditions = conditions_for(adapter, batch, settings.seed, _prompt_set(settings))
    seeds = list(range(settings.seed, settings.seed + batch))
    from var_core.eval.twomodel import attach_model_switch

    policy = attach_model_switch(build_policy(get_preset(method)), adapter)

    def run(tracer):
        with _AdapterTracer(adapter, tracer):
            return generate(adapter, conditions, seeds=seeds, sampling=sampling, policy=policy, tracer=tracer,
                            options=options)

    return profile_generations(run, ProfileSchedule(wait=0, warmup=1, active=1), out_dir=out,
                               trace_name=f"{method}_b{batch}", device=adapter.device)


# ----- markdown ----------------------------------------------------------------------------------------------
def _md_table(frame, floatfmt: str = ".2f") -> str:
    cols = list(frame.columns)
    lines = ["| " + " | ".join(str(c) for c in cols) + " |", "|" + "---|" * len(cols)]
    for _, row in frame.iterrows():
        cells = []
        for c in cols:
            v = row[c]
            if isinstance(v, float):
                cells.append("—" if v != v else format(v, floatfmt))
            else:
                cells.append(str(v))
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _side_by_side_md(rows: list[dict], reference: str) -> str:
    import pandas as pd

    out = []
    for row in rows:
        out.append({
            "method": row["method"],
            "total ms": f"{row['total_ms']:.1f} [{row['total_q1']:.1f}–{row['total_q3']:.1f}]",
            "text enc. ms": f"{row['text_encode_ms']:.1f}" if row["text_encode_ms"] else "—",
            "transformer ms": f"{row['transformer_ms']:.1f} [{row['transformer_q1']:.1f}–{row['transformer_q3']:.1f}]",
            "VQ decode ms": f"{row['vq_decode_ms']:.1f}",
            "speedup (transformer)": f"{row['speedup_transformer']:.2f}× [{row['speedup_transformer_q1']:.2f}–"
                                      f"{row['speedup_transformer_q3']:.2f}]",
            "speedup (end to end)": f"{row['speedup_total']:.2f}×",
            "GFLOPs": f"{row['gflops_transformer']:.3g}",
            "FLOPs ratio": f"{row['flops_ratio']:.3f}",
            "ideal ×": f"{row['ideal_speedup']:.2f}",
            "peak MiB": f"{row['peak_mib']:.1f}",
            "img/s": f"{row['images_per_s']:.3g}",
            "entropy/scoring share": f"{100 * row['entropy_share']:.1f} %",
        })
    return _md_table(pd.DataFrame(out))


def write_markdown(path: Path, info: dict, summaries: dict[int, list[dict]], per_scale, breakdowns: dict,
                   figures: dict, profile_md: str | None) -> Path:
    env = info["environment"]
    reference = info["reference"]
    lines = [f"# Latency report: {info['method']} vs {', '.join(m for m in info['methods'] if m != info['method'])}"
             f" on `{info['model']}`", ""]
    lines += ["```", info["command"], "```", ""]
    for note in info["notes"]:
        lines += [f"> {note}", ""]
    lines += ["## Environment", "",
              f"- device: {env['device']} ({env['device_name']}), dtype {env['dtype']}, "
              f"{env['threads']} torch threads (interop {env['interop_threads']}), {env['cpu_count']} logical CPUs",
              f"- attention backend: {env['attention_backend']}",
              f"- torch {env['torch']}" + (f", CUDA {env['cuda']}" if env.get("cuda") else "")
              + f", python {env['packages'].get('python')}, {env['packages'].get('platform')}",
              f"- git {env['git'].get('sha')} (dirty: {env['git'].get('dirty')}), host {env['hostname']}",
              f"- load average at start {env.get('load_average_start')}, at end {env.get('load_average_end')}",
              f"- timer: {env['timer']}; memory: **{env['memory_source']}**"
              + (" (torch.cuda.max_memory_allocated per scale)" if env["memory_source"] == "cuda-measured"
                 else " (profilers.memory.analytic_memory: weights + reserved KV cache + residual stream + largest "
                      "activation; no CUDA here)"),
              f"- sampling: {info['sampling']}; seeds {info['seeds']}", ""]
    lines += ["## Protocol", "",
              f"{info['warmup']} warm-up generation(s) per method and batch size discarded; {info['repeats']} rounds, "
              "each running every method once in a seeded shuffled order. Medians over the rounds, "
              "[interquartile range] in brackets (min–max in the CSV). Speedups: ratio of medians against "
              f"`{reference}`, [IQR of the per-round paired ratios]. **total** = `time.perf_counter` around "
              "`generate()` (synchronised on GPU), VQ decode included; **text enc.** = the `text_encode` span "
              "(Infinity); **VQ decode** = the `vq_decode` span; **transformer** = total − text enc. − VQ decode. "
              "GFLOPs: analytic, transformer only (VQ decode in the JSON), following the tokens each block actually "
              "computed; FLOPs ratio and ideal × against the reference. Entropy/scoring share: self time of "
              "`accel/scorer`, `accel/entropy` and the logit lens over the transformer time.", ""]
    lines += ["## Methods side by side", ""]
    for batch, rows in summaries.items():
        label = "latency batch" if batch == info["batch_size"] else "throughput batch"
        lines += [f"### batch {batch} ({label})", "", _side_by_side_md(rows, reference), ""]
    if "methods_latency" in figures:
        lines += [f"![latency per method]({figures['methods_latency']})", ""]
    lines += ["## Per scale", ""]
    import pandas as pd

    ps = per_scale
    for batch in sorted(ps["batch"].unique()):
        sub = ps[ps["batch"] == batch]
        wide = sub.pivot_table(index="scale", columns="method", values="ms", aggfunc="first")
        tokens = sub.pivot_table(index="scale", columns="method", values="computed_tokens", aggfunc="first")
        gfl = sub.pivot_table(index="scale", columns="method", values="gflops", aggfunc="first")
        mem = sub.pivot_table(index="scale", columns="method", values="peak_mib", aggfunc="first")
        table = pd.DataFrame({"tokens": sub.groupby("scale")["tokens"].first()})
        for m in info["methods"]:
            table[f"{m} ms"] = wide[m].map(lambda v: f"{v:.1f}")
            table[f"{m} GFLOPs"] = gfl[m].map(lambda v: f"{v:.3g}")
            table[f"{m} computed tok."] = tokens[m]
            table[f"{m} peak MiB"] = mem[m].map(lambda v: f"{v:.1f}")
        table = table.reset_index()
        lines += [f"### batch {batch}", "", _md_table(table), ""]
    for key in ("methods_per_scale", "methods_memory"):
        if key in figures:
            lines += [f"![{key}]({figures[key]})", ""]
    lines += ["## Breakdown of a representative high-resolution scale", "",
              "`profilers.breakdown.scale_breakdown` of every timed run, then the median per component over the "
              "runs (self time; `loop (outside spans)` = the scale window minus the spans), so a run descheduled "
              "inside one span does not put a spike in the table. Shares are of the sum of the medians; the median "
              "scale window is listed below it (larger when different runs were hit in different components). "
              "Entropy share = `accel/scorer` + `accel/entropy` + logit lens.", ""]
    for (method, batch), (scale, table, entropy_ms, entropy_pct) in breakdowns.items():
        t = table.reset_index()
        t.columns = ["component"] + [str(c) for c in t.columns[1:]]
        t["ms"] = t["ms"].map(lambda v: f"{v:.2f}")
        if "gflops" in t:
            t["gflops"] = t["gflops"].map(lambda v: "—" if v != v else f"{v:.3g}")
        t["share"] = t["share"].map(lambda v: f"{v:.1f} %")
        lines += [f"### {method}, batch {batch}, scale {scale}", "",
                  _md_table(t), "", f"entropy/scoring: {entropy_ms:.2f} ms = **{entropy_pct:.1f} %** of the scale (Σ medians)",
                  ""]
    main = f"{info['method']}_b{info['batch_size']}/"
    inline = [(k, v) for k, v in figures.items() if k.startswith(main)]
    if inline:
        lines += [f"## Figures: {info['method']}, batch {info['batch_size']}", ""]
        for key, rel in inline:
            lines += [f"![{key}]({rel})", ""]
    grouped: dict[str, list[str]] = {}
    for key, rel in figures.items():
        group, _, name = key.rpartition("/")
        grouped.setdefault(group or "comparison", []).append(f"[{name}]({rel})")
    lines += ["## All figures", ""]
    lines += [f"- {group}: " + ", ".join(items) for group, items in grouped.items()]
    lines.append("")
    if profile_md:
        lines += ["## torch.profiler", "", profile_md, ""]
    path.write_text("\n".join(lines))
    return path


# ----- the study ---------------------------------------------------------------------------------------------
def batch_sizes(settings: LatencySettings) -> list[int]:
    """The latency batch, then the throughput batch when there is a different one."""
    batches = [settings.batch_size]
    if settings.throughput_batch and settings.throughput_batch != settings.batch_size:
        batches.append(settings.throughput_batch)
    return batches


def default_out_dir(settings: LatencySettings, model: str) -> Path:
    """``--out``, else ``results/latency/<model>_<method>_b<B>[-<TB>]`` (``model`` resolved)."""
    if settings.out:
        return Path(settings.out)
    from var_core.engine.precision import run_tag, study_precision
    from var_core.zoo import ZOO

    device = torch.device(latency_device(settings))
    spec = ZOO.get(model.removeprefix("random:"))
    precision = study_precision(settings.precision, settings.dtype, spec.family if spec else "var", device)
    return Path("results") / "latency" / (
        f"{model.replace(':', '-')}_{settings.method}_b{'-'.join(map(str, batch_sizes(settings)))}"
        f"{run_tag(device.type, precision)}")


def latency_device(settings: LatencySettings) -> str:
    """``settings.device``, else ``cuda`` when torch sees a GPU, else ``cpu``."""
    if settings.device not in (None, "auto"):
        return settings.device
    return "cuda" if torch.cuda.is_available() else "cpu"


def latency_methods(settings: LatencySettings) -> tuple[list[str], list[str]]:
    """``(methods, notes)``: ``method``, then ``compare``, then ``baseline`` (the speedup reference) when it is not
    among them, with a note saying so. Checks the counts and every preset name, so a mistake fails before anything is
    loaded (``ValueError``; an unknown preset is a :class:`~var_core.errors.UserError` with a did-you-mean)."""
    from var_core.accel.presets import get_preset

    if settings.repeats < 1 or settings.warmup < 0 or settings.batch_size < 1 or settings.throughput_batch < 0:
        raise ValueError("need --repeats >= 1, --warmup >= 0, --batch-size >= 1, --throughput-batch >= 0")
    methods = [settings.method] + [m for m in settings.compare if m != settings.method]
    notes = []
    if REFERENCE not in methods:
        methods.append(REFERENCE)
        notes.append(f"`{REFERENCE}` added as the speedup reference")
    for m in methods:
        get_preset(m)  # unknown names fail before anything runs
    return methods, notes


def report_latency(settings: LatencySettings, adapter, model: str, sampling, *, notes=(),
                   images_root: Path | None = None, command: str | None = None, log=print) -> dict:
    """Measure every method of :func:`latency_methods` on the loaded ``adapter`` (zoo name ``model``) with
    ``sampling`` and write the report (the module docstring says what and how). ``notes``: lines quoted at the top
    of the report (the model's, then the methods'); ``images_root``: where ``--save-images`` writes (None: no images).
    Returns ``{"out", "paths", "summary", "figures"}``. Threads are the caller's (``studies.latency`` sets
    ``--threads`` before loading the model and restores them)."""
    import pandas as pd

    from profilers.breakdown import write_breakdown

    methods, method_notes = latency_methods(settings)
    notes = list(notes) + method_notes
    reference = REFERENCE
    device = latency_device(settings)
    _prompt_set(settings)  # a prompt file that does not read fails before anything is measured
    batches = batch_sizes(settings)
    out = default_out_dir(settings, model)
    out.mkdir(parents=True, exist_ok=True)
    cuda = torch.device(device).type == "cuda" and torch.cuda.is_available()
    env = _environment(adapter, device, settings, "cuda-events" if cuda else "cpu-perf_counter",
                       "cuda-measured" if cuda else "analytic")
    log(f"latency: model {model}, methods {methods}, batches {batches}, device {device}, "
        f"{torch.get_num_threads()} threads -> {out}")

    all_runs: dict[int, dict[str, MethodRun]] = {}
    for batch in batches:
        all_runs[batch] = measure(adapter, methods, batch, settings, sampling, device, log, images_root)
    env["load_average_end"] = list(os.getloadavg()) if hasattr(os, "getloadavg") else None

    summaries = {b: summary_rows(runs, reference) for b, runs in all_runs.items()}
    summary = pd.DataFrame([row for rows in summaries.values() for row in rows])
    repeats = pd.DataFrame([r for runs in all_runs.values() for run in runs.values() for r in run.repeats])
    per_scale = pd.DataFrame([row for runs in all_runs.values() for row in per_scale_rows(runs)])
    scale_long = pd.DataFrame([
        {"method": run.method, "batch": run.batch, "round": i, "scale": s, "ms": v}
        for runs in all_runs.values() for run in runs.values() for i, w in enumerate(run.scale_ms)
        for s, v in w.items()])
    paths = {"summary_csv": out / "summary.csv", "repeats_csv": out / "repeats.csv",
             "per_scale_csv": out / "per_scale.csv"}
    summary.to_csv(paths["summary_csv"], index=False)
    repeats.to_csv(paths["repeats_csv"], index=False)
    per_scale.to_csv(paths["per_scale_csv"], index=False)

    breakdowns, breakdown_json = {}, {}
    for batch, runs in all_runs.items():
        for name, run in runs.items():
            scale = representative_scale(run, settings.breakdown_scale, adapter.num_scales)
            table, entropy_ms, entropy_pct = scale_table(run, scale)
            breakdowns[(name, batch)] = (scale, table, entropy_ms, entropy_pct)
            breakdown_json[f"{name}_b{batch}"] = {
                "scale": scale, "entropy_ms": entropy_ms, "entropy_share_pct": entropy_pct,
                "table": json.loads(table.reset_index().to_json(orient="records")),
            }
            table.to_csv(out / f"scale_breakdown_{name}_b{batch}.csv")

    figures: dict[str, str] = {}
    if settings.plots:
        figures["methods_latency"] = plot_methods_latency(repeats, out / "methods_latency.png").name
        figures["methods_per_scale"] = plot_methods_per_scale(scale_long, out / "methods_per_scale.png",
                                                              settings.batch_size).name
        weight_mib = model_weight_bytes(adapter) / MIB
        figures["methods_memory"] = plot_methods_memory(per_scale, out / "methods_memory.png", weight_mib).name
        for batch, runs in all_runs.items():
            if batch != settings.batch_size and not settings.all_breakdowns:
                continue  # the throughput batch: per_scale.csv and the methods_* figures cover it
            for name, run in runs.items():
                sub = out / "breakdown" / f"{name}_b{batch}"
                written = write_breakdown(sub, timer=run.median_timer(), flops=run.flops, memory=run.memory)
                for key, p in written.items():
                    if str(p).endswith(".png"):
                        figures[f"{name}_b{batch}/{p.stem}"] = str(p.relative_to(out))

    profile_md = None
    profile_json = None
    if settings.profile:
        prof_dir = out / "profile"
        frames, traces, md = [], [], []
        for name in [settings.method, reference] if settings.method != reference else [reference]:
            prof = run_profile(adapter, name, settings.batch_size, settings, sampling, prof_dir)
            ops = prof.ops_per_range()
            ops.insert(0, "method", name)
            frames.append(ops)
            traces += [str(p.relative_to(out)) for p in prof.traces]
            by_component = prof.ops.groupby(["component", "op"], as_index=False)[["calls", "self_cpu_us",
                                                                                  "self_device_us"]].sum()
            by_component = by_component.sort_values("self_cpu_us", ascending=False).head(15)
            by_component["self_cpu_ms"] = by_component.pop("self_cpu_us") / 1e3
            device_us = by_component.pop("self_device_us")
            if "cuda" in prof.activities:
                by_component["self_device_ms"] = device_us / 1e3
            md += [f"### {name}, batch {settings.batch_size} — top operators grouped by loop range component", "",
                   _md_table(by_component.reset_index(drop=True)), ""]
        ops_all = pd.concat(frames, ignore_index=True)
        ops_all.to_csv(prof_dir / "ops_by_range.csv", index=False)
        paths["profile_ops_csv"] = prof_dir / "ops_by_range.csv"
        md.insert(0, "Chrome traces: " + ", ".join(f"[{t}]({t})" for t in traces)
                  + ". Full op table per range: [profile/ops_by_range.csv](profile/ops_by_range.csv). One profiled "
                    "generation after one profiler warm-up (the profiler adds ≈ 20 % on small models: these are "
                    "attributions, not the latency numbers above).\n")
        profile_md = "\n".join(md)
        profile_json = {"traces": traces, "ops_csv": "profile/ops_by_range.csv"}

    info = {
        "model": model, "method": settings.method, "methods": methods, "reference": reference,
        "batch_size": settings.batch_size, "batches": batches, "repeats": settings.repeats,
        "warmup": settings.warmup, "notes": notes, "environment": env,
        "sampling": dataclasses.asdict(sampling), "seeds": list(range(settings.seed, settings.seed + max(batches))),
        "command": command or "python -m studies.latency", "settings": dataclasses.asdict(settings),
        "timed_region": "generate() call incl. text encoding (Infinity) and VQ decode; parts separated by spans",
    }
    paths["report_md"] = write_markdown(out / "report.md", info, summaries, per_scale, breakdowns, figures,
                                        profile_md)
    report = {
        **info,
        "summary": json.loads(summary.to_json(orient="records")),
        "repeats": json.loads(repeats.to_json(orient="records")),
        "per_scale": json.loads(per_scale.to_json(orient="records")),
        "scale_breakdown": breakdown_json,
        "flops_per_scale": {f"{n}_b{b}": json.loads(r.flops.per_scale().reset_index().to_json(orient="records"))
                            for b, runs in all_runs.items() for n, r in runs.items()},
        "memory": {f"{n}_b{b}": r.memory.to_dict() for b, runs in all_runs.items() for n, r in runs.items()},
        "figures": figures, "profile": profile_json,
    }
    paths["report_json"] = out / "report.json"
    paths["report_json"].write_text(json.dumps(report, indent=1, default=str))
    return {"out": out, "paths": paths, "summary": summary, "figures": figures}


# ----- arch-only FLOPs (no weights, no run) ------------------------------------------------------------------
ATTENTION_OPS = ("scores", "pv")


class ArchConfigError(UserError, ValueError):
    """``--arch-flops`` for a model whose architecture is not known without its weights."""


def arch_flops_table(model: str, text_len: int = 64, batch: int = 1, guidance: bool = True):
    """Per-scale analytic FLOPs of a dense generation of a zoo architecture, built from its config alone
    (:func:`profilers.flops.infinity_arch` / :func:`~profilers.flops.var_arch` and
    :func:`~profilers.flops.dense_records`): nothing is loaded or run, so ``infinity-2b`` / ``var-d30`` cost
    nothing. Rows per scale: tokens and their share, GFLOPs split into linear layers, self-attention (QKᵀ + PV),
    cross-attention to the text (QKᵀ + PV), head; the FLOP share. Row ``-1``: once per generation (conditioning,
    text projections and text K/V for Infinity). Returns ``(table, report)``."""
    import pandas as pd

    from profilers.flops import count_record_flops, dense_records, infinity_arch, var_arch
    from var_core.engine import GuidanceMode
    from var_core.zoo import INFINITY_SPECS, ZOO

    base = model.removeprefix("random:")
    if base in INFINITY_SPECS and INFINITY_SPECS[base].config is not None:
        from var_core.models.infinity import scale_schedule

        spec = INFINITY_SPECS[base]
        schedule = scale_schedule(spec.pn, 1.0, spec.num_scales)
        arch = infinity_arch(spec.config, schedule, text_len=text_len)
    elif base in ZOO and ZOO[base].var_config is not None:
        arch = var_arch(ZOO[base].var_config)
    else:
        raise ArchConfigError(f"no arch-only config for {model!r}: use infinity-2b, infinity-8b, infinity-tiny or "
                         f"var-d16 … var-d36")
    mode = GuidanceMode.BOTH if guidance else GuidanceMode.COND_ONLY
    report = count_record_flops(arch, dense_records(arch.scale_hw, mode), batch_size=batch)
    frame = report.frame()
    frame["kind"] = "linear"
    frame.loc[(frame["component"] == "attn") & frame["op"].isin(ATTENTION_OPS), "kind"] = "self-attention"
    frame.loc[(frame["component"] == "cross") & frame["op"].isin(ATTENTION_OPS), "kind"] = "cross-attention"
    frame.loc[frame["component"] == "head", "kind"] = "head"
    frame.loc[frame["component"] == "condition", "kind"] = "condition"
    kinds = frame.pivot_table(index="scale", columns="kind", values="flops", aggfunc="sum", fill_value=0) / 1e9
    total = kinds.sum(axis=1)
    tokens = pd.Series({si: h * w for si, (h, w) in enumerate(arch.scale_hw)})
    table = pd.DataFrame({
        "hw": pd.Series({si: f"{h}x{w}" for si, (h, w) in enumerate(arch.scale_hw)}),
        "tokens": tokens, "token_share": tokens / tokens.sum(),
    }).reindex(kinds.index)
    table = table.join(kinds)
    table["gflops"] = total
    table["flop_share"] = total / total.sum()
    table.index.name = "scale"
    return table, report




def arch_flops_summary(model: str, text_len: int = 64, batch: int = 1, guidance: bool = True,
                       out: str | Path | None = None) -> list[str]:
    """What ``studies.latency --arch-flops`` prints: :func:`arch_flops_table`, its totals and the share of the last
    two scales in tokens and FLOPs; with ``out`` also ``arch_flops_<model>.csv`` and its stacked-bar PNG there."""
    table, report = arch_flops_table(model, text_len, batch, guidance=guidance)
    arch = report.arch
    K = len(arch.scale_hw)
    last = [K - 2, K - 1]
    tok = table.loc[last, "tokens"].sum() / table.loc[table.index >= 0, "tokens"].sum()
    flop = table.loc[last, "gflops"].sum() / table["gflops"].sum()
    lines = [table.to_string(float_format=lambda v: f"{v:.4g}"),
             f"total: {int(table['tokens'].sum())} tokens, {table['gflops'].sum():.1f} GFLOPs "
             f"(batch {batch}, {'CFG: 2 rows per sample' if guidance else 'no CFG'}"
             + (f", text length {arch.text_len}" if arch.family == "infinity" else "") + ")",
             f"last two scales {arch.scale_hw[-2]} + {arch.scale_hw[-1]}: {100 * tok:.1f} % of tokens, "
             f"{100 * flop:.1f} % of FLOPs"]
    if out:
        Path(out).mkdir(parents=True, exist_ok=True)
        path = Path(out) / f"arch_flops_{model.replace(':', '-')}.csv"
        table.to_csv(path)
        lines.append(f"table: {path}")
        from profilers.breakdown import plot_scale_stack, scale_component_frame

        png = plot_scale_stack(scale_component_frame(flops=report), path.with_suffix(".png"), "gflops",
                               title=f"{model}: GFLOPs per scale (dense, analytic)")
        lines.append(f"figure: {png}")
    return lines
