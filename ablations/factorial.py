"""``compose``: a full factorial of orthogonal methods — do they stack? (issue 30)

Factors (each off / on, every combination an arm; all off = the plain model):

* ``prune`` — token pruning, FastVAR's machinery as the ``fastvar`` preset runs it on the model at hand;
* ``guidance`` — guidance skipping, SkipVAR's fixed reading: conditional rows only from the third-last scale on
  (``guidance=stop_at``, ``start_scale=-3``);
* ``early`` — early stop: the last scale is not generated (``skip=skip_last``, ``count=1``).

``compose4`` adds ``kv`` (``kv=keep_recent``: half of each block's keys kept; 16 arms). Attention sparsity
(``attention=window_only``) is not a factor: its patterns run on dense scales over a dense cache and refuse a
block with pruned tokens or evicted keys, so it does not cross with ``prune`` or ``kv``.

The analysis (``<out>/analysis/compose_effects.{json,csv,md}``) estimates the factorial effects on per-sample
responses paired across arms — SSIM vs the baseline, the classifier's probability of the sample's class (when the
model has one) — and on the log2 FLOPs per image and log2 of the interleaved speedup (one value per arm: no CI): main effects (mean over the arms with the factor on minus the
mean with it off) and every interaction (±1 contrasts, Yates' normalisation 1/2^(k−1): the AB interaction is half
the difference between A's effect with B on and with B off), each with a percentile bootstrap 95 % CI over samples
and a paired t-test. A log2-FLOPs interaction of 0 means the savings multiply (they stack); > 0 means the two
methods remove some of the same work.
"""

from __future__ import annotations

import itertools
import json
import math
from pathlib import Path

import numpy as np

from .base import AnalysisContext, Arm, FamilyContext, baseline_arm, compose, family

__all__ = ["FACTORS", "factorial_arms", "factorial_effects", "compose_analysis"]

FACTORS: dict[str, tuple] = {
    "prune": ("prune", None, {}),  # the base becomes the fastvar preset
    "guidance": ("guidance", "stop_at", {"start_scale": -3}),
    "early": ("skip", "skip_last", {"count": 1}),
    "kv": ("kv", "keep_recent", {"budget": 0.5}),
}
THREE = ("prune", "guidance", "early")
FOUR = ("prune", "guidance", "early", "kv")


def arm_name(on: tuple[str, ...]) -> str:
    return "+".join(on) if on else "baseline"


def factorial_arms(factors: tuple[str, ...]) -> list[Arm]:
    """Every on/off combination of ``factors`` as an arm (all off: the baseline)."""
    arms = []
    for bits in itertools.product((0, 1), repeat=len(factors)):
        on = tuple(f for f, b in zip(factors, bits) if b)
        if not on:
            arms.append(baseline_arm())
            continue
        # an unregistered component makes compose() report the arm as unavailable, with why
        edits = [FACTORS[f] for f in on if f != "prune"]
        base = "fastvar" if "prune" in on else "baseline"
        arms.append(compose(base, arm_name(on), *edits,
                            description="factorial cell: " + ", ".join(f"{f} on" for f in on)))
    return arms


def factorial_effects(cells: dict[tuple[int, ...], np.ndarray], factors: tuple[str, ...], *, n_boot: int = 2000,
                      seed: int = 0) -> list[dict]:
    """Main effects and interactions of a 2^k factorial from per-sample responses paired across cells.

    ``cells[bits]`` is the ``[n]`` response of the arm with factor ``j`` on where ``bits[j] == 1``. The effect of a
    set S of factors is ``(1 / 2^(k−1)) Σ_cells Π_{f∈S} x_f · y_cell`` with ``x = ±1``, computed per sample; its CI
    is a percentile bootstrap of the per-sample effects' mean, its p a paired (one-sample) t-test."""
    from scipy import stats

    k = len(factors)
    if len(cells) != 2 ** k:
        raise ValueError(f"a 2^{k} factorial needs {2 ** k} cells, got {len(cells)}")
    n = len(next(iter(cells.values())))
    rng = np.random.default_rng(seed)
    idx = rng.integers(0, n, size=(n_boot, n))
    out = []
    for order in range(1, k + 1):
        for subset in itertools.combinations(range(k), order):
            per = np.zeros(n)
            for bits, y in cells.items():
                sign = np.prod([1 if bits[j] else -1 for j in subset])
                per = per + sign * np.asarray(y, dtype=float)
            per = per / 2 ** (k - 1)
            reps = per[idx].mean(axis=1)
            low, high = np.percentile(reps, [2.5, 97.5]).tolist()
            if n > 1 and np.ptp(per) > 1e-12 * max(1.0, float(np.abs(per).max())):  # no spread: no t-test
                p = float(stats.ttest_1samp(per, 0.0).pvalue)
            else:
                p = 0.0 if per.mean() != 0 else 1.0
            out.append({"effect": "×".join(factors[j] for j in subset), "order": order, "value": float(per.mean()),
                        "low": low, "high": high, "p": p, "n": n})
    return out


