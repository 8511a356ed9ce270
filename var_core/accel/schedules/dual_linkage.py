"""NOVA's dual linkage: the scale-linkage ratio as the base of the layer linkage (specs/methods.md §2.3)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..base import Schedule
from ..entropy import SCALE_ENTROPY_DEFINITIONS
from ..knobs import ComponentConfig, SearchSpace, knob
from ..registry import SCHEDULES
from ._linkage_math import (DIRECTIONS, FIRST_BLOCK_REFERENCES, RATIO_MEANINGS, activation_scales,
                            counts_for_rows, last_growth_B, nova_scale_ratio, per_scale, keep_from_ratio, LayerEntropyLinked, layer_adjusted_ratio,
                            linkage_keep_bound,
                            layer_difference_on, per_scale_block_counts, started_B,
                            started_on)
from .scale_linkage import scale_ratio_B

EXTRAS_KEY = "dual_linkage"


@SCHEDULES.register("dual_linkage")
class DualLinkage(LayerEntropyLinked, Schedule):
    """NOVA (arXiv 2602.01345) §2.3, the full method: ``r_{t,l}`` from ``r_t``. Knob: ``tau``.

    ``r_t = sigmoid(τ·(t*+1)/t − λ_s·tanh(g_{t−1}))`` exactly as in ``scale_linkage`` (t* from
    ``signals.activation_scale_B``, g recomputed from the scale entropies), then per block
    ``r_{t,l} = sigmoid(logit(r_t) − λ_l·tanh(H_{t,l} − mean_{j<l} H_{t,j}))`` exactly as in ``layer_linkage``
    (logit-lens entropy of the state entering block l, declared on accelerated scales only, or a fixed profile
    with ``layer_profile``); keeps ``ceil((1 − r_{t,l})·N)`` tokens. Rows of samples that are not accelerated yet
    stay dense.

    RECONSTRUCTED parts (each an option; defaults first): ``direction`` (``printed`` / ``increasing``),
    ``definition`` (``mean`` / ``sum`` / ``normalized``) of ``scale_linkage``; ``first_block_reference``
    (``previous_scale`` / ``none``) and ``layer_profile`` (``()`` = logit lens / a fixed per-block entropy profile,
    no lens: see ``layer_linkage``) of ``layer_linkage``; ``ratio_is`` (``removed`` / ``kept``) of the final ratio.
    The two λ are separate knobs (the layer formula is a reconstruction "in the same style"; both default to 0.1).
    ``signals.extras["dual_linkage"][(si, block)]`` keeps the per-sample ratio.
    """

    @dataclass(frozen=True)
    class Config(ComponentConfig):
        tau: float = knob(0.8, "temperature of the scale ratio: r_t = sigmoid(tau (t*+1)/t - lambda tanh g)",
                          low=0.0, high=1.0, low_open=True, search=SearchSpace("float", 0.3, 1.0))
        scale_lam: float = knob(0.1, "lambda of the scale-entropy-growth correction", low=0.0, high=1.0,
                                low_open=True, search=SearchSpace("float", 0.01, 1.0, log=True))
        layer_lam: float = knob(0.1, "lambda of the layer-entropy correction", low=0.0, high=1.0, low_open=True,
                                search=SearchSpace("float", 0.01, 1.0, log=True))
        direction: str = knob("printed", "'printed' tau (t*+1)/t (decreasing) or 'increasing' tau t/(t*+1)",
                              choices=DIRECTIONS, reconstructed=True)
        definition: str = knob("mean", "scale entropy behind the growth g", choices=SCALE_ENTROPY_DEFINITIONS,
                               reconstructed=True)
        first_block_reference: str = knob("previous_scale", "entropy standing for the raw input entering block 1: "
                                          "the previous scale's mean predictive entropy, or none",
                                          choices=FIRST_BLOCK_REFERENCES, reconstructed=True)
        ratio_is: str = knob("removed", "whether r is the removed or the kept fraction", choices=RATIO_MEANINGS,
                             reconstructed=True)
        layer_profile: tuple[float, ...] = knob((), "fixed entropy of the state entering each block (one value per "
                                                "block) used instead of the logit lens; () = measure it with the "
                                                "lens at every pruned scale", unit="per_block")

    def _block_counts(self, ctx, block, rows, signals, device):
        cfg = self.config
        r_t_B = scale_ratio_B(ctx, signals, cfg.tau, cfg.scale_lam, cfg.direction, cfg.definition, device)
        diff_B = layer_difference_on(ctx, signals, block, cfg.first_block_reference, cfg.layer_profile, device)
        r_B = layer_adjusted_ratio(r_t_B, diff_B, 0.0, cfg.layer_lam)
        keep_B = keep_from_ratio(r_B, ctx.num_tokens, cfg.ratio_is)
        return r_B, counts_for_rows(ctx, keep_B, started_on(ctx, signals, device), rows, device)

    def count_bound(self, ctx, block, rows, signals):
        """``count_sync='bounded'``: ``r_{t,l} = sigmoid(logit(r_t) − λ_l·tanh(D))`` lies within
        ``logit(r_t) ± λ_l`` whatever the lens measures inside the scale (:func:`linkage_keep_bound`); ``r_t`` (known
        before the scale) reaches the host once per scale. None with a fixed ``layer_profile`` (its counts are read
        once per scale anyway)."""
        cfg = self.config
        if cfg.layer_profile:
            return None

        def host_ratio():  # r_t as scale_ratio_B computes it, from the growth read once
            g_prev = last_growth_B(ctx, signals, cfg.definition).cpu()
            return nova_scale_ratio(ctx.scale_index + 1, activation_scales(ctx, signals).double(), g_prev, cfg.tau,
                                    cfg.scale_lam, cfg.direction)
        r_t_B = per_scale(ctx, signals, ("dual_linkage.r_t", id(self)), host_ratio)
        return linkage_keep_bound(ctx, signals, torch.logit(r_t_B.double()), cfg.layer_lam, cfg.ratio_is, rows)

    def keep_counts(self, ctx, block, branch, scores_RN, signals):
        if not bool(started_B(ctx, signals).any()):  # host data: nobody accelerated yet, dense
            return None
        rows, device = scores_RN.shape[0], scores_RN.device
        if self.config.layer_profile:  # nothing measured inside the scale: every block's count at once, one host copy
            r_LB, counts_LR = per_scale_block_counts(self, ctx, rows, signals, device)
            r_B, counts = r_LB[block], counts_LR[block]
        else:
            r_B, counts = self._block_counts(ctx, block, rows, signals, device)
        signals.extras.setdefault(EXTRAS_KEY, {})[(ctx.scale_index, block)] = r_B
        return counts
