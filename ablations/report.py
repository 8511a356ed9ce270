"""The report of an ablation run folder: table (CSV + Markdown), seaborn plots, overview grid, W&B mirror.

Everything here reads the per-arm JSON records (and the arms' ``.pt`` tensors for the overview grid), so
``python -m studies.report RUN_DIR`` can rebuild it at any time. The JSON records stay the system of record; the
W&B run (offline by default, under ``RUN_DIR/wandb``; grouped per study, with the records and table as a ``study``
artifact) is a mirror. The table shows one headline speedup, the interleaved re-timing when the study has one, and
says which (:func:`headline_speedup`); the sample grids carry their arm names in the image.
"""

from __future__ import annotations

import math
import os
import textwrap
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import numpy as np

from var_core.eval import records as rec
from var_core.eval.lightning import TIMED_REGION
from var_core.eval.stats import format_summary, holm_adjust

from var_core.eval.activity import activity_lines

from .loadwatch import FLAG_MARK, IDENTICAL_MARK, is_identical, sequential_marks, table_footnotes

__all__ = ["table_frame", "write_table", "write_plots", "write_overview_grid", "log_wandb", "write_report",
           "headline_speedup", "wandb_study", "study_artifact_files",
           "load_records", "read_folder", "FolderContents", "plot_quality_vs_flops", "plot_layer_entropy", "plot_gamma",
           "plot_criterion_iou", "plot_rho_calibration", "write_analysis_plots"]

# (column stem, summary key, label, digits, scale)
METRICS = (
    ("ms_per_image", "ms_per_image", "latency ms/img", 1, 1.0),
    ("speedup", "speedup", "speedup", 2, 1.0),
    ("speedup_interleaved", "speedup_interleaved", "speedup interleaved", 2, 1.0),
    ("gflops", "gflops_per_image", "GFLOPs/img", 3, 1.0),
    ("flops_ratio", "flops_ratio", "FLOPs ratio", 3, 1.0),
    ("peak_mb", "peak_memory_mb", "peak MiB", 1, 1.0),
    ("memory_ratio", "memory_ratio", "peak-mem ratio", 3, 1.0),
    ("kv_mb", "kv_mb", "KV MiB/img", 3, 1.0),  # measured KV cache carried across scales (engine.kvcache)
    ("kv_ratio", "kv_ratio", "KV-bytes ratio", 3, 1.0),
    ("kv_alloc_mb", "kv_alloc_mb", "KV alloc MiB/img", 3, 1.0),  # KV buffers allocated during the last scale
    ("kv_alloc_ratio", "kv_alloc_ratio", "KV-alloc ratio", 3, 1.0),
    ("psnr", "psnr", "PSNR dB (capped mean)", 2, 1.0),  # identical images count as 100 dB (kept for old readers)
    ("psnr_differing", "psnr_differing", "PSNR dB (differing)", 2, 1.0),  # over the non-identical samples only
    ("identical", "identical", "identical", 3, 1.0),  # fraction of images equal to the baseline's
    ("psnr_mean_mse", "psnr_mean_mse", "PSNR of mean MSE dB", 2, 1.0),  # 10 log10(1 / mean MSE), all samples
    ("ssim", "ssim", "SSIM", 3, 1.0),
    ("ms_ssim", "ms_ssim", "MS-SSIM", 3, 1.0),
    ("token_agreement", "token_agreement", "token agree", 3, 1.0),
    ("class_acc", "class_correct", "class acc", 3, 1.0),
    ("fid_proxy", "fid_proxy", "FID-proxy", 2, 1.0),
    ("kid_proxy", "kid_proxy", "KID-proxy", 4, 1.0),
    ("is_proxy", "is_proxy", "IS-proxy", 2, 1.0),
    ("fid_real", "fid_real", "FID-real", 2, 1.0),
    ("fid_inception", "fid_inception", "FID (Inception)", 2, 1.0),
    ("kid_inception", "kid_inception", "KID (Inception)", 4, 1.0),
    ("is_inception", "is_inception", "IS (Inception)", 2, 1.0),
    ("lpips_alex", "lpips_alex", "LPIPS (alex)", 4, 1.0),
    ("lpips_vgg", "lpips_vgg", "LPIPS (vgg)", 4, 1.0),
    ("clip_score", "clip_score", "CLIP", 2, 1.0),
    ("image_reward", "image_reward", "ImageReward", 3, 1.0),
    ("hpsv2", "hpsv2", "HPSv2.1", 2, 1.0),
    # imported from the benchmarks' own result files (ablations.imports; python -m studies.report --import)
    ("geneval_single_object", "geneval_single_object", "GenEval Single Obj.", 3, 1.0),
    ("geneval_two_object", "geneval_two_object", "GenEval Two Obj.", 3, 1.0),
    ("geneval_counting", "geneval_counting", "GenEval Counting", 3, 1.0),
    ("geneval_colors", "geneval_colors", "GenEval Colors", 3, 1.0),
    ("geneval_position", "geneval_position", "GenEval Position", 3, 1.0),
    ("geneval_color_attr", "geneval_color_attr", "GenEval Color Attri.", 3, 1.0),
    ("geneval_overall", "geneval_overall", "GenEval Overall", 3, 1.0),
    ("dpg_global", "dpg_global", "DPG Global", 2, 1.0),
    ("dpg_entity", "dpg_entity", "DPG Entity", 2, 1.0),
    ("dpg_attribute", "dpg_attribute", "DPG Attribute", 2, 1.0),
    ("dpg_relation", "dpg_relation", "DPG Relation", 2, 1.0),
    ("dpg_other", "dpg_other", "DPG Other", 2, 1.0),
    ("dpg_overall", "dpg_overall", "DPG Overall", 2, 1.0),
)
PROMPT_AND_IMPORTED = ("clip_score", "image_reward", "hpsv2") + tuple(m[0] for m in METRICS
                                                                     if m[0].startswith(("geneval_", "dpg_")))
MARKDOWN_COLUMNS = ("ms_per_image", "speedup", "speedup_interleaved", "gflops", "flops_ratio", "peak_mb",
                    "memory_ratio", "kv_mb", "kv_ratio", "kv_alloc_mb",
                    "kv_alloc_ratio", "psnr_differing", "identical", "ssim", "ms_ssim",
                    "token_agreement", "lpips_alex", "lpips_vgg", "class_acc", "fid_proxy", "fid_real",
                    "fid_inception", "kid_inception", "is_inception", "clip_score",
                    "image_reward", "hpsv2") + PROMPT_AND_IMPORTED[3:]


def reference_metrics(records: list[dict]) -> tuple:
    """The FID-vs-reference columns the records hold (``--fid-reference``, var_core.eval.reference): ``fid_ref``
    and one ``fid_ref_<category>`` per reference category, as :data:`METRICS` rows."""
    keys = sorted({k for r in records for k in (r.get("summary") or {})
                   if k == "fid_ref" or k.startswith("fid_ref_")}, key=lambda k: (k != "fid_ref", k))
    spaces = {str(e.get("feature_space")) for r in records for k in keys
              if isinstance(e := (r.get("summary") or {}).get(k), dict) and e.get("feature_space")}
    space = f" ({', '.join(sorted(spaces))})" if spaces else ""
    return tuple((k, k, f"FID vs ref{space}" if k == "fid_ref" else f"FID vs ref [{k[len('fid_ref_'):]}]", 2, 1.0)
                 for k in keys)


def reference_note(records: list[dict]) -> str | None:
    """The line under the table naming the FID reference: protocol, file, sha256, reference and sample counts."""
    for r in records:
        entry = (r.get("summary") or {}).get("fid_ref")
        if isinstance(entry, dict) and entry.get("reference"):
            proto = (r.get("protocol") or {}).get("name")
            return (f"FID vs ref: {entry.get('protocol')}{f', protocol {proto}' if proto else ''}; reference "
                    f"{entry['reference']} (sha256 {str(entry.get('reference_sha256'))[:16]}…, "
                    f"{entry.get('n_reference')} reference images), {entry.get('n')} generated samples per arm "
                    f"(per category: that category's samples against its statistics). The baseline's FID is "
                    f"against the reference too. FIDs of other feature spaces or sample counts are not "
                    f"comparable.\n")
    return None


@dataclass
class FolderContents:
    """What a results folder holds: the readable finished ``records`` (baseline first), the ``unavailable`` arms
    (``ablations.base.Arm`` with ``error``: could not be built, record unreadable, or no finished record) and one
    line per file that could not be read (``problems``)."""

    records: list[dict]
    unavailable: list
    problems: list[str] = field(default_factory=list)


def _summary_problem(record: dict) -> str | None:
    """What in a record's ``summary`` the table cannot show (a number stored as a string, an entry that is not an
    interval), naming the key; ``None`` when it is fine."""
    summary = record.get("summary")
    if summary is None:
        return None
    if not isinstance(summary, dict):
        return f"'summary' is {type(summary).__name__}, not an object"
    for key, value in summary.items():
        if value is None:
            continue
        if not isinstance(value, dict):
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                return f"summary.{key} is {value!r} ({type(value).__name__}), not an interval"
            continue
        for part in ("mean", "low", "high", "n", "level"):
            v = value.get(part)
            if v is not None and (isinstance(v, bool) or not isinstance(v, (int, float))):
                return f"summary.{key}.{part} is {v!r} ({type(v).__name__}), not a number"
    return None


