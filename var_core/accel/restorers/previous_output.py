"""StageVAR's Representative Token Restoration: pruned tokens take the previous scale's output of their chunk."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ...engine.context import GuidanceMode, ScaleContext
from ...engine.policy import scatter_into_zeros
from ..base import Needs, Restorer, Signals, ends_block_chunk
from ..knobs import ComponentConfig, SearchSpace, knob
from ..registry import RESTORERS
from .static_cache import INTERPOLATIONS, fill_pruned, interpolate_tokens, rows_for_now


@RESTORERS.register("previous_output")
class PreviousOutput(Restorer):
    """StageVAR (arXiv 2512.16483) RTR: a pruned token's hidden state after a block chunk is the chunk's OUTPUT at
    the previous computed scale, resampled to this grid: ``F^o_k = {F^o_r(i) : i ∈ I} ∪ {interp(F^o_{k−1})(i) :
    i ∉ I}`` (FOUND(code), sen-mao/FasterVAR ``Infinity/infinity/models/infinity.py``: the cached chunk outputs
    are area-interpolated and the kept outputs scattered over them). Knob: ``interpolation`` (the code: ``area``).

    A value, not an update: where FastVAR's cache restoration (``static_cache``) adds a cached branch OUTPUT to the
    token's current state, here the state itself is replaced. In the loop's additive form the first branch of the
    restoring block gives a pruned slot ``target − x`` and the later branches zero (``x + (target − x)`` equals
    the target to one rounding).

    Where it acts: with the policy's ``granularity='chunk'`` (StageVAR's unit, Infinity's 8 block chunks) at the
    LAST block of each chunk, with that block's previous-scale output, i.e. the chunk's output; the chunk's earlier
    blocks give pruned slots zero (their state is the chunk input, which no kept token reads: the KV cache of a
    pruned block holds its kept tokens only). With ``granularity='block'`` every pruned block restores its own
    previous output. Before any computed scale (nothing cached) pruned slots get zero. Rows follow guidance drops
    (StageVAR keeps the unconditional rows in its refinement stage).
    """

    @dataclass(frozen=True)
    class Config(ComponentConfig):
        interpolation: str = knob("area", "resampling of the previous scale's output map (StageVAR's code: area)",
                                  choices=INTERPOLATIONS, search=SearchSpace("categorical", choices=INTERPOLATIONS))

    def start(self, info, signals: Signals) -> None:
        self._first_branch = info.branches[0]
        # block -> (scale index, hw, guidance layout, block output [R, N, C]) of the latest computed scale
        self._prev: dict[int, tuple[int, tuple[int, int], GuidanceMode, torch.Tensor]] = {}

    def needs(self, ctx, signals) -> Needs:
        return Needs(block_io=True)  # references to outputs the loop computed anyway

    def observe_block(self, ctx: ScaleContext, block, x_in_RNC, x_out_RNC, signals) -> None:
        self._prev[block] = (ctx.scale_index, ctx.hw, ctx.guidance, x_out_RNC)

    def previous_output(self, ctx: ScaleContext, block: int) -> torch.Tensor | None:
        """Block ``block``'s output at the latest earlier computed scale, on this grid and rows, or None."""
        entry = self._prev.get(block)
        if entry is None or entry[0] >= ctx.scale_index:
            return None
        _, hw, mode, y_RNC = entry
        return interpolate_tokens(rows_for_now(y_RNC, mode, ctx.guidance, ctx.batch_size), hw, ctx.hw,
                                  self.config.interpolation)

    def restore(self, ctx, block, branch, out_kept_RnC, keep_Rn, x_RNC, signals):
        restores_here = branch == self._first_branch and (
            not signals.chunked_selection or ends_block_chunk(block, ctx.num_blocks))
        target_RNC = self.previous_output(ctx, block) if restores_here else None
        if target_RNC is None:
            return scatter_into_zeros(out_kept_RnC, keep_Rn, x_RNC.shape[1])
        return fill_pruned((target_RNC - x_RNC).to(out_kept_RnC.dtype), out_kept_RnC, keep_Rn, owned=True)