def _responses(records: dict[str, dict], factors: tuple[str, ...]) -> dict[str, dict[tuple[int, ...], np.ndarray]]:
    """Per-sample responses per cell: ssim (1 for the baseline: it is its own reference), class_prob, and the
    log2 FLOPs per image (one value per arm, repeated per sample)."""
    out: dict[str, dict] = {"ssim": {}, "class_prob": {}, "log2_flops": {}}
    n = None
    for bits in itertools.product((0, 1), repeat=len(factors)):
        name = arm_name(tuple(f for f, b in zip(factors, bits) if b))
        rec = records[name]
        ps = rec["metrics"]["per_sample"]
        n = len(rec["metrics"]["index"])
        if rec.get("role") == "baseline":
            out["ssim"][bits] = np.ones(n)
        elif ps.get("ssim") is not None:
            out["ssim"][bits] = np.array([math.nan if v is None else v for v in ps["ssim"]], dtype=float)
        if ps.get("class_prob") is not None:
            out["class_prob"][bits] = np.array([math.nan if v is None else v for v in ps["class_prob"]], dtype=float)
        flops = rec["timing"].get("flops_per_image")
        if flops:
            out["log2_flops"][bits] = np.full(n, math.log2(flops))
    return {k: v for k, v in out.items() if len(v) == 2 ** len(factors)
            and all(np.all(np.isfinite(y)) for y in v.values())}


def effects_markdown(effects: dict[str, list[dict]], factors: tuple[str, ...], means: dict) -> str:
    lines = [f"# compose: {' × '.join(factors)} factorial", "",
             "Effects on paired per-sample responses; value [95 % bootstrap CI], paired t-test p. Main effect = "
             "mean with the factor on − mean with it off; interactions: Yates' ±1 contrasts / 2^(k−1).", ""]
    for response, rows in effects.items():
        lines += [f"## {response}", "", "| effect | order | value [95 % CI] | p |", "|---|---|---|---|"]
        for r in rows:
            if r["low"] == r["high"]:  # one value per arm (analytic FLOPs, one timing): no sampling spread
                lines.append(f"| {r['effect']} | {r['order']} | {r['value']:.4f} (one value per arm) | — |")
                continue
            lines.append(f"| {r['effect']} | {r['order']} | {r['value']:.4f} [{r['low']:.4f}, {r['high']:.4f}] | "
                         f"{r['p']:.3g} |")
        lines.append("")
    lines += ["## cell means", "", "| arm | " + " | ".join(effects) + " |", "|---" * (len(effects) + 1) + "|"]
    for arm, vals in means.items():
        lines.append(f"| {arm} | " + " | ".join(f"{vals.get(r, math.nan):.4f}" for r in effects) + " |")
    return "\n".join(lines) + "\n"


def compose_analysis(ctx: AnalysisContext, factors: tuple[str, ...] = THREE) -> dict:
    """Factorial main effects and interactions with bootstrap CIs over samples (from the arms' records)."""
    import pandas as pd

    from var_core.eval.records import record_paths, write_json_atomic

    records = {}
    for bits in itertools.product((0, 1), repeat=len(factors)):
        name = arm_name(tuple(f for f, b in zip(factors, bits) if b))
        path = record_paths(ctx.out_dir, name)[0]
        if not Path(path).is_file():
            ctx.log(f"compose: arm {name} has no record; effects need every cell")
            return {"error": f"missing arm {name}"}
        records[name] = json.loads(Path(path).read_text())
    responses = _responses(records, factors)
    timing = Path(ctx.out_dir) / "timing_interleaved.json"
    if timing.is_file():  # the runner's interleaved re-timing: one median per arm (a measurement, no sample spread)
        arms = json.loads(timing.read_text()).get("arms", {})
        names = {bits: arm_name(tuple(f for f, b in zip(factors, bits) if b))
                 for bits in itertools.product((0, 1), repeat=len(factors))}
        if all(arms.get(n, {}).get("seconds") for n in names.values()):
            base_s = float(np.median(arms["baseline"]["seconds"]))
            n = len(next(iter(records.values()))["metrics"]["index"])
            responses["log2_speedup_interleaved"] = {
                bits: np.full(n, math.log2(base_s / float(np.median(arms[name]["seconds"]))))
                for bits, name in names.items()}
    effects = {r: factorial_effects(cells, factors, seed=0) for r, cells in responses.items()}
    means = {arm_name(tuple(f for f, b in zip(factors, bits) if b)): {r: float(np.mean(responses[r][bits]))
                                                                       for r in responses}
             for bits in itertools.product((0, 1), repeat=len(factors))}
    folder = ctx.analysis_dir
    write_json_atomic(folder / "compose_effects.json", {"factors": list(factors), "effects": effects,
                                                       "cell_means": means})
    pd.DataFrame([dict(response=r, **row) for r, rows in effects.items() for row in rows]).to_csv(
        folder / "compose_effects.csv", index=False)
    (folder / "compose_effects.md").write_text(effects_markdown(effects, factors, means))
    ctx.log(f"compose: effects written to {folder / 'compose_effects.md'}")
    return {"effects": str(folder / "compose_effects.md")}


@family("compose", "factorial of token pruning × guidance skipping × early stop: main effects and interactions",
        analysis=compose_analysis, samples=16)
def compose_family(ctx: FamilyContext) -> list[Arm]:
    """The 2^3 factorial: FastVAR pruning × guidance stop at the third-last scale × last scale skipped."""
    return factorial_arms(THREE)


def _compose4_analysis(ctx: AnalysisContext) -> dict:
    """Factorial effects of the four-factor design (pruning, guidance, early stop, KV budget)."""
    return compose_analysis(ctx, FOUR)


@family("compose4", "compose with a KV budget as a fourth factor (2^4 = 16 arms)", analysis=_compose4_analysis,
        samples=16)
def compose4_family(ctx: FamilyContext) -> list[Arm]:
    """The 2^4 factorial: pruning × guidance stop × last scale skipped × half the KV cache kept."""
    return factorial_arms(FOUR)
