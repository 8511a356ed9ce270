"""Leave out every scale whose token map has one of the listed widths (StageVAR's and FastVAR's released codes)."""

from __future__ import annotations

from dataclasses import dataclass

from ..base import ScaleSkip, SkipDecision
from ..knobs import ComponentConfig, knob
from ..registry import SKIPS


@SKIPS.register("skip_widths")
class SkipWidths(ScaleSkip):
    """A scale whose token map is ``w`` tokens wide, ``w`` in ``widths``, is not generated; the image is decoded
    from the codes summed over the generated scales. Knob: ``widths``.

    FOUND(code): StageVAR's released Infinity code (sen-mao/FasterVAR ``infinity/models/infinity.py``: ``if 48 ==
    pn[2] or 64 == pn[2]: continue``) and FastVAR's skip the 48- and 64-wide scales of Infinity-1024. Keyed on the
    width as they are: a schedule without these widths (Infinity below 1024 px, VAR) loses nothing. Each left-out
    scale is recorded as skipped (the loop goes on with the next scale).
    """

    @dataclass(frozen=True)
    class Config(ComponentConfig):
        widths: tuple[int, ...] = knob((48, 64), "token-map widths of the scales left out (the released "
                                       "StageVAR / FastVAR Infinity codes: 48, 64)", low=1)

    def start(self, info, signals) -> None:
        self.check_model(info)

    def check_model(self, info) -> None:
        if info.scale_hw and all(hw[1] in self.config.widths for hw in info.scale_hw):
            raise ValueError(f"skip 'skip_widths': widths={self.config.widths} leaves out every scale of the "
                             f"model; remove a width")

    def decide(self, ctx, signals) -> SkipDecision:
        return SkipDecision(skip=ctx.hw[1] in self.config.widths)
