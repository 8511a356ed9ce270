"""StageVAR's semantic irrelevance: the last scales run the unconditional (null-condition) rows only."""

from __future__ import annotations

from dataclasses import dataclass

from ...engine.context import GuidanceMode
from ..base import KEEP_GUIDANCE, Guidance, GuidanceDecision
from ..knobs import ComponentConfig, SearchSpace, knob
from ..registry import GUIDANCES


@GUIDANCES.register("null_late")
class NullLate(Guidance):
    """StageVAR §8: the last ``count`` scales (the "fidelity refinement" stage) use only the unconditional rows.

    Knob: ``count`` (default 3: StageVAR's refinement stage of Infinity-1024, scales 40, 48, 64, which hold 76 %
    of the 10,521 tokens). For the 10-scale VAR-256 schedule the default is also 3: its last three scales (10²,
    13², 16²) hold 525 of 680 tokens, 77 %, the same share (on 512 px, 1…32, they hold 86 %). The code keeps rows
    ``[B:]`` (the KV cache is sliced by the loop) and samples from the unconditional logits (``cfg_list[-3:] = 0``).
    On a class-conditional VAR the null rows carry the null class, so late scales lose the class signal; that is
    the ablation. Nothing happens when the uncond rows are not computed (cfg = 0 / no uncond branch).
    """

    @dataclass(frozen=True)
    class Config(ComponentConfig):
        count: int = knob(3, "number of last scales computed with the unconditional rows only", low=0,
                          search=SearchSpace("int", low=1, high=4), unit="scales")

    def start(self, info, signals) -> None:
        self.check_model(info)

    def check_model(self, info) -> None:
        if self.config.count >= info.num_scales:
            raise ValueError(f"guidance 'null_late': count={self.config.count} would make every one of the "
                             f"{info.num_scales} scales unconditional; use count < {info.num_scales}")

    def initial_mode(self, mode: GuidanceMode) -> GuidanceMode:
        """With cfg 1 (Infinity computes no unconditional rows) the rows are computed from the start all the same,
        as the released code does (``cfg_list`` holds zeros, so ``any(cfg_list != 1)`` gives ``2B`` rows; the
        cfg-1 scales sample the conditional rows, here ``1·c + 0·u``, the same value)."""
        if self.config.count > 0 and mode is GuidanceMode.NONE:
            return GuidanceMode.BOTH
        return mode

    def decide(self, ctx, signals) -> GuidanceDecision:
        late = self.config.count > 0 and ctx.scale_index >= ctx.num_scales - self.config.count
        if late and ctx.guidance is GuidanceMode.BOTH:
            return GuidanceDecision(mode=GuidanceMode.UNCOND_ONLY)
        return KEEP_GUIDANCE
