"""``guidance``: keeping classifier-free guidance, stopping it at a fixed scale, or adaptively (SATS).

Base: ``ldpruning`` (LD-Pruning, whose SATS is the adaptive arm). Arms: ``full`` (both CFG halves at every scale),
``stop_at`` (unconditional rows dropped from a fixed scale on; two settings), ``sats`` (stop per sample when the
conditional / unconditional discrepancy falls below δ), and, when registered, ``null_late`` (StageVAR).
"""

from __future__ import annotations

from var_core.accel.registry import REGISTRIES

from .base import Arm, FamilyContext, baseline_arm, family, swap

STOP_SCALES = (-3, -2)


@family("guidance", "full CFG vs fixed stop vs SATS on LD-Pruning's base")
def guidance_family(ctx: FamilyContext) -> list[Arm]:
    base = "ldpruning"
    arms = [baseline_arm(), swap(base, "guidance", "full")]
    for start in STOP_SCALES:
        arms.append(swap(base, "guidance", "stop_at", arm_name=f"stop_at@{start}", start_scale=start))
    arms.append(swap(base, "guidance", "sats", role="base"))
    if "null_late" in REGISTRIES["guidance"].names():
        arms.append(swap(base, "guidance", "null_late"))
    return arms
