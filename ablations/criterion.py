"""``criterion``: which domain's signal selects LD-Pruning's tokens (LD-Pruning Table 1, Fig. 4).

Matched kept count (issue 28). LD-Pruning's own selection keeps the shortest prefix holding ρ = 0.5 of the
criterion's score *energy*, so every criterion would keep a different number of tokens (FLOPs 0.327–0.451 on the
testbed) and Table 1 would compare costs as much as criteria. Here every criterion arm keeps the SAME count: the
energy-fraction schedule with ``counts="tokens"`` at ``ρ = MATCHED_RHO`` = 0.21, i.e. ``ceil(0.21·N)`` tokens at
each of LD-Pruning's pruned scales, for every criterion and every sample. 0.21 is matched to LHEP's own cost: on
the default testbed (depth 8; 16 samples, seed 0, its card's sampling) LHEP with the energy rule has FLOPs ratio
0.349 and ``counts="tokens"`` gives 0.344 at ρ = 0.20 and 0.379 at 0.25 (LHEP's token-weighted mean kept share,
taken on the padded rows, is 0.27 on the testbed and 0.25 on testbed-small; ρ was chosen on FLOPs). On another
model the matched ρ differs: re-match with ``--set schedule.rho=...``. SATS still decides per sample (its
guidance stop can move the FLOPs a little between arms); the result table reports each arm's FLOPs.

Base: ``lhep`` = ``ldpruning`` with its schedule at the matched count (its pruned scales, restoration and SATS
stay); each other arm swaps the token criterion only:

* ``lhep`` — Image Latent Domain: LHEP's high-frequency energy of the previous quantised residual (the base);
* ``pixel_change`` — Pixel Domain: the decoded change ``|I_{k−1} − I_{k−2}|`` on the token grid (one VAE decode per
  scale: the paper's "substantial latency");
* ``attention`` — Semantic Aggregation Domain: the attention mass each token receives (``received_mass``: a
  non-negative score, as the energy-fraction selection needs);
* ``entropy`` — the predictive entropy of the previous scale (NOVA's criterion, non-negative);
* ``random`` — the control (beyond the paper);
* ``lhep@energy`` — ``ldpruning`` itself (LHEP with its adaptive energy rule, ρ = 0.5): the operating point the
  matched count stands in for; it differs from ``lhep`` in the schedule's count rule only.

Analysis (LD-Pruning Fig. 4): on dense generations of the study's first samples, at each of the last
``IOU_SCALES`` scales (the scales LHEP prunes), every criterion's kept set at pruning rate p (the ``N − ⌊pN⌋``
top-scored tokens, ties to the lower position) is compared with the tokens that actually change — the same number
of tokens with the largest decoded change ``|I_k − I_{k−1}|`` the scale makes — by IoU, per rate; mean with a 95 %
bootstrap interval over samples (the IoU of a sample is its mean over the scales). Written to
``analysis/criterion_iou.{json,md}`` and plotted.
"""

from __future__ import annotations

import json
import math

import numpy as np
import torch

from .base import AnalysisContext, Arm, FamilyContext, baseline_arm, compose, family

CRITERIA = {  # arm / criterion label -> (scorer, options, domain)
    "lhep": (None, {}, "image latent domain (LHEP)"),
    "pixel_change": ("pixel_change", {}, "pixel domain |I_{k-1} - I_{k-2}|"),
    "attention": ("attention", {"signal": "received_mass"}, "semantic aggregation domain (attention received)"),
    "entropy": ("entropy", {}, "predictive entropy of the previous scale"),
    "random": ("random", {}, "random control (beyond the paper)"),
}
MATCHED_RHO = 0.21  # tokens kept per pruned scale = ceil(0.21 N): LHEP's energy-rule FLOPs on the default testbed
PRUNING_RATES = (0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9)
IOU_SCALES = 3
ANALYSIS_BATCH = 8


def entropy_params() -> dict:
    """The entropy scorer on the predictive distribution (``source='predictive'``, named ``previous`` before)."""
    from .base import component_choices

    choices = component_choices("scorer", "entropy", "source") or ()
    for source in ("predictive", "previous"):
        if source in choices:
            return {"source": source}
    return {}


