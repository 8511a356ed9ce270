"""``depth``: ToProVAR's tri-dimensional progression, scale → + token → + layer (ToProVAR Table 10).

ToProVAR's extended ablation on Infinity-2B has five rows; the arms here, in its order:

* ``fixed-scale-exit`` — generation stops a fixed number of scales before the end (``skip_last``). The paper does
  not give the exit scale; it gives the row's speed, 5.1× on Infinity-2B. MATCHED to that speed (issue 28):
  ``FIXED_EXIT_COUNT`` = 3, the skip count whose FLOPs-ideal speedup on Infinity-2B's 13-scale 1024-px schedule
  is nearest 5.1× (``profilers.plan_flops.ideal_speedup``, no text tokens: 2 → 3.15×, **3 → 5.46×**, 4 → 9.59×;
  on the depth-8 testbed 3 → 5.19×), i.e. the exit after the 32×32 scale. Until issue 28 it was 2 (FastVAR's two
  left-out scales, 3.15×), which no reading of the row's 5.1× allows;
* ``scale-depth-loc`` — the adaptive exit: stop at ToProVAR's depth D (``ρ_s ≤ τ``, §4.2), the ``depth_exit`` skip
  component (unavailable until it is registered);
* ``scale-depth-loc+token-pruning`` — instead of exiting, scales ≥ D are token-pruned by the entropy gate in every
  layer: the ``toprovar`` preset with layer identification switched off by ``beta → 0`` (every layer's
  ``R = exp(−β(ϱ−1)) ≈ 1``, so every layer is Detail and the gate is not scaled down);
* ``scale-depth-loc+layer-ident`` — scales ≥ D keep their Global layers dense and skip their Detail layers: the
  ``toprovar`` preset with ``alpha_min = alpha_max = 1`` (a Detail layer prunes every token but the policy's
  ``min_keep`` = 1; pruned tokens pass through, the preset's identity restorer), no token gate;
* ``toprovar`` — the full method (scale + layer + token), the preset itself.

Analysis: ToProVAR's τ calibration (Fig. 8, :mod:`ablations.calibrate`) on the study's first samples — ρ_s per
scale, the exit SSIM, and the τ they imply — written to ``analysis/rho_calibration.json`` and plotted.
"""

from __future__ import annotations

import json

from var_core.accel.registry import REGISTRIES

from .base import AnalysisContext, Arm, FamilyContext, baseline_arm, compose, family

FIXED_EXIT_COUNT = 3  # ToProVAR Table 10's 5.1x: skip_last 3 is 5.46x FLOPs-ideal on Infinity-2B (2: 3.15x)
NO_LAYER_IDENTIFICATION_BETA = 1e-9
PAPER_ROWS = ("fixed-scale-exit", "scale-depth-loc", "scale-depth-loc+token-pruning", "scale-depth-loc+layer-ident",
              "toprovar")


def depth_analysis(ctx: AnalysisContext) -> dict:
    """ToProVAR's tau calibration: rho_s per scale and the exit SSIM of the study's first samples (Fig. 8)"""
    from .calibrate import implied_tau, measure_rho_ssim

    table = measure_rho_ssim(ctx.adapter, ctx.conditions, ctx.sampling, samples=ctx.max_samples)
    calibration = implied_tau(table.rho, table.ssim)
    path = ctx.analysis_dir / "rho_calibration.json"
    path.write_text(json.dumps({"table": table.to_dict(), "calibration": calibration.to_dict()}, indent=1))
    ctx.log(f"  implied tau {calibration.tau} (paper 0.4); safe share {calibration.safe_share}")
    return {"rho_calibration": str(path)}


@family("depth", "fixed exit vs adaptive scale depth vs + token pruning vs + layer identification vs ToProVAR",
        table="ToProVAR Table 10", analysis=depth_analysis)
def depth_family(ctx: FamilyContext) -> list[Arm]:
    arms = [baseline_arm(),
            compose("baseline", "fixed-scale-exit", ("skip", "skip_last", {"count": FIXED_EXIT_COUNT}),
                    description=f"the plain model stopped {FIXED_EXIT_COUNT} scales before the end (fixed exit)")]
    if "depth_exit" in REGISTRIES["skip"].names():
        arms.append(compose("baseline", "scale-depth-loc", ("skip", "depth_exit", {}),
                            description="the plain model stopped at ToProVAR's depth D (adaptive exit)"))
    else:
        arms.append(Arm("scale-depth-loc", None, "stop at ToProVAR's depth D", error=(
            "the skip component 'depth_exit' (ToProVAR's adaptive scale-depth truncation) is not registered yet; "
            f"registered skips: {', '.join(REGISTRIES['skip'].names())}")))
    arms.append(compose("toprovar", "scale-depth-loc+token-pruning",
                        ("schedule", None, {"beta": NO_LAYER_IDENTIFICATION_BETA}),
                        description="toprovar without layer identification: the entropy gate in every layer from D"))
    arms.append(compose("toprovar", "scale-depth-loc+layer-ident",
                        ("schedule", None, {"alpha_min": 1.0, "alpha_max": 1.0}),
                        description="toprovar without the token gate: Detail layers skipped (1 token kept), Global "
                                    "layers dense, from D"))
    arms.append(compose("toprovar", "toprovar", role="base", description="ToProVAR: scale + layer + token"))
    return arms