def read_folder(out_dir: str | Path) -> FolderContents:
    """Every arm of a results folder, none dropped silently: an arm of the manifest or a record file that cannot
    be shown comes back in ``unavailable`` with the reason, naming the file."""
    import json

    from .base import Arm

    out_dir = Path(out_dir)
    problems: list[str] = []
    manifest_arms: list[dict] = []
    manifest = out_dir / "study.json"
    if manifest.is_file():
        try:
            data = json.loads(manifest.read_text())
            manifest_arms = [a for a in data.get("arms", []) if isinstance(a, dict) and isinstance(a.get("name"), str)]
        except (OSError, ValueError, AttributeError) as exc:
            problems.append(f"cannot read {manifest} ({type(exc).__name__}: {exc}); arms ordered by file name")
    by_file = {a["record"]: a for a in manifest_arms if a.get("record")}
    records: list[dict] = []
    unavailable: list = []
    seen: set[str] = set()
    for path in sorted((out_dir / "arms").glob("*.json")):
        rel = str(path.relative_to(out_dir))
        entry = by_file.get(rel, {})
        try:
            record = rec.load_record(path)
        except rec.RecordError as exc:
            name = entry.get("name") or path.name[: -len(".json")]
            seen.add(name)
            problems.append(f"arm {name!r}: cannot read its record {path} ({exc.reason})")
            unavailable.append(Arm(name, None, entry.get("description", ""), role=entry.get("role", "arm"),
                                   error=f"record {rel} cannot be read ({exc.reason}); re-run the study with the "
                                         f"same --out to recompute it", changes=entry.get("changes", "")))
            continue
        if record is None:
            continue
        bad = _summary_problem(record)
        if bad is not None:
            name = record.get("arm") or entry.get("name") or path.name[: -len(".json")]
            seen.add(name)
            problems.append(f"arm {name!r}: cannot use its record {path} ({bad})")
            unavailable.append(Arm(name, None, entry.get("description", ""), role=entry.get("role", "arm"),
                                   error=f"record {rel} cannot be used ({bad}); re-run the study with the same "
                                         f"--out to recompute it", changes=entry.get("changes", "")))
            continue
        if record.get("status") != "complete":
            name = record["arm"]
            seen.add(name)
            unavailable.append(Arm(name, None, record.get("description", ""), role=record.get("role", "arm"),
                                   error=f"record {rel} is not finished (status {record.get('status')!r})",
                                   changes=record.get("changes", "")))
            continue
        seen.add(record["arm"])
        records.append(record)
    for a in manifest_arms:
        if a["name"] in seen:
            continue
        if a.get("error"):
            error = a["error"]
        else:
            where = a.get("record") or f"arms/{rec.arm_slug(a['name'])}.json"
            error = (f"no finished record ({where} is missing: the arm did not finish or the file was removed); "
                     f"re-run the study with the same --out to compute it")
            problems.append(f"arm {a['name']!r}: {error}")
        unavailable.append(Arm(a["name"], None, a.get("description", ""), role=a.get("role", "arm"), error=error,
                               changes=a.get("changes", "")))
    rank = {a["name"]: i for i, a in enumerate(manifest_arms)}
    records.sort(key=lambda r: (r["role"] != "baseline", rank.get(r["arm"], len(rank)), r["arm"]))
    unavailable.sort(key=lambda a: rank.get(a.name, len(rank)))
    return FolderContents(records, unavailable, problems)


def load_records(out_dir: str | Path) -> list[dict]:
    """Finished, readable records of a run folder in the order of its manifest (baseline first); see
    :func:`read_folder` for the arms that cannot be shown."""
    return read_folder(out_dir).records


def _get(summary: dict, key: str) -> dict | None:
    value = summary.get(key)
    return value if isinstance(value, dict) else None


def _with_psnr_summaries(records: list[dict]) -> list[dict]:
    """Records whose summary holds ``psnr_differing`` / ``psnr_mean_mse`` (copies; computed from the per-sample
    PSNR for records written before these summaries existed)."""
    from var_core.eval.metrics import psnr_summaries

    out = []
    for r in records:
        ps = r.get("metrics", {}).get("per_sample", {})
        if r.get("role") != "baseline" and "psnr_differing" not in r["summary"] and ps.get("psnr"):
            extra = psnr_summaries(ps["psnr"], ps.get("identical"), seed=r.get("samples", {}).get("base_seed", 0))
            r = dict(r, summary=dict(r["summary"], **extra))
        out.append(r)
    return out


def _wilcoxon_family(records: list[dict]) -> list[tuple[str, str, dict, float]]:
    """Every Wilcoxon test of the records as ``(arm, metric, test, Holm-adjusted p)``; the family is all of them."""
    tests = [(r["arm"], name, t) for r in records for name, t in r["metrics"].get("wilcoxon_vs_baseline", {}).items()]
    adjusted = holm_adjust([t.get("p_value") for _, _, t in tests])
    return [(arm, name, t, float(a)) for (arm, name, t), a in zip(tests, adjusted)]


def _with_interleaved(records: list[dict], interleaved: dict | None) -> list[dict]:
    """Records whose summary also holds ``speedup_interleaved`` / ``ms_per_image_interleaved`` (copies)."""
    if not interleaved:
        return records
    out = []
    for r in records:
        entry = interleaved.get("arms", {}).get(r["arm"])
        if entry:
            r = dict(r, summary=dict(r["summary"], ms_per_image_interleaved=entry["ms_per_image"],
                                     **({"speedup_interleaved": entry["speedup"]} if "speedup" in entry else {})))
        out.append(r)
    return out


def headline_speedup(records: list[dict], interleaved: dict | None) -> dict:
    """Which timing the table's one headline speedup is, and how its column is labelled.

    The interleaved re-timing (``timing_interleaved.json``: a batch of ``b`` per arm, the arms back to back in a
    rotating order, paired by round) when the study has one: at ``b = 1`` the latency regime, and robust to load
    changes between the arms' sequential main runs. Else the main runs' sequential batches (the throughput batch,
    paired by batch). The other timing stays in the table as a detail column (``table.csv`` keeps both ``speedup``,
    the sequential one, and ``speedup_interleaved``; ``speedup_headline*`` repeats the headline)."""
    n_batches = {len(r["timing"].get("batches", [])) for r in records}
    sizes = {r["timing"].get("batch_size") for r in records}
    count = n_batches.pop() if len(n_batches) == 1 else None
    seq = (f"{count} batch{'es' if count != 1 else ''}" if count is not None else "batches") + (
        f" of {sizes.pop()}" if len(sizes) == 1 and None not in sizes else "")
    if interleaved and interleaved.get("arms"):
        b, rounds = interleaved.get("batch_size"), interleaved.get("rounds")
        return {"stem": "speedup_interleaved", "timing": "interleaved",
                "description": f"interleaved re-timing, batch {b}, {rounds} rounds",
                "label": f"speedup interleaved (b={b}, {rounds} rounds)",
                "detail": {"stem": "speedup", "label": f"seq. speedup ({seq})"}}
    return {"stem": "speedup", "timing": "sequential", "description": f"sequential main runs, {seq}",
            "label": f"speedup sequential ({seq})", "detail": None}


def table_frame(records: list[dict], unavailable: list | None = None, interleaved: dict | None = None):
    """One row per arm; each metric as ``<stem>``, ``<stem>_low``, ``<stem>_high``, ``<stem>_n``; the headline
    speedup (:func:`headline_speedup`) also as ``speedup_headline*`` with ``speedup_headline_timing`` naming it."""
    import pandas as pd

    headline = headline_speedup(records, interleaved)

    records = _with_psnr_summaries(_with_interleaved(records, interleaved))
    holm = {(arm, name): a for arm, name, _, a in _wilcoxon_family(records)}
    rows = []
    for r in records:
        s = r["summary"]
        t = r["timing"]
        row: dict[str, Any] = {"arm": r["arm"], "role": r["role"], "changes": r.get("changes", ""),
                               "n": r["samples"]["n"], "batch_size": t.get("batch_size"),
                               "n_batches": len(t.get("batches", []))}
        for stem, key, _, _, _ in METRICS + reference_metrics(records):
            summ = _get(s, key)
            if r["role"] == "baseline" and key in ("speedup", "speedup_interleaved", "flops_ratio", "memory_ratio",
                                                   "kv_ratio", "kv_alloc_ratio"):
                summ = {"mean": 1.0, "low": 1.0, "high": 1.0, "n": summ["n"] if summ else None}
            row[stem] = summ["mean"] if summ else None
            row[f"{stem}_low"] = summ["low"] if summ else None
            row[f"{stem}_high"] = summ["high"] if summ else None
            row[f"{stem}_n"] = summ["n"] if summ else None
        for suffix in ("", "_low", "_high", "_n"):
            row[f"speedup_headline{suffix}"] = row[f"{headline['stem']}{suffix}"]
        row["speedup_headline_timing"] = headline["description"]
        ident = r["metrics"]["per_sample"].get("identical")
        row["identical_fraction"] = (float(np.mean([v for v in ident if v is not None])) if ident else None)
        row["identical_to_baseline"] = is_identical(r)  # every token and image of every sample (ablations.loadwatch)
        row["timing_flag"] = "; ".join(((t.get("load") or {}).get("flag")) or []) or None
        row["memory_source"] = memory_source(r)  # "analytic" for an old CPU record without it
        tests = r["metrics"].get("wilcoxon_vs_baseline", {})
        for name in ("class_prob", "entropy_mean"):
            row[f"wilcoxon_p_{name}"] = tests.get(name, {}).get("p_value") if name in tests else None
            adj = holm.get((r["arm"], name))
            row[f"wilcoxon_p_holm_{name}"] = adj if adj is not None and math.isfinite(adj) else None
        row["config_hash"] = r["config_hash"]
        row["status"] = "reference" if r["role"] == "baseline" else "ok"
        rows.append(row)
    for arm in unavailable or []:
        rows.append({"arm": arm.name, "role": arm.role, "changes": arm.changes, "status": f"unavailable: {arm.error}"})
    return pd.DataFrame(rows)


