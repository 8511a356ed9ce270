"""LD-Pruning's sparse residual tokens: pruned positions get no new residual at the scale where they are pruned."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ...engine.policy import scatter_into_zeros
from ..base import Restorer, Signals
from ..knobs import ComponentConfig, knob
from ..registry import RESTORERS

COMBINE = ("any", "all")


@RESTORERS.register("sparse_residual")
class SparseResidual(Restorer):
    """LD-Pruning (arXiv 2606.00310) §5.3 "Token Selection Update": only the kept tokens produce a residual.

    FOUND(paper §5.3; specs/methods.md errata 4): the kept inputs run through the transformer and their outputs are
    quantised into *sparse residual tokens* ``R_k^r``, so a pruned position receives no new residual at that scale.
    In our loop that is two things:

    * the pruned slots of every branch output are zero (the pruned tokens' hidden states pass through unchanged;
      the KV cache of a pruned branch holds only kept tokens, so nothing else reads them);
    * the engine's ``latent_mask`` slot: the head still produces logits and the sampler a code at every position,
      but at pruned positions the code map added to the latent is zero (VAR: zero embedding before the bicubic
      upsampling and Phi; Infinity: zero codes before the trilinear upsampling), and the scale's recorded residual
      map (``ScaleRecord.residual_BChw``, what LHEP reads at the next scale) is zero there too. On a scale at full
      latent resolution without Phi (Infinity's last scale) the latent is therefore unchanged at pruned positions;
      where the scale is upsampled (or VAR's 3×3 Phi applies) the zeros are blended with their kept neighbours, as
      the paper's ``F_k = Σ Up(R_i)`` implies.

    Knob: ``combine`` (ours: the paper selects once per scale, where both readings agree): with selections that
    differ between blocks, branches or CFG rows, a position keeps its residual if ``any`` pruned branch computed it
    (default) or only if ``all`` did. Blocks exempt from pruning are not counted. This is the alternative to
    FastVAR-style cache restoration (``static_cache``, which the ``ldpruning`` preset keeps).
    """

    @dataclass(frozen=True)
    class Config(ComponentConfig):
        combine: str = knob("any", "with per-block/branch/row selections: a position keeps its new residual if any "
                            "pruned branch computed it ('any') or only if every one did ('all')", choices=COMBINE)

    def start(self, info, signals: Signals) -> None:
        self._scale: int | None = None
        self._keep_BN: torch.Tensor | None = None
        signals.extras["sparse_residual_kept"] = {}  # scale -> int64 [B]: positions that got a new residual

    def restore(self, ctx, block, branch, out_kept_RnC, keep_Rn, x_RNC, signals):
        N, B = x_RNC.shape[1], ctx.batch_size
        computed_RN = torch.zeros(keep_Rn.shape[0], N, dtype=torch.bool, device=keep_Rn.device)
        computed_RN.scatter_(1, keep_Rn, True)  # ragged padding repeats kept indices: no effect
        rows_per_sample = computed_RN.view(-1, B, N)  # [1 or 2 CFG halves, B, N]: row r is sample r % B
        any_mode = self.config.combine == "any"
        computed_BN = rows_per_sample.any(0) if any_mode else rows_per_sample.all(0)
        if self._scale != ctx.scale_index or self._keep_BN is None:
            self._scale, self._keep_BN = ctx.scale_index, computed_BN
        else:
            self._keep_BN = (self._keep_BN | computed_BN) if any_mode else (self._keep_BN & computed_BN)
        return scatter_into_zeros(out_kept_RnC, keep_Rn, N)

    def latent_mask(self, ctx, signals) -> torch.Tensor | None:
        if self._scale != ctx.scale_index or self._keep_BN is None:
            return None  # nothing was pruned at this scale
        keep_BN = self._keep_BN
        self._keep_BN = None
        signals.extras["sparse_residual_kept"][ctx.scale_index] = keep_BN.sum(1)
        return None if bool(keep_BN.all()) else keep_BN
