"""NOVA's layer-linkage ratio: a per-block adjustment of a fixed base ratio (specs/methods.md §2.3, RECONSTRUCTED)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..base import NO_NEEDS, Schedule
from ..knobs import ComponentConfig, SearchSpace, knob
from ..registry import SCHEDULES
from .fixed_table import ratio_for_scale
from ._linkage_math import (FIRST_BLOCK_REFERENCES, RATIO_MEANINGS, counts_for_rows, keep_from_ratio,
                            LayerEntropyLinked, layer_adjusted_ratio, linkage_keep_bound,
                            layer_difference_on, per_scale_block_counts, started_B,
                            started_on)

EXTRAS_KEY = "layer_linkage"


@SCHEDULES.register("layer_linkage")
class LayerLinkage(LayerEntropyLinked, Schedule):
    """NOVA (arXiv 2602.01345) §2.3 layer linkage alone (NOVA Table 6's layer-only arm). Knob: ``r_base``.

    Per accelerated scale t and block l (1-indexed ``l = block + 1``), RECONSTRUCTED in the style of the scale
    function: ``r_{t,l} = sigmoid(logit(r_base) − λ·tanh(H_{t,l} − mean_{j<l} H_{t,j}))``, ``r_{t,1} = r_base``;
    keeps ``ceil((1 − r_{t,l})·N)`` tokens. ``H_{t,l}`` is the mean logit-lens entropy of the hidden state ENTERING
    block l (the lens of block l−1's output, declared in ``needs`` on accelerated scales only and recorded with
    ``var_core.accel.lens.record_lens_entropy``, guided CFG combination), per sample. A layer whose entropy is above
    the mean of the earlier layers keeps more tokens.

    RECONSTRUCTED parts (each an option; defaults first):

    * ``first_block_reference`` — the state entering the first block is the raw input (its lens is meaningless):
      ``previous_scale`` uses the previous scale's mean predictive entropy for ``H_{t,1}`` (methods.md §2.5), so
      the second block already compares with it; ``none`` leaves ``H_{t,1}`` out (the first two blocks keep
      ``r_base``).
    * ``ratio_is`` — ``removed`` / ``kept``.
    * ``layer_profile`` — where ``H_{t,l}`` comes from. ``()`` (default): the logit lens at every pruned scale (our
      reading; one head projection per block). A tuple of one value per block: a FIXED profile, the entropy of the
      state entering each block measured once offline (``_linkage_math.measure_layer_profile`` on a lens run),
      the same for every sample and scale; then no lens is run and the schedule costs nothing per block. This is
      the variant consistent with NOVA's cost model (errata 5: entropy only from the distributions already
      produced, 0.9 % of a scale — too little for a per-block lens): NOVA §3.2 motivates the layer linkage with an
      offline analysis (Fig. 4(c): the average entropy differs from layer to layer, e.g. layer 19 is low), which
      is a property of the layer rather than of the sample, and the final predictive distribution has no per-layer
      information to derive it from. The paper's own formula is not in our copy of §3.3 (RECONSTRUCTED).

    * ``scale_ratios`` — the base ratio per scale. ``()`` (default): ``r_base`` on every accelerated scale. A table
      (aligned to the LAST scales, as ``fixed_table``'s ``ratios``): each scale's base ratio is its entry instead
      of ``r_base``; a scale the table does not cover (or gives 0) is not pruned, an entry of 1.0 leaves the scale
      out once every sample is accelerated (``fixed_table``'s 100 %; until then its accelerated rows keep the
      policy's ``min_keep``, as there). NOVA Table 6's layer-only†/‡ arms: the
      layer adjustment around FastVAR's / SparseVAR's fixed scale-level ratios, on exactly the scales those
      tables prune or leave out, so the arm differs from the no-linkage arm in the layer term alone.

    Rows of samples that are not accelerated yet stay dense. ``signals.extras["layer_linkage"][(si, block)]`` keeps
    the per-sample ratio.
    """

    @dataclass(frozen=True)
    class Config(ComponentConfig):
        r_base: float = knob(0.5, "base reduction ratio every block starts from (the first block uses it as is)",
                             low=0.0, high=1.0, low_open=True, high_open=True, search=SearchSpace("float", 0.2, 0.9))
        lam: float = knob(0.1, "weight lambda of the layer-entropy correction tanh(H_l - mean_{j<l} H_j)", low=0.0,
                          high=1.0, low_open=True, search=SearchSpace("float", 0.01, 1.0, log=True))
        first_block_reference: str = knob("previous_scale", "entropy standing for the raw input entering block 1: "
                                          "the previous scale's mean predictive entropy, or none",
                                          choices=FIRST_BLOCK_REFERENCES, reconstructed=True)
        ratio_is: str = knob("removed", "whether r is the removed or the kept fraction", choices=RATIO_MEANINGS,
                             reconstructed=True)
        layer_profile: tuple[float, ...] = knob((), "fixed entropy of the state entering each block (one value per "
                                                "block) used instead of the logit lens; () = measure it with the "
                                                "lens at every pruned scale", unit="per_block")
        scale_ratios: tuple[float, ...] = knob((), "base ratio per scale aligned to the last scales (replaces r_base; "
                                               "uncovered or 0 = not pruned, 1.0 = not generated); () = r_base on "
                                               "every accelerated scale", low=0.0, high=1.0)

    def _base_ratio(self, ctx) -> float:
        """The scale's base ratio: its ``scale_ratios`` entry (0 where the table does not reach), else ``r_base``."""
        if not self.config.scale_ratios:
            return self.config.r_base
        return ratio_for_scale(self.config.scale_ratios, ctx.scale_index, ctx.num_scales)

    def _tabled_out(self, ctx) -> bool:
        """A scale the table leaves dense (no entry, or 0)."""
        return bool(self.config.scale_ratios) and self._base_ratio(ctx) <= 0.0

    def needs(self, ctx, signals):
        if self.config.scale_ratios and not 0.0 < self._base_ratio(ctx) < 1.0:
            return NO_NEEDS  # dense, or 100 %: the layer term cannot move the ratio (no lens)
        return super().needs(ctx, signals)

    def prunes_scale(self, ctx, signals) -> bool:
        return not self._tabled_out(ctx) and super().prunes_scale(ctx, signals)

    def skips_scale(self, ctx, signals) -> bool:
        return bool(self.config.scale_ratios) and self._base_ratio(ctx) >= 1.0

    def count_bound(self, ctx, block, rows, signals):
        """``count_sync='bounded'``: ``r_{t,l} = sigmoid(logit(r_base) − λ·tanh(D))`` lies within
        ``logit(r_base) ± λ`` (:func:`linkage_keep_bound`); None with a fixed ``layer_profile`` or a base ratio of
        0 or 1 (counts read once per scale, or no pruning)."""
        cfg = self.config
        base = self._base_ratio(ctx)
        if cfg.layer_profile or not 0.0 < base < 1.0:
            return None
        centre = torch.logit(torch.full((ctx.batch_size,), base, dtype=torch.float64))
        return linkage_keep_bound(ctx, signals, centre, cfg.lam, cfg.ratio_is, rows)

    def keep_counts(self, ctx, block, branch, scores_RN, signals):
        cfg = self.config
        if self._tabled_out(ctx) or not bool(started_B(ctx, signals).any()):  # host data: dense
            return None
        device = scores_RN.device
        if self._base_ratio(ctx) >= 1.0:  # 100 %: every accelerated row keeps the policy's min_keep, as fixed_table
            keep_B = torch.zeros(ctx.batch_size, dtype=torch.long, device=device)
            return counts_for_rows(ctx, keep_B, started_on(ctx, signals, device), scores_RN.shape[0], device)
        if cfg.layer_profile:  # nothing measured inside the scale: every block's count at once, one host copy
            r_LB, counts_LR = per_scale_block_counts(self, ctx, scores_RN.shape[0], signals, device)
            r_B, counts = r_LB[block], counts_LR[block]
        else:
            r_B, counts = self._block_counts(ctx, block, scores_RN.shape[0], signals, device)
        signals.extras.setdefault(EXTRAS_KEY, {})[(ctx.scale_index, block)] = r_B
        return counts

    def _block_counts(self, ctx, block, rows, signals, device):
        cfg = self.config
        diff_B = layer_difference_on(ctx, signals, block, cfg.first_block_reference, cfg.layer_profile, device)
        r_B = layer_adjusted_ratio(self._base_ratio(ctx), diff_B, 0.0, cfg.lam)
        keep_B = keep_from_ratio(r_B, ctx.num_tokens, cfg.ratio_is)
        return r_B, counts_for_rows(ctx, keep_B, started_on(ctx, signals, device), rows, device)