def _cell(record: dict, stem: str, key: str, digits: int) -> str:
    if record["role"] == "baseline":
        if key in ("speedup", "speedup_interleaved", "flops_ratio", "memory_ratio", "kv_ratio", "kv_alloc_ratio"):
            return "1 (ref)"
        if key in ("psnr", "psnr_differing", "psnr_mean_mse", "identical", "ssim", "ms_ssim", "token_agreement",
                   "fid_proxy", "kid_proxy"):
            return "ref"
    if stem == "identical":  # "k/n" images equal to the baseline's
        flags = [v for v in record["metrics"]["per_sample"].get("identical") or [] if v is not None]
        return f"{int(round(sum(flags)))}/{len(flags)}" if flags else "n/a"
    summ = _get(record["summary"], key)
    if summ is None:
        return "n/a"
    if stem == "psnr_differing" and not summ.get("n"):
        return "all identical"
    minimum = frechet_ci_minimum(key, summ)
    if minimum is not None and (summ.get("n") or 0) < minimum:
        point = format_summary(dict(summ, low=None, high=None), digits)
        return f"{point} [CI n/a: n={summ.get('n')} ≤ d={minimum - 1}]" if point != "n/a" else point
    return format_summary(summ, digits)


MEMORY_SOURCE_LABELS = {"cuda-measured": "CUDA measured", "analytic": "analytic estimate"}


def memory_source(record: dict) -> str | None:
    """Where a record's peak memory comes from: ``"cuda-measured"`` (``torch.cuda.max_memory_allocated``) or
    ``"analytic"`` (:func:`profilers.memory.analytic_memory`, an estimate from tensor sizes), as the record says
    (``timing.memory_source``, else the method of its ``peak_memory_mb`` summary). A record written before the
    source was stored: ``"analytic"`` on a CPU device (the only source there), None (unknown) elsewhere or
    without a peak."""
    timing = record.get("timing") or {}
    peak = _get(record.get("summary") or {}, "peak_memory_mb")
    if timing.get("peak_memory_bytes") is None and peak is None:
        return None
    source = timing.get("memory_source") or (peak or {}).get("method")
    if source in MEMORY_SOURCE_LABELS:
        return source
    device = str((record.get("environment") or {}).get("device") or "")
    return "analytic" if device.startswith("cpu") else None


def memory_labels(records: list[dict]) -> dict[str, str]:
    """The table's headers of the memory columns, naming the source (:func:`memory_source`) they hold."""
    sources = {memory_source(r) for r in records if memory_source(r) is not None or
               _get(r.get("summary") or {}, "peak_memory_mb") is not None}
    if not sources:
        return {}
    what = (MEMORY_SOURCE_LABELS.get(next(iter(sources))) or "source not recorded") if len(sources) == 1 \
        else "sources differ, see below"
    return {"peak_mb": f"peak MiB ({what})", "memory_ratio": f"peak-mem ratio ({what})"}


def memory_note(records: list[dict]) -> str | None:
    """The line under the table that says how its peak memory was obtained (None without memory numbers)."""
    by_source: dict[str | None, list[str]] = {}
    for r in records:
        if memory_source(r) is not None or _get(r.get("summary") or {}, "peak_memory_mb") is not None:
            by_source.setdefault(memory_source(r), []).append(r["arm"])
    if not by_source:
        return None
    text = {
        "analytic": "**analytic estimate, not a measurement** (on the CPU there is no allocator peak to read): "
                    "`profilers.memory.analytic_memory` adds, at each scale's peak, the weights, the KV cache as "
                    "allocated, twice the hidden state and the largest activation, from the shapes the generation "
                    "recorded; allocator fragmentation and the sampler's temporaries are not in it. It compares "
                    "arms; measure absolute peaks on a GPU",
        "cuda-measured": "**measured**: `torch.cuda.max_memory_allocated`, reset at every scale, the highest over "
                         "the scales and batches (weights, KV cache, activations, allocator rounding)",
        None: "source not recorded (a record written before the source was stored, not on a CPU)",
    }
    if len(by_source) == 1:
        return f"Peak memory (`peak MiB`, `peak-mem ratio`): {text[next(iter(by_source))]}.\n"
    parts = "; ".join(f"{', '.join(f'`{a}`' for a in arms)}: {text[source]}" for source, arms in by_source.items())
    return f"Peak memory (`peak MiB`, `peak-mem ratio`) comes from different sources: {parts}.\n"


# Fréchet distances (FID) and the dimension of the features they compare (``features`` in a summary overrides it)
FRECHET_FEATURES = {"fid_proxy": 128, "fid_real": 128, "fid_inception": 2048}


def frechet_ci_minimum(key: str, summ: dict | None = None) -> int | None:
    """The fewest samples at which the table shows the bootstrap interval of a Fréchet distance (``fid_proxy``,
    ``fid_real``, ``fid_inception``): ``d + 1`` for ``d``-dimensional features (128 for the testbed classifier's,
    2048 for Inception's pool3); None for every other metric, whose interval is always shown.

    FID fits a mean and a ``d × d`` covariance to each feature set. With ``n ≤ d`` samples the sample covariance
    has rank ``n − 1 < d``, so the distance reflects the missing rank as much as the images, and each bootstrap
    resample (its duplicates lower the rank further) mostly re-measures that: at the default 32 samples a
    FID-proxy of 0.42 came with the "interval" [0.00, 14.94]. FID's authors require more samples than feature
    dimensions (Heusel et al. 2017, TTUR reference code: the sample size "should be greater than the dimension of
    the coding layer", 10,000 recommended), and FID's bias falls only as ``1/n`` (Chong & Forsyth 2020,
    "Effectively Unbiased FID"). Below ``d + 1`` the point is kept (comparable only between arms with the same
    ``n`` against the same reference) and the interval reads ``n/a``. KID is an unbiased estimator (Bińkowski et
    al. 2018) and keeps its interval, as do IS and the per-sample paired metrics (PSNR, SSIM, token agreement)."""
    if key not in FRECHET_FEATURES:
        return None
    features = (summ or {}).get("features")
    return (int(features) if isinstance(features, int) and features > 0 else FRECHET_FEATURES[key]) + 1


def frechet_ci_note(records: list[dict], shown: list[str]) -> str | None:
    """The line under the table that explains a FID cell whose interval is ``n/a`` (None when there is none)."""
    labels = {m[1]: m[2] for m in METRICS}
    hit = set()
    for r in records:
        for key in shown:
            summ = _get(r.get("summary") or {}, key) if r.get("role") != "baseline" else None
            minimum = frechet_ci_minimum(key, summ)
            if summ and minimum is not None and summ.get("mean") is not None and (summ.get("n") or 0) < minimum:
                hit.add((labels[key], minimum))
    if not hit:
        return None
    which = ", ".join(f"{label} from n = {minimum}" for label, minimum in sorted(hit))
    return (f"`[CI n/a: n ≤ d]`: a FID's bootstrap interval is shown only with more samples than feature dimensions "
            f"d ({which}): with fewer, each set's covariance is rank-deficient and the resampled distances measure "
            f"that more than the images (Heusel et al. 2017; `ablations.report.frechet_ci_minimum`). The point "
            f"value compares arms of the same n only. KID and the per-sample metrics keep their intervals.\n")


# quality metrics whose CI is over the samples (the speedups' CIs are over timing rounds or batches)
CI_WIDTH_METRICS = ("token_agreement", "ssim", "psnr_differing", "class_correct", "fid_proxy")


def ci_width_note(records: list[dict]) -> str | None:
    """What the sample count buys: the median 95 % CI half-width over the non-baseline arms of the main metrics
    (``(high − low) / 2``), e.g. ``"… at n = 32: token agree ±0.008, SSIM ±0.022"``; None without such CIs."""
    import statistics

    labels = {m[1]: m[2] for m in METRICS}
    arms = [r for r in records if r.get("role") != "baseline"]
    parts = []
    for key in CI_WIDTH_METRICS:
        halves = []
        for r in arms:
            summ = _get(r.get("summary") or {}, key)
            minimum = frechet_ci_minimum(key, summ)
            if minimum is not None and summ and (summ.get("n") or 0) < minimum:
                continue  # no interval shown at this n (frechet_ci_minimum)
            if summ and all(isinstance(summ.get(k), (int, float)) and math.isfinite(summ[k]) for k in ("low", "high")):
                halves.append((summ["high"] - summ["low"]) / 2)
        if halves:
            parts.append(f"{labels[key]} ±{statistics.median(halves):.2g}")
    if not parts:
        return None
    ns = sorted({r["samples"]["n"] for r in arms if r.get("samples")})
    n = "/".join(str(v) for v in ns) or "?"
    return (f"CI width this sample count buys (n = {n} per arm; median 95 % CI half-width over the arms): "
            + ", ".join(parts) + ". Four times the samples halve it.\n")


