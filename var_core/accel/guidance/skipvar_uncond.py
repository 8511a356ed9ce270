"""SkipVAR's unconditional-branch replacement as its per-sample decision picks it (the ``skipvar_decision`` skip)."""

from __future__ import annotations

from dataclasses import dataclass

from ...engine.context import GuidanceMode
from ..base import KEEP_GUIDANCE, Guidance, GuidanceDecision, Signals
from ..knobs import ComponentConfig
from ..registry import GUIDANCES

DECISION_KEY = "skipvar"  # written by the skip component skipvar_decision (var_core/accel/skip/skipvar_decision.py)


@GUIDANCES.register("skipvar_uncond")
class SkipVARUncond(Guidance):
    """SkipVAR (arXiv 2506.08908) "unconditional branch replacement", per sample: from scale ``K − u`` on a sample
    samples from its conditional logits only (the released code: ``cfg·c + (1 − cfg)·c`` of the conditional rows,
    which is what the loop's conditional-only mode computes), where ``u`` is what the ``skipvar_decision`` skip's
    uncond model chose for it (only asked when it skips no scale). No knob: it reads the decision from
    ``signals.extras["skipvar"]`` and does nothing without it (e.g. composed with another skip component).

    Samples whose latent the decision froze (they stopped earlier inside a batch) count as conditional-only, so the
    unconditional rows are dropped physically (``COND_ONLY``, half the compute of the remaining scales) once every
    sample either switched or stopped; before that the switch is logical (``cond_only_B``, same outputs).
    """

    @dataclass(frozen=True)
    class Config(ComponentConfig):
        pass

    def decide(self, ctx, signals: Signals) -> GuidanceDecision:
        state = signals.extras.get(DECISION_KEY)
        if state is None or ctx.guidance is not GuidanceMode.BOTH:
            return KEEP_GUIDANCE
        si = ctx.scale_index
        switched_B = (state["cond_from_B"] <= si) | (state["stop_B"] <= si)
        if bool(switched_B.all()):
            return GuidanceDecision(mode=GuidanceMode.COND_ONLY)
        if bool(switched_B.any()):
            return GuidanceDecision(cond_only_B=switched_B)
        return KEEP_GUIDANCE
