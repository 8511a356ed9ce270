"""NOVA's residual cache reuse: pruned tokens receive the same block's residual from the previous scale."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ...engine.context import GuidanceMode, ScaleContext
from ...engine.policy import scatter_into_zeros
from ..base import Needs, Restorer, Signals
from ..knobs import ComponentConfig, SearchSpace, knob
from ..registry import RESTORERS
from .static_cache import INTERPOLATIONS, fill_pruned, interpolate_tokens, rows_for_now


@RESTORERS.register("residual_reuse")
class ResidualReuse(Restorer):
    """NOVA §2.4: pruned slots get the same layer's full residual at the previous computed scale, interpolated.

    Knob that matters: ``granularity`` (RECONSTRUCTED, specs §2.4). ``block`` (default): one residual per block,
    ``R_{t-1,l} = x_out − x_in`` of block l at the previous scale (the full map, pruned slots included); it is
    restored in the block's FIRST branch and the later branches give pruned slots zero, so a pruned token gets
    ``x + interp(R_{t-1,l})``, exactly the reconstructed NOVA update. (With a policy that re-selects per
    sub-layer, a token pruned only in a later branch therefore gets a zero update there.) ``branch``: one
    residual per sub-layer (that branch's full output at the previous scale), the sub-layer variant the spec
    allows. ``interpolation`` (RECONSTRUCTED: "'area' like FastVAR, or bilinear"): default ``area``.

    The previous scale's maps are held as references to tensors the loop computed anyway (the block difference
    is taken lazily, only when a pruned block needs it); every scale is observed because an adaptive activation
    may start pruning at any scale. Rows follow guidance drops. At the first computed scale (no previous scale)
    pruned slots get zero.
    """

    @dataclass(frozen=True)
    class Config(ComponentConfig):
        granularity: str = knob("block", "RECONSTRUCTED: one residual per block (x_out - x_in, restored in the "
                                "block's first branch) or one per sub-layer ('branch')", choices=("block", "branch"),
                                reconstructed=True)
        interpolation: str = knob("area", "RECONSTRUCTED: resampling of the previous scale's residual map",
                                  choices=INTERPOLATIONS, reconstructed=True,
                                  search=SearchSpace("categorical", choices=INTERPOLATIONS))

    def start(self, info, signals: Signals) -> None:
        self._first_branch = info.branches[0]
        # key (block) or (block, branch) -> (scale index, hw, guidance layout, tensors)
        self._prev: dict[object, tuple[int, tuple[int, int], GuidanceMode, tuple[torch.Tensor, ...]]] = {}

    def needs(self, ctx, signals) -> Needs:
        if self.config.granularity == "block":
            return Needs(block_io=True)
        return Needs(branch_outputs=True)

    def observe_block(self, ctx: ScaleContext, block, x_in_RNC, x_out_RNC, signals) -> None:
        if self.config.granularity == "block":
            self._prev[block] = (ctx.scale_index, ctx.hw, ctx.guidance, (x_in_RNC, x_out_RNC))

    def observe_branch(self, ctx: ScaleContext, block, branch, out_RNC, signals) -> None:
        if self.config.granularity == "branch":
            self._prev[(block, branch)] = (ctx.scale_index, ctx.hw, ctx.guidance, (out_RNC,))

    def previous_residual(self, ctx: ScaleContext, block: int, branch: str) -> torch.Tensor | None:
        """The residual to reuse for (block, branch), on this scale's grid and rows ``[R, N, C]``, or None."""
        key = block if self.config.granularity == "block" else (block, branch)
        entry = self._prev.get(key)
        if entry is None or entry[0] >= ctx.scale_index:
            return None
        _, hw, mode, tensors = entry
        tensors = [rows_for_now(t, mode, ctx.guidance, ctx.batch_size) for t in tensors]
        residual_RNC = tensors[1] - tensors[0] if len(tensors) == 2 else tensors[0]
        return interpolate_tokens(residual_RNC, hw, ctx.hw, self.config.interpolation)

    def restore(self, ctx, block, branch, out_kept_RnC, keep_Rn, x_RNC, signals):
        if self.config.granularity == "block" and branch != self._first_branch:
            return scatter_into_zeros(out_kept_RnC, keep_Rn, x_RNC.shape[1])
        base_RNC = self.previous_residual(ctx, block, branch)
        if base_RNC is None:
            return scatter_into_zeros(out_kept_RnC, keep_Rn, x_RNC.shape[1])
        # a temporary unless it is a stored branch output on an unchanged grid
        owned = self.config.granularity == "block" or tuple(self._prev[(block, branch)][1]) != tuple(ctx.hw)
        return fill_pruned(base_RNC, out_kept_RnC, keep_Rn, owned)