def write_table(out_dir: Path, records: list[dict], unavailable: list, plan=None, interleaved: dict | None = None
                ) -> dict[str, Path]:
    """``table.csv`` (every number, with CI bounds and n) and ``table.md`` (formatted, with notes)."""
    frame = table_frame(records, unavailable, interleaved)
    records = _with_psnr_summaries(_with_interleaved(records, interleaved))
    csv_path = out_dir / "table.csv"
    tmp = csv_path.with_name(".table.csv.tmp")
    frame.to_csv(tmp, index=False)
    os.replace(tmp, csv_path)

    present = [m for m in METRICS if m[0] in MARKDOWN_COLUMNS and any(
        _get(r["summary"], m[1]) is not None for r in records if r["role"] != "baseline"
        or m[0] in ("gflops", "peak_mb") + PROMPT_AND_IMPORTED) or m[0] in ("ms_per_image", "speedup")]
    present += list(reference_metrics(records))  # --fid-reference: FID vs ref, per category
    n_batches = {len(r["timing"].get("batches", [])) for r in records}
    batches_note = f" ({n_batches.pop()} batches)" if len(n_batches) == 1 else " (batches)"
    # one headline speedup column, right after the latency, its header naming the timing; the other timing after it
    headline = headline_speedup(records, interleaved)
    by_stem = {m[0]: m for m in present}
    speed = [by_stem[headline["stem"]]] if headline["stem"] in by_stem else []
    if headline["detail"] is not None and headline["detail"]["stem"] in by_stem:
        speed.append(by_stem[headline["detail"]["stem"]])
    rest = [m for m in present if m[0] not in ("speedup", "speedup_interleaved")]
    present = rest[:1] + speed + rest[1:]
    labels = {headline["stem"]: headline["label"]}
    if headline["detail"] is not None:
        labels[headline["detail"]["stem"]] = headline["detail"]["label"]
    labels.update(memory_labels(records))  # "peak MiB (analytic estimate)" / "(CUDA measured)"
    header = ["arm", "n"] + [labels.get(m[0], m[2] + (batches_note if m[0] == "ms_per_image" else ""))
                             for m in present]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    # ablations.loadwatch: † on a sequential timing taken while the load moved; "(= baseline)" on an arm whose every
    # token and image equals the baseline's, in its `identical` cell (in its name's cell without that column)
    marks = sequential_marks(records)
    same_cell = "identical" if any(m[0] == "identical" for m in present) else "arm"
    for r in records:
        same = f" {IDENTICAL_MARK}" if r["role"] != "baseline" and is_identical(r) else ""
        cells = [f"**{r['arm']}**" if r["role"] == "baseline" else r["arm"] + (same if same_cell == "arm" else ""),
                 str(r["samples"]["n"])]
        cells += [_cell(r, m[0], m[1], m[3]) + (same if m[0] == same_cell else "")
                  + (f" {FLAG_MARK}" if marks.get(r["arm"], {}).get({"ms_per_image": "ms", "speedup": "speedup"}
                                                                    .get(m[0], "")) else "") for m in present]
        lines.append("| " + " | ".join(cells) + " |")
    for arm in unavailable:
        lines.append("| " + " | ".join([arm.name, "0"] + ["unavailable"] * len(present)) + " |")
    base = next((r for r in records if r["role"] == "baseline"), None)
    doc = []
    if base is not None:
        fam = base["family"]
        doc.append(f"# Ablation `{fam}` on `{base['model']['name']}`\n")
        s = base["sampling"]
        env = base["environment"]
        processes = env.get("processes") or []
        # the generating processes' intra-op threads (set per process), not the launcher's
        threads = processes[0].get("threads") if processes and processes[0].get("threads") else env.get("threads")
        doc.append(f"{base['samples']['n']} samples per arm (labels i mod classes, per-sample seeds from base seed "
                   f"{base['samples']['base_seed']}; sample set {base['samples']['hash']}), sampling cfg={s['cfg']} "
                   f"top_k={s['top_k']} top_p={s['top_p']}; batch {base['timing']['batch_size']}, "
                   f"{base['timing']['warmup_generations']} warm-up generation(s) per process and arm discarded"
                   f"{_warmup_size_note(base['timing'])}; "
                   f"{env.get('device_name')} ({env.get('device')}), {threads} threads per process, dtype "
                   f"{env.get('dtype')}, git {(env.get('git') or {}).get('sha', '?')}"
                   + (" (dirty)" if (env.get('git') or {}).get('dirty') else "") + ".\n")
        if plan is not None and plan.notes:
            doc.extend(f"> {note}\n" for note in plan.notes)
    doc.append(_headline_note(headline, interleaved))
    doc.append("Each cell: mean [95 % bootstrap CI]; `n` = samples per arm (latency and sequential speedup: over "
               "the n/batch-size batches, paired by batch; FID/KID/IS: set-level, bootstrap over samples). "
               "Fidelity metrics (PSNR, SSIM, MS-SSIM, token agreement, FID-proxy) compare each arm with the "
               "baseline image of the same seed. `PSNR dB (differing)`: mean over only the samples whose image "
               "differs from the baseline's (an identical image has no finite PSNR; `identical` counts them, k/n); "
               "table.csv also has `psnr` (the mean with identical images capped at 100 dB, inflated by them) and "
               "`psnr_mean_mse` (PSNR of the mean MSE over all samples).\n")
    width = ci_width_note(records)
    if width:
        doc.append(width)
    doc.extend(lines)
    doc.append("")
    doc.extend(table_footnotes(records))
    doc.extend(activity_lines(records))  # how often each component acted, and which never did (issue 31)
    protocols = sorted({str(r["metrics"].get("set_level", {}).get(name, {}).get("protocol"))
                        for r in records for name in ("fid_inception", "kid_inception", "is_inception")
                        if isinstance(r["metrics"].get("set_level", {}).get(name), dict)
                        and r["metrics"]["set_level"][name].get("protocol")})
    if protocols:
        doc.append(f"FID / KID / IS (Inception): the FID Inception-v3 network, input protocol "
                   f"{' and '.join(protocols)} (var_core.eval.inception; protocols resize and normalise "
                   f"differently, so their FIDs are not comparable).\n")
    doc.append(f"Timed region: {TIMED_REGION}.\n")
    if reference_note(records):
        doc.append(reference_note(records))
    for note in (memory_note(records) if {"peak_mb", "memory_ratio"} & {m[0] for m in present} else None,
                 frechet_ci_note(records, [m[1] for m in present])):
        if note:
            doc.append(note)
    reasons: dict[str, str] = {}
    for r in records:
        for name, why in r["metrics"].get("unavailable", {}).items():
            if why != "reference arm":
                reasons.setdefault(name, why)
    from .imports import import_footer
    from var_core.eval.metric_registry import directions_line

    doc.extend(import_footer(out_dir, records))
    shown = directions_line([m[1] for m in present])
    if shown:
        doc.append(shown + "\n")
    if reasons:
        doc.append("Not available here:\n")
        doc.extend(f"- `{name}`: {why}" for name, why in sorted(reasons.items()))
        doc.append("")
    tests = _wilcoxon_family(records)
    if tests:
        family = sum(math.isfinite(a) for *_, a in tests)
        doc.append("Paired Wilcoxon signed-rank tests against the baseline (same samples; two-sided). `p`: the raw "
                   f"p-value of each test; `p (Holm)`: Holm-Bonferroni adjusted over the family of all {family} "
                   "tests in this table (controls the family-wise error rate; read significance from it):\n")
        doc.append("| arm | metric | n | non-zero | median diff | p | p (Holm) |")
        doc.append("|---|---|---|---|---|---|---|")
        for arm, name, t, adj in tests:
            p = t.get("p_value")
            md = t.get("median_difference")
            doc.append(f"| {arm} | {name} | {t.get('n')} | {t.get('n_nonzero')} | "
                       f"{'n/a' if md is None else f'{md:.4g}'} | {'n/a' if p is None else f'{p:.3g}'} | "
                       f"{f'{adj:.3g}' if math.isfinite(adj) else 'n/a'} |")
        doc.append("")
    if unavailable:
        doc.append("Unavailable arms:\n")
        doc.extend(f"- `{a.name}`: {a.error}" for a in unavailable)
        doc.append("")
    doc.append("Arms:\n")
    doc.extend(f"- `{r['arm']}` ({r['config_hash']}): {r.get('changes') or r['description']}" for r in records)
    md_path = out_dir / "table.md"
    tmp = md_path.with_name(".table.md.tmp")
    tmp.write_text("\n".join(doc) + "\n")
    os.replace(tmp, md_path)
    return {"csv": csv_path, "markdown": md_path}


def _warmup_size_note(timing: dict) -> str:
    """How big the warm-up generations were (records before the field existed say nothing)."""
    size = timing.get("warmup_batch_size")
    if not size or not timing.get("warmup_generations"):
        return ""
    return (f" (the first arm a process generates warms with {size} sample(s), i.e. its timed batch; later arms "
            f"with one sample, the process being warm at the timed shapes)")


def _headline_note(headline: dict, interleaved: dict | None) -> str:
    """The line above the table that says which timing the headline speedup is (and when it was measured)."""
    if headline["timing"] == "interleaved":
        m = (interleaved or {}).get("measured") or {}
        when = (f" Measured {m.get('at')} (measurement {m.get('id')}: {m.get('reason')}; kept with the study and "
                f"reused on resume, `--retime` re-measures)." if m else "")
        return (f"**Headline speedup: `{headline['label']}`**, the interleaved re-timing: after all arms, a batch of "
                f"{interleaved['batch_size']} (the first samples) per arm re-timed {interleaved['rounds']} times with "
                f"the arms back to back in a rotating order, the baseline/arm ratio paired by round (bootstrap CI "
                f"over rounds): {'the latency-regime speedup, ' if interleaved['batch_size'] == 1 else ''}robust "
                f"to load changes between the arms' main runs.{when} Detail: `{headline['detail']['label']}`, the "
                f"sequential main runs (the throughput batch, paired by batch; `speedup` in table.csv).\n")
    return (f"**Headline speedup: `{headline['label']}`**, the sequential main runs: baseline/arm generate() "
            f"seconds paired by batch (the throughput batch; no interleaved re-timing of these arms: --timing-rounds "
            f"0, a single arm, or one measured for other arms).\n")


# ----- plots -----------------------------------------------------------------------------------------------
# Every plot stays readable with many arms (issue 25): the legend sits outside the axes (right of the figure, in
# room the constrained layout reserves, so it covers neither data nor titles), colour = series and marker = level
# (:func:`arm_styles`), and per-arm facets are a grid sized to the arm count, never truncated.
MARKERS = ("o", "s", "^", "D", "v", "P", "X", "*", "<", ">", "h", "p", "d", "H", "8")
BASELINE_COLOR = (0.0, 0.0, 0.0)
MAX_LINES_PER_PANEL = 6  # per-scale curves: more arms than this are split into panels (a series never split)
LEGEND_ROWS = 26  # legend entries per column before a second column starts


def _plt():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import seaborn as sns

    sns.set_theme(style="whitegrid", context="paper")
    return plt, sns


