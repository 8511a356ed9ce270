"""``scorer``: which per-token importance drives NOVA's pruning (NOVA Table 4), at several pruning levels.

Base: the ``nova`` preset (entropy-inflection activation, dual-linkage ratios, residual cache reuse). NOVA Table 4
compares its entropy criterion with an attention-based (Attn) and an MSE-based one under the same dual-linkage
configuration; "similar to SparseVAR, we treat MSE metric as a proxy for frequency signal magnitude", so the
**MSE arm is SparseVAR's block input/output change** (``mse``, ``mode="block_change"``). Beyond the paper:
FastVAR's distance to the mean token (``mean_distance``, a separate arm), LD-Pruning's LHEP energy (``lhep``) and
random scores (``random``, the floor any scorer must beat).

Beyond the paper, too: every scorer runs at ``len(TAU_LEVELS)`` pruning levels, set by dual linkage's τ
(``r_t = sigmoid(τ·(t*+1)/t − λ·tanh g)``: τ = 0.2 / 0.5 / 0.8 remove about 55 / 62 / 69 % of the tokens at the first
accelerated scale; 0.8 is the paper's setting). The kept-token counts come from the schedule's rule, never from
the scores: at one level the scorers keep matched counts, up to the small shift (λ = 0.1 · tanh of an entropy
difference) that the entropies the rule reads make once pruning has changed what was generated. The family draws
one quality-vs-FLOPs curve per scorer (the report's ``quality_vs_flops`` plot, 95 % CIs) instead of one point where
the scorers tie. Arms are named ``<scorer>@tau=<τ>``.
"""

from __future__ import annotations

import json

from .base import AnalysisContext, Arm, FamilyContext, baseline_arm, compose, family

NOVA_TAU = 0.8
TAU_LEVELS = (0.2, 0.5, NOVA_TAU)
# label -> (scorer component, options, where it comes from); None = keep the base's own scorer (NOVA's entropy)
SCORERS = {
    "entropy": (None, {}, "NOVA's predictive entropy (the preset's own scorer)"),
    "attention": ("attention", {}, "attention-based (Attn): ToProVAR's head-averaged attention entropy"),
    "mse": ("mse", {"mode": "block_change"}, "MSE: SparseVAR's block input/output change at the previous scale"),
    "mean_distance": ("mse", {"mode": "mean_distance"}, "FastVAR's distance to the mean token (beyond the paper)"),
    "lhep": ("lhep", {}, "LD-Pruning's latent high-frequency energy (beyond the paper)"),
    "random": ("random", {}, "random scores, the control (beyond the paper)"),
}
PAPER_ARMS = ("attention", "mse", "entropy")  # NOVA Table 4: Attn, MSE, Entropy (ours)


LAYER_MAP_SAMPLES = 4
# 19 arms: 32 samples per arm keep the default study (no arguments, the depth-8 testbed, 2 CPU cores) within 5
# minutes (README); the table states the CI width this buys. --samples 64 or more for a paper-grade table.
DEFAULT_SAMPLES = 32


def arm_name(label: str, tau: float) -> str:
    return f"{label}@tau={tau:g}"


def layer_entropy_maps(adapter, conditions, sampling, *, samples: int = LAYER_MAP_SAMPLES, scale: int = -1) -> dict:
    """Per-layer predictive-entropy maps (NOVA Fig. 4(c)): the head applied to the output of every block ("logit
    lens", conditional rows) at one scale (default the last) of the plain model's generation of the first
    ``samples`` samples. Returns ``maps`` (samples × blocks × h × w, nats) and ``mean`` (samples × blocks)."""
    from .calibrate import TracePolicy, trace_batches

    si = scale % adapter.num_scales
    blocks = range(adapter.num_blocks)
    maps, indices = [], []
    for idx, policy, _ in trace_batches(adapter, conditions, sampling,
                                        lambda: TracePolicy(lens_blocks=lambda s: blocks if s == si else ()),
                                        samples=samples, batch_size=samples, decode=False):
        h, w = adapter.scale_hw[si]
        per_block = [policy.lens_entropy[(si, b)].view(len(idx), h, w) for b in blocks]
        maps += [[per_block[b][i].tolist() for b in blocks] for i in range(len(idx))]
        indices += idx
    mean = [[float(sum(map(sum, m)) / (len(m) * len(m[0]))) for m in sample] for sample in maps]
    return {"scale": si, "hw": list(adapter.scale_hw[si]), "indices": indices,
            "labels": [int(conditions.labels[i]) for i in indices] if hasattr(conditions, "labels") else None,
            "maps": maps, "mean": mean,
            "what": "entropy (nats) of softmax(head(block output)) for the conditional rows (logit lens)"}


def layer_entropy_analysis(ctx: AnalysisContext) -> dict:
    """per-layer logit-lens entropy maps of the plain model at the last scale (NOVA Fig. 4(c))"""
    data = layer_entropy_maps(ctx.adapter, ctx.conditions, ctx.sampling,
                              samples=min(LAYER_MAP_SAMPLES, ctx.max_samples))
    path = ctx.analysis_dir / "layer_entropy.json"
    path.write_text(json.dumps(data))
    return {"layer_entropy": str(path)}


@family("scorer", "entropy vs attention vs MSE (+ mean distance, lhep, random) at 3 pruning levels on NOVA's base",
        table="NOVA Table 4", analysis=layer_entropy_analysis, samples=DEFAULT_SAMPLES)
def scorer_family(ctx: FamilyContext) -> list[Arm]:
    arms = [baseline_arm()]
    for label, (component, params, what) in SCORERS.items():
        for tau in TAU_LEVELS:
            edits = [] if component is None else [("scorer", component, params)]
            if tau != NOVA_TAU:
                edits.append(("schedule", None, {"tau": tau}))
            role = "base" if component is None and tau == NOVA_TAU else "arm"
            arms.append(compose("nova", arm_name(label, tau), *edits, role=role,
                                description=f"nova, scorer = {what}, dual-linkage tau = {tau:g}"))
    return arms


