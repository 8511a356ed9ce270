"""The claims ledger (issue 30): each method's published headline beside what varscope measures here.

Published side: ``var_core/data/claims/headlines.json`` (speedup, latency, model, resolution, batch, GPU, baseline
kernel, quality, source table — copied from specs/methods.md §10 and the papers; ``unknown`` where the source does
not say). Measured side, per preset at its published setting, on the model and machine at hand:

* ``flops_ideal`` — baseline FLOPs / preset FLOPs (analytic; a **bound**: the speedup if time were FLOPs);
* ``bw_ideal`` — bandwidth-aware ideal (:func:`profilers.memory.bandwidth_aware_ideal`: every op at a roofline
  measured here on the model's GEMM shape; a **bound** that also charges the weights a scale streams);
* ``measured_speedup`` — baseline / preset generate() seconds, each arm batch paired with a baseline run of the
  same batch right before it (``timing_repeats`` interleaved rounds, fastest kept): **measured**;
* quality deltas vs the baseline on the same samples (SSIM, PSNR, class accuracy − baseline): **measured**.

``comparison`` says how the two sides relate: ``direct`` only on a GPU with the paper's model; otherwise the
measured numbers are of *this* model on *this* device, and only the bounds transfer in shape, not in value.
"""

from __future__ import annotations

import json
import math
import time
from importlib import resources
from pathlib import Path
from typing import Callable

from var_core.errors import UserError

from .evaluate import EvalSettings, SweepEvaluator

__all__ = ["load_headlines", "run_claims", "claims_markdown", "comparison_kind"]


def load_headlines() -> dict[str, dict]:
    """Preset -> published headline (the packaged JSON)."""
    text = resources.files("var_core").joinpath("data/claims/headlines.json").read_text()
    return {h["preset"]: h for h in json.loads(text)["headlines"]}


def comparison_kind(device: str, model: str, headline_model: str) -> str:
    """``direct`` on a CUDA device running the headline's model, else ``bound+proxy`` (CPU or another model)."""
    same_model = model.replace("-", "").lower() == str(headline_model).replace("-", "").lower()
    return "direct" if device.startswith("cuda") and same_model else "bound+proxy"


def _bw_ideal(evaluator: SweepEvaluator, policies: dict[str, object], log) -> tuple[dict[str, float], str]:
    """Bandwidth-aware ideal per preset on the first batch of samples (one roofline measured here)."""
    import torch

    from profilers.flops import count_flops
    from profilers.memory import bandwidth_aware_ideal, calibrate_roofline
    from var_core.accel.policy import AccelPolicy
    from var_core.engine import generate

    n = min(evaluator.settings.batch_size, len(evaluator.conditions))
    inputs = evaluator.conditions.inputs(range(n), device=getattr(evaluator.adapter, "device", None))
    seeds = evaluator.conditions.seeds[:n]

    def report(policy):
        with torch.inference_mode():
            result = generate(evaluator.adapter, inputs, seeds=seeds,
                              policy=None if policy is None else AccelPolicy(policy), sampling=evaluator.sampling)
        return count_flops(evaluator.adapter, result, batch_size=n)

    base = report(None)
    log("roofline: calibrating GEMM throughput and weight streaming on the model's MLP shape")
    roofline = calibrate_roofline((base.arch.embed_dim, base.arch.mlp_hidden), device=evaluator.launch.device)
    return {name: bandwidth_aware_ideal(base, report(p), roofline) for name, p in policies.items()}, \
        roofline.describe()