def _figure(nrows: int = 1, ncols: int = 1, figsize: tuple[float, float] = (6.4, 4.0), **subplots):
    """A figure on its own Agg canvas (no pyplot state to close) with the constrained layout, and its axes as a
    2-d array: the layout makes room for titles and for an ``"outside"`` legend (:func:`_legend_outside`)."""
    _plt()  # the theme
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=figsize, layout="constrained")
    FigureCanvasAgg(fig)
    axes = fig.subplots(nrows, ncols, squeeze=False, **subplots)
    return fig, axes


def _legend_outside(fig, handles: list, labels: list[str], title: str | None = None, fontsize: float = 7):
    """One legend right of every axes (``loc="outside right upper"``: the constrained layout shrinks the axes to
    make room, so it never covers the data or a title), in columns of at most :data:`LEGEND_ROWS` entries."""
    if not handles:
        return None
    ncols = max(1, math.ceil(len(handles) / LEGEND_ROWS))
    return fig.legend(handles, labels, loc="outside right upper", fontsize=fontsize, frameon=False, ncols=ncols,
                      title=title, title_fontsize=fontsize + 1)


def _legend_height(entries: int) -> float:
    """Inches a one-column legend of ``entries`` lines needs (the figure is made at least this tall)."""
    return 0.17 * min(entries, LEGEND_ROWS) + 0.6


def _save(fig, path: Path) -> Path:
    fig.savefig(path, dpi=130, bbox_inches="tight")
    return path


@dataclass(frozen=True)
class ArmStyle:
    series: str
    level: str
    color: tuple
    marker: str


def arm_styles(names: list[str]) -> dict[str, ArmStyle]:
    """How every plot draws each arm: **colour = series, marker = level**.

    An arm named ``<series>@<level>`` (the scorer family's ``entropy@tau=0.8``, guidance's ``stop_at@6``) is level
    ``<level>`` of series ``<series>``; any other arm is a series of its own without a level (marker ``o``).
    Series take distinct colours in the order they first appear (tab10's up to 10 series; tab20's dark then light
    shades up to 20; evenly spaced hues beyond), levels take distinct markers in the order they first appear (the
    same level has the same marker in every series; more than 15 levels reuse markers). The baseline is black."""
    import seaborn as sns

    parsed = {}
    for name in names:
        series = _series(name)
        parsed[name] = series if series is not None else (name, "")
    series_names = list(dict.fromkeys(s for n, (s, _) in parsed.items() if n != "baseline"))
    count = len(series_names)
    if count <= 10:
        colors = sns.color_palette("tab10", max(count, 1))
    elif count <= 20:
        tab20 = sns.color_palette("tab20", 20)
        colors = (tab20[0::2] + tab20[1::2])[:count]
    else:
        colors = sns.color_palette("husl", count)
    color = dict(zip(series_names, (tuple(c) for c in colors)))
    levels = list(dict.fromkeys(level for _, level in parsed.values() if level))
    marker = {level: MARKERS[i % len(MARKERS)] for i, level in enumerate(levels)}
    styles = {}
    for name, (series, level) in parsed.items():
        if name == "baseline":
            styles[name] = ArmStyle("baseline", "", BASELINE_COLOR, "s")
        else:
            styles[name] = ArmStyle(series, level, color[series], marker[level] if level else "o")
    return styles


def _handle(style: ArmStyle, linestyle: str = "-"):
    """A legend entry showing an arm's colour and marker."""
    from matplotlib.lines import Line2D

    return Line2D([], [], color=style.color, marker=style.marker, linestyle=linestyle, markersize=5)


def _err(summ: dict | None) -> tuple[float, float, float]:
    if not summ or summ.get("mean") is None:
        return math.nan, 0.0, 0.0
    m = summ["mean"]
    lo = summ.get("low") if summ.get("low") is not None else m
    hi = summ.get("high") if summ.get("high") is not None else m
    return m, max(0.0, m - lo) if math.isfinite(lo) else 0.0, max(0.0, hi - m) if math.isfinite(hi) else 0.0


def _grid_shape(count: int, max_cols: int) -> tuple[int, int]:
    cols = max(1, min(max_cols, count))
    return math.ceil(count / cols), cols


def _drop_unused(axes, used: int) -> list:
    """The first ``used`` axes of a grid (row-major); the rest are removed from the figure."""
    flat = list(axes.flat)
    for ax in flat[used:]:
        ax.remove()
    return flat[:used]


def _label_grid(axes: list, ncols: int, xlabel: str, ylabel: str) -> None:
    """Axis labels on the outer facets of a shared-axes grid: the x label and tick labels on every facet with no
    facet below it (also above the removed cells of an incomplete last row), the y label on the first column."""
    for i, ax in enumerate(axes):
        bottom = i + ncols >= len(axes)
        ax.set_xlabel(xlabel if bottom else "")
        if bottom:
            ax.xaxis.set_tick_params(labelbottom=True)
        ax.set_ylabel(ylabel if i % ncols == 0 else "")


def _panels(names: list[str], styles: dict[str, ArmStyle]) -> list[list[str]]:
    """The arms packed into panels of at most :data:`MAX_LINES_PER_PANEL` curves in their order, the arms of one
    series always in one panel (a series with more levels than that gets a panel of its own)."""
    groups: dict[str, list[str]] = {}
    for name in names:
        groups.setdefault(styles[name].series, []).append(name)
    panels: list[list[str]] = []
    for members in groups.values():
        if panels and len(panels[-1]) + len(members) <= MAX_LINES_PER_PANEL:
            panels[-1].extend(members)
        else:
            panels.append(list(members))
    return panels


def per_scale_figure(records: list[dict], key: str, ylabel: str, title: str,
                     styles: dict[str, ArmStyle] | None = None):
    """``metrics.per_scale[key]`` (per sample, per scale) of every arm as a mean curve with a 95 % CI band over
    samples, coloured by series, marked by level; the arms in panels of at most :data:`MAX_LINES_PER_PANEL`
    curves (shared axes), the baseline (when it has the data) dashed in every panel as the reference. None
    without data. The band is :func:`~var_core.eval.stats.bootstrap_ci`'s percentile interval (1,000 seeded
    resamples in chunks); the values are read scale by scale from the records (a pandas row table of every
    (sample, scale) value held ~1.6 KB per sample at 10 scales, seaborn's bootstrap copies beside it)."""
    from var_core.eval.stats import bootstrap_ci

    frames = {}  # arm -> (record, {scale: the samples' values}): references to the record's floats, no row table
    for r in records:
        columns: dict[int, list] = {}
        for values in r["metrics"]["per_scale"].get(key) or []:
            for s, v in enumerate(values):
                if v is not None:
                    columns.setdefault(s, []).append(v)
        if columns:
            frames[r["arm"]] = (r, columns)
    if not frames:
        return None
    styles = styles or arm_styles(list(frames))
    reference = next((n for n, (r, _) in frames.items() if r["role"] == "baseline"), None)
    names = [n for n in frames if n != reference]
    panels = _panels(names, styles) or [[]]
    nrows, ncols = _grid_shape(len(panels), 3)
    width = 4.0 * ncols + 2.4
    height = max(3.2 * nrows + 0.7, _legend_height(len(frames)))
    fig, axes = _figure(nrows, ncols, (width, height), sharex=True, sharey=True)
    axes = _drop_unused(axes, len(panels))

    bands = {}

    def band(name):
        if name not in bands:
            rows = [(s, bootstrap_ci(np.asarray(part, dtype=float), method="percentile", n_resamples=1000, seed=0))
                    for s, part in sorted(frames[name][1].items())]
            bands[name] = np.array([(s, c.mean, c.low, c.high) for s, c in rows], dtype=float).reshape(-1, 4)
        return bands[name]

    def curve(ax, name, **kw):
        b = band(name)
        ax.plot(b[:, 0], b[:, 1], color=styles[name].color, marker=styles[name].marker, label=name, **kw)
        ax.fill_between(b[:, 0], b[:, 2], b[:, 3], color=styles[name].color, alpha=0.2, linewidth=0)

    for ax, panel in zip(axes, panels):
        if reference is not None:
            curve(ax, reference, linestyle="--", linewidth=1.0)
        for name in panel:
            curve(ax, name)
        ax.set_title(textwrap.fill(", ".join(dict.fromkeys(styles[n].series for n in panel)), 48), fontsize=8)
    _label_grid(axes, ncols, "scale (0-indexed)", ylabel)
    legend_names = ([reference] if reference is not None else []) + names
    _legend_outside(fig, [_handle(styles[n], "--" if n == reference else "-") for n in legend_names], legend_names,
                    title="arm (colour: series, marker: level)")
    fig.suptitle(title)
    return fig


def speed_quality_figure(records: list[dict], styles: dict[str, ArmStyle] | None = None):
    """Speedup (the interleaved one when an arm has it) against each quality metric, one point per arm with its
    95 % CI bars; colour = series, marker = level; None without a non-baseline arm with quality numbers."""
    arms = [r for r in records if r["role"] != "baseline"]
    quality = [k for k in ("psnr_mean_mse", "fid_proxy", "class_correct") if any(_get(r["summary"], k) for r in arms)]
    if not (arms and quality):
        return None
    styles = styles or arm_styles([r["arm"] for r in records])
    fig, axes = _figure(1, len(quality), (4.6 * len(quality) + 2.4, max(4.0, _legend_height(len(records)))))
    labels = {"psnr_mean_mse": "PSNR of the mean MSE vs baseline (dB)",
              "fid_proxy": "FID-proxy vs baseline (lower is better)", "class_correct": "class accuracy"}
    interleaved = any(_get(r["summary"], "speedup_interleaved") for r in arms)
    shown: list[str] = []
    for ax, key in zip(axes[0], quality):
        for r in records:
            if r["role"] == "baseline" and key in ("psnr_mean_mse", "fid_proxy"):
                continue
            speed_key = "speedup_interleaved" if _get(r["summary"], "speedup_interleaved") else "speedup"
            x, xl, xh = _err(_get(r["summary"], speed_key)) if r["role"] != "baseline" else (1.0, 0, 0)
            y, yl, yh = _err(_get(r["summary"], key))
            if not (math.isfinite(x) and math.isfinite(y)):
                continue
            style = styles[r["arm"]]
            ax.errorbar([x], [y], xerr=[[xl], [xh]], yerr=[[yl], [yh]], fmt=style.marker, capsize=3,
                        color=style.color, label=r["arm"], alpha=0.85)
            if r["arm"] not in shown:
                shown.append(r["arm"])
        ax.axvline(1.0, color="grey", lw=0.8, ls="--")
        ax.set_xlabel("speedup vs baseline (x" + (", interleaved timing)" if interleaved else ")"))
        ax.set_ylabel(labels[key])
    shown.sort(key=[r["arm"] for r in records].index)
    _legend_outside(fig, [_handle(styles[n], "none") for n in shown], shown,
                    title="arm (colour: series, marker: level)")
    fig.suptitle(f"speed vs quality ({records[0]['family']}, n={records[0]['samples']['n']}, 95% CI)")
    return fig


