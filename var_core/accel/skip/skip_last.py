"""Leave out the last scales (FastVAR's 100 % pruning; SkipVAR's static skip rule)."""

from __future__ import annotations

from dataclasses import dataclass

from ..base import ScaleSkip, SkipDecision
from ..knobs import ComponentConfig, SearchSpace, knob
from ..registry import SKIPS


@SKIPS.register("skip_last")
class SkipLast(ScaleSkip):
    """FastVAR 100 % pruning / SkipVAR static rule: the last ``count`` scales are not generated.

    Knob: ``count`` (default 2: FastVAR's Infinity-1024 code skips 48 and 64; SkipVAR picks c ∈ {0, 1, 2, 3}).
    The image is decoded from the latent accumulated so far (already at full resolution). Option ``mode``:
    ``stop`` ends generation before scale K − count (``GenerationResult.stopped_at``); ``skip`` leaves each of the
    last scales out as a skipped record (same image; the records show every scale). ``count = 0`` is the identity.
    """

    @dataclass(frozen=True)
    class Config(ComponentConfig):
        count: int = knob(2, "number of last scales left out", low=0, search=SearchSpace("int", low=0, high=3),
                          unit="scales")
        mode: str = knob("stop", "'stop' ends generation there; 'skip' records each left-out scale as skipped",
                         choices=("stop", "skip"))

    def start(self, info, signals) -> None:
        self.check_model(info)

    def check_model(self, info) -> None:
        if self.config.count >= info.num_scales:
            raise ValueError(f"skip 'skip_last': count={self.config.count} leaves none of the {info.num_scales} "
                             f"scales; use count < {info.num_scales}")

    def decide(self, ctx, signals) -> SkipDecision:
        if self.config.count == 0 or ctx.scale_index < ctx.num_scales - self.config.count:
            return SkipDecision()
        return SkipDecision(stop=True) if self.config.mode == "stop" else SkipDecision(skip=True)
