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


def ratio_for_width(ratios: tuple[float, ...], widths: tuple[int, ...], width: int) -> float:
    """The ratio of the first entry of ``widths`` equal to ``width`` (0 when the width is not in the table)."""
    for w, r in zip(widths, ratios):
        if w == width:
            return r
    return 0.0


def check_table_widths(knob_name: str, widths, info) -> None:
    """Raise ``ValueError`` naming ``knob_name`` and the model when ``widths`` names a token-map width that the
    model's schedule (``info.scale_hw``) passes over without having it (issue 31: no silent reinterpretation)."""
    if not widths:
        return
    have = [int(hw[1]) for hw in info.scale_hw]
    missing = [int(w) for w in widths if int(w) not in have and int(w) < max(have)]
    if missing:
        raise ValueError(f"{knob_name}={tuple(widths)} names width(s) {missing} that the {info.family} model in hand "
                         f"({len(have)} scales, {info.num_blocks} blocks; widths {have}) does not have: the table was "
                         f"made for another model; give this model's widths (or ratios aligned to the last scales, "
                         f"widths=())")


@SCHEDULES.register("fixed_table")
class FixedTable(Schedule):
    """FastVAR: remove ``floor(r·N)`` tokens at the scales of a fixed table; a ratio of 1.0 leaves the scale out.

    Knob: ``ratios``. Two ways to say which scale a ratio belongs to (option ``widths``):

    * ``widths`` empty (default): the ratios are aligned to the LAST scales (``ratios[-1]`` is the last scale) —
      the position mapping used on schedules the papers did not tabulate (VAR);
    * ``widths`` given: ``ratios[i]`` applies to every scale whose token map is ``widths[i]`` tokens wide, as
      FastVAR's released Infinity code keys its table on the width (``{32: 0.4, 40: 0.5}`` and widths 48 / 64
      skipped = ``widths=(32, 40, 48, 64), ratios=(0.4, 0.5, 1.0, 1.0)``); widths not in the table are dense.

    A ratio of **1.0 means the scale is not generated** (FastVAR's "100 % pruning", ToProVAR Table 8's "s:1.0"):
    the policy skips it for the whole batch once every sample's acceleration is active (a scale cannot be left
    out per sample; samples not yet active run it, and active ones keep ``min_keep`` tokens). The image is decoded
    from the latent accumulated over the generated scales. The ``skip`` component does the same by position.
    """

    @dataclass(frozen=True)
    class Config(ComponentConfig):
        ratios: tuple[float, ...] = knob((0.4, 0.5), "removal ratio per scale (aligned to the last scales, or to "
                                         "`widths`); 1.0 = the scale is not generated", low=0.0, high=1.0)
        widths: tuple[int, ...] = knob((), "token-map widths the ratios belong to, one per ratio (FastVAR's "
                                       "Infinity code: 32, 40, 48, 64); empty = ratios aligned to the last scales",
                                       low=1)

        def __post_init__(self) -> None:
            super().__post_init__()
            if self.widths and len(self.widths) != len(self.ratios):
                raise ValueError(f"schedule 'fixed_table': widths={self.widths} has {len(self.widths)} entries but "
                                 f"ratios={self.ratios} has {len(self.ratios)}: give one ratio per width")

    def check_model(self, info) -> None:
        """A width-keyed table must name this model's token-map widths: a width the schedule passes without
        having (VAR's 13 on Infinity or HART) means the table was made for another model, and is refused rather
        than reinterpreted. Widths beyond the model's largest are allowed (not reached: a smaller resolution of
        the same model, which the released FastVAR leaves dense too)."""
        check_table_widths("schedule.widths", self.config.widths, info)

    def ratio(self, ctx) -> float:
        """The removal ratio of the scale ``ctx`` describes."""
        if self.config.widths:
            return ratio_for_width(self.config.ratios, self.config.widths, ctx.hw[1])
        return ratio_for_scale(self.config.ratios, ctx.scale_index, ctx.num_scales)

    def skips_scale(self, ctx, signals) -> bool:
        return self.ratio(ctx) >= 1.0

    def prunes_scale(self, ctx, signals) -> bool:
        return self.ratio(ctx) > 0

    def keep_counts(self, ctx, block, branch, scores_RN, signals):
        ratio = self.ratio(ctx)
        if ratio <= 0:
            return None
        N = ctx.num_tokens
        keep = N - int(ratio * N)  # FastVAR's L - int(L * ratio)
        return torch.full((scores_RN.shape[0],), keep, dtype=torch.long)  # host data: no synchronisation