MAX_CLASS_HUE = 10  # more classes than this: the activation histogram pools them (one bar per scale)


def activation_figure(records: list[dict]):
    """NOVA Fig. 8: the first accelerated scale of each sample, one facet per arm that has it (every such arm, in
    a grid sized to their count; shared axes), bars by class up to :data:`MAX_CLASS_HUE` classes, pooled beyond.
    None when no arm records an activation scale."""
    import seaborn as sns

    data: dict[str, list[tuple[int, int]]] = {}
    for r in records:
        if r["role"] == "baseline":
            continue
        act = r["metrics"].get("activation_scale")
        if not act or all(a is None for a in act):
            continue
        data[r["arm"]] = [(int(label), int(a)) for label, a in zip(r["metrics"]["label"], act) if a is not None]
    if not data:
        return None
    classes = sorted({c for pairs in data.values() for c, _ in pairs})
    by_class = len(classes) <= MAX_CLASS_HUE
    groups = classes if by_class else [None]
    colors = dict(zip(groups, sns.color_palette("tab10", max(len(groups), 1))))
    scales = [a for pairs in data.values() for _, a in pairs]
    ticks = list(range(min(scales), max(scales) + 1))
    nrows, ncols = _grid_shape(len(data), 4)
    legend_h = _legend_height(len(groups)) if by_class else 0
    fig, axes = _figure(nrows, ncols, (3.6 * ncols + (1.4 if by_class else 0.4), max(2.6 * nrows + 0.8, legend_h)),
                        sharex=True, sharey=True)
    axes = _drop_unused(axes, len(data))
    width = 0.8 / len(groups)
    num_scales = records[0].get("model", {}).get("num_scales")
    for ax, (arm, pairs) in zip(axes, data.items()):
        for j, group in enumerate(groups):
            counts = [sum(1 for c, a in pairs if a == t and (group is None or c == group)) for t in ticks]
            ax.bar([t - 0.4 + (j + 0.5) * width for t in ticks], counts, width=width, color=colors[group],
                   label="all classes" if group is None else str(group))
        ax.set_title(arm, fontsize=8)
        ax.set_xticks(ticks)
        ax.set_xticklabels(["never" if t == num_scales else str(t) for t in ticks])
    _label_grid(axes, ncols, "activation scale", "samples")
    if by_class:
        from matplotlib.patches import Patch

        _legend_outside(fig, [Patch(color=colors[g]) for g in groups], [str(g) for g in groups], title="class")
    fig.suptitle("first accelerated scale per sample, " + ("by class" if by_class else
                                                            f"all {len(classes)} classes pooled")
                 + " (never = number of scales)")
    return fig


def latency_breakdown_figure(records: list[dict]):
    """One stacked bar per arm (all of them, the figure as tall as they need) of the profiler's self time per
    component; colour = component, legend outside. None without breakdowns."""
    import pandas as pd

    rows = [(r["arm"], comp, ms) for r in records
            for comp, ms in (r["timing"].get("breakdown_ms_per_image") or {}).items()]
    if not rows:
        return None
    df = pd.DataFrame(rows, columns=["arm", "component", "ms"])
    pivot = df.pivot_table(index="arm", columns="component", values="ms", aggfunc="sum", fill_value=0.0)
    pivot = pivot.reindex([r["arm"] for r in records if r["arm"] in pivot.index])
    pivot = pivot[pivot.sum().sort_values(ascending=False).index]
    fig, axes = _figure(1, 1, (9, max(0.3 * len(pivot) + 1.8, _legend_height(pivot.shape[1]))))
    ax = axes[0][0]
    pivot.plot(kind="barh", stacked=True, ax=ax, colormap="tab20", width=0.75, legend=False)
    ax.invert_yaxis()
    ax.set_xlabel("ms per image (self time of the profiler's spans)")
    ax.set_ylabel("arm")
    handles, names = ax.get_legend_handles_labels()
    _legend_outside(fig, handles, names, title="component", fontsize=6)
    fig.suptitle("latency breakdown per component")
    return fig


def write_plots(out_dir: Path, records: list[dict]) -> dict[str, Path]:
    """speed-quality scatter, entropy per scale, activation-scale histogram per class, token agreement,
    latency breakdown, quality vs FLOPs per series of arms, and the plots of the family's analysis (if any)."""
    plots_dir = out_dir / "plots"
    plots_dir.mkdir(parents=True, exist_ok=True)
    arms = [r for r in records if r["role"] != "baseline"]
    styles = arm_styles([r["arm"] for r in records])  # one colour / marker per arm in every plot
    figures = {
        "speed_quality": lambda: speed_quality_figure(records, styles),
        "entropy_per_scale": lambda: per_scale_figure(
            records, "entropy", "mean predictive entropy (nats / token)",
            "per-scale entropy of the sampled distribution (95% CI over samples; dashed: baseline)", styles),
        "activation_histogram": lambda: activation_figure(records),
        "token_agreement": lambda: per_scale_figure(
            arms, "token_agreement", "fraction of tokens equal to the baseline",
            "token agreement with the baseline per scale (95% CI over samples)", styles),
        "latency_breakdown": lambda: latency_breakdown_figure(records),
        "quality_vs_flops": lambda: quality_vs_flops_figure(records, styles),
    }
    paths: dict[str, Path] = {}
    for name, build in figures.items():
        fig = build()
        if fig is not None:
            paths[name] = _save(fig, plots_dir / f"{name}.png")
    paths.update(write_analysis_plots(out_dir, plots_dir))
    return paths


# ----- curves and the analyses' plots (issue 12: the papers' figures) ---------------------------------------
def _series(name: str) -> tuple[str, str] | None:
    """``("entropy", "tau=0.8")`` for an arm named ``entropy@tau=0.8`` (None: not a series point)."""
    if "@" not in name:
        return None
    head, _, tail = name.partition("@")
    return head, tail


def quality_vs_flops_figure(records: list[dict], styles: dict[str, ArmStyle] | None = None):
    """Quality against the analytic FLOPs ratio, one line per series of arms (``<series>@<level>``: e.g. a scorer at
    several pruning levels; colour = series, marker = level), 95 % CI bars; arms outside a series are single
    points (the baseline, at 1, is left out so the curves keep the scale). None without a series of two points."""
    metrics = [(k, label) for k, label in (("ssim", "SSIM vs baseline"), ("token_agreement", "token agreement"),
                                           ("class_correct", "class accuracy"))
               if any(_get(r["summary"], k) for r in records if r["role"] != "baseline")]
    points = []
    for r in records:
        if r["role"] == "baseline":
            continue
        flops = _get(r["summary"], "flops_ratio")
        if flops is None or flops.get("mean") is None:
            continue
        points.append((flops["mean"], r))
    styles = styles or arm_styles([r["arm"] for _, r in points])
    groups: dict[str, list] = {}
    for x, r in points:
        groups.setdefault(styles[r["arm"]].series, []).append((x, r))
    if not metrics or not any(len(v) >= 2 for v in groups.values()):
        return None
    names = [r["arm"] for _, r in points]
    fig, axes = _figure(1, len(metrics), (5.2 * len(metrics) + 2.4, max(4.2, _legend_height(len(names)))))
    for ax, (key, label) in zip(axes[0], metrics):
        for series, pts in groups.items():
            pts = sorted(pts, key=lambda p: p[0])
            ys = [_err(_get(r["summary"], key)) for _, r in pts]
            if len(pts) > 1:
                ax.plot([p[0] for p in pts], [y[0] for y in ys], "-", color=styles[pts[0][1]["arm"]].color,
                        alpha=0.6, lw=1)
            for (x, r), (y, yl, yh) in zip(pts, ys):
                style = styles[r["arm"]]
                ax.errorbar([x], [y], yerr=[[yl], [yh]], fmt=style.marker, capsize=3, color=style.color,
                            label=r["arm"], alpha=0.85, ms=5)
        ax.set_xlabel("FLOPs ratio vs baseline (analytic)")
        ax.set_ylabel(label)
    _legend_outside(fig, [_handle(styles[n], "none") for n in names], names,
                    title="arm (colour: series, marker: level)")
    family = records[0].get("family", "") if records else ""
    fig.suptitle(f"quality vs FLOPs per series ({family}; arms named series@level; 95% CI)")
    return fig


def plot_quality_vs_flops(records: list[dict], path: Path) -> Path | None:
    """:func:`quality_vs_flops_figure` saved to ``path`` (None: nothing to plot)."""
    fig = quality_vs_flops_figure(records)
    return None if fig is None else _save(fig, path)