def matched_edit() -> tuple:
    """The schedule edit that puts LD-Pruning at the matched kept count (``ceil(MATCHED_RHO·N)`` per pruned scale)."""
    return ("schedule", None, {"counts": "tokens", "rho": MATCHED_RHO})


def criterion_edits(label: str) -> list:
    component, params, _ = CRITERIA[label]
    if component is None:
        return []
    if component == "entropy":
        params = {**params, **entropy_params()}
    return [("scorer", component, params)]


# ----------------------------------------------------------------------------------------------- IoU
def kept_mask(scores_BN: torch.Tensor, keep: int) -> torch.Tensor:
    """bool ``[B, N]``: the ``keep`` highest scores of each row (ties to the lower position; NaN ranks last)."""
    scores = torch.nan_to_num(scores_BN.double(), nan=-math.inf)
    order = scores.sort(dim=1, descending=True, stable=True).indices[:, :keep]
    return torch.zeros_like(scores, dtype=torch.bool).scatter_(1, order, True)


def iou(a_BN: torch.Tensor, b_BN: torch.Tensor) -> torch.Tensor:
    """``[B]`` |A ∩ B| / |A ∪ B| of two boolean masks (1 when both are empty)."""
    inter = (a_BN & b_BN).sum(1).double()
    union = (a_BN | b_BN).sum(1).double()
    return torch.where(union > 0, inter / union.clamp(min=1), torch.ones_like(union))


def iou_at_rates(scores_BN: torch.Tensor, reference_BN: torch.Tensor, rates=PRUNING_RATES) -> torch.Tensor:
    """``[B, len(rates)]``: at pruning rate p both sets keep ``N − ⌊p·N⌋`` tokens (``fixed_table``'s count); the
    IoU of the criterion's kept set with the reference's."""
    N = scores_BN.shape[1]
    out = []
    for p in rates:
        keep = N - int(p * N)
        out.append(iou(kept_mask(scores_BN, keep), kept_mask(reference_BN, keep)))
    return torch.stack(out, dim=1)


def _scorer(label: str):
    from var_core.accel.policy import component_config
    from var_core.accel.presets import get_preset
    from var_core.accel.registry import REGISTRIES

    component, params, _ = CRITERIA[label]
    if component is None:
        config = get_preset("ldpruning").scorer
    else:
        config = component_config("scorer", component, **dict(criterion_edits(label)[0][2]))
    return REGISTRIES["scorer"].get(config.component_name)(config)


def criterion_iou(adapter, conditions, sampling, *, samples: int = 16, criteria=tuple(CRITERIA),
                  rates=PRUNING_RATES, scales: int = IOU_SCALES, score_block: int | None = None,
                  batch_size: int = ANALYSIS_BATCH) -> dict:
    """Per criterion and pruning rate, the IoU of its kept set with the tokens the scale actually changes.

    Dense (baseline) generations of the first ``samples`` samples; the criteria score the last ``scales`` scales
    at block ``score_block`` (default: the middle block ``L // 2``; LHEP, the pixel change and the predictive
    entropy score once per scale, the attention mass is the block's own). Returns the per-sample IoU
    (``iou[criterion]``: samples × rates, averaged over the scales) and the reference definition."""
    from var_core.accel.scorers.pixel_change import pixel_change_map

    from .calibrate import TracePolicy, trace_batches

    K, L = adapter.num_scales, adapter.num_blocks
    analysed = list(range(max(1, K - scales), K))
    block = L // 2 if score_block is None else score_block
    per_sample = {label: [] for label in criteria}
    indices = []

    def make():
        return TracePolicy(decode=lambda si: si >= analysed[0] - 1,
                           scorers={label: _scorer(label) for label in criteria}, score_scales=analysed,
                           score_block=block)

    for idx, policy, result in trace_batches(adapter, conditions, sampling, make, samples=samples,
                                             batch_size=batch_size, decode=False):
        images = {r.scale_index: r.image_B3HW for r in policy.records if r.image_B3HW is not None}
        rows = {label: [] for label in criteria}
        for si in analysed:
            if si not in images or si - 1 not in images:
                continue
            reference = pixel_change_map(images[si], images[si - 1], adapter.scale_hw[si]).cpu()
            for label in criteria:
                scores = policy.scores[label].get(si)
                if scores is not None:
                    rows[label].append(iou_at_rates(scores, reference, rates))
        for label in criteria:
            if rows[label]:
                per_sample[label].append(torch.stack(rows[label]).mean(0))  # [B, rates]: mean over the scales
        indices += idx
    iou_tables = {label: torch.cat(v).tolist() for label, v in per_sample.items() if v}
    return {"rates": list(rates), "scales": analysed, "score_block": block, "indices": indices,
            "reference": "top tokens of mean_RGB |I_k - I_{k-1}| (area-pooled decoded change at scale k)",
            "domains": {label: CRITERIA[label][2] for label in criteria}, "iou": iou_tables}


