"""Fixed per-scale pruning ratios (FastVAR's hard-coded table; SparseVAR's exclusion ratio)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..base import Schedule
from ..knobs import ComponentConfig, knob
from ..registry import SCHEDULES


def ratio_for_scale(ratios: tuple[float, ...], si: int, num_scales: int) -> float:
    """``ratios`` are aligned to the LAST scales: ratios[-1] is the last scale, ratios[-2] the one before, …"""
    offset = num_scales - len(ratios)
    return ratios[si - offset] if si >= offset else 0.0


@SCHEDULES.register("fixed_table")
class FixedTable(Schedule):
    """FastVAR: remove ``floor(r·N)`` tokens at each of the last scales (ratios aligned to the last scales).

    Knob: ``ratios``. FastVAR's Infinity-1024 code uses {32: 0.4, 40: 0.5} plus 100 % (skipped) 48 and 64; on a
    10-scale VAR schedule the analogous default prunes the last two scales by 0.4 and 0.5. A ratio of 1.0 is not
    allowed here: whole-scale removal is the ``skip`` component's job.
    """

    @dataclass(frozen=True)
    class Config(ComponentConfig):
        ratios: tuple[float, ...] = knob((0.4, 0.5), "removal ratio per scale, aligned to the last scales", low=0.0,
                                         high=1.0, high_open=True)

    def prunes_scale(self, ctx, signals) -> bool:
        return ratio_for_scale(self.config.ratios, ctx.scale_index, ctx.num_scales) > 0

    def keep_counts(self, ctx, block, branch, scores_RN, signals):
        ratio = ratio_for_scale(self.config.ratios, ctx.scale_index, ctx.num_scales)
        if ratio <= 0:
            return None
        N = ctx.num_tokens
        keep = N - int(ratio * N)  # FastVAR's L - int(L * ratio)
        return torch.full((scores_RN.shape[0],), keep, dtype=torch.long, device=scores_RN.device)