def plot_layer_entropy(data: dict, path: Path) -> Path | None:
    """NOVA Fig. 4(c): one heat map per (sample, block) of the logit-lens entropy at one scale, shared colour scale,
    each titled with the block's mean entropy."""
    maps = np.asarray(data.get("maps") or [], dtype=float)  # samples x blocks x h x w
    if maps.ndim != 4 or maps.size == 0:
        return None
    plt, _ = _plt()
    S, L = maps.shape[:2]
    fig, axes = plt.subplots(S, L, figsize=(1.9 * L + 1.2, 1.9 * S + 0.6), squeeze=False)
    vmin, vmax = float(np.nanmin(maps)), float(np.nanmax(maps))
    image = None
    for i in range(S):
        for b in range(L):
            ax = axes[i][b]
            image = ax.imshow(maps[i, b], cmap="magma", vmin=vmin, vmax=vmax, interpolation="nearest")
            ax.set_xticks([])
            ax.set_yticks([])
            ax.set_title(f"block {b}: {np.nanmean(maps[i, b]):.2f}", fontsize=7)
        label = (data.get("labels") or [None] * S)[i]
        axes[i][0].set_ylabel(f"sample {data['indices'][i]}" + (f"\nclass {label}" if label is not None else ""),
                              fontsize=7)
    fig.colorbar(image, ax=axes, shrink=0.8, label="entropy (nats)")
    h, w = data.get("hw", ["?", "?"])
    fig.suptitle(f"logit-lens entropy per block at scale {data.get('scale')} ({h}x{w}); title: block mean")
    fig.savefig(path, dpi=130)
    plt.close(fig)
    return path


def plot_gamma(data: dict, path: Path) -> Path | None:
    """LD-Pruning Fig. 3(a): γ_k per scale, one thin line per sample, the mean with a 95 % CI band, SATS's δ."""
    import pandas as pd

    rows = [(i, k, g) for i, row in enumerate(data.get("gamma") or []) for k, g in enumerate(row) if g is not None]
    if not rows:
        return None
    _, sns = _plt()
    df = pd.DataFrame(rows, columns=["sample", "scale", "gamma"])
    fig, axes = _figure(1, 1, (7.6, 4))
    ax = axes[0][0]
    for _, part in df.groupby("sample"):
        ax.plot(part["scale"], part["gamma"], color="grey", lw=0.6, alpha=0.4)
    sns.lineplot(df, x="scale", y="gamma", errorbar=("ci", 95), seed=0, marker="o", ax=ax, color="C0", label="mean",
                 legend=False)
    if data.get("delta") is not None:
        ax.axhline(data["delta"], color="C3", ls="--", lw=1, label=f"SATS delta = {data['delta']:g}")
    ax.set_xlabel("scale (0-indexed)")
    ax.set_ylabel("guidance discrepancy gamma_k")
    ax.set_title(f"cond/uncond discrepancy per scale ({len(data['gamma'])} samples, plain model)")
    _legend_outside(fig, *ax.get_legend_handles_labels())
    return _save(fig, path)


def plot_criterion_iou(data: dict, path: Path) -> Path | None:
    """LD-Pruning Fig. 4: IoU with the tokens that change vs pruning rate, one line per criterion (95 % CI)."""
    rows = data.get("summary") or []
    if not rows:
        return None
    _, sns = _plt()
    names = list(dict.fromkeys(r["criterion"] for r in rows))
    fig, axes = _figure(1, 1, (7.6, max(4.0, _legend_height(len(names)))))
    ax = axes[0][0]
    colors = dict(zip(names, sns.color_palette("tab10", max(3, len(names)))))
    for name in names:
        part = sorted((r for r in rows if r["criterion"] == name), key=lambda r: r["rate"])
        x = [r["rate"] for r in part]
        ax.plot(x, [r["mean"] for r in part], "-o", ms=3, color=colors[name], label=name)
        ax.fill_between(x, [r["low"] for r in part], [r["high"] for r in part], color=colors[name], alpha=0.15)
    ax.set_xlabel("pruning rate")
    ax.set_ylabel("IoU with the changing tokens")
    ax.set_title(f"kept set vs decoded change |I_k - I_k-1| (scales {data.get('scales')}, 95% CI)")
    _legend_outside(fig, *ax.get_legend_handles_labels(), title="criterion")
    return _save(fig, path)