def summarize_iou(data: dict, seed: int = 0) -> list[dict]:
    """One row per (criterion, rate): mean IoU with a 95 % bootstrap interval over samples."""
    from var_core.eval.stats import bootstrap_ci

    rows = []
    for label, table in data["iou"].items():
        values = np.asarray(table, dtype=float)
        for j, rate in enumerate(data["rates"]):
            s = bootstrap_ci(values[:, j].tolist(), seed=seed)
            rows.append({"criterion": label, "rate": rate, "mean": s.mean, "low": s.low, "high": s.high,
                         "n": s.n})
    return rows


def iou_markdown(data: dict, rows: list[dict]) -> str:
    rates = data["rates"]
    lines = ["## Criterion IoU with the tokens that change (LD-Pruning Fig. 4)\n",
             f"Dense generations of {len(data['indices'])} samples; scales {data['scales']} (0-indexed), scores at "
             f"block {data['score_block']}; reference: {data['reference']}. Cell: mean IoU [95 % bootstrap CI] "
             f"over samples at pruning rate p (both sets keep N - floor(pN) tokens).\n",
             "| criterion | " + " | ".join(f"p={p:g}" for p in rates) + " |", "|---|" + "---|" * len(rates)]
    by = {}
    for r in rows:
        by.setdefault(r["criterion"], {})[r["rate"]] = r
    for label, cells in by.items():
        lines.append(f"| {label} | " + " | ".join(
            f"{cells[p]['mean']:.3f} [{cells[p]['low']:.3f}, {cells[p]['high']:.3f}]" for p in rates) + " |")
    return "\n".join(lines) + "\n"


def criterion_analysis(ctx: AnalysisContext) -> dict:
    """IoU of each criterion's kept set with the tokens that actually change, per pruning rate (LD-Pruning Fig. 4)"""
    data = criterion_iou(ctx.adapter, ctx.conditions, ctx.sampling, samples=ctx.max_samples)
    rows = summarize_iou(data)
    data["summary"] = rows
    json_path = ctx.analysis_dir / "criterion_iou.json"
    json_path.write_text(json.dumps(data, indent=1))
    md_path = ctx.analysis_dir / "criterion_iou.md"
    md_path.write_text(iou_markdown(data, rows))
    return {"criterion_iou": str(json_path), "criterion_iou_md": str(md_path)}


@family("criterion", "LHEP (latent) vs decoded pixel change vs attention / entropy criteria on LD-Pruning's base",
        table="LD-Pruning Table 1, Fig. 4", analysis=criterion_analysis)
def criterion_family(ctx: FamilyContext) -> list[Arm]:
    """Every criterion at the same kept count (``MATCHED_RHO``), plus LD-Pruning's own energy rule for reference."""
    base = compose("ldpruning", "lhep", matched_edit(), role="base",
                   description=f"ldpruning, criterion: {CRITERIA['lhep'][2]}, at the matched count ceil({MATCHED_RHO:g}"
                               f"·N) per pruned scale")
    arms = [baseline_arm(), base]
    for label, (component, _, domain) in CRITERIA.items():
        if component is not None:
            arms.append(compose(base.config, label, *criterion_edits(label),
                                description=f"lhep's arm with the criterion: {domain} (same kept count)"))
    arms.append(compose("ldpruning", "lhep@energy", description="ldpruning itself: LHEP with its energy rule "
                        "(rho = 0.5 of the score energy; the operating point the matched count stands in for)"))
    return arms