def run_claims(presets: tuple[str, ...], settings: EvalSettings, out_dir: Path,
               log: Callable[[str], None] = print) -> dict:
    """Evaluate each preset at its published setting; write ``claims.json`` and ``claims.md`` into ``out_dir``."""
    from var_core.accel.presets import PRESETS, get_preset
    from var_core.errors import did_you_mean
    from var_core.eval.records import write_json_atomic

    started = time.perf_counter()
    headlines = load_headlines()
    for p in presets:
        if p not in PRESETS:
            raise UserError(f"unknown preset {p!r}.{did_you_mean(p, PRESETS)}")
        if p not in headlines:
            raise UserError(f"no published headline is recorded for {p!r} (var_core/data/claims/headlines.json has "
                            f"{', '.join(headlines)})")
    evaluator = SweepEvaluator(settings, out_dir, log=log, family="claims")
    base = evaluator.baseline()
    records = {}
    for p in presets:
        t0 = time.perf_counter()
        records[p] = evaluator.evaluate(p, get_preset(p), description=f"{p} at its published setting")
        log(f"{p}: measured in {time.perf_counter() - t0:.1f} s")
    bw, roofline = _bw_ideal(evaluator, {p: get_preset(p) for p in presets}, log)
    device = str(evaluator.launch.device)
    rows = []
    for p in presets:
        s, h = records[p]["summary"], headlines[p]

        def get(key):
            v = s.get(key) or {}
            return {k: v.get(k) for k in ("mean", "low", "high", "n", "method")} if v else None

        flops = (s.get("flops_ratio") or {}).get("mean")
        rows.append({
            "preset": p, "published": h,
            "measured": {
                "model": evaluator.model, "device": device, "precision": evaluator.precision,
                "batch": settings.batch_size, "samples": len(evaluator.conditions),
                "threads": evaluator.describe()["threads"], "timing_repeats": settings.timing_repeats,
                "flops_ratio": flops, "flops_ideal": (1.0 / flops) if flops else None, "bw_ideal": bw.get(p),
                "measured_speedup": get("speedup"), "ssim": get("ssim"), "psnr": get("psnr"),
                "class_acc_delta": get("class_acc_delta"), "arm": p, "config_hash": records[p]["config_hash"]},
            "kinds": {"flops_ideal": "bound (analytic FLOPs)", "bw_ideal": f"bound ({roofline})",
                      "measured_speedup": f"measured on {device}", "quality": f"measured on {evaluator.model}"},
            "comparison": comparison_kind(device, evaluator.model, h.get("model", "")),
        })
    result = {"schema": "varscope.claims/1", "rows": rows, "model": evaluator.model, "device": device,
              "roofline": roofline, "baseline_ms_per_image": (base["summary"].get("ms_per_image") or {}).get("mean"),
              "evaluation": evaluator.describe(), "environment": base.get("environment", {}),
              "seconds": time.perf_counter() - started}
    write_json_atomic(out_dir / "claims.json", result)
    (out_dir / "claims.md").write_text(claims_markdown(result))
    return result


def _num(v, digits=2, suffix="") -> str:
    if v is None or (isinstance(v, float) and not math.isfinite(v)):
        return "—"
    return f"{v:.{digits}f}{suffix}"


def _ci(entry, digits=3) -> str:
    if not entry or entry.get("mean") is None:
        return "—"
    lo, hi = entry.get("low"), entry.get("high")
    if lo is None or hi is None or not (math.isfinite(lo) and math.isfinite(hi)):
        return f"{entry['mean']:.{digits}f}"
    if lo == hi and (entry.get("n") or 0) <= 1:  # one timed batch: a single ratio, no interval
        return f"{entry['mean']:.{digits}f} (1 batch, no CI)"
    return f"{entry['mean']:.{digits}f} [{lo:.{digits}f}, {hi:.{digits}f}]"


def claims_markdown(result: dict) -> str:
    lines = [f"# Claims ledger — measured on {result['model']}, {result['device']}", "",
             "Published: as the source states it (`unknown` = not stated). Measured: this model on this machine. "
             "FLOPs-ideal and bandwidth-aware ideal are **bounds** (models of time); the speedup is **measured** "
             "(interleaved with the baseline); quality deltas are **measured** against the baseline on the same "
             f"samples. Roofline: {result['roofline']}.", "",
             "| preset | published speedup | model, resolution | batch | GPU | baseline kernel | source | "
             "FLOPs-ideal × (bound) | bw-ideal × (bound) | measured × [95 % CI] | SSIM vs baseline | "
             "class acc − baseline (pts) | comparison |", "|---" * 13 + "|"]
    for r in result["rows"]:
        h, m = r["published"], r["measured"]
        sp = f"{h['speedup']}×" + (f" ({h['speedup_note']})" if h.get("speedup_note") else "")
        lines.append(f"| {r['preset']} | {sp} | {h['model']}, {h['resolution']} | {h['batch']} | {h['gpu']} | "
                     f"{h['baseline_kernel']} | {h['source'].split(';')[0]} | {_num(m['flops_ideal'])} | "
                     f"{_num(m['bw_ideal'])} | {_ci(m['measured_speedup'], 2)} | {_ci(m['ssim'])} | "
                     f"{_ci(m['class_acc_delta'], 1)} | {r['comparison']} |")
    lines += ["", "`bound+proxy`: the measured columns are this model on this device (not the paper's model and GPU); "
              "only `direct` rows (a GPU running the paper's model) compare the published and measured speedups "
              "one to one."]
    return "\n".join(lines) + "\n"