def plot_rho_calibration(data: dict, path: Path) -> Path | None:
    """ToProVAR Fig. 8 (right): ρ_s per scale (samples and mean with 95 % CI), the distribution of ρ* (ρ at each
    sample's good depth) with the implied τ and the paper's 0.4."""
    import pandas as pd

    table, calib = data.get("table") or {}, data.get("calibration") or {}
    rows = [(i, k, r) for i, row in enumerate(table.get("rho") or []) for k, r in enumerate(row) if r is not None]
    if not rows:
        return None
    _, sns = _plt()
    df = pd.DataFrame(rows, columns=["sample", "scale", "rho"])
    fig, axes = _figure(1, 2, (12, 4))
    ax, hx = axes[0]
    for _, part in df.groupby("sample"):
        ax.plot(part["scale"], part["rho"], color="grey", lw=0.6, alpha=0.4)
    sns.lineplot(df, x="scale", y="rho", errorbar=("ci", 95), seed=0, marker="o", ax=ax, color="C0", label="mean",
                 legend=False)
    stars = calib.get("rho_star") or []
    at = calib.get("star_scale") or calib.get("good_depth") or []
    ax.scatter([g for g, s in zip(at, stars) if s is not None], [s for s in stars if s is not None], color="C2",
               zorder=3, s=14, label=f"rho at the good depth (SSIM > {calib.get('ssim_threshold', 0.8):g})")
    for value, name, color in ((calib.get("tau"), "implied tau", "C3"), (0.4, "paper tau", "k")):
        if value is not None:
            ax.axhline(value, color=color, ls="--", lw=1, label=f"{name} = {value:.2f}")
            hx.axvline(value, color=color, ls="--", lw=1, label=f"{name} = {value:.2f}")
    ax.set_xlabel("scale (0-indexed)")
    ax.set_ylabel("rho_s (share of below-mean-entropy tokens)")
    values = [s for s in stars if s is not None]
    if values:
        hx.hist(values, bins=min(20, max(5, len(values) // 2)), color="C2", alpha=0.7)
    hx.set_xlabel("rho* (at each sample's good depth)")
    hx.set_ylabel("samples")
    handles, labels = ax.get_legend_handles_labels()  # the lines of the histogram repeat the curve's labels
    _legend_outside(fig, handles, labels)
    fig.suptitle(f"ToProVAR tau calibration ({len(table.get('rho') or [])} samples, rho from {table.get('source')})")
    return _save(fig, path)


ANALYSIS_PLOTS = {  # analysis file -> (plot name, plot function)
    "layer_entropy.json": ("layer_entropy", plot_layer_entropy),
    "gamma_per_scale.json": ("gamma_per_scale", plot_gamma),
    "criterion_iou.json": ("criterion_iou", plot_criterion_iou),
    "rho_calibration.json": ("rho_calibration", plot_rho_calibration),
}


def write_analysis_plots(out_dir: Path, plots_dir: Path) -> dict[str, Path]:
    """The plots of the family analyses found under ``<out_dir>/analysis`` (see ``ablations.base.run_analysis``)."""
    import json

    paths: dict[str, Path] = {}
    for file, (name, plot) in ANALYSIS_PLOTS.items():
        source = Path(out_dir) / "analysis" / file
        if source.is_file():
            path = plot(json.loads(source.read_text()), plots_dir / f"{name}.png")
            if path is not None:
                paths[name] = path
    return paths


def analysis_markdown(out_dir: Path) -> str:
    """The analyses' Markdown tables (``<out_dir>/analysis/*.md``), for the end of ``table.md``."""
    folder = Path(out_dir) / "analysis"
    parts = [p.read_text() for p in sorted(folder.glob("*.md"))] if folder.is_dir() else []
    return "\n".join(parts)


def write_overview_grid(out_dir: Path, records: list[dict], k: int = 8, problems: list[str] | None = None
                        ) -> Path | None:
    """One row per arm (baseline first), the first ``k`` samples (same seeds in every column), each row's arm name
    drawn in the image's left margin (:func:`ablations.grids.save_labelled_grid`; also listed in
    ``overview_rows.txt``). A tensor file that cannot be read (``weights_only=True``: nothing in it runs) leaves its
    row out and is named in ``problems``."""
    import torch

    from var_core.eval.lightning import GenerationRun, ResultFileError

    from .grids import save_labelled_grid

    rows, names = [], []
    for r in records:
        pt = rec.record_paths(out_dir, r["arm"])[1]
        if not pt.is_file():
            continue
        try:
            run = GenerationRun.load(pt)
        except ResultFileError as exc:
            if problems is not None:
                problems.append(f"arm {r['arm']!r}: cannot read its samples {pt} ({exc.reason}); its numbers come "
                                f"from its record, its row of the overview grid is left out")
            continue
        if run.images_u8 is None:
            continue
        rows.append(run.images_u8[:k].float() / 255.0)  # the first k only (.images is a float copy of all)
        names.append(r["arm"])
    if not rows:  # an older overview would show samples that cannot be read now
        for stale in ("overview.png", "overview_rows.txt"):
            (out_dir / "grids" / stale).unlink(missing_ok=True)
        return None
    k = min(x.shape[0] for x in rows)
    images = torch.cat([x[:k] for x in rows])
    upscale = max(1, 128 // images.shape[-1])
    path = save_labelled_grid(images, out_dir / "grids" / "overview.png", nrow=k, upscale=upscale, row_labels=names)
    (out_dir / "grids" / "overview_rows.txt").write_text("\n".join(names) + "\n")
    return path


def _append_problems(md_path: Path, problems: list[str]) -> None:
    """Add the files that could not be read to ``table.md`` (atomically)."""
    text = md_path.read_text() if md_path.is_file() else ""
    text += "\nFiles that could not be read (nothing in them was run):\n\n" + "".join(f"- {p}\n" for p in problems)
    tmp = md_path.with_name(f".{md_path.name}.tmp")
    tmp.write_text(text)
    os.replace(tmp, md_path)


# ----- W&B -------------------------------------------------------------------------------------------------
def wandb_study(out_dir: Path, records: list[dict]) -> dict:
    """How a study's W&B runs are grouped and tagged: ``group`` = family, model and a hash of the results folder
    (every run of one study, first run and resumes, lands in one group); ``tags``: ``family:…``, ``model:…`` and
    ``preset:…`` for every preset an arm is built from; ``artifact``: the name of its ``study`` artifact."""
    import hashlib
    import re

    from var_core.accel.presets import PRESETS

    base = records[0] if records else {}
    family = str(base.get("family") or "study")
    model = str((base.get("model") or {}).get("name") or "model")
    folder = hashlib.sha1(str(Path(out_dir).resolve()).encode()).hexdigest()[:8]
    group = re.sub(r"[^A-Za-z0-9._-]+", "-", f"{family}-{model}-{folder}")[:120]
    presets = []
    for r in records:
        name = str((r.get("policy") or {}).get("name") or "").split("/")[0]
        if name in PRESETS and name != "baseline" and name not in presets:
            presets.append(name)
    tags = [f"family:{family}", f"model:{model}"] + [f"preset:{p}" for p in presets]
    return {"group": group, "tags": [t[:64] for t in tags], "artifact": f"study-{group}", "family": family,
            "model": model, "presets": presets}


def study_artifact_files(out_dir: Path, records: list[dict]) -> dict[str, Path]:
    """The files of a study's W&B artifact, by their name in it: every arm's record (``arms/<arm>.json``),
    ``table.md``, ``table.csv`` and, when present, ``timing_interleaved.json`` (not ``study.json``: the runner
    rewrites it after the report, so the copy would still say ``running``)."""
    out_dir = Path(out_dir)
    files: dict[str, Path] = {}
    for r in records:
        path = rec.record_paths(out_dir, r["arm"])[0]
        if path.is_file():
            files[str(path.relative_to(out_dir))] = path
    for name in ("table.md", "table.csv", "timing_interleaved.json"):
        if (out_dir / name).is_file():
            files[name] = out_dir / name
    return files


def log_wandb(out_dir: Path, mode: str, records: list[dict], frame, plots: dict[str, Path],
              grids: dict[str, Path]) -> Path | None:
    """Mirror the study into a W&B run under ``out_dir/wandb`` (``disabled``: nothing at all): the table, plots and
    grids as logged media, each arm's headline numbers in the run summary, and the records and table files as an
    artifact of type ``study`` (:func:`study_artifact_files`); runs are grouped per study and tagged with family,
    model and presets (:func:`wandb_study`)."""
    if mode == "disabled":
        return None
    os.environ.setdefault("WANDB_SILENT", "true")
    wandb_root = out_dir / "wandb"
    wandb_root.mkdir(parents=True, exist_ok=True)
    for var, sub in (("WANDB_CACHE_DIR", "cache"), ("WANDB_DATA_DIR", "data"), ("WANDB_ARTIFACT_DIR", "artifacts")):
        os.environ.setdefault(var, str(wandb_root / sub))
    import wandb

    base = records[0] if records else {}
    study = wandb_study(out_dir, records)
    config = {"family": base.get("family"), "model": base.get("model"), "sampling": base.get("sampling"),
              "samples": {k: v for k, v in (base.get("samples") or {}).items() if k in ("n", "base_seed", "hash")},
              "arms": {r["arm"]: {"config_hash": r["config_hash"], "policy": r["policy"]} for r in records},
              "study": {"group": study["group"], "folder": str(Path(out_dir).resolve())}}
    run = wandb.init(mode=mode, dir=str(out_dir), project=os.environ.get("WANDB_PROJECT", "varscope"),
                     name=f"ablate-{base.get('family')}-{out_dir.name}", config=config, job_type="ablation",
                     group=study["group"], tags=study["tags"],
                     settings=wandb.Settings(silent=True, x_disable_stats=True))
    try:
        table = frame.astype(object).where(frame.notna(), None)
        payload: dict[str, Any] = {"ablation_table": wandb.Table(dataframe=table)}
        for name, path in plots.items():
            payload[f"plots/{name}"] = wandb.Image(str(path))
        for name, path in grids.items():
            payload[f"grids/{name}"] = wandb.Image(str(path), caption=name)
        run.log(payload)
        for r in records:
            for key in ("ms_per_image", "speedup", "speedup_interleaved", "psnr_mean_mse", "psnr_differing",
                        "identical", "ssim", "class_correct", "fid_proxy"):
                summ = _get(r["summary"], key)
                if summ and summ.get("mean") is not None:
                    run.summary[f"{r['arm']}/{key}"] = summ["mean"]
        if "speedup_headline" in frame.columns:
            for _, row in frame.iterrows():
                value = row.get("speedup_headline")
                if value is not None and isinstance(value, (int, float)) and math.isfinite(value):
                    run.summary[f"{row['arm']}/speedup_headline"] = float(value)
                    run.summary["speedup_headline_timing"] = row.get("speedup_headline_timing")
        files = study_artifact_files(out_dir, records)
        if files:
            artifact = wandb.Artifact(study["artifact"], type="study",
                                      description=f"ablation {study['family']} on {study['model']}: arm records "
                                                  f"and table ({Path(out_dir).resolve()})",
                                      metadata={"family": study["family"], "model": study["model"],
                                                "presets": study["presets"],
                                                "arms": {r["arm"]: r["config_hash"] for r in records}})
            for name, path in files.items():
                artifact.add_file(str(path), name=name)
            run.log_artifact(artifact)
        run_dir = Path(run.dir).parent if getattr(run, "dir", None) else wandb_root
    finally:
        run.finish()
    return run_dir


def _interleaved_matches(interleaved: dict, records: list[dict]) -> bool:
    """Whether a stored interleaved re-timing timed exactly these arms (names, and config hashes where it says)."""
    if set(interleaved.get("arms", {})) != {r["arm"] for r in records}:
        return False
    covered = (interleaved.get("covers") or {}).get("arms") or {}
    return all(covered[r["arm"]].get("config_hash", "").split("+")[0] == r["config_hash"]
               for r in records if isinstance(covered.get(r["arm"]), dict))


def write_report(out_dir: Path, records: list[dict], unavailable: list, *, plan=None, adapter=None,
                 log: Callable[[str], None] = print, plots: bool = True, grid_samples: int = 8,
                 wandb_mode: str = "offline", base_run=None, interleaved: dict | None = None,
                 problems: list[str] | None = None) -> dict[str, Any]:
    """Table, plots, grids and W&B mirror of ``records``; ``problems`` (files that could not be read, e.g. from
    :func:`read_folder`) and those met here are logged, listed at the end of ``table.md`` and returned in
    ``outputs["problems"]``."""
    out_dir = Path(out_dir)
    problems = list(problems or [])
    if interleaved is None and (out_dir / "timing_interleaved.json").is_file():
        import json

        source = out_dir / "timing_interleaved.json"
        try:
            interleaved = json.loads(source.read_text())
            if not isinstance(interleaved, dict) or not isinstance(interleaved.get("arms", {}), dict):
                raise ValueError(f"top level is {type(interleaved).__name__} with no 'arms' object")
        except (OSError, UnicodeDecodeError, ValueError) as exc:
            problems.append(f"cannot read {source} ({type(exc).__name__}: {exc}): the table shows the sequential "
                            f"speedup; re-run the study with the same --out and --retime to re-measure")
            interleaved = None
        if interleaved is not None and not _interleaved_matches(interleaved, records):
            interleaved = None  # from another selection of arms (or other configurations of them)
    outputs: dict[str, Any] = {"records": [str(rec.record_paths(out_dir, r["arm"])[0]) for r in records]}
    from .imports import merge_imports

    records = merge_imports(out_dir, records)  # GenEval / DPG-Bench summaries imported into imports/*.json
    outputs.update({k: str(v) for k, v in write_table(out_dir, records, unavailable, plan, interleaved).items()})
    extra = analysis_markdown(out_dir)  # the family's analysis (criterion IoU, ...) after the arms' table
    if extra:
        md = Path(outputs["markdown"])
        md.write_text(md.read_text() + "\n" + extra)
    if interleaved:
        outputs["timing_interleaved"] = str(out_dir / "timing_interleaved.json")
    plot_paths: dict[str, Path] = {}
    if plots and records:
        try:
            plot_paths = write_plots(out_dir, _with_psnr_summaries(_with_interleaved(records, interleaved)))
        except Exception as exc:  # noqa: BLE001 - a plot must never lose the records
            log(f"plots failed: {type(exc).__name__}: {exc}")
    outputs["plots"] = {k: str(v) for k, v in plot_paths.items()}
    grids = {rec.arm_slug(r["arm"]): out_dir / "grids" / f"{rec.arm_slug(r['arm'])}.png" for r in records}
    grids = {k: v for k, v in grids.items() if v.is_file()}
    overview = write_overview_grid(out_dir, records, grid_samples, problems)
    if overview is not None:
        grids = {"overview": overview, **grids}
    outputs["grids"] = {k: str(v) for k, v in grids.items()}
    outputs["problems"] = problems
    if problems:
        _append_problems(Path(outputs["markdown"]), problems)
        for line in problems:
            log(f"warning: {line}")
    try:
        run_dir = log_wandb(out_dir, wandb_mode, records, table_frame(records, unavailable, interleaved), plot_paths,
                            grids)
        outputs["wandb"] = str(run_dir) if run_dir else None
    except Exception as exc:  # noqa: BLE001 - W&B is a mirror; the JSON/CSV results stand without it
        outputs["wandb"] = None
        outputs["wandb_error"] = f"{type(exc).__name__}: {exc}"
        log(f"W&B logging failed ({type(exc).__name__}: {exc}); the JSON/CSV results are complete without it")
    return outputs
