"""FLOPs-ideal speedup of a method preset without generating anything: its planned kept-token counts, counted.

A *fixed* plan — which scales are skipped or pruned and how many tokens each (scale, block, branch) keeps —
depends only on the schedule and the depth, not on what the model produces: fixed activation, ``fixed_table``
schedule, guidance kept / stopped at fixed scales, ``skip_last``. :func:`planned_records` runs such a policy's
own hook slots (``plan_scale``, ``plan_block``) over the scales of an architecture on constant placeholder hidden
states, and turns the decisions into the :class:`~var_core.engine.context.ScaleRecord` list a generation would
have left; :func:`profilers.flops.count_record_flops` then counts them with the analytic formulas. Only *which*
tokens are kept depends on the placeholder, never *how many*, so the FLOPs are those of any real generation.

Adaptive plans (entropy / energy / attention driven) are refused: their counts need a generation.
"""

from __future__ import annotations

import torch

from var_core.accel.policy import AccelPolicy, PolicyConfig, build_policy
from var_core.engine.adapters.base import row_slice_after_drop
from var_core.engine.context import GenerationInfo, GuidanceMode, ScaleContext, ScaleRecord
from var_core.engine.policy import ProjectedTokens, TokenSelection
from var_core.engine.tracing import NULL_TRACER

from .flops import ArchSpec, count_record_flops, dense_records

# components whose decisions never read generated data
FIXED_COMPONENTS = {
    "activation": ("never", "fixed"),
    "schedule": ("fixed_table", "rank_table"),
    "guidance": ("full", "stop_at", "null_late"),
    "skip": ("none", "skip_last", "skip_widths"),
}


def is_fixed_plan(config: PolicyConfig) -> bool:
    """Whether the counts of ``config``'s plan are known without generating (see :data:`FIXED_COMPONENTS`)."""
    return all(getattr(config, kind).component_name in names for kind, names in FIXED_COMPONENTS.items())


def planned_records(config: PolicyConfig, arch: ArchSpec, batch_size: int = 1,
                    guidance: GuidanceMode = GuidanceMode.BOTH) -> list[ScaleRecord]:
    """The records a generation of ``batch_size`` samples on ``arch`` would leave under the fixed plan ``config``
    (resolved for the model first, as at a real start). Raises ``ValueError`` for an adaptive plan."""
    policy = build_policy(config)
    if not isinstance(policy, AccelPolicy):
        return dense_records(arch.scale_hw, guidance)
    K = len(arch.scale_hw)
    info = GenerationInfo(batch_size, K, arch.depth, arch.branches, arch.scale_hw, arch.family, guidance,
                          NULL_TRACER)
    policy.check_model(info)  # resolves a per-model preset
    if not is_fixed_plan(policy.config):
        adaptive = {k: getattr(policy.config, k).component_name for k, names in FIXED_COMPONENTS.items()
                    if getattr(policy.config, k).component_name not in names}
        raise ValueError(f"the plan of {config.name!r} is adaptive ({adaptive}): its kept-token counts need a "
                         f"generation")
    policy.start(info)
    records: list[ScaleRecord] = []
    offset = 0
    for si, hw in enumerate(arch.scale_hw):
        N = hw[0] * hw[1]
        ctx = ScaleContext(si, K, hw, offset, batch_size, guidance, arch.depth, arch.branches, arch.family,
                           tuple(records))
        offset += N
        plan = policy.plan_scale(ctx)
        if plan.stop:
            break
        if plan.guidance is not None and plan.guidance is not guidance:
            row_slice_after_drop(guidance, plan.guidance, batch_size)  # raises on an impossible change
            guidance = plan.guidance
            ctx = ScaleContext(si, K, hw, ctx.token_offset, batch_size, guidance, arch.depth, arch.branches,
                               arch.family, ctx.history)
        if plan.skip:
            record = ScaleRecord(si, hw, skipped=True, guidance=guidance)
        else:
            x_RNC = torch.ones(ctx.rows, N, 1)  # a constant stream: the counts do not depend on it
            kept = []
            for block in range(arch.depth):
                counts = []
                for branch in arch.branches:
                    selection = policy.plan_block(ctx, block, branch, x_RNC) if plan.prune else None
                    if isinstance(selection, TokenSelection):
                        selection = selection.index_Rn
                    elif isinstance(selection, ProjectedTokens):  # the chunk's blocks run on its r tokens
                        selection = selection.positions_Rr
                    counts.append(N if selection is None else int(selection.shape[1]))
                kept.append(tuple(counts))
            record = ScaleRecord(si, hw, skipped=False, guidance=guidance, kept_tokens=tuple(kept))
        records.append(record)
        policy.signals.records[si] = record
    return records


def ideal_speedup(config: PolicyConfig, arch: ArchSpec, batch_size: int = 1,
                  guidance: GuidanceMode = GuidanceMode.BOTH) -> tuple[float, int, int]:
    """``(dense FLOPs / planned FLOPs, planned FLOPs, dense FLOPs)`` of one generation (transformer, head,
    conditioning; no decoder) under the fixed plan ``config``."""
    planned = count_record_flops(arch, planned_records(config, arch, batch_size, guidance), batch_size,
                                 initial_guidance=guidance).total
    dense = count_record_flops(arch, dense_records(arch.scale_hw, guidance), batch_size).total
    return dense / planned, planned, dense
