"""``guidance``: keeping classifier-free guidance, stopping it at a fixed scale, or adaptively (SATS).

Base: ``ldpruning`` (LD-Pruning, whose SATS is the adaptive arm). Arms: ``full`` (both CFG halves at every scale),
``stop_at`` (unconditional rows dropped from a fixed scale on; two settings), ``sats`` (stop per sample when the
conditional / unconditional discrepancy falls below δ), and, when registered, ``null_late`` (StageVAR).

Analysis (LD-Pruning Fig. 3(a)): the guidance discrepancy γ_k of every scale on the plain model's generations of the
study's first samples (both CFG halves run at every scale), measured by the base's own SATS component with a δ that
never fires — written to ``analysis/gamma_per_scale.json`` and plotted per scale with SATS's δ.
"""

from __future__ import annotations

import dataclasses
import json

from var_core.accel.registry import REGISTRIES

from .base import AnalysisContext, Arm, FamilyContext, baseline_arm, compose, family, swap

STOP_SCALES = (-3, -2)


def gamma_per_scale(adapter, conditions, sampling, *, samples: int = 16, method: str = "ldpruning") -> dict:
    """γ_k per sample and scale (``gamma``: samples × scales, None where not measured) of SATS as configured in
    ``method``'s preset, on dense generations; ``delta`` is the preset's threshold."""
    from var_core.accel.presets import get_preset

    from .calibrate import TracePolicy, trace_batches

    config = get_preset(method).guidance
    if config.component_name != "sats":
        raise ValueError(f"the {method!r} preset's guidance is {config.component_name!r}, not SATS")
    observer_config = dataclasses.replace(config, delta=0.0)  # measures gamma, never stops
    cls = REGISTRIES["guidance"].get("sats")
    K = adapter.num_scales
    gamma, indices = [], []
    for idx, policy, _ in trace_batches(adapter, conditions, sampling,
                                        lambda: TracePolicy(observers={"sats": cls(observer_config)}),
                                        samples=samples, decode=False):
        measured = policy.signals.extras.get("sats_gamma", {})
        for i in range(len(idx)):
            gamma.append([float(measured[si][i]) if si in measured else None for si in range(K)])
        indices += idx
    return {"gamma": gamma, "indices": indices, "delta": float(config.delta), "method": method,
            "sats": config.to_dict(), "scale_hw": [list(hw) for hw in adapter.scale_hw]}


def gamma_analysis(ctx: AnalysisContext) -> dict:
    """the guidance discrepancy gamma_k per scale on the plain model (LD-Pruning Fig. 3(a))"""
    data = gamma_per_scale(ctx.adapter, ctx.conditions, ctx.sampling, samples=ctx.max_samples)
    path = ctx.analysis_dir / "gamma_per_scale.json"
    path.write_text(json.dumps(data))
    return {"gamma_per_scale": str(path)}


@family("guidance", "full CFG vs fixed stop vs SATS on LD-Pruning's base",
        table="LD-Pruning Table 4 (LHEP vs LHEP + SATS), Fig. 3(a)", analysis=gamma_analysis)
def guidance_family(ctx: FamilyContext) -> list[Arm]:
    base = "ldpruning"
    arms = [baseline_arm(), swap(base, "guidance", "full")]
    for start in STOP_SCALES:
        arms.append(swap(base, "guidance", "stop_at", arm_name=f"stop_at@{start}", start_scale=start))
    arms.append(compose(base, "sats", role="base", description="ldpruning itself: SATS as the preset sets it"))
    if "null_late" in REGISTRIES["guidance"].names():
        arms.append(swap(base, "guidance", "null_late"))
    return arms
