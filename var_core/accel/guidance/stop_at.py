"""Guidance stopped at a fixed scale: from there on only the conditional rows run (SkipVAR's branch replacement)."""

from __future__ import annotations

from dataclasses import dataclass

from ...engine.context import GuidanceMode
from ..base import KEEP_GUIDANCE, Guidance, GuidanceDecision
from ..knobs import ComponentConfig, SearchSpace, knob
from ..registry import GUIDANCES


@GUIDANCES.register("stop_at")
class StopAt(Guidance):
    """SkipVAR-style fixed "unconditional branch replacement": COND_ONLY from scale ``start_scale`` on.

    Knob: ``start_scale`` (0-indexed; -k = the k-th scale from the end; default -2, the last two scales, within
    SkipVAR's decision range u ∈ {1, 2, 3}). The uncond rows are physically dropped (the loop slices the KV
    cache and the conditioning), so the remaining scales cost half; the sampled logits are the conditional ones
    (cfg = 1). Nothing happens when the uncond rows are not computed (cfg = 0 / no uncond branch).
    """

    @dataclass(frozen=True)
    class Config(ComponentConfig):
        start_scale: int = knob(-2, "first scale without the unconditional rows (0-indexed; -k = k-th from the end)",
                                search=SearchSpace("int", low=-4, high=-1), unit="scale")

    def first_scale(self, num_scales: int) -> int:
        s = self.config.start_scale
        return s if s >= 0 else num_scales + s

    def start(self, info, signals) -> None:
        self.check_model(info)

    def check_model(self, info) -> None:
        if not 0 <= self.first_scale(info.num_scales) < info.num_scales:
            raise ValueError(f"guidance 'stop_at': start_scale={self.config.start_scale} is outside the "
                             f"{info.num_scales} scales of this model")

    def decide(self, ctx, signals) -> GuidanceDecision:
        if ctx.guidance is GuidanceMode.BOTH and ctx.scale_index >= self.first_scale(ctx.num_scales):
            return GuidanceDecision(mode=GuidanceMode.COND_ONLY)
        return KEEP_GUIDANCE
