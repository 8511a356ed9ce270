"""NOVA's scale-linkage ratio: one reduction ratio per accelerated scale (specs/methods.md §2.3)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..base import Schedule, Signals
from ..entropy import SCALE_ENTROPY_DEFINITIONS
from ..knobs import ComponentConfig, SearchSpace, knob
from ..registry import SCHEDULES
from ._linkage_math import (DIRECTIONS, RATIO_MEANINGS, activation_scales, counts_for_rows, keep_from_ratio,
                            last_growth_B, nova_scale_ratio, started_B,
                            started_on, activation_scales_on)

EXTRAS_KEY = "scale_linkage"


def scale_ratio_B(ctx, signals: Signals, tau: float, lam: float, direction: str, definition: str,
                  device=None) -> torch.Tensor:
    """float64 ``[B]`` NOVA ``r_t`` of every sample at ``ctx``'s scale (meaningful where the sample is accelerated),
    on ``device`` (default: the CPU; the activation scales are copied there once per scale, the growth is computed
    where the entropies live: no host read).

    ``t = si + 1``; ``t* = `` the sample's first accelerated 0-indexed scale, which is the 1-indexed number of its
    last full scale (scales ``t > t*`` are accelerated); ``g = g_{t−1}`` from the scale entropies (``definition``).
    """
    t_star = activation_scales_on(ctx, signals, device).double()
    g_prev = last_growth_B(ctx, signals, definition, device).to(device)
    return nova_scale_ratio(ctx.scale_index + 1, t_star, g_prev, tau, lam, direction)


@SCHEDULES.register("scale_linkage")
class ScaleLinkage(Schedule):
    """NOVA (arXiv 2602.01345) §2.3 scale linkage: remove ``r_t`` of the tokens of every block. Knob: ``tau``.

    ``r_t = sigmoid(τ·(t*+1)/t − λ·tanh(g_{t−1}))`` for ``t > t*`` (1-indexed scale numbers); keeps
    ``ceil((1 − r_t)·N)`` tokens per row. ``t*`` comes per sample from ``signals.activation_scale_B`` (whatever the
    activation: NOVA's ``entropy_inflection``, ``fixed``, …): t* = the first accelerated 0-indexed scale = the
    1-indexed number of the last full scale, so the first accelerated scale has ``(t*+1)/t = 1``. ``g_{t−1}`` is
    recomputed here from the sampled distributions (``signals.token_entropy``) with ``definition``, so the schedule
    does not depend on NOVA's activation; it is the growth of the last finished scale because ``g_t`` is unknown
    before scale t's logits (RECONSTRUCTED), and 0 where undefined. With τ = 0.8, λ = 0.1, t* = 8 and g = 0 it gives
    0.69, 0.67, 0.66, 0.65, 0.64 for t = 9..13.

    RECONSTRUCTED parts (each an option; defaults first):

    * ``direction`` — ``printed`` (the write-up's formula, decreasing in t) / ``increasing``
      ``sigmoid(τ·t/(t*+1) − λ·tanh(g))`` (the write-up's prose says the ratio grows with scale; 0.69 → 0.76).
    * ``ratio_is`` — ``removed`` (r is the fraction pruned) / ``kept``.
    * ``definition`` — scale entropy behind g: ``mean`` / ``sum`` / ``normalized`` (see ``entropy_inflection``).

    Rows of samples that are not accelerated yet stay dense. ``signals.extras["scale_linkage"][si]`` keeps r_t.
    """

    @dataclass(frozen=True)
    class Config(ComponentConfig):
        tau: float = knob(0.8, "temperature of the scale ratio: r = sigmoid(tau (t*+1)/t - lambda tanh g)", low=0.0,
                          high=1.0, low_open=True, search=SearchSpace("float", 0.3, 1.0))
        lam: float = knob(0.1, "weight lambda of the entropy-growth correction tanh(g)", low=0.0, high=1.0,
                          low_open=True, search=SearchSpace("float", 0.01, 1.0, log=True))
        direction: str = knob("printed", "'printed' tau (t*+1)/t (decreasing) or 'increasing' tau t/(t*+1)",
                              choices=DIRECTIONS, reconstructed=True)
        ratio_is: str = knob("removed", "whether r is the removed or the kept fraction", choices=RATIO_MEANINGS,
                             reconstructed=True)
        definition: str = knob("mean", "scale entropy behind the growth g", choices=SCALE_ENTROPY_DEFINITIONS,
                               reconstructed=True)

    def prunes_scale(self, ctx, signals) -> bool:
        return bool(started_B(ctx, signals).any())

    def keep_counts(self, ctx, block, branch, scores_RN, signals):
        cfg = self.config
        if not bool(started_B(ctx, signals).any()):  # host data: nobody accelerated yet, dense
            return None
        device = scores_RN.device
        r_B = scale_ratio_B(ctx, signals, cfg.tau, cfg.lam, cfg.direction, cfg.definition, device)
        signals.extras.setdefault(EXTRAS_KEY, {})[ctx.scale_index] = r_B
        keep_B = keep_from_ratio(r_B, ctx.num_tokens, cfg.ratio_is)
        return counts_for_rows(ctx, keep_B, started_on(ctx, signals, device), scores_RN.shape[0], device)
